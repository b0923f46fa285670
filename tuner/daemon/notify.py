"""systemd's sd_notify protocol, without libsystemd: one datagram to ``$NOTIFY_SOCKET``.

A unit with ``Type=notify`` waits for ``READY=1``; with ``WatchdogSec=`` it expects ``WATCHDOG=1`` at
least that often (systemd passes the period as ``$WATCHDOG_USEC``). ``STOPPING=1`` says a graceful stop
began; ``STATUS=…`` is the line ``systemctl status`` shows. Everything here is a no-op when
``NOTIFY_SOCKET`` is unset (not under systemd), and a failed send is logged once, never raised: the
daemon must not die because its supervisor's socket went away.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def socket_address(env: Mapping[str, str] | None = None) -> str | None:
    """The notify socket's address as ``socket.sendto`` wants it; ``@name`` is an abstract socket."""
    raw = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not raw:
        return None
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # systemd also allows vsock:…; not supported here (we never run in a VM guest)


def watchdog_seconds(env: Mapping[str, str] | None = None) -> float | None:
    """The watchdog period systemd asked for, or None when there is none (or it is meant for another
    process: ``$WATCHDOG_PID`` names the pid it applies to)."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 1e6


class Notifier:
    """Sends sd_notify messages. ``address`` None: read ``$NOTIFY_SOCKET`` once, now."""

    def __init__(self, address: str | None = None, *, env: Mapping[str, str] | None = None) -> None:
        self.address = address if address is not None else socket_address(env)
        self._warned = False

    @property
    def is_enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keys upper-cased). True when a datagram went out."""
        if self.address is None:
            return False
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(1.0)  # a datagram send never waits long; this bounds a wedged peer
                sock.sendto(message.encode("utf-8"), self.address)
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify to %r failed (further failures are not logged): %s",
                            self.address.replace("\0", "@"), exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send(ready=1, **({"status": status} if status else {}))

    def watchdog(self) -> bool:
        return self.send(watchdog=1)

    def stopping(self, status: str | None = None) -> bool:
        return self.send(stopping=1, **({"status": status} if status else {}))

    def status(self, text: str) -> bool:
        # STATUS is one line; systemd shows it verbatim.
        return self.send(status=" ".join(text.split()))
