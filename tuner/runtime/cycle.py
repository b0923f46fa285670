"""One tuner cycle, as a flat list of named steps: collect → step → pool → act → report.

``run_cycle`` is the loop body; scheduling (APScheduler) only calls it. It decides nothing itself:

1. **collect** every target's inputs in parallel through the one engine client (bounded by
   ``scrape.deadline_seconds`` per call and a deadline for the whole gathering);
2. **step** each target with ``planning.stepping.step`` — the one decision path that ``replay``,
   ``recommend`` and the scenario tests run too (windows, staleness, restarts, signals, rules, guards,
   the plan); mode observe stops at the signals;
3. **pool** (mode apply): ``planning.pooling.choose`` turns the replicas' plans into one change for the
   pool and the actions to take now; ``pooling.admit`` holds it for a maintenance window (deferred, not
   dropped) or while the tuner is stopping;
4. **act**: the dispatcher carries the actions and the change out and books the outcome;
5. **report**: self-metrics, the status views, and ONE summary line (``views.summary``)::

    cycle 812: no action (kv-pressure: cooldown 4m12s left)
    cycle 813: engine-0: --max-num-seqs 8→16 deferred (outside the maintenance window; next opens 02:00Z)

Never raises for a failing target, planner or rollout: the failure becomes part of the summary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from tuner import config
from tuner.errors import TunerError
from tuner.model import knobs
from tuner.planning import history as history_mod
from tuner.planning import pooling, stepping
from tuner.planning.guards import Action
from tuner.rules.schema import Rule
from tuner.runtime import clocks, selfmetrics, views
from tuner.runtime.collecting import Collecting, Gatherer
from tuner.runtime.results import CycleResult, RolloutOutcome, TargetResult
from tuner.runtime.scheduling import MaintenanceWindows
from tuner.runtime.state import TunerState
from tuner.signals import Signal

log = logging.getLogger("tuner.cycle")

STEPS = ("collect", "step", "pool", "act")


class Dispatcher(Protocol):
    """Carries out a cycle's actions and the pool's change (apply mode). It must return between its
    steps once ``should_stop()`` is true (SIGTERM), leaving a state it can resume from. ``signals``:
    this cycle's signals of every replica, the baseline its verification compares against. It never
    waits for a rollout to finish: it advances the one in flight (``busy``) and returns."""

    @property
    def busy(self) -> bool:
        """A rollout is in flight: it is advanced at every cycle, and no new change goes out (but one that
        supersedes it: ``verifying``)."""

    @property
    def verifying(self) -> tuple[history_mod.Change, ...]:
        """The changes of a live rollout in flight that the next live step the same way may supersede
        (machine Rule 6: every replica runs them and one still verifies); () otherwise."""

    def __call__(self, actions: Sequence[tuple[str, Action]], change: pooling.PoolChange | None, *,
                 now: float, signals: Mapping[str, Mapping[str, Signal]],
                 should_stop: Callable[[], bool]) -> RolloutOutcome: ...


def run_cycle(
    state: TunerState,
    *,
    settings: config.TunerSettings,
    collectors: Sequence[Collecting],
    rules: Sequence[Rule] = (),
    dispatcher: Dispatcher | None = None,
    maintenance: MaintenanceWindows | None = None,
    metrics: selfmetrics.TunerMetrics | None = None,
    gatherer: Gatherer | None = None,
    now: float | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    monotonic: Callable[[], float] = time.monotonic,
    clock: clocks.LoopClock | None = None,
) -> CycleResult:
    """Run one cycle; ``state`` is updated in place (``state.last`` last). ``now``: the cycle's time
    (seconds since the epoch; default: ``clock``'s, else the wall clock). ``clock``: the loop's clock
    (``runtime.clocks``); a step of the wall clock is logged once, and the loop re-based on it with
    everything ``state`` holds — between rollouts, never inside one."""
    if clock is not None:
        clock.detected()
        if abs(clock.offset()) > clock.tolerance_seconds and not (dispatcher is not None and dispatcher.busy):
            moved = clock.rebase()
            state.rebase(moved)
            now = None if now is None else now + moved  # read before the re-base: on the old base
            for c in collectors:  # readings kept between slow reads are stamped on the old base
                forget = getattr(c, "forget_cached", None)
                if forget is not None:
                    forget()
            log.warning("re-based the loop's time by %+.1fs on the wall clock (windows, cooldowns and the "
                        "pending change moved with it)", moved)
        now = clock.now() if now is None else now
    now = time.time() if now is None else now
    state.number += 1
    mode = settings.mode
    t_start = t = monotonic()
    steps: dict[str, float] = {}
    stopped: str | None = None

    def timed(name: str, since: float) -> float:
        t = monotonic()
        steps[name] = t - since
        if metrics is not None:
            metrics.observe_step(name, t - since)
        return t

    # 1. collect --------------------------------------------------------------------------------------
    own_gatherer = gatherer is None
    gatherer = gatherer or Gatherer()
    try:
        inputs = gatherer.gather(collectors, deadline_seconds=settings.scrape.collect_deadline_seconds())
    finally:
        if own_gatherer:
            gatherer.close()
    t = timed("collect", t)

    # 2. step: the one decision path ---------------------------------------------------------------------
    window = settings.scrape.window_settings()
    decide = mode != "observe" and not should_stop()
    if mode != "observe" and not decide:
        stopped = "stopping: skipped planning and acting"
    targets: dict[str, TargetResult] = {}
    for c, got in zip(collectors, inputs, strict=True):
        t_cfg = c.target
        name = t_cfg.name
        before = state.targets.setdefault(name, stepping.TargetState())
        if name not in state.args:  # a target added to the config
            state.args[name] = knobs.EngineArgs.parse(t_cfg.args or [])
        planner_error = None
        try:
            decision = stepping.step(before, got.snapshot, info=got.info, gpus=got.gpus, now=now, target=name,
                                     kind=t_cfg.kind, args=state.args[name], settings=settings.decisions,
                                     window=window, rules=rules, decide=decide,
                                     power_control=settings.gpu_control.enabled, live=got.live)
        except Exception as exc:  # a planner bug must not kill the daemon; say it every cycle
            log.exception("deciding for %s failed", name)
            planner_error = f"{type(exc).__name__}: {exc}"
            decision = stepping.step(before, got.snapshot, info=got.info, gpus=got.gpus, now=now, target=name,
                                     kind=t_cfg.kind, args=state.args[name], settings=settings.decisions,
                                     window=window, rules=rules, decide=False)
        state.targets[name] = decision.state
        if metrics is not None:
            metrics.set_signals(name, decision.signals)
            if not got.snapshot.ok:
                metrics.count_scrape_error(target=name, source="engine")
            elif got.info.error:
                metrics.count_scrape_error(target=name, source="engine_info")
            if got.gpus.unavailable and t_cfg.gpu.kind != "none":
                metrics.count_scrape_error(target=name, source="gpu")
        targets[name] = TargetResult(name, decision.signals, got.info, got.gpus, len(decision.state.window),
                                     scrape_error=got.snapshot.error, plan=decision.plan,
                                     planner_error=planner_error, current_args=state.current_args(name),
                                     live=got.live, held=decision.held)
    for gone in set(state.targets) - set(targets):  # a target removed from the config
        del state.targets[gone]
        if metrics is not None:
            metrics.forget_target(gone)
    t = timed("step", t)

    # 3. pool ---------------------------------------------------------------------------------------------
    pool: pooling.PoolPlan | None = None
    admission: pooling.Admission | None = None
    plans = {name: tr.plan for name, tr in targets.items() if tr.plan is not None}
    signals = {name: tr.signals for name, tr in targets.items()}
    kind = settings.targets[0].kind
    if mode == "apply" and dispatcher is not None and stopped is None:
        lives = {name: tr.live for name, tr in targets.items()}
        pool = pooling.choose(plans, state.args, kind=kind, settings=settings.decisions, signals=signals, now=now,
                              lives=lives)
        window_open = maintenance.is_open(now) if maintenance is not None else None
        stopping = should_stop()
        admission = pooling.admit(pool, state.pending, window_open=window_open, stopping=stopping,
                                  closed_reason=views.deferral_reason(maintenance, now), now=now,
                                  args=state.args, kind=kind, settings=settings.decisions, signals=signals,
                                  lives=lives, in_flight=dispatcher.busy, verifying=dispatcher.verifying)
        state.pending = admission.pending
        if stopping and (pool.change is not None or pool.actions):
            stopped = "stopping: the change is kept pending, not handed to the rollout"
    t = timed("pool", t)

    # 4. act ----------------------------------------------------------------------------------------------
    outcome: RolloutOutcome | None = None
    rollout_error: str | None = None
    if pool is not None and admission is not None and dispatcher is not None and stopped is None:
        change = admission.hand_over
        if change is not None or pool.actions or dispatcher.busy:
            try:
                outcome = dispatcher(pool.actions, change, now=now, signals=signals, should_stop=should_stop)
                state.rollout_state = dict(outcome.state)
            except Exception as exc:  # the rollout journals its own state; the cycle reports and goes on
                if isinstance(exc, TunerError):  # a condition it names itself (a full disk): no traceback
                    log.error("rollout failed: %s", exc)
                else:
                    log.exception("rollout failed")
                rollout_error = f"{type(exc).__name__}: {exc}"
    if metrics is not None:
        views.count(metrics, mode, plans, pool, admission, outcome, rollout_error, has_rollout=dispatcher is not None)
        for name, tr in targets.items():
            recommended = {c.flag: knobs.format_value(c.to_value) for c in (tr.plan.changes if tr.plan else ())}
            metrics.set_engine_args(name, current=state.current_args(name), recommended=recommended)
    t = timed("act", t)

    # 5. report -------------------------------------------------------------------------------------------
    result = CycleResult(number=state.number, mode=mode, started_at=now, duration_seconds=t - t_start, summary="",
                         targets=targets, step_seconds=dict(steps), pool=pool, admission=admission,
                         pending=state.pending, rollout=outcome, rollout_error=rollout_error, stopped=stopped)
    result = replace(result, summary=views.summary(result, has_rollout=dispatcher is not None))
    if metrics is not None:
        metrics.observe_cycle(result.duration_seconds, finished_at=result.finished_at)
    state.last = result
    _log_once(state, result)
    return result


def _log_once(state: TunerState, result: CycleResult) -> None:
    """The cycle's line at INFO when it says something new (a new recommendation, hold, error, rollout
    step), and at DEBUG while it repeats the last one — again at INFO every ``views.REPEAT_SECONDS``, with
    how many cycles said the same. The structured record goes with it either way."""
    said = views.gist(result)
    last = state.logged
    extra = {"tuner_cycle": views.record(result)}
    if last is not None and last[0] == said and result.started_at - last[1] < views.REPEAT_SECONDS:
        log.debug(result.summary, extra=extra)
        return
    repeats = f" (the same since cycle {last[2]})" if last is not None and last[0] == said else ""
    log.info(result.summary + repeats, extra=extra)
    state.logged = (said, result.started_at, last[2] if last is not None and last[0] == said else result.number)
