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

The pieces, one job each: ``config`` (flags, hardware), ``metrics`` (vLLM's families), ``queueing`` (the
model), ``server`` (HTTP, load, drain, live knobs); this module is the command line.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from tuner.sim.config import H200, GpuModel, SimConfig, StartupError, build_parser, config_from_args, resolve
from tuner.sim.metrics import VLLM_VERSION, VllmMetrics, cache_config_labels
from tuner.sim.queueing import Request, SimEngine
from tuner.sim.server import SIM_HEADER, SIM_HEADER_VALUE, LiveControl, SimServer, start

__all__ = ["H200", "SIM_HEADER", "SIM_HEADER_VALUE", "VLLM_VERSION", "GpuModel", "LiveControl", "Request",
           "SimConfig", "SimEngine", "SimServer", "StartupError", "VllmMetrics", "build_parser",
           "cache_config_labels", "config_from_args", "main", "resolve", "start"]

log = logging.getLogger("tuner.sim")


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
