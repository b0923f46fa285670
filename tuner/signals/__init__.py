"""Signals: named, engine-agnostic values computed from a window of snapshots by pure functions.

The names are the public vocabulary of rule files (see ``VOCABULARY`` and docs/signals.md).
A missing value is ``None`` with a human-readable ``reason`` — never 0.

Every signal has a domain (``DOMAINS``): ratios in [0, 1], counts, rates and durations finite and in
[0, 2^53] (beyond that a float64 holds no exact count: the number is garbage), the live configuration
within what vLLM accepts. ``checked`` turns a value outside its domain (KV usage 57, a negative gauge,
1e308, NaN) into ``None`` with the reason; ``engine.compute`` and ``gpu.compute`` pass every signal
through it, so no rule ever sees such a value, and none is clamped silently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tuner.model import knobs


@dataclass(frozen=True, slots=True)
class Signal:
    """One named value.

    ``reason`` explains a ``None`` value (or qualifies a real one, e.g. "lower bound").
    Quantiles from histograms carry the bucket they fell into: ``bounds`` = (lower, upper) and
    ``resolution`` = upper - lower, so rules can refuse values that are coarser than they need.
    """

    value: float | None
    reason: str | None = None
    resolution: float | None = None
    bounds: tuple[float, float] | None = None

    @property
    def is_known(self) -> bool:
        return self.value is not None


def missing(reason: str) -> Signal:
    return Signal(None, reason)


SignalSet = Mapping[str, Signal]


def value_of(signals: SignalSet, name: str) -> float | None:
    """The signal's value; None where it is missing or not computed."""
    sig = signals.get(name)
    return None if sig is None else sig.value


def reason_of(signals: SignalSet, name: str) -> str:
    """Why the signal has no value (its ``reason``), "not computed" where it is absent."""
    sig = signals.get(name)
    return (sig.reason if sig is not None else None) or "not computed"


@dataclass(frozen=True, slots=True)
class Definition:
    unit: str
    source: str
    computation: str
    kind: str = "engine"  # "engine" | "config" | "gpu"


# The vocabulary. docs/signals.md is generated from (and tested against) this table.
VOCABULARY: Mapping[str, Definition] = {
    # --- engine load -------------------------------------------------------------------------
    "requests_running": Definition(
        "requests", "vllm:num_requests_running | sglang:num_running_reqs",
        "latest value, summed over data-parallel engines"),
    "requests_running_max": Definition(
        "requests", "vllm:num_requests_running | sglang:num_running_reqs", "maximum over the window"),
    "requests_waiting": Definition(
        "requests", "vllm:num_requests_waiting | sglang:num_queue_reqs",
        "latest value, summed over data-parallel engines"),
    "requests_waiting_max": Definition(
        "requests", "vllm:num_requests_waiting | sglang:num_queue_reqs", "maximum over the window"),
    "sleep_level": Definition(
        "level", "vllm:engine_sleep_state{sleep_state}",
        "latest: 0 awake, 1 weights offloaded (sleep level 1), 2 weights and KV cache discarded (level 2); "
        "the deepest data-parallel engine"),
    "server_load": Definition(
        "requests", "vLLM GET /load",
        "latest: in-flight generation requests counted by the API server (only with "
        "--enable-server-load-tracking; 0 otherwise). Unlike vllm:num_requests_*, it counts requests sent "
        "to a sleeping engine"),
    "kv_cache_usage": Definition(
        "ratio 0..1", "vllm:kv_cache_usage_perc (old: vllm:gpu_cache_usage_perc) | sglang:token_usage",
        "latest value; the fullest data-parallel engine"),
    "kv_cache_usage_max": Definition(
        "ratio 0..1", "as kv_cache_usage", "maximum over the window"),
    "request_rate": Definition(
        "requests/s", "vllm:request_success_total (all finished_reason) | sglang:num_requests_total",
        "Δcount / Δt over the window"),
    "prompt_tokens_per_s": Definition(
        "tokens/s", "vllm:prompt_tokens_total | sglang:prompt_tokens_total", "Δcount / Δt"),
    "generation_tokens_per_s": Definition(
        "tokens/s", "vllm:generation_tokens_total | sglang:generation_tokens_total", "Δcount / Δt"),
    "preemptions_per_s": Definition(
        "preemptions/s", "vllm:num_preemptions_total | sglang:num_retracted_requests_total",
        "Δcount / Δt"),
    "requests_rejected_per_s": Definition(
        "requests/s", 'http_requests_total{handler=~"/v1/(chat/)?completions",status="4xx"}',
        "Δcount / Δt; rejected requests (too long, bad max_tokens) never reach the vllm: histograms"),
    "prefix_cache_hit_rate": Definition(
        "ratio 0..1", "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total",
        "Δhits / Δqueries over the window"),
    "queue_time_mean_s": Definition(
        "s", "vllm:request_queue_time_seconds | sglang:queue_time_seconds", "Δsum / Δcount"),
    "queue_time_p50_s": Definition(
        "s", "as queue_time_mean_s", "quantile of bucket deltas; vLLM's first bucket is 0–0.3 s, so check "
        "its bounds"),
    "queue_time_p95_s": Definition(
        "s", "as queue_time_mean_s", "quantile of bucket deltas; vLLM's first bucket is 0–0.3 s, so check "
        "its bounds"),
    "ttft_mean_s": Definition(
        "s", "vllm:time_to_first_token_seconds | sglang:time_to_first_token_seconds", "Δsum / Δcount"),
    "ttft_p50_s": Definition(
        "s", "as ttft_mean_s", "quantile of bucket deltas, linear within the bucket; carries bounds"),
    "ttft_p95_s": Definition(
        "s", "as ttft_mean_s", "quantile of bucket deltas, linear within the bucket; carries bounds"),
    "ttft_p99_s": Definition(
        "s", "as ttft_mean_s", "quantile of bucket deltas; the tail an SLO is written against (decisions.slo)"),
    "itl_mean_s": Definition(
        "s", "vllm:inter_token_latency_seconds (old: vllm:time_per_output_token_seconds) | "
        "sglang:inter_token_latency_seconds", "Δsum / Δcount"),
    "itl_p50_s": Definition(
        "s", "as itl_mean_s", "quantile of bucket deltas: the plain decode step, without prefill stalls"),
    "itl_p95_s": Definition(
        "s", "as itl_mean_s", "quantile of bucket deltas, linear within the bucket; carries bounds"),
    "itl_p99_s": Definition(
        "s", "as itl_mean_s", "quantile of bucket deltas; catches prefill stalls that a p95 hides (a few "
        "percent of gaps of 1-2.5 s while long prompts are prefilled)"),
    "tpot_mean_s": Definition(
        "s", "vllm:request_time_per_output_token_seconds (SGLang: none)",
        "Δsum / Δcount: each finished request's own mean gap between output tokens, averaged"),
    "tpot_p50_s": Definition(
        "s", "as tpot_mean_s", "quantile of bucket deltas over the window's finished requests; carries bounds"),
    "tpot_p99_s": Definition(
        "s", "as tpot_mean_s", "quantile of bucket deltas: the per-token speed 99 % of requests saw. Unlike "
        "itl_p99_s, a request's one-off prefill stall is spread over its tokens, not counted as a gap of its own"),
    "e2e_mean_s": Definition(
        "s", "vllm:e2e_request_latency_seconds | sglang:e2e_request_latency_seconds", "Δsum / Δcount"),
    "e2e_p95_s": Definition(
        "s", "as e2e_mean_s", "quantile of bucket deltas, linear within the bucket; carries bounds"),
    "prompt_tokens_p99": Definition(
        "tokens", "vllm:request_prompt_tokens | sglang:prompt_tokens_histogram",
        "upper bound of the bucket holding the 99th percentile of the window's requests (conservative)"),
    "prompt_tokens_max": Definition(
        "tokens", "as prompt_tokens_p99",
        "upper bound of the highest non-empty bucket since the engine started (cumulative)"),
    "max_tokens_p99": Definition(
        "tokens", "vllm:request_params_max_tokens",
        "upper bound of the bucket holding the 99th percentile of the window's requests (conservative)"),
    "max_tokens_max": Definition(
        "tokens", "vllm:request_params_max_tokens",
        "upper bound of the highest non-empty bucket since the engine started (cumulative)"),
    "idle_seconds": Definition(
        "s", "running, waiting and request_success",
        "time since the last snapshot that showed any request activity (≥ the window span if none)"),
    "window_seconds": Definition("s", "snapshot times", "span between the first and last snapshot"),
    # --- the concurrency model's inputs (planning/models.py) ----------------------------------
    "requests_running_mean": Definition(
        "requests", "as requests_running", "mean over the window's snapshots"),
    "requests_waiting_mean": Definition(
        "requests", "as requests_waiting", "mean over the window's snapshots"),
    "in_system_growth_per_s": Definition(
        "requests/s (signed)", "running + waiting",
        "(running + waiting) at the window's end minus at its start, over the span: > 0 while a queue builds"),
    "arrival_rate_per_s": Definition(
        "requests/s", "request_rate + in_system_growth_per_s + requests_rejected_per_s",
        "requests that arrived per second: finished, still inside, or turned away (served rate alone "
        "under-counts a slot-bound engine)"),
    "slot_seconds_mean": Definition(
        "s", "vllm:request_inference_time_seconds", "Δsum / Δcount: how long a request holds a sequence slot "
        "(prefill + decode, queue time excluded)"),
    "queue_wait_expected_s": Definition(
        "s", "requests_waiting, requests_running, in_system_growth_per_s, slot_seconds_mean",
        "(latest waiting + in_system_growth_per_s⁺ × the last scrape interval) × slot_seconds_mean / latest running: "
        "how long a request arriving by the next scrape waits for a slot, while there is a queue (leads the "
        "queue-time and TTFT histograms, which observe a request once it is admitted); where no request "
        "finished in the window, a lower bound: the slot time is at least how long the running requests have held "
        "their slots"),
    "prompt_tokens_mean": Definition(
        "tokens", "vllm:request_prompt_tokens | sglang:prompt_tokens_histogram", "Δsum / Δcount"),
    "generation_tokens_mean": Definition(
        "tokens", "vllm:request_generation_tokens | sglang:generation_tokens_histogram", "Δsum / Δcount"),
    "kv_concurrency_observed": Definition(
        "requests", "kv_cache_size_tokens / (prompt_tokens_mean + generation_tokens_mean / 2)",
        "how many requests of the window's mean size the KV cache holds at once (a running request holds its "
        "prompt and what it generated so far: on average over its life, half its output); where no request "
        "finished in either window, kv_cache_max_concurrency (the most any size could need)"),
    # --- engine live configuration ----------------------------------------------------------
    "block_size": Definition("tokens", "vllm:cache_config_info{block_size}", "label value", "config"),
    "num_gpu_blocks": Definition("blocks", "vllm:cache_config_info{num_gpu_blocks}", "label value",
                                 "config"),
    "kv_cache_size_tokens": Definition(
        "tokens", "vllm:cache_config_info{kv_cache_size_tokens} (else num_gpu_blocks × block_size) | "
        "sglang:max_total_num_tokens", "label value", "config"),
    "kv_cache_max_concurrency": Definition(
        "requests", "vllm:cache_config_info{kv_cache_max_concurrency} (else kv_cache_size_tokens / "
        "max_model_len)", "how many max_model_len requests fit in the KV cache", "config"),
    "gpu_memory_utilization": Definition(
        "ratio 0..1", "vllm:cache_config_info{gpu_memory_utilization}", "label value", "config"),
    "max_model_len": Definition(
        "tokens", "GET /v1/models data[].max_model_len", "as served (not in /metrics)", "config"),
    # --- GPU ---------------------------------------------------------------------------------
    "gpu_temp_c": Definition("°C", "NVML temperature GPU | DCGM_FI_DEV_GPU_TEMP", "max over GPUs", "gpu"),
    "mem_temp_c": Definition("°C", "NVML field MEMORY_TEMP | DCGM_FI_DEV_MEMORY_TEMP (0 = not reported)",
                             "max over GPUs", "gpu"),
    "temp_margin_c": Definition(
        "°C", "NVML slowdown threshold (or configured slowdown_temp_c) − GPU temperature",
        "min over GPUs", "gpu"),
    "thermal_throttle": Definition(
        "bool 0/1", "clock-event reasons & 0x60 (SW/HW thermal slowdown)", "any GPU", "gpu"),
    "power_capped": Definition("bool 0/1", "clock-event reasons & 0x4 (SW power cap)", "any GPU", "gpu"),
    "hw_slowdown": Definition(
        "bool 0/1", "clock-event reasons & 0xC8 (HW slowdown, HW thermal, HW power brake)", "any GPU", "gpu"),
    "sm_clock_ratio": Definition(
        "ratio 0..1", "SM clock / max SM clock (NVML; DCGM needs sm_clock_max_mhz configured)",
        "min over GPUs", "gpu"),
    "power_w": Definition("W", "NVML power usage | DCGM_FI_DEV_POWER_USAGE", "max over GPUs", "gpu"),
    "power_limit_w": Definition("W", "NVML enforced power limit", "min over GPUs", "gpu"),
    "gpu_util": Definition("ratio 0..1", "NVML utilization.gpu | DCGM_FI_DEV_GPU_UTIL", "mean over GPUs",
                           "gpu"),
    "dram_active": Definition("ratio 0..1", "DCGM_FI_PROF_DRAM_ACTIVE", "mean over GPUs", "gpu"),
    "sm_active": Definition("ratio 0..1", "DCGM_FI_PROF_SM_ACTIVE (not in dcgm-exporter's default CSV)",
                            "mean over GPUs", "gpu"),
}


# --- domains ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Domain:
    """Where a signal's value may lie: ``[low, high]``, or ``(low, high]`` with ``low_open``. Always finite."""

    low: float
    high: float
    low_open: bool = False

    def describe(self) -> str:
        return f"{'(' if self.low_open else '['}{_short(self.low)}, {_short(self.high)}]"

    def problem(self, value: float) -> str | None:
        """Why ``value`` is outside the domain (None: inside)."""
        if not math.isfinite(value):
            return f"{value} is not a finite number"
        if value < self.low or (self.low_open and value == self.low) or value > self.high:
            return f"{value:g} is outside {self.describe()}"
        return None


def _short(x: float) -> str:
    if x == 2**53:
        return "2^53"
    return f"{x:g}"


EXACT = float(2**53)  # the largest count a float64 holds exactly: anything above is not a count
COUNT = Domain(0, EXACT)
_BY_UNIT: Mapping[str, Domain] = {
    "requests": COUNT, "tokens": COUNT, "blocks": COUNT,
    "requests/s": COUNT, "tokens/s": COUNT, "preemptions/s": COUNT, "s": COUNT,
    "requests/s (signed)": Domain(-COUNT.high, COUNT.high),
    "ratio 0..1": Domain(0, 1), "bool 0/1": Domain(0, 1), "level": Domain(0, 2),
    # a GPU throttles near 90 °C and shuts down near 100 °C: a sensor outside −50…150 °C is broken
    "°C": Domain(-50, 150),
    "W": Domain(0, 5000),  # the largest single GPUs draw ~1.2 kW
}


def _range(knob: str) -> Domain:
    r = knobs.RANGES[knob]
    return Domain(r.low, r.high, r.low_open)


_OVERRIDES: Mapping[str, Domain] = {
    "temp_margin_c": Domain(-200, 200),  # slowdown threshold − temperature: negative when past it
    # the live configuration: what vLLM accepts (knobs.RANGES); a hybrid (Mamba) model's block size is
    # set by vLLM itself and may exceed the flag's 1024, so the signal allows more
    "block_size": Domain(1, 65536),
    "gpu_memory_utilization": _range("gpu_memory_utilization"),
    "max_model_len": _range("max_model_len"),
}

DOMAINS: Mapping[str, Domain] = {name: _OVERRIDES.get(name) or _BY_UNIT[d.unit] for name, d in VOCABULARY.items()}


def checked(name: str, signal: Signal) -> Signal:
    """``signal``, or ``None`` with the reason when its value lies outside the signal's domain."""
    value = signal.value
    if value is None:
        return signal
    domain = DOMAINS.get(name)
    if domain is not None and domain.low < value <= domain.high:  # the usual case, in one comparison
        return signal
    why = domain.problem(value) if domain is not None else (None if math.isfinite(value) else f"{value} is not finite")
    if why is None:
        return signal
    return missing(f"{why}: an input series is wrong, not used")
