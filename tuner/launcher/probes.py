"""The kubelet's probes and a small status page, on ``http.server`` (threaded).

- ``GET /livez``: 200 while the launcher's loop is alive and not stuck (through a planned restart too).
- ``GET /readyz``: 200 only when the engine answers ``GET /health`` 200, the replica is not drained and
  the running command line is the one desired.json asks for; otherwise 503 with the reason.
- ``GET /status``: the launcher's status as JSON (the argv's secrets redacted, no log lines).

Every handler reads an in-memory snapshot (no I/O but its own socket) and every socket has a timeout,
so a slow or stuck client costs one thread for at most ``TIMEOUT_SECONDS``.
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
        server_class = _Server6 if ":" in host else _Server
        self.server = server_class((host, port), _handler(live, ready, status))
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="probes", daemon=True)

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
