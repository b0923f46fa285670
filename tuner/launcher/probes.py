"""The kubelet's probes and a small status page, on ``http.server`` (threaded).

- ``GET /livez``: 200 while the launcher's loop is alive and not stuck (through a planned restart too).
- ``GET /readyz``: 200 only when the engine answers ``GET /health`` 200, the replica is not drained and
  the running command line is the one desired.json asks for; otherwise 503 with the reason.
- ``GET /status``: the launcher's status as JSON (the argv's secrets redacted, no log lines).

Every handler reads an in-memory snapshot (no I/O but its own socket) and every socket has a timeout,
so a slow or stuck client costs one thread for at most ``TIMEOUT_SECONDS``.

A wildcard host (``0.0.0.0``, ``::`` or empty: what the manifests pass, the kubelet probing the pod IP)
listens on every address, IPv4 and IPv6: one ``::`` socket with ``IPV6_V6ONLY`` off, so a pod of an
IPv6-only or dual-stack cluster answers on its IPv6 address too; a host without IPv6 gets ``0.0.0.0``.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TIMEOUT_SECONDS = 5.0

Answer = tuple[bool, str]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DualStackServer(_Server6):
    """``::`` with IPV6_V6ONLY off: IPv4 clients arrive as ::ffff:a.b.c.d."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def _handler(live: Callable[[], Answer], ready: Callable[[], Answer],
             status: Callable[[], dict[str, Any]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = TIMEOUT_SECONDS
        server_version = "vllm-tuner-launcher"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:  # probes every second: not in the log
            pass

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _probe(self, answer: Answer) -> None:
            ok, reason = answer
            self._send(200 if ok else 503, (reason + "\n").encode(), "text/plain; charset=utf-8")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/livez":
                self._probe(live())
            elif path == "/readyz":
                self._probe(ready())
            elif path == "/status":
                self._send(200, json.dumps(status(), indent=1).encode(), "application/json")
            else:
                self._send(404, b"not found: /livez, /readyz, /status\n", "text/plain; charset=utf-8")

        do_HEAD = do_GET

        def _refuse(self) -> None:
            self._send(405, b"GET only\n", "text/plain; charset=utf-8")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    return Handler


class ProbeServer:
    def __init__(self, host: str, port: int, *, live: Callable[[], Answer], ready: Callable[[], Answer],
                 status: Callable[[], dict[str, Any]]) -> None:
        handler = _handler(live, ready, status)
        self.server = _bind(host.strip("[]") if host not in WILDCARDS else host, port, handler)
        self.port = int(self.server.server_address[1])
        self.dual_stack = isinstance(self.server, _DualStackServer)
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="probes", daemon=True)

    @property
    def where(self) -> str:
        """What it listens on, for the log."""
        if self.dual_stack:
            return f"[::]:{self.port} (IPv4 and IPv6)"
        host = str(self.server.server_address[0])
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _bind(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> _Server:
    """A wildcard: dual-stack where the host has IPv6, else 0.0.0.0; any other host as given."""
    if host in WILDCARDS:
        if socket.has_ipv6 and hasattr(socket, "IPV6_V6ONLY"):
            try:
                return _DualStackServer(("::", port), handler)
            except OSError:  # no IPv6 on this host (EAFNOSUPPORT, EADDRNOTAVAIL): IPv4 alone
                pass
        return _Server(("0.0.0.0", port), handler)
    return (_Server6 if ":" in host else _Server)((host, port), handler)
