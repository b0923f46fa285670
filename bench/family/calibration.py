"""The simulated pool, calibrated on the real H200 runs committed in ``tests/fixtures/evaluation/h200*``.

Those runs put two vLLM 0.26 replicas of the 8B-shaped Llama on ONE H200 (``--gpu-memory-utilization 0.4``
each). The simulator's ``GpuModel`` (``tuner/sim/config.py``) was fitted on one replica owning the whole GPU
(docs/evidence-h200.md); two replicas time-share its SMs, so every step of each is slower: the decode costs
(the step's fixed cost, per sequence, per token of context) are scaled by ``DECODE_SHARE`` and the prefill cost
by ``PREFILL_SHARE``. ``python -m bench.family --calibrate`` replays each committed arm's own trace (its
``trace.json.gz``, request for request) through the simulated pool at the arm's cap — and the tuner arms
through the whole simulated loop — and prints the real and simulated goodput and TTFT p50/p99 side by side;
``--calibrate --fit`` prints the grid the three factors were chosen on.

The fit (``fit``: every committed static arm, the worst |sim/real − 1| of its goodput, and of its ITL p50 beside
it): decode 2.0, prefill 2.5 and the decode attention at 57.5 % of the HBM bandwidth put every goodput within
2.1 % and every ITL p50 within 7 %; the arm at a cap of 256 stands on a knife's edge (its ITL p50 next to the
SLO): 55 % puts it 6 % under, 60 % 21 % over. The first fit (1.9 and 2.1, without the context term) missed
``h200-family-2026-124`` by 2.7 ×: its 1,077-token prompts at a full batch of 128 made every step 71 ms on the
real pool (ITL p50), where the model's per-sequence cost, fitted at one context length, gave 62 ms. The second
(2.0 and 2.5, the context read at the full 4.8 TB/s) held every arm then committed within 1.4 %, and missed the
next one by 71 %: the same trace at a cap of 256 (``h200-family-2026-124-run2``), where 250 running sequences
of ~1,150 tokens of context made the real step 0.115 s (ITL p50) and the twin's 0.076 s — past the 0.1 s ITL
SLO on the H200, inside it in the twin. A decode's paged attention reads the cache at about half the HBM's
peak (the fit's 57.5 %), which no arm below ~130 running could tell apart from the per-sequence cost.
The low-load TTFT p50 of ``h200-rise`` (0.055 s real, 0.037 s engine-side in the simulation) gives the 0.018 s
front end.
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
# = 128 KiB per token of context, at the H200's 4.8 TB/s of HBM bandwidth 27 ns per token — at the bandwidth
# the decode's attention reaches, ATTENTION_EFFICIENCY of it (fitted: ``fit``). The single-GPU model's
# per-sequence cost (45 µs) was fitted at 1,024/256-token requests, a mean context of ~1,152 tokens
# (docs/evidence-h200.md): that much of it is the context's, the rest the sequence's own — none at the fitted
# efficiency, whose context cost at 1,152 tokens (55 µs) is above the single-GPU fit's whole 45 µs.
KV_BYTES_PER_TOKEN, HBM_BYTES_PER_S = 131072, 4.8e12
ATTENTION_EFFICIENCY = 0.575  # fit(): with the shares below, every static arm's goodput within 2.1 %, ITL p50 7 %
FITTED_CONTEXT = 1152


def context_seconds(efficiency: float) -> float:
    """Seconds a decode step spends per token of context when its attention reads the cache at ``efficiency``
    of the HBM's peak bandwidth."""
    return KV_BYTES_PER_TOKEN / (HBM_BYTES_PER_S * efficiency)


CONTEXT_TOKEN_SECONDS = context_seconds(ATTENTION_EFFICIENCY)


def twin(decode: float, prefill: float, *, context: float = CONTEXT_TOKEN_SECONDS) -> GpuModel:
    """The single-GPU model with its decode costs × ``decode`` and its prefill cost × ``prefill`` (two
    replicas time-share one GPU), the per-sequence cost split into its own and its context's (at least nothing:
    a context cost above the fitted per-sequence one leaves the sequence's own at 0)."""
    return dataclasses.replace(
        H200, name="two replicas on one NVIDIA H200 (simulated)",
        step_base_seconds=H200.step_base_seconds * decode,
        step_per_seq_seconds=max(0.0, H200.step_per_seq_seconds - context * FITTED_CONTEXT) * decode,
        step_per_context_token_seconds=context * decode,
        step_per_prefill_token_seconds=H200.step_per_prefill_token_seconds * prefill)


DECODE_SHARE, PREFILL_SHARE = 2.0, 2.5  # fit(): every committed static arm within 2.1 % (docs/evaluation.md)
GPU: GpuModel = twin(DECODE_SHARE, PREFILL_SHARE)
FRONTEND_SECONDS = runs.FRONTEND_SECONDS  # fitted here, used there
REPLICAS = 2
KV_TOKENS = GPU.kv_cache_tokens(0.4, 8192)  # each replica's cache at --gpu-memory-utilization 0.4

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "evaluation"
OLDER_LAW = ("h200", "h200-fit", "h200-rise")  # their tuner arms ran an earlier law: only their static arms count
RUNS = ("h200", "h200-fit", "h200-rise", "h200-rise-issue25", "h200-family-2026-5", "h200-family-2026-124",
        "h200-family-2026-124-run2", "h200-rise-run2", "h200-family-2026-5-run2", "h200-family-2026-124-run3")


def capacity(mix: Sequence[traces.Mix], gpu: GpuModel = GPU, *, kv_tokens: float = KV_TOKENS) -> float:
    """Requests/s the whole pool serves of this mixture at its best batch (the model's arithmetic): a request
    costs its prompt's prefill tokens plus its output tokens' share of the decode steps at batch n, with n as
    large as the KV cache (``kv_tokens`` a replica) holds for the mixture's sizes (at most 256)."""
    total = sum(m.weight for m in mix)
    prompt = sum(m.weight * m.prompt for m in mix) / total
    output = sum(m.weight * m.output for m in mix) / total
    n = max(1.0, min(256.0, kv_tokens / (prompt + output)))
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


def _static_arm(job: tuple[traces.Trace, int | None, GpuModel]) -> tuple[float, float]:
    trace, cap, gpu = job
    arm = runs.static(trace, cap, gpu=gpu)
    return arm.goodput, arm.itl_p50


def fit(decode: Sequence[float], prefill: Sequence[float], efficiency: Sequence[float], *, jobs: int = 1) -> int:
    """The grid: for each (decode, prefill) share and attention efficiency, every committed static arm
    simulated; printed with the worst and the median |sim/real − 1| of their goodput and the worst of their ITL
    p50, best first (by the worst goodput)."""
    statics = [(run, arm, trace, _cap(real.get("flags")), real["goodput"], real.get("itl_p50"))
               for run, trace, arms in _runs() for arm, real in arms.items()
               if real.get("kind") == "static" and real["goodput"]]
    grid = [(d, p, e) for d in decode for p in prefill for e in efficiency]
    work = [(trace, cap, twin(d, p, context=context_seconds(e))) for d, p, e in grid for _, _, trace, cap, _, _ in statics]
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            sims = pool.map(_static_arm, work, chunksize=1)
    else:
        sims = [_static_arm(w) for w in work]
    rows = []
    for i, (d, p, e) in enumerate(grid):
        here = sims[i * len(statics):(i + 1) * len(statics)]
        errors = [g / real - 1 for (g, _), (*_, real, _) in zip(here, statics, strict=True)]
        itl = [abs(x / real_itl - 1) for (_, x), (*_, real_itl) in zip(here, statics, strict=True) if real_itl]
        worst = max(range(len(errors)), key=lambda k: abs(errors[k]))
        rows.append((max(abs(x) for x in errors), statistics.median(abs(x) for x in errors), max(itl), d, p, e,
                     f"{statics[worst][0]} {statics[worst][1]} {errors[worst]:+.2f}"))
    print(f"{len(statics)} static arms")
    print(f"{'decode':>6} {'prefill':>7} {'attn':>5} {'worst':>6} {'median':>6} {'ITL':>6}  worst arm")
    for worst_e, median_e, itl_e, d, p, e, which in sorted(rows):
        print(f"{d:6.2f} {p:7.2f} {e:5.3f} {worst_e:6.3f} {median_e:6.3f} {itl_e:6.3f}  {which}")
    return 0


KV_BOUND_REAL = {"req_s": 4.88, "output_tokens_s": 2499, "ttft_mean_s": 14.5, "tpot_mean_s": 0.0127,
                 "running": (31, 39)}  # docs/evidence-h200.md: the whole benchmark's summary, running while loaded


def kv_bound_run(gpu: GpuModel | None = None) -> dict[str, Any]:
    """docs/evidence-h200.md's KV-bound capture replayed on one simulated engine owning the GPU: vLLM's benchmark
    client sent 256 requests of exactly 3,072/512 tokens (random dataset, ``--ignore-eos``) at a concurrency of 128
    to ``--gpu-memory-utilization 0.2 --max-num-seqs 256`` (112,976 tokens of cache). ``gpu``: the family's twin
    with no time-sharing (``twin(1, 1)``: the calibrated decode, prefill and context costs of one engine alone) by
    default. The figures are the benchmark's over the whole run, as the real ones are; running, waiting and KV
    usage are sampled each second from 5 s on while the client holds all 128 in the engine (the loaded part)."""
    gpu = twin(1.0, 1.0) if gpu is None else gpu
    cfg = config_from_args(["--gpu-memory-utilization", "0.2", "--max-num-seqs", "256", "--max-model-len", "4096"],
                           gpu=gpu)
    engine = SimEngine(cfg, started_at=0.0)
    reqs = [engine.submit(prompt_tokens=3072, max_tokens=512, output_tokens=512, wait=False) for _ in range(128)]
    seen: list[tuple[int, int, float]] = []
    t = 0.0
    while any(r.finished_at is None for r in reqs) and t < 3600:
        t += 1.0
        engine.advance(t)
        done = sum(r.finished_at is not None for r in reqs)
        while len(reqs) < 256 and len(reqs) - done < 128:  # the client: one in, one out
            reqs.append(engine.submit(prompt_tokens=3072, max_tokens=512, output_tokens=512, wait=False))
        if t >= 5 and len(reqs) - done == 128:
            seen.append((len(engine.running), len(engine.waiting), engine.metrics.kv_usage.value))
    end = max(r.finished_at or t for r in reqs)
    return {"req_s": len(reqs) / end, "output_tokens_s": sum(r.generated for r in reqs) / end,
            "ttft_mean_s": statistics.mean((r.first_token or end) - r.arrival for r in reqs),
            "tpot_mean_s": statistics.mean(((r.finished_at or end) - (r.first_token or end)) / max(1, r.generated - 1)
                                           for r in reqs),
            "running": (min(x[0] for x in seen), max(x[0] for x in seen)),
            "waiting": (min(x[1] for x in seen), max(x[1] for x in seen)),
            "kv_usage": (min(x[2] for x in seen), max(x[2] for x in seen)),
            "preemptions": int(engine.metrics.preemptions.value)}


def kv_bound() -> str:
    """The KV-bound capture, real beside simulated: the calibrated twin's single engine, and the single-GPU model
    of docs/evidence-h200.md without the context cost (what the check ran on before 2026-12-06)."""
    real = KV_BOUND_REAL
    lines = ["KV-bound capture (docs/evidence-h200.md: 256 × 3072/512 at 128 clients, 0.2 of the GPU, cap 256)",
             f"  {'':28} {'req/s':>6} {'out tok/s':>9} {'TTFT mean':>9} {'TPOT mean':>9} {'running':>8} "
             f"{'waiting':>8} {'KV usage':>10} {'preempted':>9}",
             f"  {'real (vLLM 0.26, H200)':28} {real['req_s']:6.2f} {real['output_tokens_s']:9.0f} "
             f"{real['ttft_mean_s']:8.1f}s {real['tpot_mean_s'] * 1000:7.1f}ms {'{}-{}'.format(*real['running']):>8} "
             f"{'~90':>8} {'0.97-0.999':>10} {'climbing':>9}"]
    for name, gpu in (("twin, one engine alone", None), ("single-GPU model, no context", H200)):
        sim = kv_bound_run(gpu)
        lines.append(f"  {name:28} {sim['req_s']:6.2f} {sim['output_tokens_s']:9.0f} {sim['ttft_mean_s']:8.1f}s "
                     f"{sim['tpot_mean_s'] * 1000:7.1f}ms {'{}-{}'.format(*sim['running']):>8} "
                     f"{'{}-{}'.format(*sim['waiting']):>8} {'{:.2f}-{:.3f}'.format(*sim['kv_usage']):>10} {sim['preemptions']:9d}")
    return "\n".join(lines)


def main() -> int:
    print(f"simulated pool: {GPU.name}, decode steps × {DECODE_SHARE} and prefill × {PREFILL_SHARE} of the "
          f"single-GPU model, {CONTEXT_TOKEN_SECONDS * 1e9:.1f} ns per token of context "
          f"({ATTENTION_EFFICIENCY:.1%} of the HBM's bandwidth), front end "
          f"{FRONTEND_SECONDS} s; KV {KV_TOKENS} tokens per replica")
    print(f"{'run':20} {'arm':12} {'goodput real':>12} {'sim':>7} {'sim/real':>8}   "
          f"{'TTFT p50 real':>13} {'sim':>6}   {'TTFT p99 real':>13} {'sim':>6}   {'ITL p50 real':>12} {'sim':>6}")
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
                  f"{_fmt(sim.ttft_p99)}   {_fmt(real.get('itl_p50')):>12} {_fmt(sim.itl_p50)}")
    print(kv_bound())
    return 0
