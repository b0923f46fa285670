"""A pool of simulated vLLM replicas behind a round-robin balancer, in virtual time.

Each replica is the project's simulated engine (``tuner.sim.queueing.SimEngine``: vLLM's FCFS scheduler
with the admission cap, the token budget, chunked prefill, KV blocks and preemption, its /metrics in vLLM
0.32's families) stepped by ``advance`` instead of a wall clock. The balancer sends each request to the
next replica that is up and not drained (nginx's round robin with ``proxy_next_upstream``). The tuner
reaches the replicas the way it reaches real ones — through its one engine client — over an httpx
transport that answers in-process (``transport``): ``/metrics``, ``/health``, ``/v1/models``,
``/version``, ``/load``, ``POST /v1/completions`` (warm-ups) and vLLM's live knobs
``GET /trimtab/knobs`` / ``POST /trimtab/set_knobs`` (pull request 55018: the admission cap and the step budget,
each inside the start-up envelope, as the H200 arms' plugin takes them). Restarts go through
``Actuator``/``Drainer`` (the tuner's actuator contract): a stopped replica aborts what it still holds
and a started one serves ``startup_seconds`` later.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from bench.family.traces import Trace, sizes
from tuner.actuators import base
from tuner.sim.config import GpuModel, StartupError, config_from_args
from tuner.sim.queueing import Request, SimEngine

TICK = 0.05  # closed-loop clients send their next request within this of the previous one's end
BASE_PORT = 18000


@dataclass
class Replica:
    name: str
    port: int
    argv: tuple[str, ...]
    engine: SimEngine | None = None
    up_at: float = math.inf  # when it answers /health (its start-up done)
    drained: bool = False
    starts: int = 0

    def serving(self, now: float) -> bool:
        return self.engine is not None and now >= self.up_at


@dataclass
class Sent:
    """One request of the trace and what became of it."""

    at: float
    prompt: int
    output: int
    replica: str | None = None
    req: Request | None = None
    user: int | None = None  # closed loop: the client that sent it

    def outcome(self, frontend: float = 0.0) -> tuple[bool, float | None, float | None]:
        """(completed with every token, TTFT, mean inter-token gap); ``frontend``: seconds the balancer and
        the API server add before the first token reaches the client."""
        r = self.req
        if r is None or r.finish_reason not in ("stop", "length") or r.generated < self.output:
            return False, None, None
        ttft = None if r.first_token is None else r.first_token - self.at + frontend
        itl = None if r.generated <= 1 or r.finished_at is None or r.first_token is None else \
            (r.finished_at - r.first_token) / (r.generated - 1)
        return True, ttft, itl

    def meets(self, *, ttft_slo: float, itl_slo: float, frontend: float = 0.0) -> bool:
        """Completed with every token, inside both SLOs (the goodput's one test, ``Pool.results`` and the searches)."""
        ok, ttft, itl = self.outcome(frontend)
        return ok and ttft is not None and ttft <= ttft_slo and (itl is None or itl <= itl_slo)


class Pool:
    """The replicas, the balancer and the trace's clients, all in one virtual clock (``now``)."""

    def __init__(self, trace: Trace, argv: Sequence[str], *, gpu: GpuModel, replicas: int = 2,
                 startup_seconds: float = 90.0, cap: int | None = None, seed: int = 0) -> None:
        self.trace, self.gpu, self.startup_seconds = trace, gpu, startup_seconds
        self._closed = trace.closed()  # before the engines boot: their on_finish serves the closed loops
        self.now = -20.0  # the engines start before the trace: 20 s of idle scrapes first
        self.replicas = {name: Replica(name, BASE_PORT + i, tuple(argv))
                         for i, name in enumerate("abcdefgh"[:replicas])}
        for r in self.replicas.values():
            self._boot(r, ready=True)
            if cap is not None:
                assert r.engine is not None
                r.engine.admission_cap = cap
        self.sent: list[Sent] = []
        self._next = 0  # the next open-loop request of the trace
        self._rr = 0
        self._users: dict[int, Sent] = {}  # closed loop: each client's request in flight
        self._clients_of: dict[int, int] = {}  # id() of a client's request in flight → the client
        self._done: list[int] = []  # the clients whose request finished since the last tick (SimEngine.on_finish)
        self._begun: set[int] = set()  # the closed phases whose clients have sent their first requests
        self._rng = random.Random(trace.seed + 1)
        self.events: list[tuple[float, str, str]] = []  # (at, replica, what): restarts, drains, caps

    # --- engines --------------------------------------------------------------------------------------

    def _boot(self, r: Replica, *, ready: bool = False) -> None:
        cfg = config_from_args([*r.argv, "--port", str(r.port)], gpu=self.gpu)
        r.engine = SimEngine(cfg, started_at=self.now)
        if self._closed:  # the clients' next requests follow the finished ones (_clients)
            r.engine.on_finish = self._finished
        r.engine.now = self.now
        r.up_at = self.now if ready else self.now + self.startup_seconds
        r.starts += 1

    def engine(self, port: int) -> Replica | None:
        return next((r for r in self.replicas.values() if r.port == port), None)

    # --- time -----------------------------------------------------------------------------------------

    def advance_to(self, t: float) -> None:
        """Every arrival and engine step up to ``t``."""
        while self.now < t:
            step_end = min(t, self.now + TICK)
            reqs = self.trace.requests
            while self._next < len(reqs) and reqs[self._next].at <= step_end:
                q = reqs[self._next]
                self._next += 1
                self._send(Sent(q.at, q.prompt, q.output), catch_up=True)
            self._engines_to(step_end)
            self.now = step_end
            if self._closed:
                self._clients()

    def _engines_to(self, t: float) -> None:
        for r in self.replicas.values():
            if r.engine is not None:
                r.engine.advance(t)

    def _clients(self) -> None:
        """Each closed-loop client whose request finished sends its next one, and a phase that begins sends one
        per client; in the phase's order of clients (the sizes are drawn in that order)."""
        now = self.now
        done, self._done = self._done, []
        for key in done:
            del self._users[key]
        for start, end, phase in self._closed:
            if start <= now < end:
                base = int(start * 1000) * 100_000
                if base not in self._begun:  # the phase begins: every client sends
                    self._begun.add(base)
                    users: Sequence[int] = range(phase.users)
                else:  # only the clients whose request finished (the rest still wait on theirs)
                    users = sorted(key - base for key in done if base <= key < base + phase.users)
                for user in users:
                    key = base + user
                    if key not in self._users:
                        prompt, output = sizes(self._rng, phase.mix)
                        s = Sent(now, prompt, output, user=key)
                        self._users[key] = s
                        self._send(s)

    def _finished(self, req: Request) -> None:
        user = self._clients_of.pop(id(req), None)
        if user is not None:
            self._done.append(user)

    def _send(self, s: Sent, *, catch_up: bool = False) -> None:
        """Round robin over the replicas that serve (nginx: ``proxy_next_upstream``); none: failed. ``catch_up``: the
        replica it goes to runs its steps up to the request's arrival first (an arrival inside a tick; the other
        replicas' steps do not depend on it, and each catches up at the tick's end, before anything reads them)."""
        self.sent.append(s)
        names = list(self.replicas)
        for i in range(len(names)):
            r = self.replicas[names[(self._rr + i) % len(names)]]
            if r.serving(s.at) and not r.drained and r.engine is not None and r.engine.accepting:
                self._rr = (self._rr + i + 1) % len(names)
                s.replica = r.name
                if catch_up:
                    r.engine.advance(s.at)
                s.req = r.engine.submit(prompt_tokens=s.prompt, max_tokens=s.output, output_tokens=s.output, wait=False)
                s.req.arrival = s.at
                if s.user is not None:
                    self._clients_of[id(s.req)] = s.user
                return

    # --- the actuator and the drainer (the tuner's contract, tuner.actuators.base) -------------------

    def actuator(self) -> Actuator:
        return Actuator(self)

    def drainer(self) -> Drainer:
        return Drainer(self)

    # --- results --------------------------------------------------------------------------------------

    def results(self, *, ttft_slo: float, itl_slo: float, timeout: float, frontend: float = 0.0
                ) -> dict[str, float]:
        met = failed = completed = 0
        ttfts: list[float] = []
        itls: list[float] = []  # each request's mean inter-token gap (bench/evaluation's itl_mean)
        for s in self.sent:
            ok, ttft, itl = s.outcome(frontend)
            if ok and ttft is not None and ttft <= timeout:
                completed += 1
                ttfts.append(ttft)
                if itl is not None:
                    itls.append(itl)
                if s.meets(ttft_slo=ttft_slo, itl_slo=itl_slo, frontend=frontend):
                    met += 1
            else:
                failed += 1
        duration = self.trace.duration or 1.0
        ttfts.sort()
        itls.sort()

        def q(xs: list[float], f: float) -> float:
            return xs[min(len(xs) - 1, int(f * (len(xs) - 1) + 0.5))] if xs else math.nan

        return {"requests": len(self.sent), "met": met, "failed": failed, "completed": completed,
                "goodput": met / duration, "ttft_p50": q(ttfts, 0.5), "ttft_p99": q(ttfts, 0.99),
                "itl_p50": q(itls, 0.5)}

    def busy(self) -> bool:
        return any(r.engine is not None and r.engine.has_work() for r in self.replicas.values())


class Actuator:
    """``tuner.actuators.base.Actuator`` over the virtual replicas."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def replicas(self) -> Sequence[base.Replica]:
        return [base.Replica(r.name, f"http://127.0.0.1:{r.port}") for r in self.pool.replicas.values()]

    def status(self, name: str) -> base.ReplicaStatus:
        r = self.pool.replicas[name]
        if r.engine is None:
            return base.ReplicaStatus(name, base.State.STOPPED, argv=r.argv)
        return base.ReplicaStatus(name, base.State.RUNNING, pid=1000 + r.starts, argv=r.argv)

    def start(self, name: str, argv: Sequence[str]) -> None:
        r = self.pool.replicas[name]
        if r.engine is not None:
            return
        r.argv = tuple(argv)
        try:
            self.pool._boot(r)
        except (StartupError, SystemExit) as exc:
            r.engine = None
            raise RuntimeError(f"engine refused its arguments: {exc}") from exc
        self.pool.events.append((self.pool.now, name, "start " + " ".join(argv)))

    def adopt(self, name: str, argv: Sequence[str]) -> base.ReplicaStatus:
        return self.status(name)

    def stop(self, name: str, *, timeout_seconds: float, force_after_seconds: float | None = None
             ) -> base.ReplicaStatus:
        r = self.pool.replicas[name]
        if r.engine is not None:
            r.engine.stop_accepting()
            r.engine.abort_all()
            r.engine = None
            r.up_at = math.inf
            self.pool.events.append((self.pool.now, name, "stop"))
        return self.status(name)


class Drainer:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def drain(self, name: str) -> None:
        self.pool.replicas[name].drained = True
        self.pool.events.append((self.pool.now, name, "drain"))

    def undrain(self, name: str) -> None:
        self.pool.replicas[name].drained = False
        self.pool.events.append((self.pool.now, name, "undrain"))


# --- the HTTP side: what the tuner's engine client reaches ---------------------------------------------


@dataclass
class Transport:
    """An httpx transport answering as the virtual replicas' API servers would."""

    pool: Pool
    on_cap: Callable[[str, int], None] | None = None
    calls: dict[str, int] = field(default_factory=dict)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        r = self.pool.engine(request.url.port or 80)
        path = request.url.path
        self.calls[path] = self.calls.get(path, 0) + 1
        now = self.pool.now
        if r is None or r.engine is None or not r.serving(now):
            raise httpx.ConnectError("connection refused", request=request)
        e = r.engine
        if path == "/metrics":
            return httpx.Response(200, content=e.metrics.exposition(),
                                  headers={"content-type": "text/plain; version=0.0.4"})
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return _json({"object": "list", "data": [{"id": e.cfg.model_name, "object": "model",
                                                      "max_model_len": e.cfg.max_model_len}]})
        if path == "/version":
            return _json({"version": "0.32.0"})
        if path == "/load":
            return _json({"server_load": len(e.running) + len(e.waiting)})
        if path == "/trimtab/set_knobs" and request.method == "POST":
            body = json.loads(request.content or b"{}")
            cfg = e.cfg
            if "max_num_seqs" in body:
                e.admission_cap = max(1, min(int(body["max_num_seqs"]), cfg.max_num_seqs))
                self.pool.events.append((now, r.name, f"cap {e.admission_cap}"))
                if self.on_cap is not None:
                    self.on_cap(r.name, e.admission_cap)
            if "max_num_batched_tokens" in body:
                e.step_budget = max(1, min(int(body["max_num_batched_tokens"]), cfg.max_num_batched_tokens))
                self.pool.events.append((now, r.name, f"budget {e.step_budget}"))
            return _json({"ok": True, "applied": body, "rejected": {}})
        if path == "/trimtab/knobs":
            cfg, seqs = e.cfg, e.admission_cap or e.cfg.max_num_seqs
            # the ceilings (the boot values) show once a knob was set; a cap the pool set at start (the bad start,
            # as the H200 arms' plugin sets it) counts
            moved = e.admission_cap is not None or e.step_budget is not None
            ceilings = {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens}
            return _json({"max_num_seqs": seqs, "max_num_seqs_effective": seqs, "max_num_batched_tokens": e.budget,
                          "running": len(e.running), "ceilings": ceilings if moved else {}})
        if path in ("/v1/completions", "/v1/chat/completions"):
            body = json.loads(request.content or b"{}")
            tokens = int(body.get("max_tokens") or 1)
            req = e.submit(prompt_tokens=8, max_tokens=tokens, output_tokens=tokens, wait=False)
            req.arrival = now
            return _json({"id": "warm", "object": "text_completion", "choices": [{"text": "x", "index": 0}],
                          "usage": {"prompt_tokens": 8, "completion_tokens": tokens}})
        return httpx.Response(404)


def _json(doc: object) -> httpx.Response:
    return httpx.Response(200, json=doc)


def bad_argv(trace: Trace, *, cap: int | None) -> list[str]:
    """The H200 profiles' engine flags (bench/evaluation/profiles/h200-rise.yaml): ``cap`` None leaves
    ``--max-num-seqs`` at vLLM's default (1024 on an H200), the wide envelope."""
    argv = ["--model", "llama-8b-shape", "--max-model-len", "4096", "--gpu-memory-utilization", "0.4",
            "--shutdown-timeout", "30", "--enable-server-load-tracking"]
    return argv if cap is None else [*argv, "--max-num-seqs", str(cap)]
