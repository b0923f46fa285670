"""The simulated engine's ``/metrics``: vLLM 0.32's families, types, labels, HELP texts and bucket lists."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.utils import floatToGoString as _go_float

from tuner.sim.config import SimConfig

log = logging.getLogger("tuner.sim")

VLLM_VERSION = "0.32.0"

# --- vLLM 0.32's bucket lists (v1/metrics/buckets.py, engine-contract.md §1.2) ------------------------------
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, … up to ``max_value``."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


# --- metrics ------------------------------------------------------------------------------------------------


def _go(value: float) -> str:
    """A sample's value as prometheus_client writes it."""
    return str(_go_float(value))  # type: ignore[no-untyped-call]


class _Value:
    """A counter's or a gauge's one series, kept as a plain float (``VllmMetrics`` says why)."""

    __slots__ = ("counter", "real", "value")

    def __init__(self, real: Any, *, counter: bool) -> None:
        self.real, self.value, self.counter = real, 0.0, counter

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def flush(self) -> None:
        if self.counter:
            self.real._value.set(self.value)
        else:
            self.real.set(self.value)

    def getters(self) -> list[Callable[[], float]]:
        return [lambda: self.value]

    def sentinel(self, base: float) -> int:
        self.real._value.set(base) if self.counter else self.real.set(base)
        return 1


class _Histogram:
    """A histogram's one series: a count per bucket and the sum."""

    __slots__ = ("bounds", "counts", "real", "total")

    def __init__(self, real: Any) -> None:
        self.real = real
        self.bounds = list(real._upper_bounds)  # the last is +Inf
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, amount: float, count: int = 1) -> None:
        """``count`` observations of ``amount`` (every decoding request of one engine step has the same gap)."""
        self.counts[bisect.bisect_left(self.bounds, amount)] += count  # the first bound ≥ amount
        self.total += amount * count

    def flush(self) -> None:
        for bucket, n in zip(self.real._buckets, self.counts, strict=True):
            bucket.set(n)
        self.real._sum.set(self.total)

    def getters(self) -> list[Callable[[], float]]:
        """The cumulative buckets in order (the last is also the count), then the sum."""
        return [*(lambda i=i: float(sum(self.counts[:i + 1])) for i in range(len(self.bounds))),
                lambda: self.total]

    def sentinel(self, base: float) -> int:
        """Raw buckets whose cumulative counts are base, base + 1, …; the sum base + len."""
        for i, bucket in enumerate(self.real._buckets):
            bucket.set(base if i == 0 else 1)
        self.real._sum.set(base + len(self.bounds))
        return len(self.bounds) + 1


CACHE_CONFIG_KEYS = (
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit", "gpu_memory_utilization",
    "cache_dtype", "is_attention_free", "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
    "prefix_caching_hash_algo", "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded", "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype", "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks", "effective_attention_block_size",
    "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size", "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill", "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size",
    "kv_offloading_backend", "_block_size_resolved",
)


def cache_config_labels(cfg: SimConfig) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels: 0.32's keys; values stringified as vLLM does."""
    values: dict[str, object] = {
        "block_size": cfg.block_size, "user_specified_block_size": cfg.user_specified_block_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization, "cache_dtype": "auto", "is_attention_free": False,
        "num_gpu_blocks_override": cfg.num_gpu_blocks_override, "enable_prefix_caching": cfg.enable_prefix_caching,
        "prefix_caching_hash_algo": "sha256", "kv_cache_dtype_skip_layers": [], "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none", "enable_mamba_shared_prefix_checkpoint": False,
        "use_replayssm": False, "use_kda_recoverssm": False, "num_gpu_blocks": cfg.num_gpu_blocks,
        "effective_attention_block_size": cfg.block_size, "kv_cache_size_tokens": cfg.kv_cache_size_tokens,
        "kv_cache_max_concurrency": round(cfg.kv_cache_max_concurrency, 2), "kv_sharing_fast_prefill": False,
        "swa_bounded_replay": False, "skip_page_size_padded": False, "_block_size_resolved": True,
    }
    return {key: str(values.get(key)) for key in CACHE_CONFIG_KEYS}


class VllmMetrics:
    """vLLM 0.32's ``PrometheusStatLogger`` families (those a single-GPU text-only engine registers).

    The engine updates plain numbers (``_Value``, ``_Histogram``), not prometheus_client's objects: a
    simulated engine observes every step of every request, and prometheus_client's locked observations and its
    exposition were most of the virtual-time benchmark's time (``bench.family``, issue 25). ``flush`` writes
    them into the registry (the HTTP engine's ``/metrics`` renders the registry); ``exposition`` renders the
    same text from a template of the registry's own output, values filled in (a test holds the two equal)."""

    def __init__(self, cfg: SimConfig, registry: CollectorRegistry, *, started_at: float) -> None:
        names = ["model_name", "engine"]
        lv = (cfg.model_name, "0")
        r = registry
        self.registry = registry
        self._series: list[_Value | _Histogram] = []
        self._template: tuple[list[str], list[tuple[int, str, Callable[[], float]]]] | None = None

        def wrap(real: Any, kind: str) -> Any:
            series: _Value | _Histogram = _Histogram(real) if kind == "histogram" else \
                _Value(real, counter=kind == "counter")
            self._series.append(series)
            return series

        def gauge(name: str, doc: str) -> Any:
            return wrap(Gauge(name, doc, names, registry=r).labels(*lv), "gauge")

        def counter(name: str, doc: str) -> Any:
            return wrap(Counter(name, doc, names, registry=r).labels(*lv), "counter")

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return wrap(Histogram(name, doc, names, buckets=buckets, registry=r).labels(*lv), "histogram")

        tokens = build_1_2_5_buckets(cfg.max_model_len)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                          "Number of requests waiting to be processed, by reason.", [*names, "reason"], registry=r)
        self.waiting_capacity = wrap(by_reason.labels(*lv, "capacity"), "gauge")
        by_reason.labels(*lv, "deferred").set(0)
        sleep = Gauge("vllm:engine_sleep_state",
                      "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                      "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                      [*names, "sleep_state"], registry=r)
        self.sleep_state = {state: wrap(sleep.labels(*lv, state), "gauge")
                            for state in ("awake", "weights_offloaded", "discard_all")}
        self.set_sleep_level(None)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=r)
        self.success = {reason: wrap(success.labels(*lv, reason), "counter") for reason in FINISH_REASONS}
        self.req_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_generation_tokens = histogram("vllm:request_generation_tokens",
                                               "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.num_preemptions = histogram("vllm:request_num_preemptions",
                                         "Histogram of the number of preemptions per finished request.",
                                         REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                             "Histogram of new KV tokens computed during prefill "
                                             "(excluding cached tokens).", tokens)
        labels = cache_config_labels(cfg)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     [*labels, "engine"], registry=r)
        info.labels(**labels, engine="0").set(1)
        # prometheus_fastapi_instrumentator's counter (engine-contract.md §1.1)
        self.http = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                            ["handler", "method", "status"], registry=r)
        start = Gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                      registry=r)
        start.set(started_at)

    def set_sleep_level(self, level: int | None) -> None:
        """vllm:engine_sleep_state as vLLM sets it: awake = 1 (None: awake), else weights_offloaded (level 1)
        or discard_all (level 2) = 1; level 0 only pauses the scheduler."""
        self.sleep_state["awake"].set(1 if level is None else 0)
        self.sleep_state["weights_offloaded"].set(1 if level == 1 else 0)
        self.sleep_state["discard_all"].set(1 if level == 2 else 0)

    def flush(self) -> None:
        """The registry brought up to date (before anything renders it)."""
        for series in self._series:
            series.flush()

    def exposition(self) -> bytes:
        """``generate_latest(registry)`` of the families above, without prometheus_client's per-sample work:
        the registry's text rendered once with a unique sentinel in every series this class updates says
        which line carries which value; later calls fill those lines in. Series added to the registry by
        others after the first call (the HTTP engine's ``http_requests_total``) are not in it: that engine
        flushes and renders the registry instead."""
        if self._template is None:
            self._template = self._build_template()
        lines, slots = self._template
        out = list(lines)
        for index, prefix, value in slots:
            out[index] = prefix + _go(value())
        return ("\n".join(out) + "\n").encode()

    def _build_template(self) -> tuple[list[str], list[tuple[int, str, Callable[[], float]]]]:
        base, sentinels = 7.0e12, {}
        for series in self._series:
            getters = series.getters()
            used = series.sentinel(base)
            for k in range(used):
                sentinels[_go(base + k)] = getters[k]
            base += 1000.0
        text = generate_latest(self.registry).decode()
        self.flush()
        lines = text.rstrip("\n").split("\n")
        slots = []
        for i, line in enumerate(lines):
            if line.startswith("#"):
                continue
            prefix, _, value = line.rpartition(" ")
            if value in sentinels:
                slots.append((i, prefix + " ", sentinels[value]))
        return lines, slots
