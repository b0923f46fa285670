"""One decision step for one target: its newest snapshot in, its signals and plan out. Pure.

This is the one decision path of the tuner. The daemon's cycle, ``replay``, ``recommend``, ``inspect``
and the scenario tests all call ``step`` with the same inputs a cycle has — the target's state from
the previous step, the snapshot just scraped, what ``/v1/models`` said, the GPUs' readings — so a
recorded scenario that passes here passes in the daemon::

    TargetState ─┐
    snapshot ────┼─▶ window (last window_seconds) ─▶ restart seen? ─▶ signals ─▶ planner.plan ─▶ Decision
    info, gpus ──┘                                                     (engine + GPU)

Rules of the step:

1. The window is the snapshots of the last ``window_seconds`` (at most ``max_snapshots``), the new one
   included. Signals are computed over it with the staleness limit and ``min_snapshots``; a failed
   scrape voids the windows it falls in (``signals.engine.compute``).
2. A snapshot whose ``process_start_time_seconds`` differs from the one seen before is a restart; the
   planner then plans a warm-up once (not for the tuner's own restarts, which its rollout warmed).
3. A failed scrape decides nothing: no plan, the history (streaks, cooldowns) is kept as it was, so one
   transient failure does not reset a rule that has held for several windows.
4. ``decide=False`` (mode observe) computes signals only.

``now`` is the step's time: the cycle's start in the daemon, the snapshot's time in a replay.
``replay`` runs recorded snapshots through ``step`` one at a time, booking each change as a finished
rollout would (``pooling``) when asked to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tuner.model import dialects, knobs, snapshots
from tuner.model import live as live_mod
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import planner, pooling
from tuner.planning.history import History
from tuner.rules.schema import Rule
from tuner.signals import Signal
from tuner.signals import engine as engine_signals
from tuner.signals import gpu as gpu_signals


@dataclass(frozen=True, slots=True)
class WindowSettings:
    """How a target's window of snapshots is kept and read (config ``scrape:``)."""

    window_seconds: float = 300.0
    min_snapshots: int = 3
    stale_after_seconds: float | None = None  # None: no staleness limit
    max_snapshots: int = 100_000


@dataclass(frozen=True, slots=True)
class TargetState:
    """What one target carries from step to step. ``history`` is what the daemon persists."""

    window: tuple[snapshots.Snapshot, ...] = ()
    history: History = field(default_factory=History)
    engine_started_at: float | None = None  # the engine's process start time last seen


@dataclass(frozen=True, slots=True)
class Decision:
    target: str
    at: float
    signals: Mapping[str, Signal]
    plan: planner.Plan | None
    state: TargetState
    skipped: str | None = None  # why there is no plan (a failed scrape, observe mode)


def step(
    state: TargetState,
    snapshot: snapshots.Snapshot,
    *,
    info: EngineInfo | None,
    gpus: GpuInputs,
    now: float,
    target: str,
    kind: knobs.EngineKind,
    args: knobs.EngineArgs,
    settings: planner.DecisionSettings,
    window: WindowSettings,
    rules: Iterable[Rule],
    decide: bool = True,
    power_control: bool = False,
    live: live_mod.LiveState = live_mod.NONE,
) -> Decision:
    """The step of the module docstring; ``power_control``: plan GPU power caps (``gpu_control.enabled``)."""
    kept = tuple(s for s in (*state.window, snapshot) if s.scraped_at >= now - window.window_seconds)
    kept = kept[-window.max_snapshots:]
    dialect = dialects.DIALECTS[kind]

    started = engine_signals.gauge(snapshot, dialect, "process_start") if snapshot.ok else None
    restarted_at = started if started is not None and state.engine_started_at not in (None, started) else None
    engine_started_at = started if started is not None else state.engine_started_at

    cap = knobs.effective("max_num_seqs", args, kind=kind).value  # its scheduler never runs more
    signals = engine_signals.compute(kept, dialect=dialect, info=info, now=now,
                                     stale_after_seconds=window.stale_after_seconds,
                                     min_snapshots=window.min_snapshots,
                                     max_running=float(cap) if isinstance(cap, int | float) and not
                                     isinstance(cap, bool) else None)
    signals.update(gpu_signals.compute(gpus.readings, unavailable=gpus.unavailable, now=now,
                                       stale_after_seconds=window.stale_after_seconds))
    after = TargetState(window=kept, history=state.history, engine_started_at=engine_started_at)
    if not snapshot.ok:
        return Decision(target, now, signals, None, after, skipped=f"scrape failed: {snapshot.error}")
    if not decide:
        return Decision(target, now, signals, None, after, skipped="observe mode: no plan")
    plan = planner.plan(target, signals, args, state.history, settings, rules=rules, kind=kind, now=now,
                        restarted_at=restarted_at, power_control=power_control, live=live)
    return Decision(target, now, signals, plan, replace(after, history=plan.history))


def replay(
    snaps: Sequence[snapshots.Snapshot],
    *,
    target: str,
    kind: knobs.EngineKind,
    args: knobs.EngineArgs,
    rules: Sequence[Rule],
    settings: planner.DecisionSettings,
    window: WindowSettings,
    info: EngineInfo,
    gpus: GpuInputs,
    apply: bool = False,
    decide: bool = True,
) -> Iterator[Decision]:
    """Recorded snapshots through ``step``, one step per snapshot at the snapshot's time (what ``replay``,
    ``recommend``, ``inspect`` and the scenario tests run). The GPU inputs stand for every step (a file's
    readings are taken as read at each step). ``apply``: each change is booked as a finished rollout of
    this one replica would book it (``pooling.choose`` and ``pooling.book``), so cooldowns, hysteresis and
    the restart budget bite as they would in the daemon."""
    state = TargetState()
    for snap in snaps:
        now = snap.scraped_at
        gpus_now = GpuInputs(tuple(replace(r, read_at=now) for r in gpus.readings), gpus.unavailable)
        decision = step(state, snap, info=info, gpus=gpus_now, now=now, target=target, kind=kind, args=args,
                        settings=settings, window=window, rules=rules, decide=decide)
        state = decision.state
        plan = decision.plan
        if apply and plan is not None and plan.changes:
            pool = pooling.choose({target: plan}, {target: args}, kind=kind, settings=settings,
                                  signals={target: decision.signals}, now=now)
            if pool.change is not None:
                outcome = pooling.ReplicaOutcome("ok", pool.change.new_args[target])
                histories, owned = pooling.book(
                    {target: state.history}, {target: args}, changes=pool.change.changes, outcomes={target: outcome},
                    pool_new_args=pool.change.new_args, rolled_back=False, now=now,
                    reject_seconds=settings.safety.reject_seconds)
                state, args = replace(state, history=histories[target]), owned[target]
        yield decision
