"""The engine's ``/health``, as the launcher sees it: its URL, one bounded probe, and the poller thread.

The poller only observes: it keeps every answer until the loop (``launching``) takes it, and the table in
``states`` judges them (readiness's hysteresis, liveness's deadline).
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from collections.abc import Sequence

from ..portable import argv as argvs


def derive_health_url(argv: Sequence[str]) -> str:
    host = argvs.value_of(argv, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = argvs.value_of(argv, "--port") or "8000"
    return f"http://{host}:{port}/health"


def probe_health(url: str, *, timeout: float) -> tuple[bool, str]:
    """One ``GET``: http.client directly (no proxy settings from the environment apply)."""
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        response = conn.getresponse()
        response.read(65536)
        return response.status == 200, f"GET {parts.path} {response.status}"
    except (OSError, http.client.HTTPException) as exc:
        return False, f"GET {parts.path}: {type(exc).__name__}: {exc}"[:300]
    finally:
        conn.close()


class HealthPoller:
    """Polls the current engine's /health every ``period`` seconds in its own thread. It only observes:
    every answer is kept until the loop takes it (``take``), and the table judges them."""

    MAX_KEPT = 64  # answers not taken yet (the loop takes them every 0.2 s)

    def __init__(self, period: float) -> None:
        self.period = period
        self._lock = threading.Lock()
        self._target: tuple[int, str] | None = None
        self._last: tuple[int, bool, float, str] | None = None  # serial, ok, when (monotonic), detail
        self._answers: list[bool] = []  # for the watched serial, not taken yet
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="health", daemon=True)

    def watch(self, serial: int, url: str | None, *, period: float | None = None) -> None:
        if period is not None:
            self.period = period
        with self._lock:
            self._target = (serial, url) if url else None
            self._last = None
            self._answers = []
        self._wake.set()

    def last(self, serial: int) -> tuple[bool, float, str] | None:
        with self._lock:
            if self._last is None or self._last[0] != serial:
                return None
            return self._last[1], self._last[2], self._last[3]

    def take(self, serial: int) -> tuple[bool, ...]:
        """The answers for ``serial`` since the last call, oldest first."""
        with self._lock:
            if self._target is None or self._target[0] != serial:
                return ()
            out, self._answers = tuple(self._answers), []
            return out

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                target = self._target
            if target is not None:
                ok, detail = probe_health(target[1], timeout=max(1.0, min(5.0, 4 * self.period)))
                with self._lock:
                    if self._target == target:
                        self._last = (target[0], ok, time.monotonic(), detail)
                        self._answers = [*self._answers[-(self.MAX_KEPT - 1):], ok]
            self._wake.wait(self.period)
            self._wake.clear()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
