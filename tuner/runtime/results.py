"""What a cycle produced: per target its signals and plan, and the cycle's pool decision, admission and
rollout outcome. Immutable values: ``/status`` and ``/healthz`` read the last one from another thread."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.model.live import NONE, LiveState
from tuner.planning import planner, pooling
from tuner.signals import Signal


@dataclass(frozen=True)
class RolloutOutcome:
    """What the dispatcher did this cycle.

    ``summary`` is a short clause for the cycle line; ``results`` maps replica → restart result (``ok``,
    ``rolled_back``, ``failed``) for ``tuner_restarts_total``; ``state`` is shown under ``rollout`` in
    ``/status``. A replica not in ``results`` was not restarted.
    """

    summary: str = ""
    results: Mapping[str, str] = field(default_factory=dict)
    state: Mapping[str, Any] = field(default_factory=dict)



@dataclass(frozen=True)
class TargetResult:
    name: str
    signals: Mapping[str, Signal]
    info: EngineInfo
    gpus: GpuInputs
    snapshots: int
    scrape_error: str | None = None
    plan: planner.Plan | None = None
    planner_error: str | None = None
    current_args: Mapping[str, str] = field(default_factory=dict)
    live: LiveState = NONE
    held: str | None = None  # why nothing is decided for it (two engines behind one URL)


@dataclass(frozen=True)
class CycleResult:
    number: int
    mode: str
    started_at: float  # seconds since the epoch (``now`` of the cycle)
    duration_seconds: float
    summary: str  # ONE line
    targets: Mapping[str, TargetResult]
    step_seconds: Mapping[str, float]
    pool: pooling.PoolPlan | None = None
    admission: pooling.Admission | None = None
    pending: pooling.Pending | None = None
    rollout: RolloutOutcome | None = None
    rollout_error: str | None = None
    stopped: str | None = None  # set when a stop request cut the cycle short

    @property
    def finished_at(self) -> float:
        return self.started_at + self.duration_seconds

    @property
    def handed_over(self) -> pooling.PoolChange | None:
        return self.admission.hand_over if self.admission is not None else None
