"""A tiny stand-in for a vLLM engine process: stdlib only, so it runs under any python3.

It accepts vLLM-like arguments (unknown ones are kept, not rejected), records its argv and serves:

- ``GET /health``                 200 with an empty body once "started"
- ``GET /v1/models``              one model, with ``max_model_len``
- ``GET /metrics``                ``vllm:num_requests_running`` / ``_waiting`` and a ``vllm:cache_config_info``
- ``POST /v1/completions``        sleeps ``--stub-latency`` seconds per request (a running request), then answers
                                  (as server-sent events when the request says ``"stream": true``)
- ``GET /stub/argv``              ``{"argv": [...], "pid": N}``: the arguments exactly as the process received them

Behaviours the rollout tests need, chosen by flags:

- ``--max-num-seqs 0``            fails at start (after ``--stub-start-seconds``), like vLLM's validation error
- ``--stub-start-seconds S``      sleep before listening (vLLM takes ≈45 s idle, ≈170 s under load)
- ``--stub-crash-after-requests N``  exits with status 3 while serving request number N (dies at its first requests)
- ``--shutdown-timeout N``        on SIGTERM, stop admitting and finish in-flight requests for up to N s, then exit
  (vLLM 0.32 semantics; with 0 the in-flight requests are aborted)
- ``--stub-ignore-sigterm``       never exit on SIGTERM (vLLM with clients connected): a SIGINT or SIGKILL ends it
- ``--stub-kind sglang``          speak SGLang instead: ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``,
  ``GET /get_model_info`` and ``/get_server_info``, ``POST /generate`` (and ``/v1/completions``)
- ``--api-key KEY``               like vLLM's: every ``/v1/*`` route answers 401 without ``Authorization: Bearer KEY``

Everything listens on ``--host`` (default 127.0.0.1) and ``--port``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _opt(argv: list[str], name: str, default: str | None = None) -> str | None:
    value = default
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


class Engine:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.host = _opt(argv, "--host", "127.0.0.1") or "127.0.0.1"
        self.port = int(_opt(argv, "--port", "8000") or 8000)
        self.model = _opt(argv, "--model") or _opt(argv, "--served-model-name") or "stub-model"
        self.max_num_seqs = int(_opt(argv, "--max-num-seqs", "256") or 256)
        self.max_model_len = int(_opt(argv, "--max-model-len", "2048") or 2048)
        self.block_size = int(_opt(argv, "--block-size", "16") or 16)
        self.latency = float(_opt(argv, "--stub-latency", "0.05") or 0.05)
        self.start_seconds = float(_opt(argv, "--stub-start-seconds", "0") or 0)
        self.crash_after = int(_opt(argv, "--stub-crash-after-requests", "0") or 0)
        self.shutdown_timeout = float(_opt(argv, "--shutdown-timeout", "0") or 0)
        self.ignore_sigterm = "--stub-ignore-sigterm" in argv
        self.kind = _opt(argv, "--stub-kind", "vllm") or "vllm"
        self.api_key = _opt(argv, "--api-key")
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.served = 0
        self.total = 0
        self.shutting_down = False
        self.idle = threading.Condition(self.lock)

    def metrics(self) -> str:
        with self.lock:
            running, waiting, served = self.running, self.waiting, self.served
        if self.kind == "sglang":
            labels = f'model_name="{self.model}"'
            return (
                "# TYPE sglang:num_running_reqs gauge\n"
                f"sglang:num_running_reqs{{{labels}}} {running:.1f}\n"
                "# TYPE sglang:num_queue_reqs gauge\n"
                f"sglang:num_queue_reqs{{{labels}}} {waiting:.1f}\n"
                "# TYPE sglang:num_requests_total counter\n"
                f"sglang:num_requests_total{{{labels}}} {served:.1f}\n"
            )
        labels = f'block_size="{self.block_size}",enable_prefix_caching="True",gpu_memory_utilization="0.9"'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} {running:.1f}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} {waiting:.1f}\n'
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{self.model}"}} '
            f"{served:.1f}\n"
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{engine="0",{labels}}} 1.0\n'
        )

    def complete(self) -> tuple[int, dict[str, Any]]:
        with self.lock:
            if self.shutting_down:
                return 503, {"error": {"message": "Server shutting down"}}
            self.total += 1
            number = self.total
            self.running += 1
        try:
            if self.crash_after and number >= self.crash_after:
                sys.stderr.write(f"stub: crashing at request {number}\n")
                sys.stderr.flush()
                os._exit(3)
            time.sleep(self.latency)
            return 200, {
                "id": f"cmpl-{number}",
                "object": "text_completion",
                "model": self.model,
                "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        finally:
            with self.lock:
                self.running -= 1
                self.served += 1
                self.idle.notify_all()


def _stream(body: dict[str, Any], tokens: int) -> bytes:
    """The answer as server-sent events, one " ok" chunk per token, a usage chunk, [DONE] (what vLLM's
    benchmark client reads); sent at once, after the request's latency."""
    chunk = {k: body[k] for k in ("id", "object", "model")}
    events = [dict(chunk, choices=[{"index": 0, "text": " ok", "finish_reason": None}]) for _ in range(tokens)]
    events.append(dict(chunk, choices=[], usage={"prompt_tokens": 1, "completion_tokens": tokens,
                                                  "total_tokens": tokens + 1}))
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def _handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the logs hold lifecycle lines
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _guarded(self, path: str) -> bool:
            """vLLM's AuthenticationMiddleware: /v1/* needs the bearer token when --api-key is set."""
            if engine.api_key and path.startswith("/v1") and \
                    self.headers.get("Authorization") != f"Bearer {engine.api_key}":
                self._send(401, b'{"error":"Unauthorized"}')
                return True
            return False

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if self._guarded(path):
                return
            if path == "/health":
                self._send(200, b"")
            elif path == "/v1/models":
                data = {"id": engine.model, "object": "model", "owned_by": "vllm", "root": engine.model,
                        "max_model_len": engine.max_model_len}
                self._send(200, json.dumps({"object": "list", "data": [data]}).encode())
            elif path == "/metrics":
                self._send(200, engine.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/get_model_info" and engine.kind == "sglang":
                self._send(200, json.dumps({"model_path": engine.model, "is_generation": True}).encode())
            elif path == "/get_server_info" and engine.kind == "sglang":
                self._send(200, json.dumps({"context_length": engine.max_model_len, "version": "0.5.0"}).encode())
            elif path == "/stub/argv":
                self._send(200, json.dumps({"argv": engine.argv, "pid": os.getpid()}).encode())
            else:
                self._send(404, b'{"detail":"Not Found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            path = self.path.split("?", 1)[0]
            if self._guarded(path):
                return
            if path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
                self._send(404, b'{"detail":"Not Found"}')
                return
            try:
                request = json.loads(raw or b"{}")
            except ValueError:
                request = {}
            status, body = engine.complete()
            if status == 200 and isinstance(request, dict) and request.get("stream"):
                self._send(200, _stream(body, int(request.get("max_tokens") or 1)), "text/event-stream")
            else:
                self._send(status, json.dumps(body).encode())

    return Handler


def main(argv: list[str]) -> int:
    engine = Engine(argv)
    print(f"stub: starting pid={os.getpid()} argv={json.dumps(argv)}", flush=True)
    if engine.start_seconds:
        time.sleep(engine.start_seconds)
    if engine.max_num_seqs <= 0:
        print("stub: ValueError: max_num_seqs must be positive", file=sys.stderr, flush=True)
        return 1
    server = ThreadingHTTPServer((engine.host, engine.port), _handler(engine))
    server.daemon_threads = True

    def on_term(signum: int, frame: Any) -> None:
        print("stub: SIGTERM received", flush=True)
        if engine.ignore_sigterm:
            return
        threading.Thread(target=shut_down, daemon=True).start()

    def shut_down() -> None:
        with engine.lock:
            engine.shutting_down = True
            deadline = time.monotonic() + engine.shutdown_timeout
            while engine.running and time.monotonic() < deadline:
                engine.idle.wait(deadline - time.monotonic())
        server.shutdown()

    def on_int(signum: int, frame: Any) -> None:
        # uvicorn's answer to a SIGINT while a graceful stop waits: exit now. Explicit (not Python's
        # KeyboardInterrupt unwinding through the server loop and interpreter shutdown) — CI once saw a
        # stub outlive its SIGINT by a minute.
        print("stub: SIGINT received: exiting now", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)
    print(f"stub: serving on http://{engine.host}:{engine.port}", flush=True)
    server.serve_forever(poll_interval=0.1)
    server.server_close()
    print("stub: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
