"""Class 2 of issue 17: no hang survives SIGTERM, and a stuck read blinds its target for one cycle only.

Generated schedules say, cycle by cycle, which targets' reads hang (on an event nobody sets: a hung
NVML call, a stuck socket) and which answer. The promise, for every schedule: each gathering returns;
a target whose read hangs is reported stuck for that cycle; at the next cycle it is read again on a
fresh worker and, if that read answers, it is collected as usual; no target ever has more than
``max_stuck`` reads hanging. And a real process whose collector is stuck in a blocking ``open`` of a
FIFO (a syscall no timeout interrupts) exits on SIGTERM: its readers are daemon threads, which the
interpreter does not join (a thread pool's workers, before this, kept it alive forever). The same for
the launcher (PID 1 of the engine container, with a stub engine): desired.json a FIFO, the engine's
/health a socket that accepts and never answers, a probe client that never finishes its request — each
alone and all at once, it exits on SIGTERM as soon as the engine is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import waiting
from harness.ports import free_port
from tests.support import launcher as support
from tests.support.launcher import LauncherProcess
from tuner import config
from tuner.actuators import children
from tuner.model import live, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.runtime import collecting

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 10

NAMES = ("a", "b", "c", "d")


@dataclass
class Reader:
    """A collector whose read of cycle ``n`` hangs when ``hangs(n)``; counts the reads that answered."""

    target: config.Target
    schedule: list[bool]
    release: threading.Event
    cycle: int = 0
    answered: list[int] = field(default_factory=list)

    def scrape_engine(self) -> snapshots.Snapshot:
        n = self.cycle
        if n < len(self.schedule) and self.schedule[n]:
            self.release.wait()  # hangs until the test ends
        self.answered.append(n)
        return snapshots.parse("vllm:num_requests_running 1\n", 0.0, source=self.target.name)

    def engine_info(self) -> EngineInfo:
        return EngineInfo(model="m")

    def read_gpus(self) -> GpuInputs:
        return GpuInputs(unavailable="none")

    def read_live(self) -> live.LiveState:
        return live.NONE


@settings(max_examples=20, deadline=None)
@given(schedules=st.lists(st.lists(st.booleans(), min_size=1, max_size=5), min_size=1, max_size=len(NAMES)))
def test_a_stuck_read_is_reported_and_retried_on_a_fresh_worker(schedules: list[list[bool]]) -> None:
    release = threading.Event()
    readers = [Reader(config.Target(name=NAMES[i], metrics_url="http://127.0.0.1:1/metrics"), s, release)
               for i, s in enumerate(schedules)]
    gatherer = collecting.Gatherer(max_stuck=3)
    try:
        for n in range(max(len(s) for s in schedules)):
            for r in readers:
                r.cycle = n
            before = gatherer.stuck()
            out = gatherer.gather(readers, deadline_seconds=1.0)  # ample for a read that answers
            for r, inputs in zip(readers, out, strict=True):
                hangs = n < len(r.schedule) and r.schedule[n]
                refused = before.get(r.target.name, 0) >= gatherer.max_stuck
                if hangs or refused:
                    assert not inputs.snapshot.ok and "stuck" in (inputs.snapshot.error or "")
                else:  # a read that answers is collected, whatever earlier reads of this target are doing
                    assert inputs.snapshot.ok, (n, r.target.name, inputs.snapshot.error)
            assert all(k <= gatherer.max_stuck for k in gatherer.stuck().values())
    finally:
        release.set()
        gatherer.close()


def test_a_reader_stuck_in_a_syscall_does_not_keep_the_process_alive_after_sigterm(tmp_path: Path) -> None:
    fifo = tmp_path / "ack-0.json"
    os.mkfifo(fifo)  # a blocking open of it waits for a writer that never comes
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import signal, sys, threading
        from pathlib import Path
        from tuner import config
        from tuner.runtime import collecting
        from tuner.model.engines import EngineInfo
        from tuner.model.gpus import GpuInputs
        from tuner.model import live

        class Stuck:
            target = config.Target(name="a", metrics_url="http://127.0.0.1:1/metrics")
            def scrape_engine(self):
                open({str(fifo)!r}, "rb")  # blocks in the kernel: no timeout, no exception
            def engine_info(self): return EngineInfo()
            def read_gpus(self): return GpuInputs()
            def read_live(self): return live.NONE

        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        gatherer = collecting.Gatherer(stop=stop)
        (out,) = gatherer.gather([Stuck()], deadline_seconds=0.2)
        assert "stuck" in out.snapshot.error, out.snapshot.error
        Path({str(ready)!r}).write_text("gathered")
        stop.wait(600)
        sys.exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        waited = threading.Event()
        for _ in range(600):  # the gathering, under a deadline of its own
            if ready.exists() or proc.poll() is not None:
                break
            waited.wait(0.1)
        assert ready.exists(), proc.stdout.read().decode() if proc.poll() is not None else "not gathered"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # the daemon's promise: out within 10 s of SIGTERM
    finally:
        try:
            children.stop(proc, timeout_seconds=0, signal_first=None)  # SIGKILL if it still runs, reaped
        finally:
            proc.stdout.close()


STUB_ENGINE = Path(__file__).resolve().parents[1] / "support" / "stub_engine.py"
STUCK = ("desired.json is a FIFO", "the engine's /health accepts and never answers",
         "a probe client sends its request one byte a second")


def _serves(port: int) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    return False


@pytest.mark.parametrize("stuck", [(s,) for s in STUCK] + [STUCK], ids=["fifo", "health", "probe", "all"])
def test_the_launcher_exits_promptly_on_sigterm_while_its_reads_are_stuck(tmp_path: Path,
                                                                          stuck: tuple[str, ...]) -> None:
    """PID 1 of the engine container: the kubelet's SIGTERM goes to the engine, and once the engine is gone
    the launcher exits — within ``--stop-timeout`` + ``--kill-timeout`` (its documented bound, here 3 + 2 s),
    whatever its readers are stuck in."""
    state = tmp_path / "state"
    state.mkdir()
    if STUCK[0] in stuck:
        os.mkfifo(state / "desired.json")  # a blocking open would wait for a writer forever
    health = socket.socket()  # listens, never accepts: connects succeed, requests are never answered
    health.bind(("127.0.0.1", 0))
    health.listen(16)
    options = ["--stop-timeout", "3", "--kill-timeout", "2", "--health-period", "0.5"]
    if STUCK[1] in stuck:
        options += ["--health-url", f"http://127.0.0.1:{health.getsockname()[1]}/health"]
    port = free_port()
    lp = LauncherProcess(state, [sys.executable, str(STUB_ENGINE), "--port", str(port)], options=options)
    stop_trickle = threading.Event()
    trickler: threading.Thread | None = None
    try:
        lp.start()
        st = lp.wait(lambda s: s.get("pid") and s.get("state") in ("starting", "serving"), 30, "the engine runs")
        engine = int(st["pid"])
        if STUCK[1] not in stuck:
            lp.wait_state("serving", 30)
        # The stub engine installs its SIGTERM handler before it serves: once it answers, a SIGTERM is its
        # own to handle. (With the launcher's health check pointed at the stuck socket, nothing waited for
        # that, and once, with the rest of make test beside it, Python's default ended the stub with 143.)
        waiting.wait_for(lambda: _serves(port), 30, "the stub engine to serve", poll=0.1)
        if STUCK[0] in stuck:
            assert "not a regular file" in (lp.status().get("desired_error") or "") or "FIFO" in lp.log_tail()
        if STUCK[2] in stuck:
            probe = socket.create_connection(("127.0.0.1", lp.probe_port), timeout=5)

            def trickle() -> None:
                for byte in b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"x" * 600:
                    if stop_trickle.wait(1.0):
                        break
                    with contextlib.suppress(OSError):
                        probe.send(bytes([byte]))
                probe.close()

            trickler = threading.Thread(target=trickle, daemon=True)
            trickler.start()
            stop_trickle.wait(2.5)  # the probe server's handler is now reading a request that never ends
        started = time.monotonic()
        lp.signal(signal.SIGTERM)
        code = lp.wait_exit(3 + 2 + 2)
        took = time.monotonic() - started
        assert code == 0, lp.log_tail()
        assert support.proc_state(engine) is None
        assert took < 3, f"{took:.1f}s after SIGTERM (the stub engine stops at once)\n{lp.log_tail()}"
    finally:
        stop_trickle.set()
        if trickler is not None:
            trickler.join(5)
        lp.kill_all()
        health.close()
