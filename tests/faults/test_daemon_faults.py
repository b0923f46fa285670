"""The daemon against faults of the world around it: a host reboot mid-rollout (every engine down when the
tuner starts again) and engines that answer badly (a slow loris that trickles a byte every second,
5xx, an HTML page, a redirect loop) beside a healthy one.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.faults import support
from tuner.actuators import children
from tuner.rollout import machine

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 6

# --- a host reboot ---------------------------------------------------------------------------------------


def test_engines_down_at_tuner_start_after_a_host_reboot_mid_rollout(tmp_path: Path) -> None:
    """Three replicas; the host goes down while sim-b, the second, has just been started on the new
    arguments (sim-a done, sim-c pending): the tuner is SIGKILLed at that record and every engine with it.
    The tuner that comes back starts the replicas the rollout does not hold in flight on what they ran
    (sim-a: the new arguments, sim-c: the old ones) before it resumes, restarts sim-b on its leg's
    arguments (``found_down``, not a crash: the arguments are not condemned), and the rollout ends done.
    (Before, sim-a and sim-c stayed down until the rollout ended, and Rule 2 held sim-c — two replicas
    "not serving" — until the hold timeout aborted the rollout.)"""
    with support.sim_pool(tmp_path, names=("sim-a", "sim-b", "sim-c")) as pool:
        # decision, rollout, sim-a's ten transitions; then sim-b: go, drained, idle, stopped, started
        k = 2 + 10 + 5
        first = pool.start_tuner(kill_at=k)
        assert first.wait(180) == -9, first.tail()
        before = pool.journal_path.read_bytes()
        rollout = list(pool.rollouts().values())[-1]
        assert rollout.of("sim-b").state is machine.State.WAITING_HEALTHY, machine.describe(rollout)
        pool.stop_engines()  # the reboot: every engine is gone (the balancer, like nginx's file, remembers)
        support.wait_for(lambda: not any(support.pids_with_port(p) for p in pool.ports.values()), 30,
                         "the engines to be gone")
        second = pool.start_tuner()
        support.wait_for(pool.finished_rollout, 240, "the resumed rollout to finish", poll=0.2,
                         detail=pool.diagnostics)
        pool.wait_cycles(3)
        assert second.terminate() == 0, second.tail()
        done = support.check_invariants(pool, before_kill=before)
        assert machine.outcome(done) is machine.Outcome.DONE, machine.describe(done)
        resumed = pool.records()[k:]
        found = [r for r in resumed if r.get("event") == "found_down"]
        assert [r["replica"] for r in found] == ["sim-b"] and "found the engine" in found[0]["reason"]
        assert not any(r.get("event") in ("crashed", "failed") for r in resumed)
        for name, target in pool.state()["targets"].items():
            assert target["history"]["bad_args"] == [], (name, target["history"]["bad_args"])
        log = second.log.read_text()
        first_resumed = log.index("sim-b waiting_healthy → stopping (found_down")
        for name in ("sim-a", "sim-c"):  # started before the rollout resumed, not after it
            assert -1 < log.find(f"started {name} (down at start") < first_resumed, second.tail(80)


# --- engines that answer badly ------------------------------------------------------------------------------


class SlowLoris:
    """Accepts, reads the request, then sends a valid HTTP response one byte per ``every`` seconds
    (headers first, then a long body): each read returns within any per-read timeout, the whole never
    ends. Counts connections."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.connections = 0
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        response = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: 100000\r\n\r\n"
        response += b"# HELP vllm:num_requests_running x\n" * 3000
        with contextlib.closing(conn):
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(65536)
                for i in range(len(response)):
                    if self._stop.wait(self.every):
                        return
                    conn.sendall(response[i:i + 1])

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


class BadEngines:
    """One HTTP server, three bad engines by path prefix: ``/5xx`` answers 503 with a JSON body, ``/html``
    a login page (200, text/html), ``/loop`` a 302 to itself."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                kind = self.path.split("/")[1]
                if kind == "5xx":
                    self._send(503, b'{"error": "overloaded"}', "application/json")
                elif kind == "html":
                    self._send(200, b"<!DOCTYPE html><html><body>Sign in</body></html>", "text/html")
                else:
                    self.send_response(302)
                    self.send_header("Location", self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/{kind}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def bad_world() -> Iterator[tuple[str, SlowLoris, BadEngines]]:
    """(the healthy engine's base URL: a simulated one in its own process, the slow loris, the broken ones)."""
    port = support.free_port()
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        healthy = subprocess.Popen([*support.SIM_COMMAND, "--port", str(port), "--max-num-seqs", "8",
                                    "--sim-concurrency", "4", "--sim-output-tokens", "32", "--sim-startup-seconds", "0"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        # SIGKILL to its group, reaped: last, after the fake engines below are closed
        stack.callback(children.stop, healthy, timeout_seconds=0, signal_first=None, group=True)
        loris = SlowLoris(every=1.0)
        stack.callback(loris.close)
        bad = BadEngines()
        stack.callback(bad.close)
        support.wait_for(lambda: support.healthy(url), 60, "the simulated engine to serve", poll=0.2)
        yield url, loris, bad


INTERVAL = 5.0
DEADLINE = 2.0


def test_a_slow_loris_and_broken_engines_beside_a_healthy_one_do_not_stall_the_daemon(tmp_path: Path) -> None:
    """``vllm-tuner run`` (mode recommend, JSON logs) over five targets: a healthy simulated engine, a
    slow loris (a byte per second: never trips a 5 s read timeout), an engine answering 503, one answering
    an HTML login page and one redirecting to itself. Every call is bounded by ``scrape.deadline_seconds``
    (2 s) and the interval is 5 s, so:

    - the healthy target is scraped successfully in every cycle, and the cycles keep the configured
      interval: no gap between two cycles reaches twice the interval (what a cycle overrunning the interval
      looks like to APScheduler: the next run is skipped, max_instances=1);
    - no cycle's collect step outlasts the bound (deadline per call; 3 × deadline + 1 s for the whole);
    - every bad target fails with its own reason, no traceback;
    - /healthz answers 200 throughout, and the tuner exits within 10 s of SIGTERM."""
    with bad_world() as (healthy, loris, bad):
        targets = [("healthy", healthy + "/metrics"), ("loris", loris.url + "/metrics"),
                   ("http-5xx", bad.url("5xx") + "/metrics"), ("html", bad.url("html") + "/metrics"),
                   ("redirect-loop", bad.url("loop") + "/metrics")]
        port = support.free_port()
        cfg = {
            "mode": "recommend",
            "targets": [{"name": n, "metrics_url": u, "args": ["--max-num-seqs", "8"]} for n, u in targets],
            "scrape": {"interval_seconds": INTERVAL, "window_seconds": 30, "deadline_seconds": DEADLINE},
            "daemon": {"listen_port": port, "state_file": str(tmp_path / "state.json"), "json_logs": True},
        }
        config = tmp_path / "tuner.yaml"
        config.write_text(yaml.safe_dump(cfg))
        # every cycle's record (a cycle that repeats the last one's line is logged at DEBUG: tuner/runtime/cycle.py)
        tuner = support.Tuner(config, tmp_path / "tuner.log", journal=tmp_path / "unused.jsonl",
                              env={"VLLM_TUNER_LOG_LEVEL": "DEBUG"})
        try:
            url = f"http://127.0.0.1:{port}"
            health: list[int] = []

            def cycles() -> list[dict[str, Any]]:
                out = []
                for line in tuner.log.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        record = json.loads(line)
                        if "cycle" in record:
                            out.append(record)
                return out

            def enough() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    health.append(httpx.get(url + "/healthz", timeout=5).status_code)
                return len(cycles()) >= 12

            support.wait_for(enough, 240, "12 cycles", poll=0.5, detail=tuner.tail)
            assert loris.connections >= 10  # the slow loris really was asked, cycle after cycle
            records = cycles()
            assert health and all(code == 200 for code in health[2:]), health  # the first probes: not up yet
            ends = [datetime.fromisoformat(r["ts"]).timestamp() for r in records]
            gaps = [b - a for a, b in itertools.pairwise(ends[1:])]
            assert max(gaps) < 2 * INTERVAL, gaps
            # Each bad target fails with its own reason, or, when its answer did not come within the deadline,
            # as timed out (the bad servers are threads of this test process: with the rest of `make test`
            # beside it, once a 503 took longer than the 2 s deadline). Never anything else, and each reason
            # was seen.
            own = {"http-5xx": "503", "html": "HTML", "redirect-loop": "302"}
            seen: set[str] = set()
            for r in records[1:]:
                c = r["cycle"]
                assert c["targets"]["healthy"]["scrape_error"] is None, c["summary"]
                assert c["steps"]["collect"] <= 3 * DEADLINE + 1, c["steps"]  # the gathering's own bound
                errors = {n: c["targets"][n]["scrape_error"] or "" for n, _ in targets}
                assert "timed out" in errors["loris"], errors["loris"]  # cut by the deadline: a read past it times out
                for name, reason in own.items():
                    assert reason in errors[name] or "timed out" in errors[name], (name, errors[name])
                    if reason in errors[name]:
                        seen.add(name)
            assert seen == set(own), (seen, [r["cycle"]["summary"] for r in records])
            assert "Traceback" not in tuner.log.read_text()
            os.kill(tuner.proc.pid, signal.SIGTERM)
            sent = time.monotonic()
            rc = tuner.proc.wait(30)
            assert time.monotonic() - sent < 10, "the tuner took over 10 s to stop on SIGTERM"
            assert rc == 0, tuner.tail()
        finally:
            tuner.kill()

