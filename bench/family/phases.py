"""Issue 30's search: traces whose phases want different flags, in virtual time.

For each trace, every static pair of the admission cap and the step budget (``CAPS`` × ``BUDGETS``: the
engine's envelope is vLLM's default, 1,024 slots and 8,192 tokens; the pair is held live, as the H200
evaluation's plugin-mode static arms hold the cap) runs on the calibrated twin's pool, and the requests of
each phase that met the SLO are counted. The **switching oracle** then runs: at each phase's start it sets the
pair that met the most of that phase's requests among the statics (ties: the best single static's pair, so it
switches only where a phase wants another pair). It is an oracle that knows the phases and pays nothing to
learn them — the bound a live tuner can approach, not a tuner. The ratio of its goodput to the best single
static's is the room a workload leaves; the issue asks for traces where it is widest.

    python -m bench.family.phases --traces 40 --seed 21            # the mixed-phase family below
    python -m bench.family.phases --traces 40 --seed 21 --family live   # the live family, 300 s at most

The mixed-phase family (``mixed``): 2-3 phases of 60-120 s, alternating a long-request mixture (prompts
1,024-3,072 tokens, outputs 256-1,024: the cache and the prefill weigh) and a chat mixture (64-512 / 16-256),
each at 0.4-1.1 × the pool's capacity for its sizes, a second size within a phase one time in three.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.family import calibration, runs, traces
from bench.family.pool import Pool, bad_argv

CAPS = (16, 32, 64, 128, 256, 1024)
BUDGETS = (512, 1024, 2048, 4096, 8192)
Pair = tuple[int, int]


@dataclass
class Result:
    goodput: float
    met: int
    per_phase: list[int]  # requests arriving in each phase that met the SLO


@dataclass(frozen=True)
class Setting:
    """The pool and the SLO a search runs on: the H200 profiles' by default."""

    memory: float = 0.4  # --gpu-memory-utilization of each replica (0.4: 342,021 tokens of cache; 0.2: 112,976)
    itl_slo: float = runs.ITL_SLO  # a request's mean inter-token gap
    ttft_slo: float = runs.TTFT_SLO

    def argv(self, trace: traces.Trace) -> list[str]:
        argv = bad_argv(trace, cap=None)
        argv[argv.index("--gpu-memory-utilization") + 1] = str(self.memory)
        return argv

    def capacity(self, mix: Sequence[traces.Mix]) -> float:
        return calibration.capacity(mix, kv_tokens=calibration.GPU.kv_cache_tokens(self.memory, 8192))


H200_PROFILES = Setting()


def run(trace: traces.Trace, plan: Sequence[tuple[float, Pair]], *, setting: Setting = H200_PROFILES) -> Result:
    """The trace on the twin's pool with the cap and the step budget set, live, on every replica at each
    ``(at, (cap, budget))`` of ``plan`` (the first at 0 s: before any request)."""
    pool = Pool(trace, setting.argv(trace), gpu=calibration.GPU)
    for at, (cap, budget) in sorted(plan):
        pool.advance_to(at)
        for r in pool.replicas.values():
            assert r.engine is not None
            r.engine.admission_cap, r.engine.step_budget = cap, budget
    pool.advance_to(trace.duration)
    runs._finish(pool, trace)
    per_phase = [0] * len(trace.phases)
    for s in pool.sent:
        if s.meets(ttft_slo=setting.ttft_slo, itl_slo=setting.itl_slo, frontend=runs.FRONTEND_SECONDS):
            i = next((k for k, (a, b) in enumerate(trace.spans) if a <= s.at < b), len(trace.spans) - 1)
            per_phase[i] += 1
    met = sum(per_phase)
    return Result(met / trace.duration, met, per_phase)


def search(trace: traces.Trace, *, setting: Setting = H200_PROFILES, caps: Sequence[int] = CAPS,
           budgets: Sequence[int] = BUDGETS) -> dict[str, Any]:
    """Every static pair, the best one, the best cap at vLLM's default budget, and the switching oracle."""
    statics = {(c, b): run(trace, [(0.0, (c, b))], setting=setting) for c in caps for b in budgets}
    best = max(statics, key=lambda p: (statics[p].met, -p[0], -p[1]))
    default_budget = max(budgets)
    best_cap = max((p for p in statics if p[1] == default_budget), key=lambda p: (statics[p].met, -p[0]))
    choice: list[Pair] = []
    for i in range(len(trace.phases)):
        top = max(r.per_phase[i] for r in statics.values())
        choice.append(best if statics[best].per_phase[i] == top else
                      max((p for p, r in statics.items() if r.per_phase[i] == top), key=lambda p: (-p[0], -p[1])))
    plan = [(start, pair) for (start, _), pair in zip(trace.spans, choice, strict=True)]
    oracle = run(trace, plan, setting=setting) if len(set(choice)) > 1 else statics[best]
    b = statics[best]
    return {"trace": trace.name, "describe": trace.describe(), "duration": round(trace.duration, 1),
            "requests": len(trace.requests), "best_static": list(best), "best_goodput": round(b.goodput, 4),
            "best_cap_at_default_budget": list(best_cap), "best_cap_goodput": round(statics[best_cap].goodput, 4),
            "switching": [list(p) for p in choice], "switching_goodput": round(oracle.goodput, 4),
            "room": round(oracle.goodput / b.goodput, 4) if b.goodput > 0 else 1.0,
            "per_phase_best": [max(r.per_phase[i] for r in statics.values()) for i in range(len(trace.phases))],
            "per_phase_static": b.per_phase, "per_phase_switching": oracle.per_phase,
            "statics": {f"{c}/{bb}": round(r.goodput, 4) for (c, bb), r in statics.items()}}


def mixed(rng: random.Random, *, index: int, setting: Setting = H200_PROFILES) -> traces.Trace:
    """One trace of the mixed-phase family (the module docstring)."""
    phases: list[traces.Phase] = []
    long_first = rng.random() < 0.5
    for k in range(rng.randint(2, 3)):
        long = (k % 2 == 0) == long_first
        lo_p, hi_p, lo_o, hi_o = (1024, 3072, 256, 1024) if long else (64, 512, 16, 256)
        mix = [traces.Mix(1.0, traces._log_uniform(rng, lo_p, hi_p), traces._log_uniform(rng, lo_o, hi_o))]
        if rng.random() < 1 / 3:
            mix.append(traces.Mix(rng.uniform(0.2, 1.0), traces._log_uniform(rng, 64, 3072),
                                  traces._log_uniform(rng, 16, 1024)))
        rate = round(rng.uniform(0.4, 1.1) * setting.capacity(tuple(mix)), 3)
        burst = 1.0 if rng.random() < 0.6 else round(rng.uniform(0.3, 0.9), 2)
        phases.append(traces.Phase(rng.uniform(60, 120), rate0=rate, rate1=rate, mix=tuple(mix), burstiness=burst))
    return traces.build(f"mixed-{index:03d}", rng.randrange(2**31), phases)


def draw(family: str, n: int, seed: int, setting: Setting = H200_PROFILES) -> list[traces.Trace]:
    rng = random.Random(seed)
    if family == "mixed":
        return [mixed(rng, index=i, setting=setting) for i in range(n)]
    found: list[traces.Trace] = []
    i = 0
    while len(found) < n:
        t = traces.draw(rng, index=i, mode="live", capacity=setting.capacity)
        i += 1
        if t.duration <= 300:
            found.append(t)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.family.phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=int, default=10)
    p.add_argument("--seed", type=int, default=21)
    p.add_argument("--family", choices=("mixed", "live"), default="mixed")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--memory", type=float, default=0.4, help="--gpu-memory-utilization of each replica (0.4)")
    p.add_argument("--itl-slo", type=float, default=runs.ITL_SLO, help="a request's mean inter-token gap (0.1 s)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    setting = Setting(memory=a.memory, itl_slo=a.itl_slo)
    drawn = draw(a.family, a.traces, a.seed, setting)
    if a.jobs > 1:
        with multiprocessing.get_context("fork").Pool(a.jobs) as workers:
            rows = workers.map(functools.partial(search, setting=setting), drawn, chunksize=1)
    else:
        rows = [search(t, setting=setting) for t in drawn]
    for r in sorted(rows, key=lambda r: -r["room"]):
        print(f"{r['trace']}  room {r['room']:.3f}  static {r['best_static'][0]}/{r['best_static'][1]} "
              f"{r['best_goodput']:.2f}  cap-only {r['best_cap_at_default_budget'][0]} {r['best_cap_goodput']:.2f}  "
              f"switching {' → '.join(f'{c}/{b}' for c, b in r['switching'])} {r['switching_goodput']:.2f}  "
              f"| {r['describe']}")
    rooms = [r["room"] for r in rows]
    print(f"{a.family}: {len(rows)} traces (seed {a.seed}, memory {a.memory:g}, ITL SLO {a.itl_slo:g} s), switching oracle / best static pair: median "
          f"{statistics.median(rooms):.3f}, max {max(rooms):.3f}; ≥ 1.1 on {sum(x >= 1.1 for x in rooms)}, "
          f"≥ 1.2 on {sum(x >= 1.2 for x in rooms)}")
    if a.json:
        json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
