"""Operating a running tuner, as an operator does: the real daemon (`vllm-tuner run`, apply mode, the process
actuator) on two simulated replicas that take the admission cap live, and the real command line beside it.

- `vllm-tuner status` reads its /status (text and JSON), `vllm-tuner history` its journal;
- the live change is counted as a live change, not a restart, and /metrics holds no `_created` series;
- `pin` and `pause` take effect at the next cycle, show on /status, /metrics and `status`, survive a
  restart of the tuner, and `resume`/`unpin` undo them;
- each bad input is one `error:` line with exit 1 (nothing to read) or 2 (a bad argument).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import waiting
from harness.ports import free_port
from tuner.actuators import children
from tuner.cli import demo
from tuner.sources import live_knobs

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def wait_for(what: Callable[[], Any], timeout: float, message: Callable[[], str]) -> Any:
    """harness.waiting's wait, failing the test with ``message()`` at the deadline."""
    return waiting.wait_for(what, timeout, "the condition", poll=0.3, detail=message, error=AssertionError)


class Tuner:
    def __init__(self, tmp: Path) -> None:
        cfg = json.loads(demo.live_config(tmp, max_num_seqs=256, users=64).read_text())
        cfg["live"] = {"enabled": True, "control_dir": str(tmp / "live" / "{name}"), "ack_timeout_seconds": 20,
                       "verify_seconds": 4}
        self.port = free_port()
        cfg["daemon"]["listen_port"] = self.port
        self.tmp, self.cfg = tmp, cfg
        self.path = tmp / "tuner.yaml"
        self.path.write_text(json.dumps(cfg))
        for t in cfg["targets"]:  # the bad start: the cap at 8 inside a 256 envelope, raised live
            live_knobs.write_request(live_knobs.prepare_control_dir(tmp / "live" / t["name"]), 1,
                                     max_num_active_seqs=8)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / "tuner.log"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tuner", "run", "--config", str(self.path)], cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None:
            children.stop(self.proc, timeout_seconds=60, group=True)  # SIGTERM to its group, SIGKILL after 60 s

    def status(self) -> dict[str, Any]:
        try:
            return dict(httpx.get(f"http://127.0.0.1:{self.port}/status", timeout=5).json())
        except httpx.HTTPError:
            return {}

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


@pytest.fixture
def tuner(tmp_path: Path) -> Iterator[Tuner]:
    t = Tuner(tmp_path)
    t.start()
    try:
        yield t
    finally:
        t.stop()
        demo._stop_engines(tmp_path)


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return float(s.value)
    return None


def test_status_history_pause_and_pins_on_a_running_tuner(tuner: Tuner) -> None:
    names = [t["name"] for t in tuner.cfg["targets"]]
    cfg = str(tuner.path)

    # 1. the live change goes out and is judged; history tells it, status shows the pool
    def judged() -> list[dict[str, Any]]:
        out = cli("history", "--config", cfg, "--format", "json")
        return [e for e in json.loads(out.stdout) if e.get("outcome") == "done"] if out.returncode == 0 else []

    (entry,) = wait_for(judged, 150, lambda: "a live change to be judged: " + tuner.tail())
    assert entry["kind"] == "live"
    assert [(c["flag"], c["from"], c["to"]) for c in entry["changes"]] == [("--max-num-seqs", "8", "256")]
    text = cli("history", "--config", cfg)
    assert text.returncode == 0
    assert f"{entry['rollout']} live: --max-num-seqs 8→256 (" in text.stdout and text.stdout.rstrip().endswith(": done")

    out = cli("status", "--config", cfg)
    assert out.returncode == 0, out.stderr
    assert "mode apply" in out.stdout and "paused: no" in out.stdout and "pinned: none" in out.stdout
    for name in names:
        assert f"  {name}: " in out.stdout and "--max-num-seqs 256" in out.stdout  # the command line: untouched
    body = json.loads(cli("status", "--config", cfg, "--format", "json").stdout)
    assert set(body["targets"]) == set(names) and body["mode"] == "apply"

    metrics = tuner.metrics()
    for name in names:  # a live change, not a restart
        assert sample(metrics, "tuner_live_changes_total", {"target": name, "result": "ok"}) == 1
    assert sample(metrics, "tuner_restarts_total") is None
    assert "_created" not in metrics
    assert sample(metrics, "tuner_paused") == 0

    # 2. a pin: held with its reason at the next cycle
    out = cli("pin", "--max-num-seqs", "--reason", "agreed with the clients", "--config", cfg)
    assert out.returncode == 0 and out.stdout.startswith("pinned --max-num-seqs: agreed with the clients"), out
    wait_for(lambda: "--max-num-seqs" in ((tuner.status().get("control") or {}).get("pins") or {}), 30,
             lambda: json.dumps(tuner.status().get("control")))
    assert sample(tuner.metrics(), "tuner_pinned", {"flag": "--max-num-seqs"}) == 1
    assert "pinned: --max-num-seqs (agreed with the clients; runtime)" in cli("status", "--config", cfg).stdout

    # 3. a pause: every change held, said on /status, /metrics and in `status`
    assert cli("pause", "--reason", "freeze", "--config", cfg).returncode == 0
    wait_for(lambda: (tuner.status().get("control") or {}).get("paused"), 30, lambda: json.dumps(tuner.status()))
    wait_for(lambda: "paused" in tuner.status().get("summary", ""), 30, lambda: json.dumps(tuner.status()))
    assert sample(tuner.metrics(), "tuner_paused") == 1
    assert "paused: yes (vllm-tuner pause: freeze)" in cli("status", "--config", cfg).stdout

    # 4. the switches survive a restart of the tuner (and are said once in its log)
    tuner.stop()
    tuner.start()
    wait_for(lambda: tuner.status().get("cycle"), 60, tuner.tail)
    control = tuner.status()["control"]
    assert control["paused"] and control["paused_reason"] == "vllm-tuner pause: freeze"
    assert "--max-num-seqs" in control["pins"]
    assert tuner.log.read_text().count("paused (vllm-tuner pause: freeze): no change goes out until resumed") == 2

    # 5. resume and unpin undo them
    assert cli("resume", "--config", cfg).returncode == 0
    assert cli("unpin", "--max-num-seqs", "--config", cfg).returncode == 0
    wait_for(lambda: (c := tuner.status().get("control")) and not c["paused"] and not c["pins"], 30,
             lambda: json.dumps(tuner.status().get("control")))
    assert sample(tuner.metrics(), "tuner_paused") == 0
    assert sample(tuner.metrics(), "tuner_pinned", {"flag": "--max-num-seqs"}) is None

    # 6. bad input: one line, no traceback; 1 when there is nothing to read, 2 for a bad argument
    dead = cli("status", "--url", f"http://127.0.0.1:{free_port()}")
    assert dead.returncode == 1 and dead.stderr.startswith("error: cannot read the tuner's status at ")
    assert len(dead.stderr.strip().splitlines()) == 1
    for args, expected in ((("unpin", "--max-num-seqs", "--config", cfg), "error: --max-num-seqs is not pinned"),
                           (("pin", "--no-such-flag", "--config", cfg), "error: --no-such-flag: not a flag the tuner"),
                           (("history", "--config", str(tuner.tmp / "missing.yaml")), "error: ")):
        out = cli(*args)
        assert out.returncode == 2 and out.stderr.startswith(expected), (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_sighup_reloads_a_valid_configuration_and_keeps_the_running_one_otherwise(tmp_path: Path) -> None:
    """`systemctl reload vllm-tuner` (ExecReload: SIGHUP): it used to end the tuner with 129."""
    port = free_port()
    base = {"mode": "recommend",
            "targets": [{"name": "a", "metrics_url": f"http://127.0.0.1:{free_port()}/metrics",
                         "args": ["--max-num-seqs", "8"]}],
            "scrape": {"interval_seconds": 0.5},
            "daemon": {"listen_port": port, "state_file": str(tmp_path / "state.json")}}
    cfg = tmp_path / "tuner.yaml"
    cfg.write_text(json.dumps(base))
    log_path = tmp_path / "tuner.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tuner", "run", "--config", str(cfg)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def status() -> dict[str, Any]:
        try:
            return dict(httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json())
        except httpx.HTTPError:
            return {}

    def logged(text: str, count: int = 1) -> bool:
        return log_path.read_text().count(text) >= count

    try:
        wait_for(lambda: status().get("cycle"), 30, log_path.read_text)
        # 1. not YAML, then a field out of range, then a rule file that is missing: each kept out
        for broken in ("targets: [", json.dumps({**base, "scrape": {"interval_seconds": -1}}),
                       json.dumps({**base, "rule_files": [str(tmp_path / "missing.yaml")]})):
            cfg.write_text(broken)
            before = log_path.read_text().count("keeping the running configuration")
            os.kill(proc.pid, signal.SIGHUP)
            wait_for(lambda b=before: logged("keeping the running configuration", b + 1), 10, log_path.read_text)
        assert proc.poll() is None, "SIGHUP ended the tuner"
        cycle = status()["cycle"]
        wait_for(lambda: status().get("cycle", 0) > cycle + 2, 15, log_path.read_text)  # cycles go on
        assert not status()["control"]["paused"]
        text = log_path.read_text()
        assert "reload: " in text and "interval_seconds" in text and "missing.yaml" in text
        assert "Traceback" not in text
        # 2. a valid one: the decisions section takes effect at the next cycle; a scrape change waits
        cfg.write_text(json.dumps({**base, "decisions": {"paused": "reloaded"}, "scrape": {"interval_seconds": 1}}))
        os.kill(proc.pid, signal.SIGHUP)
        wait_for(lambda: (status().get("control") or {}).get("paused"), 15, log_path.read_text)
        assert status()["control"]["paused_reason"] == "reloaded"
        assert logged("not applied until a restart (systemctl restart vllm-tuner): scrape")
        assert proc.poll() is None
    finally:  # SIGTERM to its group, SIGKILL after 30 s: it must have exited 0 on its own
        assert children.stop(proc, timeout_seconds=30, group=True) == 0, log_path.read_text()[-2000:]
