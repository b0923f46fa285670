"""The tuner's own HTTP endpoint (stdlib ``ThreadingHTTPServer``), bound to 127.0.0.1 by default.

=====================  =========================================================================
``GET /metrics``       the ``tuner_*`` series (its own registry, Prometheus text format)
``GET /healthz``       200 while the loop is alive and the last cycle is recent (or one is
                       running and not stuck); 503 otherwise
``GET /status``        JSON: targets with their last signals, the pending change, rollout state
``GET /recommendations``  JSON: this cycle's proposed and held changes, and the pending one
=====================  =========================================================================

Read-only: nothing here changes the tuner or an engine, so there is no authentication; keep it on
loopback (or behind something that authenticates) — ``/status`` shows engine arguments. Bound to a
wider address (the Kubernetes agent's, for Prometheus), ``/status`` and ``/recommendations`` still
answer loopback peers only unless ``status_from_network`` (``daemon.status_from_network``). Never their
secrets: every document goes out through the ``redactor`` (``model.secrets``: ``--api-key ***``).
Handlers only read ``state.last``, an immutable ``CycleResult`` that the loop swaps in atomically.

Bounded against the clients it cannot trust (a slow client, a flood of them, a web page):

- One thread accepts and reads every request's head without blocking (``selectors``); a connection that
  has begun its head may take at most ``REQUEST_DEADLINE_SECONDS`` from its connect for all of it (not
  per read: a byte every 3 s does not keep it), and at most ``MAX_PENDING`` wait at once — a new one
  evicts the oldest, so a flood of slow clients costs ``MAX_PENDING`` descriptors and never stands in
  front of a scrape that sends its request at once. Before a connection is closed for either, what has
  arrived on it is read: a head that came in time is answered even when the server itself was late (a
  process starved of CPU past the deadline).
- A connection that has sent nothing yet is not cut by that deadline but after ``SILENT_SECONDS`` (or by
  the cap): a request goes out in one write, so a client between its connect and that write is one whose
  own thread is starved (a scrape on a loaded machine got "Server disconnected without sending a
  response" that way), not a slow sender. The cap still bounds what silent connections cost.
- A complete request is answered by one of ``WORKERS`` threads (``MAX_QUEUED`` may wait for one; beyond
  that: 503). Nothing else makes a thread, so the tuner's descriptors stay for its engines.
- ``Host`` must name this server: a loopback name, an IP address, the listen address, this machine's
  name or one of ``daemon.allowed_hosts`` (a DNS-rebinding page, whose Host is its own domain, gets 421
  and never ``/status``).
"""

from __future__ import annotations

import collections
import contextlib
import io
import ipaddress
import json
import logging
import queue
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Self

from tuner.model import secrets
from tuner.runtime import selfmetrics, views
from tuner.runtime.state import TunerState

log = logging.getLogger("tuner.http")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9180
REQUEST_DEADLINE_SECONDS = 5.0  # a client's whole request head, from its connect, once it has begun
SILENT_SECONDS = 60.0  # a connection that sent nothing: nginx's client_header_timeout default; the cap bounds it
MAX_PENDING = 64  # connections whose head is still arriving; a new one evicts the oldest
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers (curl and Prometheus send < 1 KiB)
WORKERS = 4  # threads that answer complete requests
MAX_QUEUED = 32  # complete requests waiting for a worker; beyond: 503
WRITE_TIMEOUT_SECONDS = 5.0  # an answer's send to a client that does not read
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


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
        status_from_network: bool = False,
        allowed_hosts: Iterable[str] = (),
        request_deadline_seconds: float = REQUEST_DEADLINE_SECONDS,
        silent_seconds: float = SILENT_SECONDS,
    ) -> None:
        self.metrics = metrics
        self.status_from_network = status_from_network
        self.redactor = redactor if redactor is not None else state.redactor
        self.state = state
        self.max_age_seconds = max_age_seconds
        self.is_alive = is_alive  # the loop runs and its current cycle (if any) is not stuck
        self.is_busy = is_busy  # a cycle is running now: a long one (a rollout) is not a wedged loop
        self.clock = clock
        self.allowed_hosts = allowed_host_names(host, allowed_hosts)
        self._server = _BoundedServer(host, port, _handler_class(self), deadline_seconds=request_deadline_seconds,
                                     silent_seconds=silent_seconds)
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return str(self._server.address[0])

    @property
    def port(self) -> int:
        return int(self._server.address[1])

    def is_allowed_host(self, header: str | None) -> bool:
        """The ``Host`` header names this server (see the module docstring); no header (HTTP/1.0) passes."""
        if header is None:
            return True
        name = header.strip().lower()
        if name.startswith("["):  # [::1]:9180
            name = name[1:name.find("]")] if "]" in name else name
        elif name.count(":") == 1:
            name = name.rsplit(":", 1)[0]
        name = name.rstrip(".")
        if name in self.allowed_hosts:
            return True
        try:  # an address: a page of another origin cannot send it (its Host is its own domain)
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    @property
    def waiting(self) -> int:
        """Connections whose request head is still arriving."""
        return self._server.waiting

    @property
    def closed_unanswered(self) -> int:
        """Connections closed without an answer: evicted, past their deadline, a head too large, or 503."""
        return self._server.evicted

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> Self:
        self._server.start_workers()
        self._thread = threading.Thread(target=self._server.serve_forever, name="tuner-http", daemon=True)
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
                    "rollout": dict(self.state.rollout_state) or None,
                    "left_drained": dict(self.state.left_drained)}
        body = {**head, **views.status(last)}
        live = self.state.rollout_state
        if live.get("outcome") == "running":  # a rollout in progress (inside a cycle, or resumed at start)
            body["rollout"] = dict(live)
        body["left_drained"] = dict(self.state.left_drained)  # out of the pool after a failed way back
        return body

    def recommendations(self) -> dict[str, Any]:
        last = self.state.last
        if last is None:
            return {"cycle": None, "recommendations": [], "held": [], "pending": None}
        return views.recommendations(last)


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, and IPv4 loopback mapped into IPv6."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool((mapped or ip).is_loopback)


def _handler_class(owner: TunerHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        server_version = "vllm-tuner"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            if not owner.is_allowed_host(self.headers.get("Host")):
                self._json(HTTPStatus.MISDIRECTED_REQUEST, {"error": (
                    "this Host is not one of the tuner's names; add it to daemon.allowed_hosts if it is")})
                return
            try:
                if path == "/metrics":
                    text = owner.redactor.text(owner.metrics.render().decode("utf-8"))
                    self._send(HTTPStatus.OK, text.encode("utf-8"), selfmetrics.CONTENT_TYPE)
                elif path == "/healthz":
                    ok, body = owner.health()
                    self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, body)
                elif path in ("/status", "/recommendations") and not (
                        owner.status_from_network or is_loopback(self.client_address[0])):
                    self._json(HTTPStatus.FORBIDDEN, {"error": f"{path} answers on loopback only (it shows engine "
                                                               "arguments); set daemon.status_from_network: true to "
                                                               "serve it on the network"})
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


def allowed_host_names(listen_host: str, extra: Iterable[str]) -> frozenset[str]:
    """The names a ``Host`` header may carry (addresses pass on their own): loopback, the listen address,
    this machine's name, and ``extra`` (``daemon.allowed_hosts``)."""
    names = set(LOOPBACK_NAMES) | {listen_host.lower().strip("[]"), socket.gethostname().lower()}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn().lower())
    names |= {h.lower().rstrip(".") for h in extra}
    return frozenset(n for n in names if n)


class _Connection:
    __slots__ = ("address", "deadline", "head", "silent_until", "sock")

    def __init__(self, sock: socket.socket, address: Any, deadline: float, silent_until: float) -> None:
        self.sock, self.address, self.head, self.deadline = sock, address, bytearray(), deadline
        self.silent_until = silent_until


class _BoundedServer:
    """Accepts and reads request heads on one thread, answers complete ones on ``WORKERS`` threads."""

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler], *,
                 deadline_seconds: float, silent_seconds: float = SILENT_SECONDS) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.address = self._listener.getsockname()
        self._handler = handler
        self._deadline = deadline_seconds
        self._silent = max(silent_seconds, deadline_seconds)
        self._pending: collections.OrderedDict[socket.socket, _Connection] = collections.OrderedDict()
        self._queue: queue.Queue[tuple[socket.socket, Any, bytes] | None] = queue.Queue(MAX_QUEUED)
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []
        self._accept_failing = False
        self.evicted = 0  # connections closed unanswered: evicted, past their deadline, or over the queue

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def start_workers(self) -> None:
        for i in range(WORKERS):
            t = threading.Thread(target=self._work, name=f"tuner-http-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def serve_forever(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=0.1):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            for sock in list(self._pending):
                self._drop(sock)
            self._selector.close()

    def _accept(self) -> None:
        for _ in range(MAX_PENDING):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE: the process is out of descriptors; what waits is shed first
                if not self._accept_failing:
                    log.warning("status endpoint: accept failed: %s (said once until it succeeds)", exc.strerror or exc)
                self._accept_failing = True
                if self._pending:
                    self._shed(next(iter(self._pending)))
                else:
                    self._stop.wait(0.05)  # the listener stays readable: no busy loop while nothing can be freed
                return
            self._accept_failing = False
            if len(self._pending) >= MAX_PENDING:  # the oldest waiting head is the slowest client
                self._shed(next(iter(self._pending)))
            sock.setblocking(False)
            now = time.monotonic()
            self._pending[sock] = _Connection(sock, address, now + self._deadline, now + self._silent)
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        """Takes everything that has arrived on ``sock``: a complete head goes to the workers; an ended
        connection or a head over ``MAX_HEAD_BYTES`` is closed; a partial head waits for more."""
        conn = self._pending.get(sock)
        if conn is None:
            return
        while True:
            try:
                chunk = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._drop(sock)
                return
            conn.head += chunk
            end = conn.head.find(b"\r\n\r\n")
            if end >= 0:
                self._answer(sock, conn, end)
                return
            if len(conn.head) > MAX_HEAD_BYTES:
                self._drop(sock)
                return

    def _answer(self, sock: socket.socket, conn: _Connection, end: int) -> None:
        self._selector.unregister(sock)
        del self._pending[sock]
        try:
            self._queue.put_nowait((sock, conn.address, bytes(conn.head[:end + 4])))
        except queue.Full:
            self.evicted += 1
            with contextlib.suppress(OSError):
                sock.send(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n")
            sock.close()

    def _expire(self, now: float) -> None:
        """Sheds the connections past their deadline, oldest first (deadlines follow the accept order);
        what has arrived is read first (a head that came whole is answered, see ``_shed``), and one that
        has still sent nothing waits until ``silent_until``."""
        for sock, conn in list(self._pending.items()):
            if conn.deadline > now:
                return
            self._read(sock)
            if sock in self._pending and (conn.head or conn.silent_until <= now):
                self._drop(sock)

    def _shed(self, sock: socket.socket) -> None:
        """Closes a waiting connection (past its deadline, the oldest over the cap, or out of descriptors)
        unless its whole head has already arrived: then the server was late, not the client (a process
        starved of CPU for longer than the deadline, a burst of accepts), and the request is answered."""
        self._read(sock)
        if sock in self._pending:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        self.evicted += 1
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            sock, address, head = item
            try:
                sock.setblocking(True)
                sock.settimeout(WRITE_TIMEOUT_SECONDS)
                self._handler(_Request(sock, head), address, self)  # type: ignore[arg-type]
            except Exception:  # a client gone mid-answer: nothing to report
                log.debug("status endpoint: answering %s failed", address, exc_info=True)
            finally:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def shutdown(self) -> None:
        self._stop.set()
        for _ in self._workers:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=1)

    def server_close(self) -> None:
        self._listener.close()


class _Request:
    """What a handler reads: the head already received, and the socket to answer on."""

    def __init__(self, sock: socket.socket, head: bytes) -> None:
        self.sock, self.head = sock, head


class _Handler(BaseHTTPRequestHandler):
    """Reads the request from the head the acceptor collected; writes to the socket."""

    def setup(self) -> None:
        request: _Request = self.request
        self.connection = request.sock
        self.rfile = io.BytesIO(request.head)
        self.wfile = socketserver._SocketWriter(request.sock)  # type: ignore[attr-defined]

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            self.wfile.flush()
