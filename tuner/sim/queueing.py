"""The queueing model: FCFS admission under ``--max-num-seqs``, the token budget and free KV blocks; one engine
step's cost from the running sequences and the prefill tokens; preemption when a decode step finds no block."""

from __future__ import annotations

import collections
import heapq
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from tuner.sim.config import SimConfig
from tuner.sim.metrics import VllmMetrics

log = logging.getLogger("tuner.sim")

# --- the queueing model --------------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    id: int
    prompt_tokens: int
    output_tokens: int  # generated before the simulated EOS (≤ max_tokens)
    max_tokens: int
    arrival: float  # simulated seconds
    from_user: int | None = None  # the closed-loop user that sent it
    state: str = "waiting"  # waiting | running | finished
    decoding: bool = False  # False: (re)computing its prefill
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0
    blocks: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    preemptions: int = 0
    finish_reason: str | None = None
    finished_at: float | None = None
    done: threading.Event | None = None  # set when it finishes (or is aborted); submit(wait=True) creates it
    lazy_from: tuple[int, int, int] = (0, 0, 0)  # _Decoding: (steps, generated, computed) when last synced

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before the next token is sampled: after a preemption (recompute), the output
        so far as well."""
        return self.prompt_tokens + self.generated


class _Decoding:
    """The running requests past their prefill, advanced lazily. Every engine step computes one more token
    of each, so a request's counters are what they were when it joined plus the steps since (``sync``); the
    step needs only their number, the sum of their contexts, how many cross a KV block boundary, and which
    finish — O(1) a step instead of a pass over the batch (the family benchmark's 200 traces: issue 25)."""

    __slots__ = ("block_size", "csum", "heap", "members", "residues")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.members: dict[int, Request] = {}
        self.csum = 0  # Σ (computed − steps) at joining: Σ computed = csum + len(members) × steps
        self.residues = [0] * block_size  # members by (computed − steps) mod block size
        self.heap: list[tuple[int, int, Request]] = []  # (the step count after which it finishes, id, request)

    @property
    def n(self) -> int:
        return len(self.members)

    def add(self, req: Request, steps: int, limit: int) -> None:
        """``req`` decodes from now on (``steps`` steps run so far); it finishes when it has ``limit`` tokens."""
        req.lazy_from = (steps, req.generated, req.computed)
        self.members[req.id] = req
        self.csum += req.computed - steps
        self.residues[(req.computed - steps) % self.block_size] += 1
        heapq.heappush(self.heap, (steps + limit - req.generated, req.id, req))

    def crossing(self, steps: int) -> int:
        """How many members need a new KV block in the next step (their context is a whole number of blocks)."""
        return self.residues[(-steps) % self.block_size] if self.members else 0

    def sync(self, req: Request, steps: int, last_end: float) -> None:
        """Write the lazy counters into ``req`` (its fields are then exact)."""
        s0, g0, c0 = req.lazy_from
        d = steps - s0
        req.generated, req.computed = g0 + d, c0 + d
        req.blocks = -(-req.computed // self.block_size)
        if d > 0:
            req.last_token = last_end
        req.lazy_from = (steps, req.generated, req.computed)

    def remove(self, req: Request) -> None:
        s0, _, c0 = req.lazy_from
        del self.members[req.id]
        self.csum -= c0 - s0
        self.residues[(c0 - s0) % self.block_size] -= 1

    def clear(self) -> None:
        self.members.clear()
        self.csum = 0
        self.residues = [0] * self.block_size
        self.heap.clear()


class SimEngine:
    """The scheduler and the step clock. Thread-safe: every public method takes the lock."""

    MAX_WAITING = 100_000  # open-loop arrivals beyond this are dropped (bounded memory)

    def __init__(self, cfg: SimConfig, *, registry: CollectorRegistry | None = None,
                 started_at: float | None = None) -> None:
        self.cfg = cfg
        self.registry = registry if registry is not None else CollectorRegistry()
        self.started_at = time.time() if started_at is None else started_at
        self.metrics = VllmMetrics(cfg, self.registry, started_at=self.started_at)
        self.lock = threading.RLock()
        self.rng = random.Random(cfg.seed)
        self.now = 0.0  # simulated seconds since start
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_blocks = cfg.num_gpu_blocks
        self.concurrency = cfg.concurrency
        self.arrival_rate = cfg.arrival_rate
        self.accepting = True
        self.drained = False
        self._next_id = 0
        self._users_busy = 0
        self._next_arrival: float | None = None
        self.steps = 0
        self.finished = 0
        self._published: tuple[int, int, int] | None = None  # (running, waiting, free blocks) the gauges show
        self.on_finish: Callable[[Request], None] | None = None  # told of every request that finishes or is aborted
        self.sleep_level: int | None = None  # vLLM sleep mode: None awake; 0 paused; 1/2 also KV discarded
        self.admission_cap: int | None = None  # the live cap (vllm-tuner-plugin's max_num_active_seqs)
        self.step_budget: int | None = None  # the live token budget of a step, inside the startup envelope
        self._lazy = _Decoding(cfg.block_size)  # the decoding requests, advanced in O(1) a step (_step)
        self._prefilling: list[Request] = []  # the running requests still (re)computing their prompt, in order
        self._last_end = 0.0  # when the last step ended (every decoding request's last token)
        self._schedule_arrival()

    # -- sleep mode (vLLM's POST /sleep?mode=keep, /wake_up) -------------------------------------------
    def sleep(self, level: int) -> None:
        """Pause the scheduler and discard the KV cache (levels 1 and 2). Running requests are kept and
        recomputed after the wake (vLLM's ``mode=keep``); requests arriving meanwhile wait."""
        with self.lock:
            self._sync_all()
            for req in reversed(self.running if level >= 1 else []):
                self.free_blocks += req.blocks
                req.blocks, req.computed, req.decoding, req.state = 0, 0, False, "waiting"
                self.waiting.appendleft(req)
            if level >= 1:
                self.running = []
            self.sleep_level = level
            self._relazify()
            self.metrics.set_sleep_level(level)  # the request gauges keep their last values (see advance)

    def wake(self) -> None:
        with self.lock:
            self.sleep_level = None
            self.metrics.set_sleep_level(None)

    # -- load -------------------------------------------------------------------------------------
    def set_load(self, *, concurrency: int | None = None, arrival_rate: float | None = None) -> None:
        with self.lock:
            if concurrency is not None:
                self.concurrency = max(0, concurrency)
            if arrival_rate is not None:
                self.arrival_rate = max(0.0, arrival_rate)
                self._next_arrival = None
                self._schedule_arrival()

    def _load_active(self) -> bool:
        return self.accepting and not self.drained

    def _schedule_arrival(self) -> None:
        if self.arrival_rate > 0 and self._next_arrival is None:
            self._next_arrival = self.now + self.rng.expovariate(self.arrival_rate)

    def _draw(self, mean: int) -> int:
        return max(1, round(self.rng.uniform(0.5, 1.5) * mean))

    def _synthetic(self, user: int | None) -> Request:
        cfg = self.cfg
        prompt = min(self._draw(cfg.prompt_tokens), cfg.max_model_len - 1)
        max_tokens = min(cfg.max_tokens, cfg.max_model_len)
        max_tokens = max(1, min(max_tokens, cfg.max_model_len - prompt))  # vLLM clamps (engine-contract.md §4)
        output = min(self._draw(cfg.output_tokens), max_tokens)
        return self._new(prompt, output, max_tokens, user)

    def _new(self, prompt: int, output: int, max_tokens: int, user: int | None) -> Request:
        self._next_id += 1
        return Request(self._next_id, prompt, output, max_tokens, self.now, from_user=user)

    def _generate_load(self) -> None:
        if not self._load_active():
            return
        while self._users_busy < self.concurrency:
            self._users_busy += 1
            self.waiting.append(self._synthetic(self._users_busy))
        while self._next_arrival is not None and self._next_arrival <= self.now:
            if len(self.waiting) < self.MAX_WAITING:
                self.waiting.append(self._synthetic(None))
            self._next_arrival += self.rng.expovariate(self.arrival_rate) if self.arrival_rate > 0 else math.inf
            if math.isinf(self._next_arrival):
                self._next_arrival = None

    def submit(self, *, prompt_tokens: int, max_tokens: int, output_tokens: int | None = None,
               wait: bool = True) -> Request:
        """An HTTP request, already validated; ``done`` is set when it finishes (or is aborted). ``wait``:
        False where nobody waits on ``done`` (virtual time: an Event a request costs as much as its step)."""
        with self.lock:
            output = max_tokens if output_tokens is None else max(1, min(output_tokens, max_tokens))
            req = self._new(prompt_tokens, output, max_tokens, None)
            if wait:
                req.done = threading.Event()
            self.waiting.append(req)
            return req

    # -- time ---------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        with self.lock:
            return bool(self.running or self.waiting)

    def advance(self, until: float, *, max_steps: int = 100_000) -> int:
        """Run engine steps until the simulated clock reaches ``until``; the number of steps run.

        An idle engine jumps to the next arrival (or to ``until``). A step that starts before ``until``
        runs to its end, so ``now`` may pass ``until`` by one step.
        """
        steps = 0
        with self.lock:
            if self.sleep_level is not None:  # paused: time passes, nothing is scheduled, and the gauges
                self._generate_load()          # stand still, as vLLM's do (H200, vLLM 0.26: a request sent
                self.now = max(self.now, until)  # to a sleeping engine left num_requests_* at 0)
                return 0
            while self.now < until and steps < max_steps:
                self._generate_load()
                if not self.running and not self.waiting:
                    nxt = self._next_arrival if self._load_active() and self._next_arrival is not None else until
                    self.now = max(self.now, min(until, nxt))
                    self._publish()
                    if self.now >= until:
                        break
                    continue
                self._step()
                steps += 1
            self._publish()
        return steps

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _preempt(self) -> Request:
        """Recompute-preempt the lowest-priority running request (the newest), as vLLM v1 does."""
        victim = self.running.pop()
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.decoding = False
        victim.state = "waiting"
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        self.metrics.preemptions.inc()
        return victim

    def _limit(self, req: Request) -> int:
        """The tokens ``req`` finishes at: its EOS, its max_tokens, or the context length."""
        return min(req.output_tokens, req.max_tokens, self.cfg.max_model_len - req.prompt_tokens)

    def _sync_all(self) -> None:
        """Every decoding request's fields exact, and the lazy bookkeeping emptied (``_relazify`` rebuilds it)."""
        for req in self._lazy.members.values():
            self._lazy.sync(req, self.steps, self._last_end)
        self._lazy.clear()

    def _relazify(self) -> None:
        self._lazy.clear()
        self._prefilling = []
        for req in self.running:
            if req.decoding:
                self._lazy.add(req, self.steps, self._limit(req))
            else:
                self._prefilling.append(req)

    def _step(self) -> None:
        """One engine iteration (``_step_exact`` says what it does). The decoding requests are advanced
        lazily (``_Decoding``); a step that would run out of KV blocks — a preemption — takes the exact path
        over every request. Both take the decodes' tokens of the budget before any prefill chunk (vLLM walks
        its running list in order, and a long chunk ahead of a decode can leave it out of a step: the two
        differ only in which gets the budget's last few tokens)."""
        if not self._fast_step():
            self._sync_all()
            steps = self.steps
            self._step_exact()
            if self.steps > steps:
                self._last_end = self.now
            self._relazify()

    @property
    def budget(self) -> int:
        """The tokens one step may carry: the live ``step_budget`` where set, never past ``--max-num-batched-tokens``
        (the envelope the engine sized its buffers for at start-up)."""
        envelope = self.cfg.max_num_batched_tokens
        return envelope if self.step_budget is None else max(1, min(self.step_budget, envelope))

    def _fast_step(self) -> bool:
        # the hottest loop of the family benchmark (issue 25: 200 traces in 10 minutes on 2 cores): the clock and
        # the step count bound to locals once the step is timed
        cfg, m, lazy = self.cfg, self.metrics, self._lazy
        steps0 = self.steps
        decoding = lazy.n
        free = self.free_blocks - lazy.crossing(steps0)
        if free < 0:
            return False  # a decode finds no block: preemption, the exact path
        budget = self.budget - decoding
        plan: list[tuple[Request, int, int]] = []
        for req in self._prefilling:
            n = min(req.prefill_target - req.computed, budget)
            if n <= 0:
                continue
            need = self._blocks_for(req.computed + n) - req.blocks
            if need > free:
                return False
            free -= need
            plan.append((req, n, need))
            budget -= n
        # committed: nothing below gives up the step
        self.free_blocks = free
        for req, _, need in plan:
            req.blocks += need
        if self.waiting:
            plan.extend(self._admit(budget))
        if not plan and not decoding:
            self.now += cfg.gpu.step_base_seconds  # nothing fits (see _step_exact)
            return True
        context = lazy.csum + decoding * steps0 if cfg.gpu.step_per_context_token_seconds else 0
        prefill = 0
        for _, n, _ in plan:
            prefill += n
        self.now += cfg.gpu.step_seconds(sequences=decoding + len(plan), prefill_tokens=prefill, context_tokens=context)
        now = self.now
        self.steps += 1
        steps = self.steps
        if decoding:
            m.itl.observe(now - self._last_end, decoding)  # every decode of a step has the same gap
        emitted = decoding
        prompt_counted = 0
        finished = decoded = False
        for req, n, _ in plan:
            req.computed += n
            if req.computed < req.prefill_target:
                continue  # more prefill chunks to go
            req.decoding = decoded = True
            req.generated += 1  # a finished prefill samples a token
            emitted += 1
            if req.first_token is None:
                prompt_counted += self._first_token(req)
            elif req.last_token is not None:
                m.itl.observe(now - req.last_token)  # a recompute after preemption
            req.last_token = now
            limit = self._limit(req)
            if req.generated >= limit:
                self._finish(req, self._reason(req))
                finished = True
            else:
                lazy.add(req, steps, limit)
        heap = lazy.heap
        while heap and heap[0][0] <= steps:
            _, _, req = heapq.heappop(heap)
            lazy.sync(req, steps, now)
            lazy.remove(req)
            self._finish(req, self._reason(req))
            finished = True
        if finished:
            self.running = [r for r in self.running if r.state == "running"]
        if finished or decoded:
            self._prefilling = [r for r in self._prefilling if r.state == "running" and not r.decoding]
        self._last_end = now
        m.prompt_tokens.inc(prompt_counted)
        m.generation_tokens.inc(emitted)
        m.iteration_tokens.observe(prompt_counted + emitted)
        return True

    def _admit(self, budget: int) -> list[tuple[Request, int, int]]:
        """Waiting requests admitted FCFS while sequence slots, the step's ``budget`` and KV blocks last:
        (request, tokens of prompt this step, blocks taken) each, already running."""
        cfg, admitted = self.cfg, []
        cap = self.admission_cap or cfg.max_num_seqs  # a lower live cap drains down, never preempts
        while self.waiting and len(self.running) < cap and budget > 0:
            req = self.waiting[0]
            n = req.prefill_target - req.computed
            if not cfg.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            need = self._blocks_for(req.computed + n)
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= need
            req.blocks = need
            req.state = "running"
            if req.first_scheduled is None:
                req.first_scheduled = self.now
                self.metrics.prefix_queries.inc(req.prompt_tokens)
            self.running.append(req)
            self._prefilling.append(req)  # the exact path rebuilds this list after its step (_relazify)
            admitted.append((req, n, need))
            budget -= n
        return admitted

    def _first_token(self, req: Request) -> int:
        """``req`` samples its first token now: its TTFT observed; the prompt tokens to count (vLLM counts a
        prompt once, at its first token)."""
        m = self.metrics
        req.first_token = self.now
        m.ttft.observe(self.now - req.arrival)
        m.params_n.observe(1)
        m.max_num_generation_tokens.observe(req.max_tokens)
        return req.prompt_tokens

    def _reason(self, req: Request) -> str:
        eos = req.generated >= req.output_tokens and req.generated < req.max_tokens
        return "stop" if eos else "length"

    def _step_exact(self) -> None:
        """One engine iteration, as vLLM v1's scheduler does it (simplified): running requests first
        (decodes need one token each, unfinished prefills the rest of the budget), preempting the newest
        when KV blocks run out; then waiting requests FCFS while sequence slots, budget and blocks last."""
        cfg, m = self.cfg, self.metrics
        budget = self.budget
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        # the decodes take their token first, then the prefill chunks in running order (as _fast_step)
        for req in [r for r in self.running if r.decoding] + [r for r in self.running if not r.decoding]:
            if req.state != "running":  # preempted earlier in this step
                continue
            n = 1 if req.decoding else min(req.prefill_target - req.computed, budget)
            if n <= 0:
                continue
            need = self._blocks_for(req.computed + n) - req.blocks
            while need > self.free_blocks and req.state == "running":
                victim = self._preempt()
                preempted = True
                if any(r is victim for r, _ in scheduled):
                    scheduled = [(r, k) for r, k in scheduled if r is not victim]
            if req.state != "running":
                continue
            if need > 0:
                self.free_blocks -= need
                req.blocks += need
            scheduled.append((req, n))
            budget -= n
        if not preempted:  # vLLM admits nothing new in a step that had to preempt
            scheduled.extend((req, n) for req, n, _ in self._admit(budget))
        if not scheduled:
            # nothing fits: cannot last (resolve() guarantees one max_model_len request fits the cache),
            # but let the clock move so advance() always ends
            self.now += cfg.gpu.step_base_seconds
            return
        prefill_tokens = sum(n for r, n in scheduled if not r.decoding)
        context = sum(r.computed for r, _ in scheduled if r.decoding) if cfg.gpu.step_per_context_token_seconds \
            else 0
        duration = cfg.gpu.step_seconds(sequences=len(scheduled), prefill_tokens=prefill_tokens,
                                        context_tokens=context)
        self.now += duration
        self.steps += 1
        prompt_counted = 0
        emitted = 0
        finished = False
        gaps: dict[float, int] = {}
        for req, n in scheduled:
            req.computed += n
            if not req.decoding:
                if req.computed < req.prefill_target:
                    continue  # more prefill chunks to go
                req.decoding = True
            req.generated += 1  # a finished prefill samples a token; so does every decode step
            emitted += 1
            if req.first_token is None:
                prompt_counted += self._first_token(req)
            elif req.last_token is not None:
                gap = self.now - req.last_token
                gaps[gap] = gaps.get(gap, 0) + 1
            req.last_token = self.now
            if req.generated >= self._limit(req):
                self._finish(req, self._reason(req))
                finished = True
        for gap, count in gaps.items():
            m.itl.observe(gap, count)
        if finished:
            self.running = [r for r in self.running if r.state == "running"]
        m.prompt_tokens.inc(prompt_counted)
        m.generation_tokens.inc(emitted)
        m.iteration_tokens.observe(prompt_counted + emitted)

    def _finish(self, req: Request, reason: str) -> None:
        """Record a finished request (the caller removes it from ``running``)."""
        m = self.metrics
        req.state = "finished"
        self.free_blocks += req.blocks
        req.blocks = 0
        req.finish_reason = reason
        req.finished_at = self.now
        self.finished += 1
        m.success[reason].inc()
        scheduled = req.first_scheduled if req.first_scheduled is not None else self.now
        first = req.first_token if req.first_token is not None else self.now
        m.e2e.observe(self.now - req.arrival)
        m.queue.observe(scheduled - req.arrival)
        m.inference.observe(self.now - scheduled)
        m.prefill.observe(first - scheduled)
        m.decode.observe(self.now - first)
        m.req_prompt_tokens.observe(req.prompt_tokens)
        m.req_generation_tokens.observe(req.generated)
        m.tpot.observe((self.now - first) / (req.generated - 1) if req.generated > 1 else 0.0)
        m.params_max_tokens.observe(req.max_tokens)
        m.num_preemptions.observe(req.preemptions)
        m.prefill_kv_computed.observe(req.prompt_tokens)
        if req.from_user is not None:
            self._users_busy -= 1
        if req.done is not None:
            req.done.set()
        if self.on_finish is not None:
            self.on_finish(req)

    def _publish(self) -> None:
        state = (len(self.running), len(self.waiting), self.free_blocks)
        if state == self._published:
            return  # the gauges already say it (advance publishes on every call, most of them changing nothing)
        self._published = state
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.waiting))
        m.waiting_capacity.set(len(self.waiting))
        used = self.cfg.num_gpu_blocks - self.free_blocks
        m.kv_usage.set(used / self.cfg.num_gpu_blocks if self.cfg.num_gpu_blocks else 0.0)

    # -- shutdown ---------------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        """SIGTERM: no new work (the built-in load stops; new HTTP requests are refused)."""
        with self.lock:
            self.accepting = False
            for req in [r for r in self.waiting if r.from_user is not None and r.first_scheduled is None]:
                # closed-loop users that had not been served yet simply never sent their request
                self.waiting.remove(req)
                self._users_busy -= 1

    def abort_all(self) -> int:
        with self.lock:
            self._sync_all()
            victims = [*self.running, *self.waiting]
            self.running, self.waiting = [], collections.deque()
            self._prefilling = []
            for req in victims:
                self._finish(req, "abort")
            self._publish()
            return len(victims)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"simulated": True, "sim_time_seconds": round(self.now, 3), "steps": self.steps,
                    "running": len(self.running), "waiting": len(self.waiting), "finished": self.finished,
                    "free_blocks": self.free_blocks, "num_gpu_blocks": self.cfg.num_gpu_blocks,
                    "concurrency": self.concurrency, "arrival_rate": self.arrival_rate,
                    "drained": self.drained, "accepting": self.accepting, "sleep_level": self.sleep_level}
