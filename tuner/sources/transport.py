"""An httpx transport whose every socket operation is bounded by the calling thread's deadline.

httpx's timeouts are per operation (connect, each read, each write): an engine that trickles a byte
every few seconds never trips a 5 s read timeout and holds a scrape — and with it the whole cycle —
forever. Here each connect, read, write and TLS handshake gets ``min(its own timeout, time left until
the deadline)``, and an operation that starts after the deadline fails at once with httpx's own
timeout error; so a call made inside ``deadline(seconds)`` returns (or raises) within ``seconds`` plus
scheduling noise, whatever the peer does.

The deadline lives in a context variable: it belongs to the thread (or task) that set it, so one client
serves concurrent collectors, each with its own deadline. Outside ``deadline(...)`` only the ordinary
timeouts apply.
"""

from __future__ import annotations

import contextlib
import contextvars
import ssl
import time
import typing
from collections.abc import Iterator

import httpcore
import httpx

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tuner_http_deadline", default=None)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Bound every HTTP operation of this thread to ``seconds`` from now (None: no overall bound)."""
    token = _DEADLINE.set(None if seconds is None else time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _left(timeout: float | None, error: type[Exception]) -> float | None:
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise error("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout), local_address,
                                               socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None
                            ) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout),
                                                       socket_options))

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)  # httpx's own


class DeadlineTransport(httpx.HTTPTransport):
    """``httpx.HTTPTransport`` over a connection pool whose sockets obey ``deadline``."""

    def __init__(self, *, verify: bool | str = True, cert: str | None = None, limits: httpx.Limits = LIMITS) -> None:
        super().__init__(verify=verify, cert=cert, trust_env=False, limits=limits)
        # httpx builds its httpcore pool without a way to pass a network backend; this is the same
        # pool (same TLS context, same limits) with ours. tests/unit/test_engine_client.py holds it.
        self._pool.close()
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, cert=cert, trust_env=False),
            max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=_Backend(),
        )
