"""Schedulers shaped like vLLM 0.32's and 0.26's, for the plugin's fast tests.

Each keeps exactly the attributes the plugin reads and the lines of ``schedule()`` that use them (read in
``vllm/v1/core/sched/scheduler.py`` of each version):

- ``__init__``: ``max_num_running_reqs = scheduler_config.max_num_seqs``; 0.32 only:
  ``max_num_active_reqs = scheduler_config.max_num_active_seqs or max_num_running_reqs``;
  ``max_num_scheduled_tokens = scheduler_config.max_num_scheduled_tokens or max_num_batched_tokens``.
- ``schedule()``: ``token_budget = self.max_num_scheduled_tokens``; running requests first (1 decode
  token each, or a prefill chunk); then admission while
  ``len(self.running) + self.num_waiting_for_streaming_input < <cap>`` with ``<cap>`` =
  ``max_num_active_reqs`` (0.32) or ``max_num_running_reqs`` (0.26); prefill chunked to the budget;
  at the end the same two asserts as vLLM.
- ``update_from_output()``: a request whose prompt is done produces one token per step and leaves
  ``running`` after ``output_len`` tokens.

Nothing here is preempted (the plugin never needs it to be).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

_ids = itertools.count()


@dataclass
class FakeRequest:
    prompt_len: int
    output_len: int
    computed: int = 0
    generated: int = 0
    request_id: int = field(default_factory=lambda: next(_ids))

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len


def vllm_config(
    *,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_num_active_seqs: int | None = None,
    max_num_scheduled_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    dp_rank: int = 0,
    dp_size: int = 1,
    moe: bool = False,
    speculative: bool = False,
    with_active_field: bool = True,
) -> SimpleNamespace:
    scheduler_config = SimpleNamespace(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_scheduled_tokens=max_num_scheduled_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    if with_active_field:
        scheduler_config.max_num_active_seqs = max_num_active_seqs
    return SimpleNamespace(
        scheduler_config=scheduler_config,
        # As vLLM runs a DP rank: a non-MoE one as an independent engine whose data_parallel_rank and
        # data_parallel_size are reset to 0 and 1 (the rank count is then only on the command line); an MoE
        # one keeps both (vllm/v1/engine/core.py, reconfigure_for_independent_dp_rank).
        parallel_config=SimpleNamespace(data_parallel_rank=dp_rank if moe else 0, data_parallel_index=dp_rank,
                                        data_parallel_size=dp_size if moe else 1),
        speculative_config=SimpleNamespace(num_speculative_tokens=3) if speculative else None,
        model_config=SimpleNamespace(runner_type="generate"),
    )


class _FakeScheduler:
    ADMISSION_ATTR = "max_num_running_reqs"

    def __init__(self, vllm_config: Any, kv_cache_config: Any = None, **kwargs: Any) -> None:
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self._init_admission()
        self.max_num_scheduled_tokens = (
            self.scheduler_config.max_num_scheduled_tokens
            if self.scheduler_config.max_num_scheduled_tokens is not None
            else self.scheduler_config.max_num_batched_tokens
        )
        self.running: list[FakeRequest] = []
        self.waiting: deque[FakeRequest] = deque()
        self.num_waiting_for_streaming_input = 0
        self.max_num_encoder_input_tokens = 0
        self.connector = None
        self.ec_connector = None
        self.need_mamba_block_aligned_split = False
        self.is_encoder_decoder = False
        self.steps = 0
        self.step_tokens: list[int] = []  # tokens scheduled per step
        self.step_running: list[int] = []  # len(running) at the end of each step

    def _init_admission(self) -> None:
        pass

    # -- what vLLM's engine core calls ------------------------------------------------------------
    def add_request(self, request: FakeRequest) -> None:
        self.waiting.append(request)

    def schedule(self, throttle_prefills: bool = False) -> dict[int, int]:
        self.steps += 1
        token_budget = self.max_num_scheduled_tokens
        scheduled: dict[int, int] = {}
        for request in self.running:
            if token_budget <= 0:
                break
            n = min(max(request.prompt_len - request.computed, 1), token_budget)
            scheduled[request.request_id] = n
            token_budget -= n
        while self.waiting and token_budget > 0:
            num_running = len(self.running) + self.num_waiting_for_streaming_input
            if num_running >= getattr(self, self.ADMISSION_ATTR):
                break
            request = self.waiting.popleft()
            n = min(request.prompt_len - request.computed, token_budget)  # chunked prefill
            self.running.append(request)
            scheduled[request.request_id] = n
            token_budget -= n
        total = sum(scheduled.values())
        # The two asserts vLLM ends schedule() with.
        assert total <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs
        self.step_tokens.append(total)
        self.step_running.append(len(self.running))
        return scheduled

    def update_from_output(self, scheduled: dict[int, int]) -> list[FakeRequest]:
        finished = []
        for request in list(self.running):
            n = scheduled.get(request.request_id, 0)
            if not n:
                continue
            if request.computed < request.prompt_len:
                request.computed += n
                if request.computed >= request.prompt_len:
                    request.generated += 1
            else:
                request.generated += 1
            if request.done:
                self.running.remove(request)
                finished.append(request)
        return finished

    # -- test helpers -----------------------------------------------------------------------------
    def step(self) -> list[FakeRequest]:
        return self.update_from_output(self.schedule())

    def finish(self, k: int) -> None:
        """Finish the first ``k`` running requests (as if they hit a stop token)."""
        for request in self.running[:k]:
            request.generated = request.output_len
        del self.running[:k]

    def fill(self, n: int, *, prompt_len: int = 16, output_len: int = 10_000) -> None:
        for _ in range(n):
            self.add_request(FakeRequest(prompt_len, output_len))


class Scheduler032(_FakeScheduler):
    """vLLM 0.32: a separate admission attribute (``--max-num-active-seqs``, PR 56758)."""

    ADMISSION_ATTR = "max_num_active_reqs"

    def _init_admission(self) -> None:
        active = self.scheduler_config.max_num_active_seqs
        self.max_num_active_reqs = active if active is not None else self.max_num_running_reqs


class Scheduler026(_FakeScheduler):
    """vLLM 0.26: ``max_num_running_reqs`` both admits and bounds."""

    ADMISSION_ATTR = "max_num_running_reqs"


def fresh(cls: type[_FakeScheduler]) -> type[_FakeScheduler]:
    """A new subclass per test, so that patching it leaves the others alone."""
    return type(cls.__name__, (cls,), {})
