"""The simulated engine's HTTP surface: vLLM's endpoints, the load generator, the drain hook and the
engine-side live knobs (vllm-tuner-plugin's file protocol)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from prometheus_client import CollectorRegistry, generate_latest

from tuner.sim.config import H200, GpuModel, SimConfig, config_from_args
from tuner.sim.metrics import VLLM_VERSION
from tuner.sim.queueing import SimEngine

log = logging.getLogger("tuner.sim")

SIM_HEADER = "X-Simulated-Engine"
SIM_HEADER_VALUE = "vllm-tuner-sim (a queueing model, not vLLM)"
CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"

# --- the HTTP server --------------------------------------------------------------------------------------


class LiveControl:
    """vllm-tuner-plugin's file protocol (plugin/README.md, protocol 1), as the simulator speaks it: with
    $VLLM_TUNER_CONTROL_DIR set it reads ``control.json`` and answers in ``ack-0.json``. Only the admission
    cap (``max_num_active_seqs``) moves live here; simplified: it answers between ticks, idle or not."""

    def __init__(self, engine: SimEngine, directory: str) -> None:
        self.engine, self.dir = engine, directory
        self._seen: tuple[float, int] | None = None
        # acks belong to a launch (the plugin's protocol.py): this process is the launch, of one rank
        self._launched_at = time.time()
        self._launch = f"sim-{os.getpid()}-{time.time_ns()}"
        self._ack({"seq": None, "applied": None, "refused": None})

    def poll(self) -> None:
        path = os.path.join(self.dir, "control.json")
        try:
            st = os.stat(path)
        except OSError:
            return
        if self._seen == (st.st_mtime, st.st_size):
            return
        self._seen = (st.st_mtime, st.st_size)
        try:
            with open(path, encoding="utf-8") as f:
                request = json.load(f)
            seq = int(request["seq"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        envelope = self.engine.cfg.max_num_seqs
        cap = request.get("max_num_active_seqs")
        budget = request.get("max_num_batched_tokens")
        refused = None
        if cap is not None and not (isinstance(cap, int) and 1 <= cap <= envelope):
            refused = f"max_num_active_seqs {cap} is outside the startup envelope 1..{envelope}"
        elif budget is not None and budget != self.engine.cfg.max_num_batched_tokens:
            refused = "max_num_batched_tokens is not live in the simulator"
        if refused is None:
            with self.engine.lock:
                self.engine.admission_cap = cap
        self._ack({"seq": seq, "applied": None if refused else {"max_num_active_seqs": cap}, "refused": refused})

    def _ack(self, fields: dict[str, Any]) -> None:
        cfg = self.engine.cfg
        doc = {"protocol": 1, "live": True, **fields,
               "effective": {"seq": fields["seq"], "max_num_active_seqs": self.engine.admission_cap or cfg.max_num_seqs,
                             "max_num_batched_tokens": cfg.max_num_batched_tokens},
               "envelope": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                            "max_num_active_seqs": cfg.max_num_seqs},
               "not_live": {"max_num_batched_tokens": "not live in the simulator"}, "at": time.time(),
               "pid": os.getpid(), "dp_rank": 0, "engine_version": VLLM_VERSION, "engine_known": True,
               "mode": "simulated", "plugin_version": "sim", "launch": self._launch,
               "launched_at": self._launched_at, "ranks": 1}
        tmp = os.path.join(self.dir, f".ack-0.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(self.dir, "ack-0.json"))


class _Driver(threading.Thread):
    """Moves the simulated clock with the wall clock (× time_scale), in small ticks."""

    TICK_SECONDS = 0.005
    MAX_TICK_WORK_SECONDS = 0.1  # falling further behind slows the simulated clock instead

    def __init__(self, engine: SimEngine, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="sim-driver", daemon=True)
        self.engine = engine
        self.monotonic = monotonic
        self.halt = threading.Event()
        control = os.environ.get("VLLM_TUNER_CONTROL_DIR")
        self.live = LiveControl(engine, control) if control and os.path.isdir(control) else None

    def run(self) -> None:
        scale = self.engine.cfg.time_scale
        wall0, sim0 = self.monotonic(), self.engine.now
        while not self.halt.is_set():
            started = self.monotonic()
            target = sim0 + (started - wall0) * scale
            while self.engine.now < target and self.monotonic() - started < self.MAX_TICK_WORK_SECONDS:
                self.engine.advance(min(target, self.engine.now + 0.05), max_steps=200)
            if self.engine.now < target:  # could not keep up: let simulated time lag, do not pile up debt
                wall0, sim0 = self.monotonic(), self.engine.now
            if self.live is not None:
                self.live.poll()
            self.halt.wait(self.TICK_SECONDS)


class SimServer:
    """A simulated engine on 127.0.0.1 (by default): HTTP + the driver thread. ``port=0`` picks a port."""

    def __init__(self, cfg: SimConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.engine = SimEngine(cfg, registry=registry)
        self._http = ThreadingHTTPServer((cfg.host, cfg.port), _handler(self))
        self._http.daemon_threads = True
        self._driver = _Driver(self.engine)
        self._thread: threading.Thread | None = None
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self.created = int(self.engine.started_at)
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"  # vLLM's dev-mode routes (sleep)
        self.server_load = 0  # GET /load with --enable-server-load-tracking

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def start(self) -> Self:
        """Start serving (idempotent)."""
        if self._thread is not None:
            return self
        self._driver.start()
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="sim-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, *, timeout_seconds: float | None = None) -> bool:
        """Graceful stop: refuse new work, finish in-flight requests (bounded), close. True if none was aborted."""
        timeout = self.cfg.shutdown_timeout if timeout_seconds is None else timeout_seconds
        self.engine.stop_accepting()
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        aborted = self.engine.abort_all()
        if aborted:
            log.warning("SIMULATED engine: aborted %d request(s) at the %.0fs shutdown deadline", aborted, timeout)
        # let handler threads write their responses (bounded)
        end = time.monotonic() + 5.0
        while self._inflight and time.monotonic() < end:
            time.sleep(0.02)
        self._driver.halt.set()
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=5)
        self._http.server_close()
        self._driver.join(timeout=5)
        return aborted == 0

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown(timeout_seconds=0)

    # -- request handling (called from handler threads) ---------------------------------------------
    def models(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len,
            "permission": [{"id": f"modelperm-sim-{self.port}", "object": "model_permission",
                            "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}],
        }]}

    def complete(self, body: dict[str, Any], *, chat: bool) -> tuple[int, dict[str, Any]]:
        cfg = self.cfg
        if body.get("stream"):
            return 400, _error("streaming is not supported by the SIMULATED engine", "stream", True)
        if chat:
            messages = body.get("messages") or []
            text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompt = max(1, -(-len(text) // 4))
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        else:
            raw = body.get("prompt", "")
            if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
                prompt = len(raw)
            else:
                prompt = max(1, -(-len(raw if isinstance(raw, str) else json.dumps(raw)) // 4))
            key = "max_tokens"
        requested = body.get(key)
        max_tokens = 16 if requested is None and not chat else requested
        if max_tokens is not None:
            try:
                max_tokens = int(max_tokens)
            except (TypeError, ValueError):
                return 400, _error(f"{key} must be an integer", key, requested)
            if max_tokens > cfg.max_model_len:
                return 400, _error(f"{key}={max_tokens} cannot be greater than max_model_len={cfg.max_model_len}. "
                                   "Please request fewer output tokens.", key, max_tokens)
        if prompt > cfg.max_model_len:
            return 400, _error(f"This model's maximum context length is {cfg.max_model_len} tokens. However, your "
                               f"prompt contains {prompt} input tokens, which exceeds this limit even without any "
                               "output tokens. Please reduce the length of the input prompt.", "input_tokens", prompt)
        if prompt == cfg.max_model_len:
            return 400, _error(f"The decoder prompt (length {prompt}) plus the number of requested output tokens "
                               f"(at least 1) is longer than the maximum model length of {cfg.max_model_len}. Make "
                               "sure that `max_model_len` is no smaller than the number of text tokens plus "
                               "multimodal tokens.", "input_tokens", prompt)
        limit = cfg.max_model_len - prompt
        max_tokens = limit if max_tokens is None else min(max_tokens, limit)  # clamped (engine-contract.md §4)
        output = max_tokens if body.get("ignore_eos") else min(max_tokens, self.engine._draw(cfg.output_tokens))
        if not self.engine.accepting:
            return 503, _error("The server is shutting down (SIMULATED engine).", None, None, code=503)
        req = self.engine.submit(prompt_tokens=prompt, max_tokens=max_tokens, output_tokens=output)
        if cfg.enable_server_load_tracking:
            with self._inflight_lock:
                self.server_load += 1
        try:
            if req.done is None or not req.done.wait(timeout=3600):
                return 504, _error("timed out in the SIMULATED engine", None, None, code=504)
        finally:
            if cfg.enable_server_load_tracking:
                with self._inflight_lock:
                    self.server_load -= 1
        if req.finish_reason == "abort":
            return 500, _error("The request was aborted: the SIMULATED engine shut down.", None, None, code=500)
        text = " ".join(["SIMULATED"] * req.generated)
        usage = {"prompt_tokens": prompt, "completion_tokens": req.generated, "total_tokens": prompt + req.generated}
        created = int(time.time())
        if chat:
            return 200, {"id": f"chatcmpl-sim-{req.id}", "object": "chat.completion", "created": created,
                         "model": cfg.model_name, "choices": [{
                             "index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": req.finish_reason}], "usage": usage}
        return 200, {"id": f"cmpl-sim-{req.id}", "object": "text_completion", "created": created,
                     "model": cfg.model_name, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                           "finish_reason": req.finish_reason}], "usage": usage}


def _error(message: str, param: str | None, value: Any, *, code: int = 400) -> dict[str, Any]:
    if param is not None:
        message = f"{message} (parameter={param}, value={value})"
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(code, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# prometheus_fastapi_instrumentator leaves these out of http_requests_total (engine-contract.md §1.1)
_UNINSTRUMENTED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
_ROUTES = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/sim/load", "/sim/drain",
                     "/sim/undrain", "/sim/state"})


def _handler(server: SimServer) -> type[BaseHTTPRequestHandler]:
    engine = server.engine

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"  # what vLLM answers with; X-Simulated-Engine says what this really is
        sys_version = ""
        timeout = 60  # seconds an idle keep-alive connection may hold a handler thread

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def _route(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics/":
                path = "/metrics"
            with server._inflight_lock:
                server._inflight += 1
            status = 500
            try:
                status = self._dispatch(method, path)
            finally:
                with server._inflight_lock:
                    server._inflight -= 1
                if path not in _UNINSTRUMENTED:
                    handler = path if path in _ROUTES else "none"
                    engine.metrics.http.labels(handler=handler, method=method, status=f"{status // 100}xx").inc()

        def _dispatch(self, method: str, path: str) -> int:
            if method == "GET" and path == "/metrics":
                with engine.lock:
                    engine.metrics.flush()
                    exposition = generate_latest(engine.registry)
                return self._send(200, exposition, CONTENT_TYPE_METRICS)
            if path in ("/health", "/ping") and method in ("GET", "POST"):
                return self._send(200, b"", "application/json")
            if method == "GET" and path == "/version":
                return self._json(200, {"version": VLLM_VERSION, "simulated": SIM_HEADER_VALUE})
            if method == "GET" and path == "/load":
                return self._json(200, {"server_load": server.server_load})
            if method == "GET" and path == "/v1/models":
                return self._json(200, server.models())
            if method == "GET" and path == "/sim/state":
                return self._json(200, engine.snapshot())
            if method == "POST" and path in ("/v1/completions", "/v1/chat/completions", "/sim/load"):
                body = self._body()
                if body is None:
                    return self._json(400, _error("the body is not a JSON object", None, None))
                if path == "/sim/load":
                    try:
                        engine.set_load(concurrency=_opt_int(body.get("concurrency")),
                                        arrival_rate=_opt_float(body.get("arrival_rate")))
                    except (TypeError, ValueError) as exc:
                        return self._json(400, _error(f"bad load: {exc}", None, None))
                    return self._json(200, engine.snapshot())
                status, payload = server.complete(body, chat=path.endswith("chat/completions"))
                return self._json(status, payload)
            if path in ("/sleep", "/wake_up", "/is_sleeping") and server.dev_mode:
                return self._sleep_route(method, path)
            if method == "POST" and path in ("/sim/drain", "/sim/undrain"):
                with engine.lock:
                    engine.drained = path == "/sim/drain"
                return self._json(200, engine.snapshot())
            if path in _ROUTES or path in _UNINSTRUMENTED:
                return self._json(405, {"detail": "Method Not Allowed"})
            return self._json(404, {"detail": "Not Found"})

        def _sleep_route(self, method: str, path: str) -> int:
            """vLLM's dev-mode sleep routes (engine-contract.md §3), present only with VLLM_SERVER_DEV_MODE=1."""
            query = urllib.parse.parse_qs(self.path.partition("?")[2])
            if path == "/is_sleeping" and method == "GET":
                return self._json(200, {"is_sleeping": engine.sleep_level is not None})
            if method != "POST":
                return self._json(405, {"detail": "Method Not Allowed"})
            if not engine.cfg.enable_sleep_mode:
                return self._json(500, _error("Sleep mode is not enabled (start with --enable-sleep-mode)",
                                              None, None, code=500))
            if path == "/wake_up":
                engine.wake()
                return self._json(200, {"status": "awake", "tags": None})
            try:
                level = int(query.get("level", ["1"])[0])
            except ValueError:
                level = -1
            if level not in (0, 1, 2):
                return self._json(422, {"detail": "level must be 0, 1 or 2"})
            engine.sleep(level)
            return self._json(200, {"status": "sleeping", "level": level})

        def _body(self) -> dict[str, Any] | None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > 64 * 1024 * 1024:
                return None
            try:
                data = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return None
            return data if isinstance(data, dict) else None

        def _json(self, status: int, payload: Any) -> int:
            return self._send(status, json.dumps(payload).encode("utf-8"), "application/json")

        def _send(self, status: int, data: bytes, content_type: str) -> int:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.send_header(SIM_HEADER, SIM_HEADER_VALUE)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return status

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def start(argv: Sequence[str] = (), *, gpu: GpuModel = H200, **overrides: Any) -> SimServer:
    """For tests: a started in-process SimServer on a free 127.0.0.1 port, without the start-up delay.

    ``argv`` is a vLLM-style command line; ``overrides`` replace resolved fields (``time_scale=5``…).
    """
    cfg = config_from_args(["--port", "0", *argv], gpu=gpu)
    cfg = replace(cfg, **{"startup_seconds": 0.0, **overrides})
    return SimServer(cfg).start()
