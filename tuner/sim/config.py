"""The simulated engine's flags and hardware: vLLM's flags with its defaults for an H200-class GPU, its
start-up refusals, and the GPU and model the queueing model runs on (``GpuModel``)."""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("tuner.sim")

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
    # a decode reads every running sequence's KV cache: time per token of context in the step. 0 here (the
    # per-sequence cost above was fitted at one context length, ~1,150 tokens); the family's twin
    # (bench/family/calibration.py) splits it, which long prompts at a full batch need
    step_per_context_token_seconds: float = 0.0

    def kv_cache_tokens(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        activation = self.activation_base_gib * 2**30 + self.activation_bytes_per_batched_token * max_num_batched_tokens
        free = gpu_memory_utilization * self.memory_gib * 2**30 - self.weights_gib * 2**30 - activation
        return max(0, int(free // self.kv_bytes_per_token))

    def step_seconds(self, *, sequences: int, prefill_tokens: int, context_tokens: int = 0) -> float:
        return (self.step_base_seconds + self.step_per_seq_seconds * sequences
                + self.step_per_prefill_token_seconds * prefill_tokens
                + self.step_per_context_token_seconds * context_tokens)


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
