"""sd_notify over a real unix datagram socket, and the loop's systemd lifecycle (READY, STATUS,
WATCHDOG, STOPPING; SIGTERM → finish the step, persist, exit 0)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuner.daemon import notify, scheduling


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


def received(sock: socket.socket, *, timeout: float = 5.0) -> list[str]:
    sock.settimeout(timeout)
    return sock.recv(4096).decode().split("\n")


def drain(sock: socket.socket) -> list[list[str]]:
    out = []
    sock.settimeout(0.05)
    while True:
        try:
            out.append(sock.recv(4096).decode().split("\n"))
        except TimeoutError:
            return out


def test_no_socket_is_a_no_op() -> None:
    n = notify.Notifier(env={})
    assert not n.is_enabled
    assert n.ready() is False
    assert n.watchdog() is False


def test_ready_status_watchdog_stopping_reach_a_real_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = notify.Notifier(env={"NOTIFY_SOCKET": path})
    assert n.ready("up") is True
    assert received(sock) == ["READY=1", "STATUS=up"]
    assert n.watchdog()
    assert received(sock) == ["WATCHDOG=1"]
    assert n.status("cycle 3:\n  no action")
    assert received(sock) == ["STATUS=cycle 3: no action"]  # one line, as systemd shows it
    assert n.stopping()
    assert received(sock) == ["STOPPING=1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract unix sockets are Linux-only")
def test_abstract_socket_name_starting_with_at() -> None:
    name = f"vllm-tuner-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        n = notify.Notifier(env={"NOTIFY_SOCKET": "@" + name})
        assert n.address == "\0" + name
        assert n.ready()
        assert received(sock) == ["READY=1"]


def test_a_vanished_socket_is_logged_once_never_raised(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    n = notify.Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    with caplog.at_level(logging.WARNING, logger="tuner.daemon.notify"):
        assert n.watchdog() is False
        assert n.watchdog() is False
    assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1


def test_unsupported_addresses_are_ignored() -> None:
    assert notify.socket_address({"NOTIFY_SOCKET": "vsock:2:1234"}) is None
    assert notify.socket_address({"NOTIFY_SOCKET": ""}) is None


def test_watchdog_period() -> None:
    assert notify.watchdog_seconds({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert notify.watchdog_seconds({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert notify.watchdog_seconds({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None  # not ours
    assert notify.watchdog_seconds({"WATCHDOG_USEC": "0"}) is None
    assert notify.watchdog_seconds({}) is None


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
                           notifier=notify.Notifier(env={"NOTIFY_SOCKET": path}), watchdog_seconds=1.0)
    loop.start()
    try:
        assert ran.wait(5)
        time.sleep(1.2)  # at least two watchdog pings at half the 1 s period
        assert loop.is_alive() and not loop.is_busy()
        assert not loop.stop_event.is_set()
    finally:
        assert loop.stop() == 0
    messages = drain(sock)
    assert messages[0][0] == "READY=1"
    assert ["STATUS=cycle 1: no action"] in messages
    assert messages.count(["WATCHDOG=1"]) >= 1
    assert messages[-1][0] == "STOPPING=1"
    assert persisted == [True]
    assert not loop.is_alive() and loop.stop_event.is_set()


def test_loop_runs_cycles_one_at_a_time() -> None:
    active = 0
    overlap = False
    count = 0
    lock = threading.Lock()

    def step() -> None:
        nonlocal active, overlap, count
        with lock:
            active += 1
            overlap = overlap or active > 1
            count += 1
        time.sleep(0.3)  # longer than the interval: runs coalesce instead of overlapping
        with lock:
            active -= 1

    loop = scheduling.Loop(step, interval_seconds=0.1, notifier=notify.Notifier(env={}))
    loop.start()
    time.sleep(1.0)
    assert loop.stop() == 0
    assert not overlap
    assert 2 <= count <= 5


def test_a_failing_persist_gives_exit_code_1() -> None:
    def boom() -> None:
        raise OSError("disk full")

    loop = scheduling.Loop(lambda: None, interval_seconds=10, on_stop=boom, notifier=notify.Notifier(env={}))
    loop.start()
    assert loop.stop() == 1


SIGTERM_SCRIPT = textwrap.dedent("""
    import pathlib, sys, time
    from tuner.daemon import notify, scheduling

    out = pathlib.Path(sys.argv[1])
    def step():
        out.with_suffix(".started").write_text("1")
        time.sleep(1.5)  # the step in progress when SIGTERM arrives
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
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.with_suffix(".finished").exists(), "the step in progress was cut short"
    assert out.read_text() == "persisted"
