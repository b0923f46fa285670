"""The cycle loop (APScheduler wiring, tuner.runtime.scheduling.Loop) in real time: READY, STATUS, watchdog
pings and STOPPING over a real NOTIFY_SOCKET, one cycle at a time, SIGTERM finishing the step in progress.
Every wait waits for an event or a condition with a deadline, never for a fixed time."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tests.support.sdnotify import drain
from tuner.actuators import children
from tuner.daemon import notify
from tuner.runtime import scheduling


class _Result:
    def __init__(self, summary: str) -> None:
        self.summary = summary


def test_loop_sends_ready_status_watchdog_then_stopping(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    ran = threading.Event()
    persisted: list[bool] = []

    def step() -> _Result:
        ran.set()
        return _Result("cycle 1: no action")

    loop = scheduling.Loop(step, interval_seconds=60, on_stop=lambda: persisted.append(True),
                           notifier=notify.Notifier(env={"NOTIFY_SOCKET": path}), watchdog_seconds=0.2)
    loop.start()
    messages: list[list[str]] = []
    try:
        assert ran.wait(10)
        deadline = time.monotonic() + 10  # pings every 0.1 s (half the period): wait for two, not for a time
        while messages.count(["WATCHDOG=1"]) < 2:
            assert time.monotonic() < deadline, messages
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            messages.append(sock.recv(4096).decode().split("\n"))
        assert loop.is_alive() and not loop.is_busy()
        assert not loop.stop_event.is_set()
    finally:
        assert loop.stop() == 0
    messages += drain(sock)
    assert messages[0][0] == "READY=1"
    assert ["STATUS=cycle 1: no action"] in messages
    assert messages.count(["WATCHDOG=1"]) >= 2
    assert messages[-1][0] == "STOPPING=1"
    assert persisted == [True]
    assert not loop.is_alive() and loop.stop_event.is_set()


def test_loop_runs_cycles_one_at_a_time() -> None:
    """A cycle that outlasts many intervals delays the next one instead of overlapping it, and the missed
    runs collapse into one (APScheduler: max_instances=1, coalesce)."""
    active = 0
    overlap = False
    count = 0
    lock = threading.Lock()
    release = threading.Event()
    second = threading.Event()

    def step() -> None:
        nonlocal active, overlap, count
        with lock:
            active += 1
            overlap = overlap or active > 1
            count += 1
            n = count
        if n == 1:
            release.wait(10)  # the first cycle runs past ~10 intervals of 0.05 s
        elif n == 2:
            second.set()
        with lock:
            active -= 1

    loop = scheduling.Loop(step, interval_seconds=0.05, notifier=notify.Notifier(env={}))
    loop.start()
    deadline = time.monotonic() + 10
    while loop.is_busy() is False or count < 1:  # the first cycle is running
        assert time.monotonic() < deadline
        time.sleep(0.01)
    missed = threading.Event()
    missed.wait(0.5)  # ~10 intervals pass while the first cycle holds
    assert count == 1 and not overlap
    release.set()
    assert second.wait(10)
    assert loop.stop() == 0
    assert not overlap


def test_a_failing_persist_gives_exit_code_1() -> None:
    def boom() -> None:
        raise OSError("disk full")

    loop = scheduling.Loop(lambda: None, interval_seconds=10, on_stop=boom, notifier=notify.Notifier(env={}))
    loop.start()
    assert loop.stop() == 1


SIGTERM_SCRIPT = textwrap.dedent("""
    import pathlib, sys, time
    from tuner.daemon import notify
    from tuner.runtime import scheduling

    out = pathlib.Path(sys.argv[1])
    def step():
        out.with_suffix(".started").write_text("1")
        while not out.with_suffix(".go").exists():  # the step in progress when SIGTERM arrives
            time.sleep(0.01)
        out.with_suffix(".finished").write_text("1")

    loop = scheduling.Loop(step, interval_seconds=60, on_stop=lambda: out.write_text("persisted"),
                           notifier=notify.Notifier(env={}))
    sys.exit(loop.run())
""")


def test_sigterm_finishes_the_current_step_persists_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(out)])
    try:
        deadline = time.monotonic() + 20
        while not out.with_suffix(".started").exists():
            assert time.monotonic() < deadline, "the first cycle never started"
            assert proc.poll() is None
            time.sleep(0.05)
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # it must not exit while its step is still running…
        assert proc.poll() is None
        out.with_suffix(".go").write_text("1")  # …and exits 0 once the step has finished
        assert proc.wait(timeout=20) == 0
    finally:
        children.stop(proc, timeout_seconds=0, signal_first=None)  # SIGKILL if it still runs; reaped either way
    assert out.with_suffix(".finished").exists(), "the step in progress was cut short"
    assert out.read_text() == "persisted"
