"""`vllm-tuner run` killed with SIGKILL mid-rollout and started again, on two simulated replicas (the
demo's: process actuator, the simulator's drain hook, rules/default.yaml).

The restarted daemon resumes the rollout inside its first cycle: systemd hears READY=1 (over a real
NOTIFY_SOCKET datagram socket) and watchdog pings while it runs, /healthz answers 200 and /status shows
the resumed rollout's progress; the resumed replica is judged against the baseline journaled with the
decision, and the rollout ends with both replicas on the new arguments. The e2e tier does the same on
real vLLM through systemd (tests/e2e/test_systemd_live.py).

The engines carry a secret (``--api-key``, and the token file the tuner scrapes with): every engine the
resumed tuner starts gets it — from the configuration, since the journal, state.json and the pid files
hold it masked — and none of the tuner's outputs shows it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from harness import waiting
from harness.ports import free_port
from tuner.actuators import children
from tuner.cli import demo as cli_demo
from tuner.rollout import journal

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 7

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-recovery-3e9b51c7"


def start_tuner(cfg: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "tuner", "run", "--config", str(cfg)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(what, timeout: float, *, every: float = 0.2):
    """harness.waiting's wait, failing the test with what it waited for (``what``'s docstring) at the deadline."""
    return waiting.wait_for(what, timeout, what.__doc__ or getattr(what, "__name__", "the condition"), poll=every,
                            error=AssertionError)


def test_a_tuner_killed_mid_rollout_resumes_it_inside_its_first_cycle_visibly(tmp_path: Path) -> None:
    cfg_path = cli_demo.live_config(tmp_path)
    cfg = yaml.safe_load(cfg_path.read_text())
    port = free_port()
    cfg["daemon"]["listen_port"] = port
    for target in cfg["targets"]:
        target["args"] += ["--api-key", KEY]
    (tmp_path / "token").write_text(KEY + "\n")
    cfg["scrape"]["bearer_token_file"] = str(tmp_path / "token")
    cfg_path.write_text(json.dumps(cfg))
    jpath = Path(cfg["rollout"]["journal_file"])
    log = tmp_path / "tuner.log"
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(0.2)
    first = start_tuner(cfg_path, log)
    second: subprocess.Popen[bytes] | None = None
    try:
        def a_verifying() -> bool:
            """sim-a in its verification window"""
            return any(e.get("replica") == "sim-a" and e.get("to") == "verifying" for e in events(jpath))

        wait_for(a_verifying, 150)
        children.stop(first, timeout_seconds=0, signal_first=None, group=True)  # SIGKILL, reaped
        killed_at = len(events(jpath))
        decision = next(e for e in events(jpath) if e["kind"] == "decision")
        # the check and its bound (the median request's TPOT within the TPOT SLO), journaled for the restarted tuner
        assert (decision["checks"][0]["signal"], decision["checks"][0]["bound"]) == ("tpot_p50_s", 0.1)
        assert decision["baselines"]["sim-a"]["tpot_p50_s"] > 0

        second = start_tuner(cfg_path, log, env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "4000000"})
        heard: list[str] = []

        def ready() -> bool:
            """READY=1 on the notify socket"""
            with contextlib.suppress(TimeoutError):
                heard.append(sock.recv(4096).decode())
            return any("READY=1" in m for m in heard)

        wait_for(ready, 30, every=0)
        # READY went out while the rollout was still being resumed: the journal has not finished it
        assert journal.unfinished(journal.read_records(jpath)) is not None

        def status_shows_the_resumed_rollout() -> dict | None:
            """/status showing the rollout running"""
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/status", timeout=2).json()
            except httpx.HTTPError:
                return None
            return body if (body.get("rollout") or {}).get("outcome") == "running" else None

        status = wait_for(status_shows_the_resumed_rollout, 20)
        assert status["rollout"]["id"] == decision["rollout"]
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        assert health.status_code == 200, health.text

        def finished() -> list[dict]:
            """the resumed rollout's last replica verified"""
            return [e for e in events(jpath)[killed_at:] if e.get("replica") == "sim-b" and e.get("to") == "done"]

        wait_for(finished, 150)
        resumed = events(jpath)[killed_at:]
        assert resumed[0]["event"] == "interrupted" and resumed[0]["replica"] == "sim-a"
        verified_a = next(e for e in resumed if e.get("replica") == "sim-a" and e.get("to") == "done")
        assert "tpot_p50_s (queue-slot-bound)" in verified_a["reason"]  # judged by the journaled check
        assert "no baseline known" not in verified_a["reason"]
        for _ in range(50):  # watchdog pings kept coming during the resumed rollout
            ready()
        assert sum("WATCHDOG=1" in m for m in heard) >= 2, heard
        # the decided value: the 64 users ÷ 0.8 → 80, and on to the TPOT frontier (a restart raise)
        to = str(decision["changes"][0]["to"])
        assert int(to) >= 80, decision["changes"]

        def saved() -> dict | None:
            """state.json on the new arguments (saved by the cycle after the rollout ended between cycles)"""
            state = json.loads((tmp_path / "state.json").read_text())
            return state if all(flag(state["targets"][n]["args"]) == to for n in ("sim-a", "sim-b")) else None

        def flag(args: list[str]) -> str:
            return args[args.index("--max-num-seqs") + 1]

        state = wait_for(saved, 20)
        for name in ("sim-a", "sim-b"):
            args = state["targets"][name]["args"]
            assert args[args.index("--api-key") + 1] == "***"
            # the engine the resumed tuner runs got the real key (its own command line)
            pid = json.loads((tmp_path / "engines" / f"{name}.json").read_text())["pid"]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert cmdline[cmdline.index(b"--api-key") + 1] == KEY.encode() and to.encode() in cmdline
        shown = {p: httpx.get(f"http://127.0.0.1:{port}{p}", timeout=5).text
                 for p in ("/metrics", "/status", "/recommendations")}
        shown |= {str(f): f.read_text(errors="replace") for f in (log, jpath, tmp_path / "state.json",
                                                                  *(tmp_path / "engines").glob("*.json"))}
        shown["sd_notify STATUS="] = "\n".join(heard)
        for where, text in shown.items():
            assert KEY not in text, where
    finally:
        try:  # SIGTERM to each one's group, SIGKILL after 30 s, reaped
            children.stop_all([p for p in (first, second) if p is not None], timeout_seconds=30, group=True)
        finally:
            cli_demo._stop_engines(tmp_path)
            sock.close()


def test_the_tuner_starts_the_pool_one_engine_at_a_time(tmp_path: Path) -> None:
    """``rollout.start_one_at_a_time`` (the default): the second engine starts only once the first answers
    /health — two engines sharing a GPU must not profile its free memory at the same moment. Judged by the
    kernel's start times of the two processes (the pid files) against the first one's simulated start-up."""
    startup = 4.0
    cfg_path = cli_demo.live_config(tmp_path)
    cfg = yaml.safe_load(cfg_path.read_text())
    for t in cfg["targets"]:
        t["args"][t["args"].index("--sim-startup-seconds") + 1] = str(startup)
    cfg["daemon"]["listen_port"] = free_port()
    cfg_path.write_text(json.dumps(cfg))
    log = tmp_path / "tuner.log"
    tuner = start_tuner(cfg_path, log)
    pidfiles = [tmp_path / "engines" / f"{t['name']}.json" for t in cfg["targets"]]
    try:
        def spawned(p: Path) -> bool:
            """the engine's pid file names its process (the record written ahead of the spawn has no pid yet)"""
            with contextlib.suppress(OSError, ValueError):
                return json.loads(p.read_text()).get("pid") is not None
            return False

        def both_started() -> bool:
            """both engines started"""
            return all(spawned(p) for p in pidfiles)

        wait_for(both_started, 120)
    finally:
        try:
            children.stop(tuner, timeout_seconds=60, group=True)  # SIGTERM to its group, SIGKILL after 60 s
        finally:
            # the engines outlive the tuner (by design): read their pid files, then stop them
            started = {p: json.loads(p.read_text()) for p in pidfiles if p.exists()}
            cli_demo._stop_engines(tmp_path)
    first, second = (started[p] for p in pidfiles)
    ticks = os.sysconf("SC_CLK_TCK")
    assert (second["starttime"] - first["starttime"]) / ticks >= startup, (first, second, log.read_text()[-2000:])
    assert "sim-a is healthy; starting the next engine" in log.read_text()
