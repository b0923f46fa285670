"""The simulated engine's ``/metrics``: vLLM 0.32's families, types, labels, HELP texts and bucket lists."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


def observe_many(histogram: Any, amount: float, count: int) -> None:
    """``count`` observations of the same ``amount`` at once: every decoding request of one engine step has
    the same inter-token gap, and observing them one by one was half of the simulation's time (the
    virtual-time benchmark, ``bench.family``, runs it for hours of simulated traffic). Falls back to
    single observations where prometheus_client's histogram lacks the attributes used."""
    try:
        histogram._raise_if_not_observable()
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(count)
            break


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
    """vLLM 0.32's ``PrometheusStatLogger`` families (those a single-GPU text-only engine registers)."""

    def __init__(self, cfg: SimConfig, registry: CollectorRegistry, *, started_at: float) -> None:
        names = ["model_name", "engine"]
        lv = (cfg.model_name, "0")
        r = registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*lv)

        tokens = build_1_2_5_buckets(cfg.max_model_len)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                          "Number of requests waiting to be processed, by reason.", [*names, "reason"], registry=r)
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        by_reason.labels(*lv, "deferred").set(0)
        sleep = Gauge("vllm:engine_sleep_state",
                      "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                      "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                      [*names, "sleep_state"], registry=r)
        self.sleep_state = {state: sleep.labels(*lv, state) for state in ("awake", "weights_offloaded", "discard_all")}
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
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
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
