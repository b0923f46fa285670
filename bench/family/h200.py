"""Choose, before running anything on the GPU, the family traces the H200 evaluates, and write their profiles.

The rule is fixed here and applied in order to the draws of one seed (``--seed``): a trace qualifies when
the evaluation player can play it as drawn — every phase open loop at one rate above 0 (no ramps, no
closed loop) with one request size (``bench/evaluation/profiles``' schema: ``range_ratio`` 0.25 is the
family's ±25 % jitter) — when it lasts at most ``MAX_SECONDS`` (an arm of the tuner and one static arm
fit a 10-minute command), and when the simulated bad start (cap 8) meets the SLO for at most 90 % of what
vLLM's default cap does (the trace gives the tuner something to do). The first ``count`` that qualify are
written as ``bench/evaluation/profiles/h200-family-<seed>-<index>.yaml``, with the engines, player, SLO and
tuner settings of ``h200-rise.yaml`` and the sweep at the cap the simulation found best (one static arm:
the device time of a session fits the tuner and that one per trace).

    python -m bench.family.h200 --seed 2026 --count 2
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import yaml

from bench.family import calibration, runs, traces

MAX_SECONDS = 150.0
PROFILES = Path(__file__).resolve().parents[1] / "evaluation" / "profiles"


def playable(trace: traces.Trace) -> bool:
    return all(p.users == 0 and p.rate0 == p.rate1 and p.rate0 > 0 and len(p.mix) == 1 for p in trace.phases)


def profile(trace: traces.Trace, *, seed: int, index: int, best: int) -> dict[str, object]:
    template = yaml.safe_load((PROFILES / "h200-rise.yaml").read_text())
    phases = [{"name": f"p{i + 1}", "seconds": round(p.seconds, 1), "rate": round(p.rate0, 3),
               "input_len": p.mix[0].prompt, "output_len": p.mix[0].output, "burstiness": p.burstiness}
              for i, p in enumerate(trace.phases)]
    return {**template, "name": f"h200-family-{seed}-{index}",
            "description": f"Drawn from the trace family (bench.family.h200, seed {seed}, draw {index}), chosen "
                           f"by its rule before any GPU run: {trace.describe()}.",
            "sweep": {"values": [best], "mode": "plugin"}, "share_engines": True,
            "trace": {"seed": trace.seed, "range_ratio": 0.25, "phases": phases}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.family.h200", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--max-draws", type=int, default=400)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    found = 0
    for i in range(args.max_draws):
        trace = traces.draw(rng, index=i, mode="live", capacity=calibration.capacity)
        if not playable(trace) or trace.duration > MAX_SECONDS:
            continue
        bad = runs.static(trace, runs.BAD_START, gpu=calibration.GPU)
        arms = {cap: runs.static(trace, cap, gpu=calibration.GPU) for cap in (*runs.SWEEP, None)}
        best_cap, best = max(arms.items(), key=lambda kv: (kv[1].goodput, -(kv[0] or 1024)))
        if bad.met > 0.9 * arms[None].met:
            continue
        doc = profile(trace, seed=args.seed, index=i, best=best_cap or 1024)
        path = PROFILES / f"{doc['name']}.yaml"
        header = ("# Chosen by bench/family/h200.py's rule before any GPU run (its docstring); regenerate with\n"
                  f"#   python -m bench.family.h200 --seed {args.seed} --count {args.count}\n")
        path.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=110))
        print(f"{path.name}: {trace.describe()}; simulated best static {best_cap or 'default'} "
              f"{best.goodput:.2f} req/s, bad start {bad.goodput:.2f}")
        found += 1
        if found == args.count:
            return 0
    print(f"error: only {found} of {args.count} traces qualified in {args.max_draws} draws", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
