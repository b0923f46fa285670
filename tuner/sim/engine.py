"""A SIMULATED vLLM 0.32 replica: vLLM's flags and HTTP surface over a small queueing model.

Run it like vLLM (the process actuator does)::

    python -m tuner.sim.engine --port 8001 --max-num-seqs 8 --sim-concurrency 64

THIS IS NOT vLLM. The model id is ``SIMULATED-…``, every response carries ``X-Simulated-Engine``, the
first log line says so. What is faithful (engine-contract.md §1-§4):

- ``/metrics``: vLLM 0.32's families with its types, ``model_name``/``engine`` labels, HELP texts and
  bucket lists (request-token histograms: 1-2-5 buckets capped at ``--max-model-len``), written by
  prometheus_client as vLLM's are; ``vllm:cache_config_info`` with 0.32's label keys;
  ``http_requests_total{handler,method,status}``; ``process_start_time_seconds``.
- ``/health`` (200, empty body; the port is not even bound during the simulated start-up),
  ``/v1/models`` (with ``max_model_len``), ``/version``, ``/ping``, ``/load``, and non-streaming
  ``POST /v1/completions`` / ``/v1/chat/completions`` with vLLM's 400s for over-long requests.
- The flags ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--max-model-len``, ``--block-size``,
  ``--gpu-memory-utilization``, ``--[no-]enable-chunked-prefill``, ``--num-gpu-blocks-override``,
  ``--shutdown-timeout``, ``--host``, ``--port`` with vLLM's defaults for an H200-class GPU and vLLM's
  start-up refusals (``max_num_batched_tokens < max_num_seqs``, a budget below ``max_model_len`` with
  chunked prefill off, a KV cache too small for one ``max_model_len`` request, a block size no CUDA
  attention backend takes), exiting 1 with vLLM's wording.

The model (``GpuModel``) is an 8B-shaped Llama on an H200, calibrated on docs/evidence-h200.md: KV capacity
from ``--gpu-memory-utilization`` (0.85 → ~857k tokens, 0.2 → ~113k), one engine step costs
4.6 ms + 0.045 ms per running sequence + 0.0232 ms per prefill token, so 8 → 128 sequences gives ≈4×
throughput with ≈2× median inter-token latency, and an 8192-token prefill chunk makes a ~200 ms ITL
spike. The scheduler admits FCFS under ``--max-num-seqs``, the token budget and free KV blocks, and
preempts (recompute) the newest request when a decode step finds no free block.

Load comes from HTTP requests and/or a built-in generator: ``--sim-concurrency N`` closed-loop users or
``--sim-arrival-rate R`` Poisson arrivals per second; ``POST /sim/load`` changes it live and
``POST /sim/drain`` / ``/sim/undrain`` stop and resume it (a drain hook for demos). ``--sim-time-scale``
runs the simulated clock faster than the wall clock (latencies are reported in simulated seconds).

Differences from vLLM, on purpose: ``--shutdown-timeout`` defaults to 30 (vLLM: 0 = abort) so that
SIGTERM finishes in-flight requests, then exits 0; streaming is not supported (400); tokens are
estimated as 4 characters each; prefix caching never hits.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import random
import re
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, Self

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("tuner.sim")

VLLM_VERSION = "0.32.0"
SIM_HEADER = "X-Simulated-Engine"
SIM_HEADER_VALUE = "vllm-tuner-sim (a queueing model, not vLLM)"
CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"

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


# --- the simulated hardware and model -----------------------------------------------------------------


@dataclass(frozen=True)
class GpuModel:
    """An 8B-shaped Llama (32 layers, 8 KV heads × 128, bf16) on one H200, calibrated on docs/evidence-h200.md."""

    name: str = "NVIDIA H200 (simulated)"
    memory_gib: float = 139.8
    weights_gib: float = 13.0
    activation_base_gib: float = 0.31
    activation_bytes_per_batched_token: int = 110 * 1024  # profiling peak grows with the step budget
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2  # K and V × layers × KV heads × head dim × bf16
    max_position_embeddings: int = 32768
    step_base_seconds: float = 0.0046
    step_per_seq_seconds: float = 0.000045
    step_per_prefill_token_seconds: float = 0.000020

    def kv_cache_tokens(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        activation = self.activation_base_gib * 2**30 + self.activation_bytes_per_batched_token * max_num_batched_tokens
        free = gpu_memory_utilization * self.memory_gib * 2**30 - self.weights_gib * 2**30 - activation
        return max(0, int(free // self.kv_bytes_per_token))

    def step_seconds(self, *, sequences: int, prefill_tokens: int) -> float:
        return (self.step_base_seconds + self.step_per_seq_seconds * sequences
                + self.step_per_prefill_token_seconds * prefill_tokens)


H200 = GpuModel()


class StartupError(Exception):
    """vLLM would refuse to start with these arguments (the message is vLLM's)."""


# --- arguments ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """Resolved engine configuration (vLLM's defaults applied) plus the simulation's own knobs."""

    model: str = "SIMULATED-llama-8b"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    block_size: int = 16
    user_specified_block_size: bool = False
    gpu_memory_utilization: float = 0.92
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    shutdown_timeout: float = 30.0
    enable_sleep_mode: bool = False
    enable_server_load_tracking: bool = False
    # the simulation
    concurrency: int = 0
    arrival_rate: float = 0.0
    prompt_tokens: int = 1024
    output_tokens: int = 256
    max_tokens: int = 512
    time_scale: float = 1.0
    startup_seconds: float = 2.0
    seed: int = 0
    gpu: GpuModel = H200
    num_gpu_blocks: int = 0  # resolved

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def kv_cache_size_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def kv_cache_max_concurrency(self) -> float:
        return self.kv_cache_size_tokens / self.max_model_len


def _human_int(text: str) -> int:
    """vLLM's human-readable ints: 8192, 8k (8000), 8K (8192), 25.6k; ValueError otherwise."""
    s = text.strip()
    if re.fullmatch(r"-?\d+", s):
        return int(s)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", s)
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
    num, unit = m.groups()
    power = {"k": 1, "m": 2, "g": 3}[unit.lower()]
    if unit.isupper():
        if "." in num:
            raise argparse.ArgumentTypeError(f"{text!r}: a fraction needs a decimal suffix")
        return int(num) * int(1024**power)
    value = float(num) * float(1000**power)
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _model_len(text: str) -> int:
    return -1 if text.strip().lower() == "auto" else _human_int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tuner.sim.engine",
        description="A SIMULATED vLLM 0.32 engine (a queueing model; not vLLM). Accepts vLLM's tuning flags.")
    p.add_argument("model_tag", nargs="?", help="the model (as `vllm serve MODEL`); only a name here")
    p.add_argument("--model", help="the model name (default SIMULATED-llama-8b)")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=_human_int)
    p.add_argument("--max-num-batched-tokens", type=_human_int)
    p.add_argument("--max-model-len", type=_model_len)
    p.add_argument("--block-size", type=int)
    p.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.92,
                   dest="gpu_memory_utilization")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to finish in-flight requests on SIGTERM (vLLM's default is 0; the sim's 30)")
    # accepted for compatibility with real command lines, without effect here
    for flag in ("--dtype", "--load-format", "--tensor-parallel-size", "--pipeline-parallel-size", "--seed",
                 "--tokenizer", "--kv-cache-dtype", "--performance-mode", "--uvicorn-log-level",
                 "--api-key", "--max-num-queued-reqs", "--long-prefill-token-threshold"):
        p.add_argument(flag, help="accepted, no effect in the simulation")
    for flag in ("--trust-remote-code", "--enforce-eager", "--disable-log-requests", "--disable-log-stats",
                 "--async-scheduling"):
        p.add_argument(flag, action="store_true", help="accepted, no effect in the simulation")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="POST /sleep, /wake_up and GET /is_sleeping (with VLLM_SERVER_DEV_MODE=1, as vLLM)")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts in-flight generation requests (else it stays 0, as vLLM)")
    sim = p.add_argument_group("simulation (not vLLM flags)")
    sim.add_argument("--sim-concurrency", type=int, default=0, help="closed-loop users (0: none)")
    sim.add_argument("--sim-arrival-rate", type=float, default=0.0, help="Poisson arrivals per second (0: none)")
    sim.add_argument("--sim-prompt-tokens", type=int, default=1024, help="mean prompt length (uniform ±50%%)")
    sim.add_argument("--sim-output-tokens", type=int, default=256, help="mean output length (uniform ±50%%)")
    sim.add_argument("--sim-max-tokens", type=int, default=512, help="the max_tokens the built-in load sends")
    sim.add_argument("--sim-time-scale", type=float, default=1.0, help="simulated seconds per wall second")
    sim.add_argument("--sim-startup-seconds", type=float, default=2.0, help="simulated start-up time")
    sim.add_argument("--sim-seed", type=int, default=0)
    return p


def resolve(ns: argparse.Namespace, *, gpu: GpuModel = H200) -> SimConfig:
    """vLLM's defaults and start-up checks (engine-contract.md §2); raises StartupError like vLLM would fail."""
    model = ns.model or ns.model_tag or "SIMULATED-llama-8b"
    if not model.startswith("SIMULATED-"):
        model = f"SIMULATED-{model}"
    served = ns.served_model_name[0] if ns.served_model_name else None
    if served is not None and not served.startswith("SIMULATED-"):
        served = f"SIMULATED-{served}"
    chunked = True if ns.enable_chunked_prefill is None else bool(ns.enable_chunked_prefill)
    gmu = float(ns.gpu_memory_utilization)
    if not 0 < gmu <= 1:
        raise StartupError(f"GPU memory utilization must be within (0, 1]. Got {gmu}.")
    max_model_len = gpu.max_position_embeddings if ns.max_model_len is None else int(ns.max_model_len)
    if max_model_len > gpu.max_position_embeddings and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        raise StartupError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
            f"(max_position_embeddings={gpu.max_position_embeddings}). Make sure the value is correct and within "
            "the model context size.")
    # H200-class GPU (≥ 70 GiB, not A100): 1024 sequences, 8192 batched tokens (engine-contract.md §2)
    batched = 8192 if ns.max_num_batched_tokens is None else int(ns.max_num_batched_tokens)
    if ns.max_num_batched_tokens is None and not chunked:
        batched = max(max_model_len if max_model_len > 0 else gpu.max_position_embeddings, batched)
    seqs = min(1024, batched) if ns.max_num_seqs is None else int(ns.max_num_seqs)
    block = 16 if ns.block_size is None else int(ns.block_size)
    if block <= 0:
        raise StartupError(f"block_size must be > 0, got {block}")
    if block % 16:
        raise StartupError(f"No valid attention backend found for block_size={block}: FlashAttention and "
                           "Triton need a multiple of 16")
    if seqs <= 0:
        raise StartupError(f"max_num_seqs must be > 0, got {seqs}")
    kv_tokens = gpu.kv_cache_tokens(gmu, batched)
    if ns.num_gpu_blocks_override is not None:
        kv_tokens = int(ns.num_gpu_blocks_override) * block
    if max_model_len <= 0:  # -1 / auto: fit to memory
        max_model_len = min(gpu.max_position_embeddings, kv_tokens // block * block)
        if ns.max_num_batched_tokens is None and not chunked:
            batched = max(max_model_len, 8192)
    if batched < seqs:
        raise StartupError(
            f"max_num_batched_tokens ({batched}) must be greater than or equal to max_num_seqs ({seqs}).")
    if not chunked and batched < max_model_len:
        raise StartupError(
            f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_model_len}). This "
            "effectively limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject "
            "longer sequences. Please increase max_num_batched_tokens or decrease max_model_len.")
    blocks = kv_tokens // block
    if kv_tokens <= 0:
        raise StartupError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                           "when initializing the engine.")
    if blocks * block < max_model_len:
        need = max_model_len * gpu.kv_bytes_per_token / 2**30
        have = blocks * block * gpu.kv_bytes_per_token / 2**30
        raise StartupError(
            f"To serve at least one request with the models's max seq len ({max_model_len}), ({need:.2f} GiB KV "
            f"cache is needed, which is larger than the available KV cache memory ({have:.2f} GiB). Based on the "
            f"available memory, the estimated maximum model length is {blocks * block}. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
    return SimConfig(
        model=model, served_model_name=served, host=ns.host, port=int(ns.port), max_num_seqs=seqs,
        max_num_batched_tokens=batched, max_model_len=max_model_len, block_size=block,
        user_specified_block_size=ns.block_size is not None, gpu_memory_utilization=gmu,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=True if ns.enable_prefix_caching is None else bool(ns.enable_prefix_caching),
        num_gpu_blocks_override=ns.num_gpu_blocks_override, shutdown_timeout=float(ns.shutdown_timeout),
        enable_sleep_mode=bool(ns.enable_sleep_mode),
        enable_server_load_tracking=bool(ns.enable_server_load_tracking),
        concurrency=max(0, ns.sim_concurrency), arrival_rate=max(0.0, ns.sim_arrival_rate),
        prompt_tokens=max(1, ns.sim_prompt_tokens), output_tokens=max(1, ns.sim_output_tokens),
        max_tokens=max(1, ns.sim_max_tokens), time_scale=max(1e-3, ns.sim_time_scale),
        startup_seconds=max(0.0, ns.sim_startup_seconds), seed=ns.sim_seed, gpu=gpu, num_gpu_blocks=blocks,
    )


def config_from_args(argv: Sequence[str], *, gpu: GpuModel = H200) -> SimConfig:
    """Parse and resolve a vLLM-style command line (SystemExit 2 on unknown flags, like vLLM)."""
    return resolve(build_parser().parse_args(list(argv)), gpu=gpu)


# --- metrics ------------------------------------------------------------------------------------------------


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


# --- the queueing model --------------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    id: int
    prompt_tokens: int
    output_tokens: int  # generated before the simulated EOS (≤ max_tokens)
    max_tokens: int
    arrival: float  # simulated seconds
    from_user: int | None = None  # the closed-loop user that sent it
    state: str = "waiting"  # waiting | running | finished
    decoding: bool = False  # False: (re)computing its prefill
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0
    blocks: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    preemptions: int = 0
    finish_reason: str | None = None
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before the next token is sampled: after a preemption (recompute), the output
        so far as well."""
        return self.prompt_tokens + self.generated


class SimEngine:
    """The scheduler and the step clock. Thread-safe: every public method takes the lock."""

    MAX_WAITING = 100_000  # open-loop arrivals beyond this are dropped (bounded memory)

    def __init__(self, cfg: SimConfig, *, registry: CollectorRegistry | None = None,
                 started_at: float | None = None) -> None:
        self.cfg = cfg
        self.registry = registry if registry is not None else CollectorRegistry()
        self.started_at = time.time() if started_at is None else started_at
        self.metrics = VllmMetrics(cfg, self.registry, started_at=self.started_at)
        self.lock = threading.RLock()
        self.rng = random.Random(cfg.seed)
        self.now = 0.0  # simulated seconds since start
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_blocks = cfg.num_gpu_blocks
        self.concurrency = cfg.concurrency
        self.arrival_rate = cfg.arrival_rate
        self.accepting = True
        self.drained = False
        self._next_id = 0
        self._users_busy = 0
        self._next_arrival: float | None = None
        self.steps = 0
        self.finished = 0
        self.sleep_level: int | None = None  # vLLM sleep mode: None awake; 0 paused; 1/2 also KV discarded
        self.admission_cap: int | None = None  # the live cap (vllm-tuner-plugin's max_num_active_seqs)
        self._schedule_arrival()

    # -- sleep mode (vLLM's POST /sleep?mode=keep, /wake_up) -------------------------------------------
    def sleep(self, level: int) -> None:
        """Pause the scheduler and discard the KV cache (levels 1 and 2). Running requests are kept and
        recomputed after the wake (vLLM's ``mode=keep``); requests arriving meanwhile wait."""
        with self.lock:
            for req in reversed(self.running if level >= 1 else []):
                self.free_blocks += req.blocks
                req.blocks, req.computed, req.decoding, req.state = 0, 0, False, "waiting"
                self.waiting.appendleft(req)
            if level >= 1:
                self.running = []
            self.sleep_level = level
            self.metrics.set_sleep_level(level)  # the request gauges keep their last values (see advance)

    def wake(self) -> None:
        with self.lock:
            self.sleep_level = None
            self.metrics.set_sleep_level(None)

    # -- load -------------------------------------------------------------------------------------
    def set_load(self, *, concurrency: int | None = None, arrival_rate: float | None = None) -> None:
        with self.lock:
            if concurrency is not None:
                self.concurrency = max(0, concurrency)
            if arrival_rate is not None:
                self.arrival_rate = max(0.0, arrival_rate)
                self._next_arrival = None
                self._schedule_arrival()

    def _load_active(self) -> bool:
        return self.accepting and not self.drained

    def _schedule_arrival(self) -> None:
        if self.arrival_rate > 0 and self._next_arrival is None:
            self._next_arrival = self.now + self.rng.expovariate(self.arrival_rate)

    def _draw(self, mean: int) -> int:
        return max(1, round(self.rng.uniform(0.5, 1.5) * mean))

    def _synthetic(self, user: int | None) -> Request:
        cfg = self.cfg
        prompt = min(self._draw(cfg.prompt_tokens), cfg.max_model_len - 1)
        max_tokens = min(cfg.max_tokens, cfg.max_model_len)
        max_tokens = max(1, min(max_tokens, cfg.max_model_len - prompt))  # vLLM clamps (engine-contract.md §4)
        output = min(self._draw(cfg.output_tokens), max_tokens)
        return self._new(prompt, output, max_tokens, user)

    def _new(self, prompt: int, output: int, max_tokens: int, user: int | None) -> Request:
        self._next_id += 1
        return Request(self._next_id, prompt, output, max_tokens, self.now, from_user=user)

    def _generate_load(self) -> None:
        if not self._load_active():
            return
        while self._users_busy < self.concurrency:
            self._users_busy += 1
            self.waiting.append(self._synthetic(self._users_busy))
        while self._next_arrival is not None and self._next_arrival <= self.now:
            if len(self.waiting) < self.MAX_WAITING:
                self.waiting.append(self._synthetic(None))
            self._next_arrival += self.rng.expovariate(self.arrival_rate) if self.arrival_rate > 0 else math.inf
            if math.isinf(self._next_arrival):
                self._next_arrival = None

    def submit(self, *, prompt_tokens: int, max_tokens: int, output_tokens: int | None = None) -> Request:
        """An HTTP request, already validated; ``done`` is set when it finishes (or is aborted)."""
        with self.lock:
            output = max_tokens if output_tokens is None else max(1, min(output_tokens, max_tokens))
            req = self._new(prompt_tokens, output, max_tokens, None)
            self.waiting.append(req)
            return req

    # -- time ---------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        with self.lock:
            return bool(self.running or self.waiting)

    def advance(self, until: float, *, max_steps: int = 100_000) -> int:
        """Run engine steps until the simulated clock reaches ``until``; the number of steps run.

        An idle engine jumps to the next arrival (or to ``until``). A step that starts before ``until``
        runs to its end, so ``now`` may pass ``until`` by one step.
        """
        steps = 0
        with self.lock:
            if self.sleep_level is not None:  # paused: time passes, nothing is scheduled, and the gauges
                self._generate_load()          # stand still, as vLLM's do (H200, vLLM 0.26: a request sent
                self.now = max(self.now, until)  # to a sleeping engine left num_requests_* at 0)
                return 0
            while self.now < until and steps < max_steps:
                self._generate_load()
                if not self.running and not self.waiting:
                    nxt = self._next_arrival if self._load_active() and self._next_arrival is not None else until
                    self.now = max(self.now, min(until, nxt))
                    self._publish()
                    if self.now >= until:
                        break
                    continue
                self._step()
                steps += 1
            self._publish()
        return steps

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _preempt(self) -> Request:
        """Recompute-preempt the lowest-priority running request (the newest), as vLLM v1 does."""
        victim = self.running.pop()
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.decoding = False
        victim.state = "waiting"
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        self.metrics.preemptions.inc()
        return victim

    def _step(self) -> None:
        """One engine iteration, as vLLM v1's scheduler does it (simplified): running requests first
        (decodes need one token each, unfinished prefills the rest of the budget), preempting the newest
        when KV blocks run out; then waiting requests FCFS while sequence slots, budget and blocks last."""
        cfg, m = self.cfg, self.metrics
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        for req in list(self.running):
            if req.state != "running":  # preempted earlier in this step
                continue
            n = 1 if req.decoding else min(req.prefill_target - req.computed, budget)
            if n <= 0:
                continue
            need = self._blocks_for(req.computed + n) - req.blocks
            while need > self.free_blocks and req.state == "running":
                victim = self._preempt()
                preempted = True
                if any(r is victim for r, _ in scheduled):
                    scheduled = [(r, k) for r, k in scheduled if r is not victim]
            if req.state != "running":
                continue
            if need > 0:
                self.free_blocks -= need
                req.blocks += need
            scheduled.append((req, n))
            budget -= n
        if not preempted:  # vLLM admits nothing new in a step that had to preempt
            cap = self.admission_cap or cfg.max_num_seqs  # a lower live cap drains down, never preempts
            while self.waiting and len(self.running) < cap and budget > 0:
                req = self.waiting[0]
                n = req.prefill_target - req.computed
                if not cfg.enable_chunked_prefill and n > budget:
                    break
                n = min(n, budget)
                need = self._blocks_for(req.computed + n)
                if need > self.free_blocks:
                    break
                self.waiting.popleft()
                self.free_blocks -= need
                req.blocks = need
                req.state = "running"
                if req.first_scheduled is None:
                    req.first_scheduled = self.now
                    m.prefix_queries.inc(req.prompt_tokens)
                self.running.append(req)
                scheduled.append((req, n))
                budget -= n
        if not scheduled:
            # nothing fits: cannot last (resolve() guarantees one max_model_len request fits the cache),
            # but let the clock move so advance() always ends
            self.now += cfg.gpu.step_base_seconds
            return
        prefill_tokens = sum(n for r, n in scheduled if not r.decoding)
        duration = cfg.gpu.step_seconds(sequences=len(scheduled), prefill_tokens=prefill_tokens)
        self.now += duration
        self.steps += 1
        prompt_counted = 0
        emitted = 0
        finished = False
        for req, n in scheduled:
            req.computed += n
            if not req.decoding:
                if req.computed < req.prefill_target:
                    continue  # more prefill chunks to go
                req.decoding = True
            req.generated += 1  # a finished prefill samples a token; so does every decode step
            emitted += 1
            if req.first_token is None:
                req.first_token = self.now
                prompt_counted += req.prompt_tokens  # vLLM counts a prompt once, at its first token
                m.ttft.observe(self.now - req.arrival)
                m.params_n.observe(1)
                m.max_num_generation_tokens.observe(req.max_tokens)
            elif req.last_token is not None:
                m.itl.observe(self.now - req.last_token)
            req.last_token = self.now
            if req.generated >= req.output_tokens or req.generated >= req.max_tokens \
                    or req.prompt_tokens + req.generated >= cfg.max_model_len:
                eos = req.generated >= req.output_tokens and req.generated < req.max_tokens
                self._finish(req, "stop" if eos else "length")
                finished = True
        if finished:
            self.running = [r for r in self.running if r.state == "running"]
        m.prompt_tokens.inc(prompt_counted)
        m.generation_tokens.inc(emitted)
        m.iteration_tokens.observe(prompt_counted + emitted)

    def _finish(self, req: Request, reason: str) -> None:
        """Record a finished request (the caller removes it from ``running``)."""
        m = self.metrics
        req.state = "finished"
        self.free_blocks += req.blocks
        req.blocks = 0
        req.finish_reason = reason
        req.finished_at = self.now
        self.finished += 1
        m.success[reason].inc()
        scheduled = req.first_scheduled if req.first_scheduled is not None else self.now
        first = req.first_token if req.first_token is not None else self.now
        m.e2e.observe(self.now - req.arrival)
        m.queue.observe(scheduled - req.arrival)
        m.inference.observe(self.now - scheduled)
        m.prefill.observe(first - scheduled)
        m.decode.observe(self.now - first)
        m.req_prompt_tokens.observe(req.prompt_tokens)
        m.req_generation_tokens.observe(req.generated)
        m.tpot.observe((self.now - first) / (req.generated - 1) if req.generated > 1 else 0.0)
        m.params_max_tokens.observe(req.max_tokens)
        m.num_preemptions.observe(req.preemptions)
        m.prefill_kv_computed.observe(req.prompt_tokens)
        if req.from_user is not None:
            self._users_busy -= 1
        req.done.set()

    def _publish(self) -> None:
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.waiting))
        m.waiting_capacity.set(len(self.waiting))
        used = self.cfg.num_gpu_blocks - self.free_blocks
        m.kv_usage.set(used / self.cfg.num_gpu_blocks if self.cfg.num_gpu_blocks else 0.0)

    # -- shutdown ---------------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        """SIGTERM: no new work (the built-in load stops; new HTTP requests are refused)."""
        with self.lock:
            self.accepting = False
            for req in [r for r in self.waiting if r.from_user is not None and r.first_scheduled is None]:
                # closed-loop users that had not been served yet simply never sent their request
                self.waiting.remove(req)
                self._users_busy -= 1

    def abort_all(self) -> int:
        with self.lock:
            victims = [*self.running, *self.waiting]
            self.running, self.waiting = [], collections.deque()
            for req in victims:
                self._finish(req, "abort")
            self._publish()
            return len(victims)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"simulated": True, "sim_time_seconds": round(self.now, 3), "steps": self.steps,
                    "running": len(self.running), "waiting": len(self.waiting), "finished": self.finished,
                    "free_blocks": self.free_blocks, "num_gpu_blocks": self.cfg.num_gpu_blocks,
                    "concurrency": self.concurrency, "arrival_rate": self.arrival_rate,
                    "drained": self.drained, "accepting": self.accepting, "sleep_level": self.sleep_level}


# --- the HTTP server --------------------------------------------------------------------------------------


class LiveControl:
    """vllm-tuner-plugin's file protocol (plugin/README.md, protocol 1), as the simulator speaks it: with
    $VLLM_TUNER_CONTROL_DIR set it reads ``control.json`` and answers in ``ack-0.json``. Only the admission
    cap (``max_num_active_seqs``) moves live here; simplified: it answers between ticks, idle or not."""

    def __init__(self, engine: SimEngine, directory: str) -> None:
        self.engine, self.dir = engine, directory
        self._seen: tuple[float, int] | None = None
        self._ack({"seq": None, "applied": None, "refused": None})

    def poll(self) -> None:
        path = os.path.join(self.dir, "control.json")
        try:
            st = os.stat(path)
        except OSError:
            return
        if self._seen == (st.st_mtime, st.st_size):
            return
        self._seen = (st.st_mtime, st.st_size)
        try:
            with open(path, encoding="utf-8") as f:
                request = json.load(f)
            seq = int(request["seq"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        envelope = self.engine.cfg.max_num_seqs
        cap = request.get("max_num_active_seqs")
        budget = request.get("max_num_batched_tokens")
        refused = None
        if cap is not None and not (isinstance(cap, int) and 1 <= cap <= envelope):
            refused = f"max_num_active_seqs {cap} is outside the startup envelope 1..{envelope}"
        elif budget is not None and budget != self.engine.cfg.max_num_batched_tokens:
            refused = "max_num_batched_tokens is not live in the simulator"
        if refused is None:
            with self.engine.lock:
                self.engine.admission_cap = cap
        self._ack({"seq": seq, "applied": None if refused else {"max_num_active_seqs": cap}, "refused": refused})

    def _ack(self, fields: dict[str, Any]) -> None:
        cfg = self.engine.cfg
        doc = {"protocol": 1, "live": True, **fields,
               "effective": {"seq": fields["seq"], "max_num_active_seqs": self.engine.admission_cap or cfg.max_num_seqs,
                             "max_num_batched_tokens": cfg.max_num_batched_tokens},
               "envelope": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                            "max_num_active_seqs": cfg.max_num_seqs},
               "not_live": {"max_num_batched_tokens": "not live in the simulator"}, "at": time.time(),
               "pid": os.getpid(), "dp_rank": 0, "engine_version": VLLM_VERSION, "engine_known": True,
               "mode": "simulated", "plugin_version": "sim"}
        tmp = os.path.join(self.dir, f".ack-0.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(self.dir, "ack-0.json"))


class _Driver(threading.Thread):
    """Moves the simulated clock with the wall clock (× time_scale), in small ticks."""

    TICK_SECONDS = 0.005
    MAX_TICK_WORK_SECONDS = 0.1  # falling further behind slows the simulated clock instead

    def __init__(self, engine: SimEngine, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="sim-driver", daemon=True)
        self.engine = engine
        self.monotonic = monotonic
        self.halt = threading.Event()
        control = os.environ.get("VLLM_TUNER_CONTROL_DIR")
        self.live = LiveControl(engine, control) if control and os.path.isdir(control) else None

    def run(self) -> None:
        scale = self.engine.cfg.time_scale
        wall0, sim0 = self.monotonic(), self.engine.now
        while not self.halt.is_set():
            started = self.monotonic()
            target = sim0 + (started - wall0) * scale
            while self.engine.now < target and self.monotonic() - started < self.MAX_TICK_WORK_SECONDS:
                self.engine.advance(min(target, self.engine.now + 0.05), max_steps=200)
            if self.engine.now < target:  # could not keep up: let simulated time lag, do not pile up debt
                wall0, sim0 = self.monotonic(), self.engine.now
            if self.live is not None:
                self.live.poll()
            self.halt.wait(self.TICK_SECONDS)


class SimServer:
    """A simulated engine on 127.0.0.1 (by default): HTTP + the driver thread. ``port=0`` picks a port."""

    def __init__(self, cfg: SimConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.engine = SimEngine(cfg, registry=registry)
        self._http = ThreadingHTTPServer((cfg.host, cfg.port), _handler(self))
        self._http.daemon_threads = True
        self._driver = _Driver(self.engine)
        self._thread: threading.Thread | None = None
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self.created = int(self.engine.started_at)
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"  # vLLM's dev-mode routes (sleep)
        self.server_load = 0  # GET /load with --enable-server-load-tracking

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def start(self) -> Self:
        """Start serving (idempotent)."""
        if self._thread is not None:
            return self
        self._driver.start()
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="sim-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, *, timeout_seconds: float | None = None) -> bool:
        """Graceful stop: refuse new work, finish in-flight requests (bounded), close. True if none was aborted."""
        timeout = self.cfg.shutdown_timeout if timeout_seconds is None else timeout_seconds
        self.engine.stop_accepting()
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        aborted = self.engine.abort_all()
        if aborted:
            log.warning("SIMULATED engine: aborted %d request(s) at the %.0fs shutdown deadline", aborted, timeout)
        # let handler threads write their responses (bounded)
        end = time.monotonic() + 5.0
        while self._inflight and time.monotonic() < end:
            time.sleep(0.02)
        self._driver.halt.set()
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=5)
        self._http.server_close()
        self._driver.join(timeout=5)
        return aborted == 0

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown(timeout_seconds=0)

    # -- request handling (called from handler threads) ---------------------------------------------
    def models(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len,
            "permission": [{"id": f"modelperm-sim-{self.port}", "object": "model_permission",
                            "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}],
        }]}

    def complete(self, body: dict[str, Any], *, chat: bool) -> tuple[int, dict[str, Any]]:
        cfg = self.cfg
        if body.get("stream"):
            return 400, _error("streaming is not supported by the SIMULATED engine", "stream", True)
        if chat:
            messages = body.get("messages") or []
            text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompt = max(1, -(-len(text) // 4))
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        else:
            raw = body.get("prompt", "")
            if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
                prompt = len(raw)
            else:
                prompt = max(1, -(-len(raw if isinstance(raw, str) else json.dumps(raw)) // 4))
            key = "max_tokens"
        requested = body.get(key)
        max_tokens = 16 if requested is None and not chat else requested
        if max_tokens is not None:
            try:
                max_tokens = int(max_tokens)
            except (TypeError, ValueError):
                return 400, _error(f"{key} must be an integer", key, requested)
            if max_tokens > cfg.max_model_len:
                return 400, _error(f"{key}={max_tokens} cannot be greater than max_model_len={cfg.max_model_len}. "
                                   "Please request fewer output tokens.", key, max_tokens)
        if prompt > cfg.max_model_len:
            return 400, _error(f"This model's maximum context length is {cfg.max_model_len} tokens. However, your "
                               f"prompt contains {prompt} input tokens, which exceeds this limit even without any "
                               "output tokens. Please reduce the length of the input prompt.", "input_tokens", prompt)
        if prompt == cfg.max_model_len:
            return 400, _error(f"The decoder prompt (length {prompt}) plus the number of requested output tokens "
                               f"(at least 1) is longer than the maximum model length of {cfg.max_model_len}. Make "
                               "sure that `max_model_len` is no smaller than the number of text tokens plus "
                               "multimodal tokens.", "input_tokens", prompt)
        limit = cfg.max_model_len - prompt
        max_tokens = limit if max_tokens is None else min(max_tokens, limit)  # clamped (engine-contract.md §4)
        output = max_tokens if body.get("ignore_eos") else min(max_tokens, self.engine._draw(cfg.output_tokens))
        if not self.engine.accepting:
            return 503, _error("The server is shutting down (SIMULATED engine).", None, None, code=503)
        req = self.engine.submit(prompt_tokens=prompt, max_tokens=max_tokens, output_tokens=output)
        if cfg.enable_server_load_tracking:
            with self._inflight_lock:
                self.server_load += 1
        try:
            if not req.done.wait(timeout=3600):
                return 504, _error("timed out in the SIMULATED engine", None, None, code=504)
        finally:
            if cfg.enable_server_load_tracking:
                with self._inflight_lock:
                    self.server_load -= 1
        if req.finish_reason == "abort":
            return 500, _error("The request was aborted: the SIMULATED engine shut down.", None, None, code=500)
        text = " ".join(["SIMULATED"] * req.generated)
        usage = {"prompt_tokens": prompt, "completion_tokens": req.generated, "total_tokens": prompt + req.generated}
        created = int(time.time())
        if chat:
            return 200, {"id": f"chatcmpl-sim-{req.id}", "object": "chat.completion", "created": created,
                         "model": cfg.model_name, "choices": [{
                             "index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": req.finish_reason}], "usage": usage}
        return 200, {"id": f"cmpl-sim-{req.id}", "object": "text_completion", "created": created,
                     "model": cfg.model_name, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                           "finish_reason": req.finish_reason}], "usage": usage}


def _error(message: str, param: str | None, value: Any, *, code: int = 400) -> dict[str, Any]:
    if param is not None:
        message = f"{message} (parameter={param}, value={value})"
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(code, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# prometheus_fastapi_instrumentator leaves these out of http_requests_total (engine-contract.md §1.1)
_UNINSTRUMENTED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
_ROUTES = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/sim/load", "/sim/drain",
                     "/sim/undrain", "/sim/state"})


def _handler(server: SimServer) -> type[BaseHTTPRequestHandler]:
    engine = server.engine

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"  # what vLLM answers with; X-Simulated-Engine says what this really is
        sys_version = ""
        timeout = 60  # seconds an idle keep-alive connection may hold a handler thread

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def _route(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics/":
                path = "/metrics"
            with server._inflight_lock:
                server._inflight += 1
            status = 500
            try:
                status = self._dispatch(method, path)
            finally:
                with server._inflight_lock:
                    server._inflight -= 1
                if path not in _UNINSTRUMENTED:
                    handler = path if path in _ROUTES else "none"
                    engine.metrics.http.labels(handler=handler, method=method, status=f"{status // 100}xx").inc()

        def _dispatch(self, method: str, path: str) -> int:
            if method == "GET" and path == "/metrics":
                return self._send(200, generate_latest(engine.registry), CONTENT_TYPE_METRICS)
            if path in ("/health", "/ping") and method in ("GET", "POST"):
                return self._send(200, b"", "application/json")
            if method == "GET" and path == "/version":
                return self._json(200, {"version": VLLM_VERSION, "simulated": SIM_HEADER_VALUE})
            if method == "GET" and path == "/load":
                return self._json(200, {"server_load": server.server_load})
            if method == "GET" and path == "/v1/models":
                return self._json(200, server.models())
            if method == "GET" and path == "/sim/state":
                return self._json(200, engine.snapshot())
            if method == "POST" and path in ("/v1/completions", "/v1/chat/completions", "/sim/load"):
                body = self._body()
                if body is None:
                    return self._json(400, _error("the body is not a JSON object", None, None))
                if path == "/sim/load":
                    try:
                        engine.set_load(concurrency=_opt_int(body.get("concurrency")),
                                        arrival_rate=_opt_float(body.get("arrival_rate")))
                    except (TypeError, ValueError) as exc:
                        return self._json(400, _error(f"bad load: {exc}", None, None))
                    return self._json(200, engine.snapshot())
                status, payload = server.complete(body, chat=path.endswith("chat/completions"))
                return self._json(status, payload)
            if path in ("/sleep", "/wake_up", "/is_sleeping") and server.dev_mode:
                return self._sleep_route(method, path)
            if method == "POST" and path in ("/sim/drain", "/sim/undrain"):
                with engine.lock:
                    engine.drained = path == "/sim/drain"
                return self._json(200, engine.snapshot())
            if path in _ROUTES or path in _UNINSTRUMENTED:
                return self._json(405, {"detail": "Method Not Allowed"})
            return self._json(404, {"detail": "Not Found"})

        def _sleep_route(self, method: str, path: str) -> int:
            """vLLM's dev-mode sleep routes (engine-contract.md §3), present only with VLLM_SERVER_DEV_MODE=1."""
            query = urllib.parse.parse_qs(self.path.partition("?")[2])
            if path == "/is_sleeping" and method == "GET":
                return self._json(200, {"is_sleeping": engine.sleep_level is not None})
            if method != "POST":
                return self._json(405, {"detail": "Method Not Allowed"})
            if not engine.cfg.enable_sleep_mode:
                return self._json(500, _error("Sleep mode is not enabled (start with --enable-sleep-mode)",
                                              None, None, code=500))
            if path == "/wake_up":
                engine.wake()
                return self._json(200, {"status": "awake", "tags": None})
            try:
                level = int(query.get("level", ["1"])[0])
            except ValueError:
                level = -1
            if level not in (0, 1, 2):
                return self._json(422, {"detail": "level must be 0, 1 or 2"})
            engine.sleep(level)
            return self._json(200, {"status": "sleeping", "level": level})

        def _body(self) -> dict[str, Any] | None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > 64 * 1024 * 1024:
                return None
            try:
                data = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return None
            return data if isinstance(data, dict) else None

        def _json(self, status: int, payload: Any) -> int:
            return self._send(status, json.dumps(payload).encode("utf-8"), "application/json")

        def _send(self, status: int, data: bytes, content_type: str) -> int:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.send_header(SIM_HEADER, SIM_HEADER_VALUE)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return status

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def start(argv: Sequence[str] = (), *, gpu: GpuModel = H200, **overrides: Any) -> SimServer:
    """For tests: a started in-process SimServer on a free 127.0.0.1 port, without the start-up delay.

    ``argv`` is a vLLM-style command line; ``overrides`` replace resolved fields (``time_scale=5``…).
    """
    cfg = config_from_args(["--port", "0", *argv], gpu=gpu)
    cfg = replace(cfg, **{"startup_seconds": 0.0, **overrides})
    return SimServer(cfg).start()


# --- the command line ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = config_from_args(argv)
    except StartupError as exc:
        log.error("SIMULATED vLLM engine failed to start: ValueError: %s", exc)
        return 1
    log.info("SIMULATED vLLM %s engine (vllm-tuner sim: a queueing model, NOT vLLM) — model %s, "
             "max_num_seqs=%d max_num_batched_tokens=%d max_model_len=%d block_size=%d "
             "gpu_memory_utilization=%g chunked_prefill=%s; KV cache %d tokens (%d blocks)",
             VLLM_VERSION, cfg.model_name, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
             cfg.block_size, cfg.gpu_memory_utilization, cfg.enable_chunked_prefill, cfg.kv_cache_size_tokens,
             cfg.num_gpu_blocks)
    signals_seen: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals_seen.append(signum)  # only record it: the main thread polls

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ready_at = time.monotonic() + cfg.startup_seconds
    while time.monotonic() < ready_at and not signals_seen:  # "loading the model": the port is not bound yet
        time.sleep(0.05)
    if signals_seen:
        log.info("SIMULATED engine stopped during start-up")
        return 0
    try:
        server = SimServer(cfg).start()
    except OSError as exc:
        log.error("SIMULATED engine cannot listen on %s:%d: %s", cfg.host, cfg.port, exc)
        return 1
    log.info("SIMULATED engine serving on %s (load: %d users, %.3g req/s)", server.base_url, cfg.concurrency,
             cfg.arrival_rate)
    while not signals_seen:
        time.sleep(0.05)
    log.info("SIMULATED engine: signal %d, finishing in-flight requests (up to %.0fs)", signals_seen[0],
             cfg.shutdown_timeout)
    clean = server.shutdown()
    log.info("SIMULATED engine stopped (%s)", "clean" if clean else "in-flight requests aborted at the deadline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
