"""The simulated pool, calibrated on the real H200 runs committed in ``tests/fixtures/evaluation/h200*``.

Those runs put two vLLM 0.26 replicas of the 8B-shaped Llama on ONE H200 (``--gpu-memory-utilization 0.4``
each). The simulator's ``GpuModel`` (``tuner/sim/config.py``) was fitted on one replica owning the whole GPU
(docs/evidence-h200.md); two replicas time-share its SMs, so every step of each is slower. One factor,
``SHARE``, scales the three step costs (the step's fixed cost, per sequence, per prefill token). It is fitted
by ``python -m bench.family --calibrate``, which replays each committed arm's own trace (its
``trace.json.gz``, request for request) through the simulated pool at the arm's cap — and the tuner arms
through the whole simulated loop — and prints the real and simulated goodput and TTFT p50/p99 side by side.

The fit (a grid over both factors, 1.7-2.1 × 0.9-2.1, on the static arms; the figures ``--calibrate``
prints are in docs/evaluation.md): 1.9 and 2.1 put every static arm's goodput within 1 % of the real one —
the overloaded ``h200`` cap-128 arm (29.6 req/s served; TTFT p50 11.48 s simulated against 11.44 s real)
and ``h200-fit``'s bad start and cap 128 among them; the low-load TTFT p50 of ``h200-rise`` (0.055 s real,
0.037 s engine-side in the simulation) gives the 0.018 s front end.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path

from bench.family import runs, traces
from tuner.sim.config import H200, GpuModel

DECODE_SHARE, PREFILL_SHARE = 1.9, 2.1
GPU: GpuModel = dataclasses.replace(
    H200, name="two replicas on one NVIDIA H200 (simulated)",
    step_base_seconds=H200.step_base_seconds * DECODE_SHARE,
    step_per_seq_seconds=H200.step_per_seq_seconds * DECODE_SHARE,
    step_per_prefill_token_seconds=H200.step_per_prefill_token_seconds * PREFILL_SHARE)
FRONTEND_SECONDS = runs.FRONTEND_SECONDS  # fitted here, used there
REPLICAS = 2
KV_TOKENS = GPU.kv_cache_tokens(0.4, 8192)  # each replica's cache at --gpu-memory-utilization 0.4

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "evaluation"
OLDER_LAW = ("h200", "h200-fit", "h200-rise")  # their tuner arms ran an earlier law: only their static arms count
RUNS = ("h200", "h200-fit", "h200-rise", "h200-rise-issue25", "h200-family-2026-5", "h200-family-2026-124")


def capacity(mix: Sequence[traces.Mix], gpu: GpuModel = GPU) -> float:
    """Requests/s the whole pool serves of this mixture at its best batch (the model's arithmetic): a request
    costs its prompt's prefill tokens plus its output tokens' share of the decode steps at batch n, with n as
    large as the KV cache holds for the mixture's sizes (at most 256)."""
    total = sum(m.weight for m in mix)
    prompt = sum(m.weight * m.prompt for m in mix) / total
    output = sum(m.weight * m.output for m in mix) / total
    n = max(1.0, min(256.0, KV_TOKENS / (prompt + output)))
    cost = output * (gpu.step_base_seconds / n + gpu.step_per_seq_seconds) + prompt * gpu.step_per_prefill_token_seconds
    return REPLICAS / cost


def _cap(flags: str | None) -> int | None:
    parts = (flags or "").split()
    return int(parts[parts.index("--max-num-seqs") + 1]) if "--max-num-seqs" in parts else None


def _fmt(v: float | None) -> str:
    return "   -  " if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:6.3f}"


def main() -> int:
    print(f"simulated pool: {GPU.name}, decode steps × {DECODE_SHARE} and prefill × {PREFILL_SHARE} of the "
          f"single-GPU model, front end {FRONTEND_SECONDS} s; "
          f"KV {KV_TOKENS} tokens per replica")
    print(f"{'run':20} {'arm':12} {'goodput real':>12} {'sim':>7} {'sim/real':>8}   "
          f"{'TTFT p50 real':>13} {'sim':>6}   {'TTFT p99 real':>13} {'sim':>6}")
    for run in RUNS:
        d = FIXTURES / run
        if not (d / "summary.json").exists():
            continue
        summary = json.loads((d / "summary.json").read_text())
        doc = json.load(gzip.open(d / "trace.json.gz"))
        trace = traces.from_profile(doc, name=run)
        for arm, real in summary["arms"].items():
            if real.get("kind") == "static":
                sim = runs.static(trace, _cap(real.get("flags")), gpu=GPU)
            elif arm == "tuner-live" and run not in OLDER_LAW:
                sim = runs.tuner(trace, 8, gpu=GPU, live=True)
            else:
                continue
            ratio = sim.goodput / real["goodput"] if real["goodput"] else math.nan
            print(f"{run:20} {arm:12} {real['goodput']:12.2f} {sim.goodput:7.2f} {ratio:8.2f}   "
                  f"{_fmt(real.get('ttft_p50')):>13} {_fmt(sim.ttft_p50)}   {_fmt(real.get('ttft_p99')):>13} "
                  f"{_fmt(sim.ttft_p99)}")
    return 0
