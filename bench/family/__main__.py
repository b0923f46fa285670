"""``python -m bench.family``: the control law on a family of traces it was not tuned on, in virtual time.

For each trace drawn (``bench.family.traces``) it runs the static sweep (the admission cap held at 8, 16,
32, 64, 128, 256 and vLLM's default 1024: the best of them is the trace's own oracle) and the tuner twice —
from the bad start (cap 8) and from vLLM's default flags — with the whole loop of ``vllm-tuner run`` on the
shipped defaults (``bench.family.runs``), on two simulated H200 replicas calibrated on the committed H200
runs (``bench.family.calibration``). It prints a row per trace and the last line::

    family: N traces, tuner/best static p5 X median Y min Z, harm K

where the ratios are the bad-start runs' goodput over the trace's best static goodput, and ``harm`` counts
runs (either start) in which the tuner did worse than staying at the flags it started from (by more than
one request in two hundred: the sim is deterministic, but a moved cap reorders admissions).

    python -m bench.family --traces 200 --seed 7            # live mode (the default)
    python -m bench.family --traces 20 --mode restart        # slow drifts, the restart path
    python -m bench.family --profile bench/evaluation/profiles/h200-rise.yaml
    python -m bench.family --profile bench/evaluation/profiles/h200-rise.yaml --scrape-phases 8
    python -m bench.family --calibrate                       # real H200 arms against their twins
    python -m bench.family --calibrate --fit                 # the grid the twin's factors were chosen on
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from typing import Any

from bench.family import calibration, runs, traces


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), min(math.floor(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def one(job: tuple[traces.Trace, str, int]) -> dict[str, Any]:
    trace, mode, phases = job
    return runs.evaluate(trace, mode=mode, gpu=calibration.GPU, phases=phases)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.family", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=int, default=20, help="how many traces to draw (default 20)")
    p.add_argument("--seed", type=int, default=1, help="the family's seed (default 1)")
    p.add_argument("--mode", choices=("live", "restart"), default="live")
    p.add_argument("--profile", help="run the single trace of an evaluation profile instead of a draw")
    p.add_argument("--scrape-phases", type=int, default=1, metavar="K",
                   help="also run each bad start with its first scrape at 1/K … (K-1)/K of an interval, and print "
                        "how far the ratio moves with where the trace's changes fall between scrapes (default 1: "
                        "no extra runs)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: cores)")
    p.add_argument("--calibrate", action="store_true",
                   help="print the committed H200 arms next to their simulated twins and exit")
    p.add_argument("--fit", action="store_true",
                   help="with --calibrate: print the grid of step-cost factors the twin was fitted on")
    args = p.parse_args(argv)
    if args.calibrate:
        if args.fit:
            return calibration.fit((1.9, 2.0, 2.1), (2.35, 2.5, 2.65), (0.5, 0.525, 0.55, 0.575, 0.6), jobs=args.jobs)
        return calibration.main()
    if args.traces < 1:
        p.error("--traces must be at least 1")
    if args.scrape_phases < 1:
        p.error("--scrape-phases must be at least 1")
    if args.profile:
        from bench.evaluation import profiles

        try:
            profile, _ = profiles.load(args.profile)
        except profiles.ProfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        jobs = [(traces.from_profile(profile.trace.build(), name=profile.name), args.mode, args.scrape_phases)]
    else:
        rng = random.Random(args.seed)
        jobs = [(traces.draw(rng, index=i, mode=args.mode, capacity=calibration.capacity), args.mode,
                 args.scrape_phases) for i in range(args.traces)]
    started = time.perf_counter()
    if args.jobs > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            results = pool.map(one, jobs, chunksize=1)
    else:
        results = [one(j) for j in jobs]
    wall = time.perf_counter() - started
    ratios = [r["ratio"] for r in results]
    harm = sum(len(r["harm"]) for r in results)
    summary = {"traces": len(results), "seed": args.seed, "mode": args.mode,
               "ratio_p5": round(_percentile(ratios, 0.05), 4), "ratio_median": round(statistics.median(ratios), 4),
               "ratio_min": round(min(ratios), 4), "harm": harm, "wall_seconds": round(wall, 1),
               "per_trace": results}
    if args.scrape_phases > 1:
        summary["scrape_phases"] = _phases_summary(results, args.scrape_phases)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{'trace':12} {'best':>5} {'oracle':>7} {'from 8':>7} {'ratio':>6} {'default':>7} {'changes':>7} "
              f"{'restarts':>8}  phases")
        for r in results:
            bad = r["tuner_bad"]
            print(f"{r['trace']:12} {r['best_static']:>5} {r['best_goodput']:7.2f} {bad['goodput']:7.2f} "
                  f"{r['ratio']:6.3f} {r['ratio_default']:7.3f} {len(bad['changes']):7d} {bad['restarts']:8d}  "
                  f"{r['describe']}{'  HARM ' + ', '.join(_harmed(r)) if r['harm'] else ''}")
            if "ratio_phases" in r:
                print(f"{'':12} by scrape phase: {' '.join(f'{x:.3f}' for x in r['ratio_phases'])}"
                      f"{'  HARM ' + ', '.join(r['harm_phases']) if r['harm_phases'] else ''}")
        print(f"wall {wall:.0f} s, {args.jobs} worker(s)")
    if "scrape_phases" in summary:
        ph = summary["scrape_phases"]
        print(f"scrape phases: {ph['phases']} per trace, the worst phase's ratio p5 {ph['worst_p5']:.3f} median "
              f"{ph['worst_median']:.3f} min {ph['worst_min']:.3f}; spread (best − worst) median "
              f"{ph['spread_median']:.3f} max {ph['spread_max']:.3f} ({ph['spread_max_trace']}), harm {ph['harm']}")
    print(f"family: {summary['traces']} traces, tuner/best static p5 {summary['ratio_p5']:.3f} median "
          f"{summary['ratio_median']:.3f} min {summary['ratio_min']:.3f}, harm {harm}")
    return 0


def _phases_summary(results: list[dict[str, Any]], phases: int) -> dict[str, Any]:
    """How far each trace's bad-start ratio moves with where its changes fall between two scrapes: the worst
    phase's ratios over the family, and each trace's spread (best − worst phase)."""
    worst = [min(r["ratio_phases"]) for r in results]
    spreads = [max(r["ratio_phases"]) - min(r["ratio_phases"]) for r in results]
    widest = max(range(len(results)), key=lambda i: spreads[i])
    return {"phases": phases, "worst_p5": round(_percentile(worst, 0.05), 4),
            "worst_median": round(statistics.median(worst), 4), "worst_min": round(min(worst), 4),
            "spread_median": round(statistics.median(spreads), 4), "spread_max": round(spreads[widest], 4),
            "spread_max_trace": results[widest]["trace"],
            "harm": sum(len(r["harm_phases"]) for r in results)}


def _harmed(r: dict[str, Any]) -> list[str]:
    """Each harmed run of a trace's row with its goodput over staying at its start flags ("0.62 × staying")."""
    out = []
    for name in r["harm"]:
        arm, start = (r["tuner_bad"], "8") if name == r["tuner_bad"]["arm"] else (r["tuner_default"], "default")
        stay = r["statics"][start]
        out.append(f"{name} ({arm['goodput'] / stay:.2f} × staying)" if stay > 0 else name)
    return out


if __name__ == "__main__":
    sys.exit(main())
