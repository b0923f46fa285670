"""Small HTTP servers that speak the engines' live-knob APIs as each pull request publishes them, for the contract
tests of the engine client's live paths (``tuner.sources.live_paths``). Real servers on 127.0.0.1 (stdlib
``ThreadingHTTPServer`` in a thread), not mocks of the client: the client reaches them over TCP as it reaches an
engine. Each one's behaviour is copied from the pull request's own code, cited per class; docs/engine-contract.md
§8 has the same shapes.

- ``Trimtab``: vLLM pull request 55018 (vllm-project/vllm ``vllm/entrypoints/serve/dev/trimtab/api_router.py``,
  ``EngineCore.trimtab_set_knobs`` / ``trimtab_get_knobs`` in ``vllm/v1/engine/core.py``; numinous-technology/trimtab
  ``docs/upstream/0001-Core-Hot-scheduler-knobs-through-an-EngineCore-utili.patch``).
- ``RuntimeConfig``: vLLM pull request 54816 (vllm-project/vllm ``vllm/entrypoints/serve/dev/runtime_config/
  api_router.py``, ``tests/entrypoints/serve/dev/test_runtime_config.py``).
- ``SGLang``: stock SGLang's ``/get_server_info`` and ``/set_internal_state`` (sgl-project/sglang
  ``python/sglang/srt/entrypoints/http_server.py``, ``managers/tokenizer_communicator_mixin.py``,
  ``managers/scheduler.py``), with pull request 37661's keys when ``pr`` (numinous-technology/trimtab
  ``docs/upstream/0001-Feature-Extend-set_internal_state-to-hot-scheduler-k.patch``).

Every server also answers ``GET /health`` (200) and ``GET /v1/models`` / ``/get_model_info`` (a model), 404
elsewhere, and logs each request in ``requests`` as ``(method, path, body)``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, Any]


class Engine:
    """One engine's API: ``answer(method, path, body) -> (status, JSON document)``."""

    kind = "vllm"

    def answer(self, method: str, path: str, body: Any) -> Answer:
        if method == "GET" and path == "/health":
            return 200, None
        if method == "GET" and path == "/v1/models" and self.kind == "vllm":
            return 200, {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]}
        if method == "GET" and path == "/get_model_info" and self.kind == "sglang":
            return 200, {"model_path": "m"}
        return 404, {"detail": "Not Found"}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float))  # as the pull requests test it: a bool passes, as in Python


@dataclass
class Trimtab(Engine):
    """vLLM with pull request 55018's dev router. ``dev_mode`` False: the router is not registered (404), or
    ``hidden`` answers in its place (a proxy's 403). ``knobs``: the keys this build's ``trimtab_set_knobs`` knows
    (an older build without ``long_prefill_token_threshold`` answers it "unknown knob"). ``lie``: values the
    read-back reports instead of the real ones (an engine that does not do what it says)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    running: int = 0
    dev_mode: bool = True
    hidden: int = 404
    knobs: tuple[str, ...] = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "log_level")
    lie: dict[str, int] = field(default_factory=dict)
    pending: int | None = None
    ceilings: dict[str, int] | None = None

    def answer(self, method: str, path: str, body: Any) -> Answer:
        if path.startswith("/trimtab/") and not self.dev_mode:
            return self.hidden, {"detail": "Not Found"}
        if method == "GET" and path == "/trimtab/knobs":
            return 200, {**self.get_knobs(), **self.lie}
        if method == "POST" and path == "/trimtab/set_knobs":
            result = self.set_knobs(body if isinstance(body, dict) else {})
            return (200 if result["ok"] else 400), result
        return super().answer(method, path, body)

    def set_knobs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        if self.ceilings is None:
            self.ceilings = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens}
        applied: dict[str, Any] = {}
        rejected: dict[str, str] = {}
        for key, value in knobs.items():
            if key == "long_prefill_token_threshold" and key in self.knobs:
                if not _number(value) or int(value) < 0:
                    rejected[key] = "must be >= 0 (0 disables the threshold)"
                else:
                    self.long_prefill_token_threshold = applied[key] = int(value)
                continue
            if key not in self.ceilings:
                rejected[key] = "unknown knob"
                continue
            ceiling = self.ceilings[key]
            if not _number(value) or not 1 <= int(value) <= ceiling:
                rejected[key] = f"valid range is 1..{ceiling} (the boot allocation)"
                continue
            if key == "max_num_seqs":
                self.pending = int(value)
                self.max_num_seqs = max(int(value), self.running)
            else:
                self.max_num_batched_tokens = int(value)
            applied[key] = int(value)
        return {"ok": not rejected, "applied": applied, "rejected": rejected}

    def get_knobs(self) -> dict[str, Any]:
        doc = {"max_num_seqs": self.pending if self.pending is not None else self.max_num_seqs,
               "max_num_seqs_effective": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
               "log_level": None, "running": self.running, "ceilings": dict(self.ceilings or {}),
               "last_reinit": None, "num_gpu_blocks": 1024}
        if "long_prefill_token_threshold" in self.knobs:
            doc["long_prefill_token_threshold"] = self.long_prefill_token_threshold
        return doc


@dataclass
class RuntimeConfig(Engine):
    """vLLM with pull request 54816's dev router: ``max_num_running_seqs`` inside ``max_num_seqs_capacity``.
    ``supported`` False: a scheduler without the live cap (GET answers ``{}``, PATCH 501)."""

    capacity: int = 256
    running_cap: int = 256
    dev_mode: bool = True
    supported: bool = True

    def answer(self, method: str, path: str, body: Any) -> Answer:
        if path == "/v1/runtime_config" and not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if path == "/v1/runtime_config" and method == "GET":
            return 200, self.config()
        if path == "/v1/runtime_config" and method == "PATCH":
            return self.patch(body)
        return super().answer(method, path, body)

    def config(self) -> dict[str, int]:
        return {"max_num_running_seqs": self.running_cap, "max_num_seqs_capacity": self.capacity} if self.supported \
            else {}

    def patch(self, body: Any) -> Answer:
        # RuntimeConfigUpdate: extra="forbid", max_num_running_seqs: int = Field(ge=1, strict=True) -> 422
        if not isinstance(body, dict):
            return 422, {"detail": [{"type": "model_attributes_type", "loc": ["body"], "msg": "Input should be a "
                                     "valid dictionary", "input": body}]}
        extra = sorted(set(body) - {"max_num_running_seqs"})
        if extra:
            return 422, {"detail": [{"type": "extra_forbidden", "loc": ["body", extra[0]],
                                     "msg": "Extra inputs are not permitted", "input": body[extra[0]]}]}
        value = body.get("max_num_running_seqs")
        if type(value) is not int:
            return 422, {"detail": [{"type": "int_type", "loc": ["body", "max_num_running_seqs"],
                                     "msg": "Input should be a valid integer", "input": value}]}
        if value < 1:
            return 422, {"detail": [{"type": "greater_than_equal", "loc": ["body", "max_num_running_seqs"],
                                     "msg": "Input should be greater than or equal to 1", "input": value}]}
        if not self.supported:
            return 501, {"detail": "The configured scheduler does not support runtime configuration"}
        if value > self.capacity:
            return 400, {"detail": "max_num_running_seqs cannot exceed the startup capacity "
                                   f"max_num_seqs ({self.capacity})"}
        self.running_cap = value
        return 200, self.config()


STOCK_KEYS = ("pp_max_micro_batch_size", "speculative_accept_threshold_single", "speculative_accept_threshold_acc",
              "dspark_force_budget_frac", "dspark_clear_info_records")
PR_KEYS = ("max_running_requests", "max_queued_requests", "chunked_prefill_size", "max_prefill_tokens",
           "schedule_policy", "schedule_conservativeness", "log_level")


@dataclass
class _Rank:
    max_running_requests: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    schedule_policy: str = "fcfs"
    ceiling: int | None = None  # _trimtab_ceilings["max_running_requests"], set at the first set


@dataclass
class SGLang(Engine):
    """SGLang: ``/get_server_info`` with one ``internal_states`` entry per data-parallel rank, ``/set_internal_state``
    answering one ``updated`` boolean per rank. ``pr``: pull request 37661's keys (``pr_keys``: those this build
    knows; the rest fall through to the stock allowlist, as in the pull request) and its ``trimtab`` block.
    ``refuse_rank``: a rank that answers false whatever it is sent (its scheduler refused)."""

    kind = "sglang"
    pr: bool = True
    ranks: int = 1
    max_running_requests: int = 128
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    max_total_num_tokens: int = 500_000
    pr_keys: tuple[str, ...] = PR_KEYS
    refuse_rank: int | None = None
    state: list[_Rank] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = [_Rank(self.max_running_requests, self.chunked_prefill_size, self.max_prefill_tokens)
                      for _ in range(self.ranks)]

    def answer(self, method: str, path: str, body: Any) -> Answer:
        if method == "GET" and path == "/get_server_info":
            return 200, self.server_info()
        if method in ("POST", "PUT") and path == "/set_internal_state":
            args = body.get("server_args") if isinstance(body, dict) else None
            allowed = (int, float, str) if self.pr else (int, float)  # SetInternalStateReq.server_args' value type
            if not isinstance(args, dict) or not all(isinstance(v, allowed) for v in args.values()):
                return 422, {"detail": [{"type": "dict_type", "loc": ["body", "server_args"],
                                         "msg": "Input should be a valid dictionary", "input": args}]}
            self.received.append(dict(args))
            return 200, [self.set_rank(i, dict(args)) for i in range(self.ranks)]
        return super().answer(method, path, body)

    def server_info(self) -> dict[str, Any]:
        states = []
        for rank in self.state:
            entry: dict[str, Any] = {"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp":
                                     rank.max_running_requests, "memory_usage": {"token_capacity":
                                                                                 self.max_total_num_tokens}}
            if self.pr:
                ceilings = {"max_prefill_tokens": self.max_total_num_tokens}
                if rank.ceiling is not None:
                    ceilings["max_running_requests"] = rank.ceiling
                entry["trimtab"] = {"max_running_requests": rank.max_running_requests, "max_queued_requests": None,
                                    "chunked_prefill_size": rank.chunked_prefill_size,
                                    "max_prefill_tokens": rank.max_prefill_tokens,
                                    "schedule_policy": rank.schedule_policy, "schedule_conservativeness": None,
                                    "log_level": None, "ceilings": ceilings}
            states.append(entry)
        # the top level is the tokenizer manager's ServerArgs: the startup values, which set_internal_state leaves
        return {"model_path": "m", "max_running_requests": None, "chunked_prefill_size": self.chunked_prefill_size,
                "max_prefill_tokens": self.max_prefill_tokens, "schedule_policy": "fcfs", "dp_size": self.ranks,
                "max_total_num_tokens": self.max_total_num_tokens, "internal_states": states, "version": "0.5.9"}

    def set_rank(self, i: int, args: dict[str, Any]) -> bool:
        rank = self.state[i]
        ok = True
        if self.pr:  # _trimtab_apply_hot_knobs: consumes the keys it knows, each validated on its own
            if rank.ceiling is None:
                rank.ceiling = rank.max_running_requests
            if "max_running_requests" in args and "max_running_requests" in self.pr_keys:
                v = args.pop("max_running_requests")
                if not _number(v) or not 1 <= int(v) <= rank.ceiling:
                    ok = False
                else:
                    rank.max_running_requests = int(v)
            if "chunked_prefill_size" in args and "chunked_prefill_size" in self.pr_keys:
                v = args.pop("chunked_prefill_size")
                if not _number(v) or int(v) <= 0:
                    ok = False
                else:
                    rank.chunked_prefill_size = int(v)
            if "max_prefill_tokens" in args and "max_prefill_tokens" in self.pr_keys:
                v = args.pop("max_prefill_tokens")
                if not _number(v) or not 1 <= int(v) <= self.max_total_num_tokens:
                    ok = False
                else:
                    rank.max_prefill_tokens = int(v)
            if "schedule_policy" in args and "schedule_policy" in self.pr_keys:
                v = args.pop("schedule_policy")
                if v not in ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority"):
                    ok = False
                else:
                    rank.schedule_policy = str(v)
            if not args:
                return ok and i != self.refuse_rank
        # the stock allowlist: one key it does not know and the whole update is refused
        if any(k not in STOCK_KEYS for k in args):
            return False
        return ok and i != self.refuse_rank


class Server:
    """``engine`` served on 127.0.0.1 (``port`` 0: any free one) in a daemon thread until ``stop``."""

    def __init__(self, engine: Engine, port: int = 0) -> None:
        self.engine = engine
        self.requests: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    self._send(422, {"detail": "There was an error parsing the body"})
                    return
                path = self.path.split("?", 1)[0]
                with outer._lock:
                    outer.requests.append((self.command, path, body))
                    status, doc = outer.engine.answer(self.command, path, body)
                self._send(status, doc)

            def _send(self, status: int, doc: Any) -> None:
                data = b"" if doc is None else json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_PUT = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name=f"live-engine-{self.port}",
                                        daemon=True)
        self._thread.start()

    def count(self, method: str, path: str) -> int:
        with self._lock:
            return sum(1 for m, p, _ in self.requests if (m, p) == (method, path))

    def bodies(self, method: str, path: str) -> list[Any]:
        with self._lock:
            return [b for m, p, b in self.requests if (m, p) == (method, path)]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
