"""Engine dialects: where each engine-agnostic concept lives in one engine's exposition.

This is the one alias table of the project. Each concept maps to candidate *family* names, newest
first; the first one present in a snapshot wins. Older vLLM names (removed in 0.12-0.14, see
engine-contract.md §1.4) stay here as fallbacks so older engines keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

EngineKind = Literal["vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class Dialect:
    kind: EngineKind
    # concept -> candidate family names (gauges as-is, counters WITHOUT the `_total` suffix,
    # histograms by base name). Absent concept: empty tuple.
    names: MappingProxyType[str, tuple[str, ...]]
    # extra name prefixes worth parsing besides the families in ``names``
    extra_prefixes: tuple[str, ...] = ()
    # handlers whose 4xx count as rejected generation requests (http_requests_total)
    completion_handlers: tuple[str, ...] = ()

    def candidates(self, concept: str) -> tuple[str, ...]:
        return self.names.get(concept, ())

    def parse_prefixes(self) -> tuple[str, ...]:
        """Name prefixes of every family this dialect reads; everything else is skipped unparsed."""
        families = sorted({name for names in self.names.values() for name in names})
        return tuple(families) + self.extra_prefixes


VLLM = Dialect(
    kind="vllm",
    names=MappingProxyType(
        {
            "running": ("vllm:num_requests_running",),
            "waiting": ("vllm:num_requests_waiting",),
            "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            "preemptions": ("vllm:num_preemptions",),
            "prompt_tokens": ("vllm:prompt_tokens",),
            "generation_tokens": ("vllm:generation_tokens",),
            "request_success": ("vllm:request_success",),
            "queue_time": ("vllm:request_queue_time_seconds",),
            "ttft": ("vllm:time_to_first_token_seconds",),
            "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
            # per-request mean time per output token (TPOT), one observation per finished request; NOT the
            # removed vllm:time_per_output_token_seconds above, which was per token gap (the old ITL)
            "tpot": ("vllm:request_time_per_output_token_seconds",),
            "e2e": ("vllm:e2e_request_latency_seconds",),
            "prompt_len": ("vllm:request_prompt_tokens",),
            "generation_len": ("vllm:request_generation_tokens",),
            "inference_time": ("vllm:request_inference_time_seconds",),
            "max_tokens": ("vllm:request_params_max_tokens",),
            "prefix_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
            "prefix_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
            "http_requests": ("http_requests",),
            "cache_info": ("vllm:cache_config_info",),
            "kv_capacity_tokens": (),
            "process_start": ("process_start_time_seconds",),
            "sleep_state": ("vllm:engine_sleep_state",),
        }
    ),
    completion_handlers=("/v1/completions", "/v1/chat/completions"),
)

SGLANG = Dialect(
    kind="sglang",
    names=MappingProxyType(
        {
            "running": ("sglang:num_running_reqs",),
            "waiting": ("sglang:num_queue_reqs",),
            "kv_usage": ("sglang:token_usage",),
            "preemptions": ("sglang:num_retracted_requests",),
            "prompt_tokens": ("sglang:prompt_tokens",),
            "generation_tokens": ("sglang:generation_tokens",),
            "request_success": ("sglang:num_requests",),
            "queue_time": ("sglang:queue_time_seconds",),
            "ttft": ("sglang:time_to_first_token_seconds",),
            "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
            "tpot": (),  # SGLang has no per-request TPOT histogram
            "e2e": ("sglang:e2e_request_latency_seconds",),
            "prompt_len": ("sglang:prompt_tokens_histogram",),
            "generation_len": ("sglang:generation_tokens_histogram",),
            "inference_time": (),
            "max_tokens": (),
            "prefix_queries": (),
            "prefix_hits": (),
            "http_requests": (),
            "cache_info": (),
            "kv_capacity_tokens": ("sglang:max_total_num_tokens",),
            "process_start": ("process_start_time_seconds",),
        }
    ),
)

DIALECTS: MappingProxyType[str, Dialect] = MappingProxyType({"vllm": VLLM, "sglang": SGLANG})
