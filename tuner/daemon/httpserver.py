"""The tuner's own HTTP endpoint (stdlib ``ThreadingHTTPServer``), bound to 127.0.0.1 by default.

=====================  =========================================================================
``GET /metrics``       the ``tuner_*`` series (its own registry, Prometheus text format)
``GET /healthz``       200 while the loop is alive and the last cycle is recent (or one is
                       running and not stuck); 503 otherwise
``GET /status``        JSON: targets with their last signals, the pending change, rollout state
``GET /recommendations``  JSON: this cycle's proposed and held changes, and the pending one
=====================  =========================================================================

Read-only: nothing here changes the tuner or an engine, so there is no authentication; keep it on
loopback (or behind something that authenticates) — ``/status`` shows engine arguments. Never their
secrets: every document goes out through the ``redactor`` (``model.secrets``: ``--api-key ***``).
Handlers only read ``state.last``, an immutable ``CycleResult`` that the loop swaps in atomically.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from tuner.daemon import selfmetrics, views
from tuner.daemon.state import TunerState
from tuner.model import secrets

log = logging.getLogger("tuner.http")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9180


class TunerHttpServer:
    """Serves the endpoints in a background thread. ``port=0`` picks a free port (tests)."""

    def __init__(
        self,
        *,
        metrics: selfmetrics.TunerMetrics,
        state: TunerState,
        max_age_seconds: float,
        is_alive: Callable[[], bool] = lambda: True,
        is_busy: Callable[[], bool] = lambda: False,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        clock: Callable[[], float] = time.time,
        redactor: secrets.Redactor | None = None,
    ) -> None:
        self.metrics = metrics
        self.redactor = redactor if redactor is not None else state.redactor
        self.state = state
        self.max_age_seconds = max_age_seconds
        self.is_alive = is_alive  # the loop runs and its current cycle (if any) is not stuck
        self.is_busy = is_busy  # a cycle is running now: a long one (a rollout) is not a wedged loop
        self.clock = clock
        self._server = ThreadingHTTPServer((host, port), _handler_class(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="tuner-http", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz, /status, /recommendations on %s", self.url)
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the documents ----------------------------------------------------------------------------
    def health(self) -> tuple[bool, dict[str, Any]]:
        now = self.clock()
        last = self.state.last
        if not self.is_alive():
            return False, {"status": "unhealthy", "reason": "the cycle loop is not running (stopping or stuck)"}
        if last is None:
            age = now - self.state.started_at
            ok = age <= self.max_age_seconds
            return ok, {"status": "ok" if ok else "unhealthy", "last_cycle": None,
                        "reason": "starting: no cycle finished yet" if ok else
                        f"no cycle finished in the {age:.0f}s since start (limit {self.max_age_seconds:g}s)"}
        age = now - last.finished_at
        busy = self.is_busy()
        ok = age <= self.max_age_seconds or busy
        body: dict[str, Any] = {"status": "ok" if ok else "unhealthy", "last_cycle": last.number,
                                "age_seconds": round(age, 3), "cycle_running": busy}
        if not ok:
            body["reason"] = f"the last cycle finished {age:.0f}s ago (limit {self.max_age_seconds:g}s)"
        return ok, body

    def status(self) -> dict[str, Any]:
        last = self.state.last
        head = {"started_at": self.state.started_at, "control": dict(self.state.control) or None}
        if last is None:
            return {**head, "cycle": None, "summary": "no cycle finished yet", "targets": {}, "pending": None,
                    "rollout": dict(self.state.rollout_state) or None}
        body = {**head, **views.status(last)}
        live = self.state.rollout_state
        if live.get("outcome") == "running":  # a rollout in progress (inside a cycle, or resumed at start)
            body["rollout"] = dict(live)
        return body

    def recommendations(self) -> dict[str, Any]:
        last = self.state.last
        if last is None:
            return {"cycle": None, "recommendations": [], "held": [], "pending": None}
        return views.recommendations(last)


def _handler_class(owner: TunerHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "vllm-tuner"
        timeout = 10  # seconds a slow client may hold a handler thread

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            try:
                if path == "/metrics":
                    text = owner.redactor.text(owner.metrics.render().decode("utf-8"))
                    self._send(HTTPStatus.OK, text.encode("utf-8"), selfmetrics.CONTENT_TYPE)
                elif path == "/healthz":
                    ok, body = owner.health()
                    self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, body)
                elif path == "/status":
                    self._json(HTTPStatus.OK, owner.status())
                elif path == "/recommendations":
                    self._json(HTTPStatus.OK, owner.recommendations())
                else:
                    self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {path!r}", "endpoints": [
                        "/metrics", "/healthz", "/status", "/recommendations"]})
            except Exception as exc:
                log.exception("HTTP %s failed", path)
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"})

        def do_HEAD(self) -> None:
            self.do_GET()

        def _json(self, status: HTTPStatus, body: Any) -> None:
            body = owner.redactor.data(json.loads(json.dumps(body, default=str)))
            data = json.dumps(body, indent=1).encode("utf-8") + b"\n"
            self._send(status, data, "application/json")

        def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler
