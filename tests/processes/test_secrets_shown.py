"""Secrets reach the engine and nothing else: real processes.

- the process actuator's pid files and log header hold the argv masked (``--api-key ***``) and the real
  one's sha256; a restarted tuner reads a live engine's real argv back from /proc/<pid>/cmdline and
  trusts it only if it hashes right; the engine itself receives the key;
- ``vllm-tuner check-config`` and ``vllm-tuner run`` (a real subprocess) never print a secret of
  ``targets[].args``, ``actuator.env``, the bearer-token file or a URL — not in the effective
  configuration, not in a reason built from an engine's error page, not in ``state.json``.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from harness import nginx as nginx_support
from tuner.actuators import base, process
from tuner.model import secrets

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "tests" / "support" / "stub_engine.py"
KEY = "sk-proc-a93f0e11"
ENV_SECRET = "hf_envsecret_55aa"
TOKEN = "bearer-file-77c2d0"
URL_PASSWORD = "pw-in-url-1b2c"


def argv(port: int, key: str = KEY) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(port), "--model", "stub", "--api-key", key]


def wait_serving(port: int, key: str) -> dict:
    deadline = time.monotonic() + 20
    while True:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2)
            if r.status_code == 200:
                return dict(httpx.get(f"http://127.0.0.1:{port}/stub/argv", timeout=2).json())
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the stub engine did not serve"
        time.sleep(0.1)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[process.ProcessActuator, dict[str, int]]]:
    ports = {"a": nginx_support.free_port()}
    replicas = [base.Replica(n, f"http://127.0.0.1:{p}") for n, p in ports.items()]
    redactor = secrets.DEFAULT.learn(argvs=[argv(ports["a"])])

    def make() -> process.ProcessActuator:
        return process.ProcessActuator(replicas, command=[sys.executable, str(STUB)], state_dir=tmp_path / "state",
                                       redactor=redactor)
    first = make()
    made = [first]
    try:
        yield first, ports
    finally:
        for a in made:
            a.stop("a", timeout_seconds=5)


def test_pid_files_hold_the_argv_masked_and_a_restarted_tuner_reads_the_real_one_back(
        engines: tuple[process.ProcessActuator, dict[str, int]], tmp_path: Path) -> None:
    actuator, ports = engines
    real = argv(ports["a"])
    actuator.start("a", real)
    served = wait_serving(ports["a"], KEY)  # the engine got the key: /v1/* answers with it
    assert served["argv"] == real
    pidfile = tmp_path / "state" / "a.json"
    record = json.loads(pidfile.read_text())
    assert KEY not in pidfile.read_text()
    assert record["argv"] == secrets.DEFAULT.argv(real) and record["argv_sha256"] == secrets.digest(real)
    log = (tmp_path / "state" / "a.log").read_text()
    assert "=== vllm-tuner: starting a:" in log and KEY not in log.split("\n")[0]

    again = process.ProcessActuator(actuator.replicas(), command=[sys.executable, str(STUB)],
                                    state_dir=tmp_path / "state")
    status = again.status("a")
    assert (status.state, status.argv) == (base.State.RUNNING, tuple(real))  # from /proc/<pid>/cmdline
    assert base.is_running_already(status, real, who="a")  # start() with the real argv is a no-op

    record["argv_sha256"] = secrets.digest(argv(ports["a"], key="another-key"))  # not what runs
    pidfile.write_text(json.dumps(record))
    doubtful = process.ProcessActuator(actuator.replicas(), command=[sys.executable, str(STUB)],
                                       state_dir=tmp_path / "state").status("a")
    assert doubtful.state is base.State.RUNNING and doubtful.argv is None  # unknown, never guessed
    assert "does not match" in doubtful.detail and "refused" in doubtful.detail


def test_a_pid_file_written_in_clear_is_adopted_and_rewritten_masked(
        engines: tuple[process.ProcessActuator, dict[str, int]], tmp_path: Path) -> None:
    actuator, ports = engines
    real = argv(ports["a"])
    actuator.start("a", real)
    wait_serving(ports["a"], KEY)
    pidfile = tmp_path / "state" / "a.json"
    record = json.loads(pidfile.read_text())
    pidfile.write_text(json.dumps({"pid": record["pid"], "starttime": record["starttime"], "argv": real}))
    adopted = process.ProcessActuator(actuator.replicas(), command=[sys.executable, str(STUB)],
                                      state_dir=tmp_path / "state")
    assert adopted.status("a").argv == tuple(real)
    assert KEY not in pidfile.read_text() and "argv_sha256" in pidfile.read_text()


# --- the CLI and the daemon, as subprocesses -------------------------------------------------------------


class _EchoingEngine(http.server.BaseHTTPRequestHandler):
    """An engine whose /metrics fails with an error page that echoes the request's Authorization header."""

    def do_GET(self) -> None:
        body = f"<html>500: {self.headers.get('Authorization')} {self.path}</html>".encode()
        self.send_response(500)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def echoing() -> Iterator[int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoingEngine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield int(srv.server_address[1])
    srv.shutdown()
    srv.server_close()


def secret_config(tmp_path: Path, port: int) -> Path:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    cfg = {
        "mode": "recommend",
        "targets": [{"name": "a", "metrics_url": f"http://user:{URL_PASSWORD}@127.0.0.1:{port}/metrics",
                     "args": ["--model", "m", "--api-key", KEY, "--max-num-seqs", "8"]}],
        "scrape": {"bearer_token_file": str(token), "interval_seconds": 1},
        "daemon": {"listen_port": 0, "state_file": str(tmp_path / "state.json"), "json_logs": True},
        "actuator": {"kind": "process", "command": [sys.executable], "state_dir": str(tmp_path / "engines"),
                     "env": {"HF_TOKEN": ENV_SECRET}},
    }
    path = tmp_path / "tuner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def assert_no_secret(text: str, where: str) -> None:
    for secret in (KEY, ENV_SECRET, TOKEN, URL_PASSWORD):
        assert secret not in text, f"{secret} in {where}:\n{text[-3000:]}"


def tuner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_check_config_and_run_never_print_a_secret(tmp_path: Path, echoing: int) -> None:
    cfg = secret_config(tmp_path, echoing)
    checked = tuner("check-config", str(cfg))
    assert checked.returncode == 0, checked.stderr
    assert_no_secret(checked.stdout + checked.stderr, "check-config's output")
    shown = yaml.safe_load(checked.stdout)
    assert shown["targets"][0]["args"] == ["--model", "m", "--api-key", "***", "--max-num-seqs", "8"]
    assert shown["actuator"]["env"] == {"HF_TOKEN": "***"}

    ran = tuner("run", "--config", str(cfg), "--once")
    assert ran.returncode == 1, ran.stderr  # it ran, and its one target could not be read
    assert ran.stderr.splitlines()[-1].startswith("error: run --once: no target could be read"), ran.stderr
    out = ran.stdout + ran.stderr
    assert "HTTP 500 (text/html" in out  # the failed scrape is reported…
    assert "<html>" not in out  # …without the error page, which echoed the bearer token
    assert "effective configuration" in out
    assert_no_secret(out, "the tuner's log")
    assert_no_secret((tmp_path / "state.json").read_text(), "state.json")


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_the_one_shot_commands_print_command_lines_masked(fmt: str) -> None:
    scenario = ROOT / "tuner" / "data" / "scenarios" / "queue-bound"
    for argv in (["replay", str(scenario)], ["recommend", *[a for p in sorted(scenario.glob("*.prom"))[:6]
                                                          for a in ("--engine-metrics", str(p))]]):
        done = tuner(*argv, "--args", f"--model m --api-key {KEY} --max-num-seqs 4", "--format", fmt)
        assert done.returncode == 0, done.stderr
        assert_no_secret(done.stdout + done.stderr, " ".join(argv[:1]))
        assert "--api-key" in done.stdout and "***" in done.stdout
