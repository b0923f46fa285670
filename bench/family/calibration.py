"""The simulated pool, calibrated on the real H200 runs committed in ``tests/fixtures/evaluation/h200*``.

Those runs put two vLLM 0.26 replicas of the 8B-shaped Llama on ONE H200 (``--gpu-memory-utilization 0.4``
each). The simulator's ``GpuModel`` (``tuner/sim/config.py``) was fitted on one replica owning the whole GPU
(docs/evidence-h200.md); two replicas time-share its SMs, so every step of each is slower: the decode costs
(the step's fixed cost, per sequence, per token of context) are scaled by ``DECODE_SHARE`` and the prefill cost
by ``PREFILL_SHARE``. ``python -m bench.family --calibrate`` replays each committed arm's own trace (its
``trace.json.gz``, request for request) through the simulated pool at the arm's cap — and the tuner arms
through the whole simulated loop — and prints the real and simulated goodput and TTFT p50/p99 side by side;
``--calibrate --fit`` prints the grid the two factors were chosen on.

The fit (``fit``: every committed static arm, the worst |sim/real − 1| of its goodput): 2.0 and 2.5 put every
one within 1.4 %. The first fit (1.9 and 2.1, without the context term) missed ``h200-family-2026-124``
by 2.7 ×: its 1,077-token prompts at a full batch of 128 made every step 71 ms on the real pool (ITL p50),
where the model's per-sequence cost, fitted at one context length, gave 62 ms; at 26.7 requests/s that pool
runs within a few per cent of its capacity, where so small an error decides whether a queue builds at all.
The context term (a decode reads each sequence's KV cache: 27 ns per token at the H200's bandwidth) carries
that difference. The low-load TTFT p50 of ``h200-rise`` (0.055 s real, 0.037 s engine-side in the
simulation) gives the 0.018 s front end.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import multiprocessing
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.family import runs, traces
from tuner.sim.config import H200, GpuModel, config_from_args
from tuner.sim.queueing import SimEngine

# A decode step reads every running sequence's KV cache: 2 (K, V) × 32 layers × 8 KV heads × 128 × 2 bytes
# = 128 KiB per token of context, at the H200's 4.8 TB/s of HBM bandwidth 27 ns per token. The single-GPU
# model's per-sequence cost (45 µs) was fitted at 1,024/256-token requests, a mean context of ~1,152 tokens
# (docs/evidence-h200.md): that much of it is the context's, the rest (14 µs) the sequence's own.
CONTEXT_TOKEN_SECONDS = 131072 / 4.8e12
FITTED_CONTEXT = 1152


def twin(decode: float, prefill: float, *, context: float = CONTEXT_TOKEN_SECONDS) -> GpuModel:
    """The single-GPU model with its decode costs × ``decode`` and its prefill cost × ``prefill`` (two
    replicas time-share one GPU), the per-sequence cost split into its own and its context's."""
    return dataclasses.replace(
        H200, name="two replicas on one NVIDIA H200 (simulated)",
        step_base_seconds=H200.step_base_seconds * decode,
        step_per_seq_seconds=max(0.0, H200.step_per_seq_seconds - context * FITTED_CONTEXT) * decode,
        step_per_context_token_seconds=context * decode,
        step_per_prefill_token_seconds=H200.step_per_prefill_token_seconds * prefill)


DECODE_SHARE, PREFILL_SHARE = 2.0, 2.5  # fit(): every committed static arm within 1.4 % (docs/evaluation.md)
GPU: GpuModel = twin(DECODE_SHARE, PREFILL_SHARE)
FRONTEND_SECONDS = runs.FRONTEND_SECONDS  # fitted here, used there
REPLICAS = 2
KV_TOKENS = GPU.kv_cache_tokens(0.4, 8192)  # each replica's cache at --gpu-memory-utilization 0.4

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "evaluation"
OLDER_LAW = ("h200", "h200-fit", "h200-rise")  # their tuner arms ran an earlier law: only their static arms count
RUNS = ("h200", "h200-fit", "h200-rise", "h200-rise-issue25", "h200-family-2026-5", "h200-family-2026-124",
        "h200-family-2026-124-run2")


def capacity(mix: Sequence[traces.Mix], gpu: GpuModel = GPU) -> float:
    """Requests/s the whole pool serves of this mixture at its best batch (the model's arithmetic): a request
    costs its prompt's prefill tokens plus its output tokens' share of the decode steps at batch n, with n as
    large as the KV cache holds for the mixture's sizes (at most 256)."""
    total = sum(m.weight for m in mix)
    prompt = sum(m.weight * m.prompt for m in mix) / total
    output = sum(m.weight * m.output for m in mix) / total
    n = max(1.0, min(256.0, KV_TOKENS / (prompt + output)))
    per_token = (gpu.step_base_seconds / n + gpu.step_per_seq_seconds
                 + gpu.step_per_context_token_seconds * (prompt + output / 2))
    cost = output * per_token + prompt * gpu.step_per_prefill_token_seconds
    return REPLICAS / cost


def _cap(flags: str | None) -> int | None:
    parts = (flags or "").split()
    return int(parts[parts.index("--max-num-seqs") + 1]) if "--max-num-seqs" in parts else None


def _fmt(v: float | None) -> str:
    return "   -  " if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:6.3f}"


def _runs() -> list[tuple[str, traces.Trace, dict[str, Any]]]:
    """Each committed H200 run: (name, its trace, its arms as summary.json has them)."""
    found = []
    for run in RUNS:
        d = FIXTURES / run
        if not (d / "summary.json").exists():
            continue
        summary = json.loads((d / "summary.json").read_text())
        doc = json.load(gzip.open(d / "trace.json.gz"))
        found.append((run, traces.from_profile(doc, name=run), summary["arms"]))
    return found


def _static_arm(job: tuple[traces.Trace, int | None, GpuModel]) -> float:
    trace, cap, gpu = job
    return runs.static(trace, cap, gpu=gpu).goodput


def fit(decode: Sequence[float], prefill: Sequence[float], *, jobs: int = 1) -> int:
    """The grid: for each (decode, prefill) share, every committed static arm simulated; printed with the worst
    and the median |sim/real − 1| of their goodput, best first."""
    statics = [(run, arm, trace, _cap(real.get("flags")), real["goodput"])
               for run, trace, arms in _runs() for arm, real in arms.items()
               if real.get("kind") == "static" and real["goodput"]]
    grid = [(d, p) for d in decode for p in prefill]
    work = [(trace, cap, twin(d, p)) for d, p in grid for _, _, trace, cap, _ in statics]
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            sims = pool.map(_static_arm, work, chunksize=1)
    else:
        sims = [_static_arm(w) for w in work]
    rows = []
    for i, (d, p) in enumerate(grid):
        errors = [sims[i * len(statics) + k] / real - 1 for k, (*_, real) in enumerate(statics)]
        worst = max(range(len(errors)), key=lambda k: abs(errors[k]))
        rows.append((max(abs(e) for e in errors), statistics.median(abs(e) for e in errors), d, p,
                     f"{statics[worst][0]} {statics[worst][1]} {errors[worst]:+.2f}"))
    print(f"{len(statics)} static arms; context {CONTEXT_TOKEN_SECONDS * 1e9:.1f} ns per token")
    print(f"{'decode':>6} {'prefill':>7} {'worst':>6} {'median':>6}  worst arm")
    for worst_e, median_e, d, p, which in sorted(rows):
        print(f"{d:6.2f} {p:7.2f} {worst_e:6.3f} {median_e:6.3f}  {which}")
    return 0


def kv_bound() -> str:
    """The single-GPU model against docs/evidence-h200.md's KV-bound capture (``--gpu-memory-utilization 0.2
    --max-num-seqs 256``, 3,072/512 tokens, 128 clients): running 31-39, about 90 waiting, 2,499 output tokens/s,
    preemptions climbing. One minute after 20 s of warm-up, the same flags and load."""
    cfg = config_from_args(["--gpu-memory-utilization", "0.2", "--max-num-seqs", "256", "--max-model-len", "4096",
                            "--sim-concurrency", "128", "--sim-prompt-tokens", "3072", "--sim-output-tokens", "512",
                            "--sim-max-tokens", "512"], gpu=H200)
    engine = SimEngine(cfg, started_at=0.0)
    engine.advance(20.0)
    tokens, preempted, seen = engine.metrics.generation_tokens.value, engine.metrics.preemptions.value, []
    for t in range(21, 81):
        engine.advance(float(t))
        seen.append((len(engine.running), len(engine.waiting)))
    rate = (engine.metrics.generation_tokens.value - tokens) / 60
    return (f"KV-bound capture (real: running 31-39, ~90 waiting, 2499 output tokens/s, preemptions climbing): "
            f"simulated running {min(r for r, _ in seen)}-{max(r for r, _ in seen)}, "
            f"{min(w for _, w in seen)}-{max(w for _, w in seen)} waiting, {rate:.0f} output tokens/s, "
            f"{(engine.metrics.preemptions.value - preempted) / 60:.2f} preemptions/s")


def main() -> int:
    print(f"simulated pool: {GPU.name}, decode steps × {DECODE_SHARE} and prefill × {PREFILL_SHARE} of the "
          f"single-GPU model, {CONTEXT_TOKEN_SECONDS * 1e9:.1f} ns per token of context, front end "
          f"{FRONTEND_SECONDS} s; KV {KV_TOKENS} tokens per replica")
    print(f"{'run':20} {'arm':12} {'goodput real':>12} {'sim':>7} {'sim/real':>8}   "
          f"{'TTFT p50 real':>13} {'sim':>6}   {'TTFT p99 real':>13} {'sim':>6}")
    for run, trace, arms in _runs():
        for arm, real in arms.items():
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
    print(kv_bound())
    return 0
