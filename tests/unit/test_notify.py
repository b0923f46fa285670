"""sd_notify over a real unix datagram socket, and the loop's systemd lifecycle (READY, STATUS,
WATCHDOG, STOPPING; SIGTERM → finish the step, persist, exit 0)."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.sdnotify import received
from tuner.daemon import notify


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
