"""TCP ports for the servers a test starts (engines, nginx, the tuner's status endpoint, probes).

Not the kernel's "bind port 0" answer: that is an *ephemeral* port, and every outgoing connection on this
machine takes its local port from the same range. A server that stops and starts again on its port (an
engine relaunched by a rollout) then finds it held by somebody's client socket, or handed to another test
as "free" in between — CI saw a relaunched engine fail with EADDRINUSE while another answered its health
checks. So ports come from below the ephemeral range, one block per pytest-xdist worker, never the same
one twice in a process (until its block wraps), and each is checked to bind right now.
"""

from __future__ import annotations

import os
import random
import socket
import threading

_FLOOR = 10000
_BLOCKS = 6  # the main process (e2e, benches) and up to five xdist workers; more share blocks
_lock = threading.Lock()
_cursor: int | None = None


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _block() -> range:
    low, high = _ephemeral()
    below, above = (_FLOOR, low), (high + 1, 65536)
    start, stop = max(below, above, key=lambda r: r[1] - r[0])
    span = (stop - start) // _BLOCKS
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    first = start + (index % _BLOCKS) * span
    return range(first, first + span)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 outside the ephemeral range that nobody holds right now."""
    global _cursor
    block = _block()
    with _lock:
        if _cursor is None:
            _cursor = random.randrange(len(block))  # two processes in one block rarely start alike
        for _ in range(len(block)):
            port = block[_cursor % len(block)]
            _cursor += 1
            if _bindable(port):
                return port
    raise RuntimeError(f"no free TCP port in {block.start}-{block.stop - 1}")
