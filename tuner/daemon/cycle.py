"""One tuner cycle: collect → signals → plan → act, ending in ONE human summary line.

``run_cycle`` is the whole loop body; scheduling (APScheduler) only calls it. It reads every target
through a collector, keeps a rolling window of snapshots per target (``scrape.window_seconds``),
computes signals, and — by mode — stops there (observe), asks the planner (recommend), or also hands
plans to the rollout (apply). Nothing here decides: the planner decides, the rollout acts; the cycle
sequences them, times each step, counts outcomes and says what happened::

    cycle 812: no action (kv-pressure: cooldown 4m12s left)
    cycle 813: engine-0: --max-num-seqs 8→16 deferred (outside the maintenance window; opens 02:00Z)

Maintenance windows. A window is a crontab expression read as the set of minutes it matches
(``"* 2-4 * * 6,0"`` = 02:00-04:59 on weekends), evaluated with APScheduler's ``CronTrigger`` against
``now``. Outside every window a plan that needs a restart is *deferred, not dropped*: it stays pending
(superseded only by a newer restart plan for the same target) and is handed to the rollout in the first
cycle inside a window. No windows configured: restarts may happen at any time.

The planner and the rollout are passed in (see ``Planner`` and ``Rollout``); the cycle only relies on
the narrow ``PlanLike`` surface below (``changes``, ``held``, ``actions``, ``restart_needed``,
``summary()``), so it does not import ``tuner.planning`` or ``tuner.rollout``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tuner import config
from tuner.daemon import selfmetrics
from tuner.daemon.collecting import GpuInputs
from tuner.model import dialects, snapshots
from tuner.model.engines import EngineInfo
from tuner.signals import Signal, reports
from tuner.signals import engine as engine_signals
from tuner.signals import gpu as gpu_signals

log = logging.getLogger("tuner.cycle")

STEPS = ("collect", "signals", "plan", "act")
OUTCOMES = ("recommended", "applied", "deferred", "held", "failed")
_OK_RESULTS = frozenset({"ok", "success", "succeeded", "applied", "verified"})


# --- what the cycle needs from its collaborators -------------------------------------------------


class Collecting(Protocol):
    """What ``collecting.Collector`` offers (a fake in tests)."""

    @property
    def target(self) -> config.Target: ...

    def scrape_engine(self) -> snapshots.Snapshot: ...

    def engine_info(self) -> EngineInfo: ...

    def read_gpus(self) -> GpuInputs: ...


@runtime_checkable
class PlanLike(Protocol):
    """The part of ``tuner.planning.planner.Plan`` the cycle reads.

    A change is read for ``rule``, ``flag``, ``from``/``to`` (attribute ``old``/``new``,
    ``from_value``/``to_value``, … or mapping keys) and ``reason``; a held item for ``rule``,
    ``guard`` and ``reason``. Missing fields read as empty.
    """

    @property
    def changes(self) -> Sequence[Any]: ...

    @property
    def held(self) -> Sequence[Any]: ...

    @property
    def actions(self) -> Sequence[Any]: ...

    @property
    def restart_needed(self) -> bool: ...

    def summary(self) -> str: ...


@dataclass(frozen=True)
class Observation:
    """Everything the cycle knows about one target this cycle: the planner's input."""

    target: config.Target
    window: tuple[snapshots.Snapshot, ...]
    signals: Mapping[str, Signal]
    info: EngineInfo
    gpus: GpuInputs


class Planner(Protocol):
    """Adapter around ``tuner.planning.planner.plan``; owns the planner's ``History`` between cycles."""

    def __call__(self, observation: Observation, *, now: float) -> PlanLike | None: ...


@dataclass(frozen=True)
class RolloutOutcome:
    """What the rollout did with the plans it was given.

    ``summary`` is a short clause for the cycle line; ``results`` maps target → restart result
    (``ok``, ``rolled_back``, ``failed``, ``skipped``…) for ``tuner_restarts_total``; ``state`` is shown
    under ``rollout`` in ``/status``. A target not in ``results`` was not restarted.
    """

    summary: str = ""
    results: Mapping[str, str] = field(default_factory=dict)
    state: Mapping[str, Any] = field(default_factory=dict)


class Rollout(Protocol):
    """Rolls plans out (apply mode only). ``maintenance_open``: None when no windows are configured.

    It must return between its steps once ``should_stop()`` is true (SIGTERM), leaving a consistent
    state it can resume from. ``signals``: this cycle's signals of every target, the baseline a
    rollout's verification compares against.
    """

    def __call__(self, plans: Mapping[str, PlanLike], *, now: float, maintenance_open: bool | None,
                 should_stop: Callable[[], bool],
                 signals: Mapping[str, Mapping[str, Signal]]) -> RolloutOutcome: ...


# --- maintenance windows ------------------------------------------------------------------------------


class MaintenanceWindows:
    """Crontab expressions read as sets of minutes. Raises ValueError naming a bad expression."""

    def __init__(self, expressions: Sequence[str], *, timezone: str = "UTC") -> None:
        from apscheduler.triggers.cron import CronTrigger

        if not expressions:
            raise ValueError("at least one crontab expression is needed, e.g. '* 2-4 * * *' (02:00-04:59)")
        self.expressions = tuple(expressions)
        self.timezone = timezone
        self._triggers = []
        for expr in expressions:
            try:
                self._triggers.append(CronTrigger.from_crontab(expr, timezone=timezone))
            except (ValueError, TypeError, LookupError) as exc:
                raise ValueError(f"maintenance window {expr!r}: {exc}; expected 5 crontab fields "
                                 "(minute hour day month weekday), e.g. '* 2-4 * * 6,0'") from exc
        self._tz = self._triggers[0].timezone

    def _minute(self, now: float) -> dt.datetime:
        return dt.datetime.fromtimestamp(now, self._tz).replace(second=0, microsecond=0)

    def is_open(self, now: float) -> bool:
        minute = self._minute(now)
        return any(t.get_next_fire_time(None, minute) == minute for t in self._triggers)

    def next_open(self, now: float) -> float | None:
        """When a window next opens (now if open); None if no expression ever fires again."""
        minute = self._minute(now)
        times = [t.get_next_fire_time(None, minute) for t in self._triggers]
        known = [t.timestamp() for t in times if t is not None]
        return min(known) if known else None


# --- state kept across cycles ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Deferred:
    plan: PlanLike
    since: float
    reason: str


@dataclass
class CycleState:
    """Mutable, owned by the loop thread. Readers (HTTP) only look at ``last`` (an immutable result)."""

    started_at: float = field(default_factory=time.time)
    number: int = 0
    windows: dict[str, deque[snapshots.Snapshot]] = field(default_factory=dict)
    deferred: dict[str, Deferred] = field(default_factory=dict)
    last: CycleResult | None = None
    rollout_state: Mapping[str, Any] = field(default_factory=dict)


# --- the result -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetResult:
    name: str
    signals: Mapping[str, Signal]
    info: EngineInfo
    gpus: GpuInputs
    snapshots: int
    scrape_error: str | None = None
    plan: PlanLike | None = None
    planner_error: str | None = None
    current_args: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CycleResult:
    number: int
    mode: str
    started_at: float  # seconds since the epoch (``now`` of the cycle)
    duration_seconds: float
    summary: str  # ONE line
    targets: Mapping[str, TargetResult]
    step_seconds: Mapping[str, float]
    deferred: Mapping[str, Deferred] = field(default_factory=dict)
    handed_over: tuple[str, ...] = ()  # targets whose plans went to the rollout
    rollout: RolloutOutcome | None = None
    stopped: str | None = None  # set when a stop request cut the cycle short

    @property
    def finished_at(self) -> float:
        return self.started_at + self.duration_seconds

    def record(self) -> dict[str, Any]:
        """The structured form of this cycle (one JSON log record)."""
        return {
            "cycle": self.number,
            "mode": self.mode,
            "summary": self.summary,
            "duration_seconds": round(self.duration_seconds, 6),
            "steps": {k: round(v, 6) for k, v in self.step_seconds.items()},
            "targets": {
                name: {
                    "scrape_error": t.scrape_error,
                    "snapshots": t.snapshots,
                    "plan": plan_json(t.plan) if t.plan is not None else None,
                    "planner_error": t.planner_error,
                } for name, t in self.targets.items()
            },
            "deferred": {name: {"since": d.since, "reason": d.reason, "plan": plan_json(d.plan)}
                         for name, d in self.deferred.items()},
            "handed_over": list(self.handed_over),
            "rollout": dataclasses.asdict(self.rollout) if self.rollout is not None else None,
            "stopped": self.stopped,
        }

    def status(self) -> dict[str, Any]:
        """``/status``: targets with their last signals, pending plans, rollout state."""
        return {
            "cycle": self.number,
            "mode": self.mode,
            "summary": self.summary,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "targets": {
                name: reports.report(t.signals, info=t.info, readings=t.gpus.readings, extra={
                    "window": {"snapshots": t.snapshots, "scrape_error": t.scrape_error},
                    "gpu_unavailable": t.gpus.unavailable,
                    "current_args": dict(t.current_args),
                    "plan": plan_json(t.plan) if t.plan is not None else None,
                    "planner_error": t.planner_error,
                }) for name, t in self.targets.items()
            },
            "pending": {name: {"since": d.since, "reason": d.reason, "plan": plan_json(d.plan)}
                        for name, d in self.deferred.items()},
            "rollout": {"summary": self.rollout.summary, "results": dict(self.rollout.results),
                        **dict(self.rollout.state)} if self.rollout is not None else None,
        }

    def recommendations(self) -> dict[str, Any]:
        """``/recommendations``: every proposed change and every held proposal, per target."""
        recs: list[dict[str, Any]] = []
        held: list[dict[str, Any]] = []
        for name, t in self.targets.items():
            if t.plan is None:
                continue
            recs += [{"target": name, **change_json(c)} for c in t.plan.changes]
            held += [{"target": name, **held_json(h)} for h in t.plan.held]
        return {
            "cycle": self.number, "mode": self.mode, "at": self.finished_at,
            "recommendations": recs, "held": held,
            "deferred": {name: [change_json(c) for c in d.plan.changes] for name, d in self.deferred.items()},
        }


# --- reading plan items without depending on their classes --------------------------------------------


def _get(obj: Any, *names: str) -> Any:
    for name in names:
        if isinstance(obj, Mapping) and name in obj:
            return obj[name]
        if hasattr(obj, name):
            value = getattr(obj, name)
            if not callable(value):
                return value
    return None


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _as_dict(obj: Any) -> dict[str, Any] | None:
    method = getattr(obj, "as_dict", None) or getattr(obj, "to_json", None)
    if callable(method):
        data = method()
        if isinstance(data, Mapping):
            return dict(data)
    return None


def change_json(change: Any) -> dict[str, Any]:
    own = _as_dict(change)
    if own is not None and "flag" in own:
        return own
    return {
        "flag": _text(_get(change, "flag", "knob")),
        "from": _text(_get(change, "from", "old", "from_value", "before", "current")),
        "to": _text(_get(change, "to", "new", "to_value", "after", "proposed")),
        "rule": _text(_get(change, "rule", "rule_id")),
        "reason": _text(_get(change, "reason")),
    }


def held_json(item: Any) -> dict[str, Any]:
    own = _as_dict(item)
    if own is not None and "rule" in own:
        return own
    return {"rule": _text(_get(item, "rule", "rule_id")), "guard": _text(_get(item, "guard", "verdict")),
            "reason": _text(_get(item, "reason"))}


def plan_json(plan: PlanLike) -> dict[str, Any]:
    own = _as_dict(plan)
    if own is not None:
        return own
    return {
        "summary": plan_summary(plan),
        "restart_needed": bool(plan.restart_needed),
        "changes": [change_json(c) for c in plan.changes],
        "held": [held_json(h) for h in plan.held],
        "actions": [_text(a) if not isinstance(a, Mapping) else dict(a) for a in plan.actions],
    }


_CYCLE_PREFIX = re.compile(r"^\s*cycle \d+:\s*")


def plan_summary(plan: PlanLike) -> str:
    """The plan's own line without a leading ``cycle N:`` (the cycle line has its own)."""
    return _CYCLE_PREFIX.sub("", " ".join(plan.summary().split()))


def _change_text(plan: PlanLike) -> str:
    parts = []
    for c in plan.changes:
        j = change_json(c)
        parts.append(f"{j['flag']} {j['from'] or '?'}→{j['to']}")
    return ", ".join(parts) or plan_summary(plan)


# --- the cycle ---------------------------------------------------------------------------------------------


def run_cycle(
    state: CycleState,
    *,
    settings: config.TunerSettings,
    collectors: Sequence[Collecting],
    planner: Planner | None = None,
    rollout: Rollout | None = None,
    maintenance: MaintenanceWindows | None = None,
    metrics: selfmetrics.TunerMetrics | None = None,
    engine_args: Callable[[str], Mapping[str, str]] | None = None,
    now: float | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    monotonic: Callable[[], float] = time.monotonic,
    max_workers: int = 8,
) -> CycleResult:
    """Run one cycle and return its result; ``state`` is updated in place (``state.last`` last).

    ``now``: the cycle's wall-clock time (seconds since the epoch; default: the clock). It trims the
    windows, judges staleness and maintenance windows, and is passed to the planner and the rollout.
    ``engine_args(target)``: the flags the target runs with (from the actuator); without it, what the
    engine itself reports (block size, gpu-memory-utilization, max-model-len).
    Never raises for a failing target, planner or rollout: the failure becomes part of the summary.
    """
    now = time.time() if now is None else now
    state.number += 1
    number = state.number
    mode = settings.mode
    scrape = settings.scrape
    t_start = monotonic()
    steps: dict[str, float] = {}
    stopped: str | None = None

    def timed(step: str, since: float) -> float:
        t = monotonic()
        steps[step] = t - since
        if metrics is not None:
            metrics.observe_step(step, t - since)
        return t

    # 1. collect -------------------------------------------------------------------------------------
    collected = _collect(collectors, metrics=metrics, max_workers=max_workers)
    t = timed("collect", t_start)

    # 2. windows and signals -------------------------------------------------------------------------
    stale = scrape.effective_stale_after()
    keep = max(8, min(100_000, math.ceil(scrape.window_seconds / scrape.interval_seconds) * 2 + 8))
    observations: dict[str, Observation] = {}
    targets: dict[str, TargetResult] = {}
    for c, (snap, info, gpus) in zip(collectors, collected, strict=True):
        name = c.target.name
        window = state.windows.get(name)
        if window is None or window.maxlen != keep:
            window = state.windows[name] = deque(window or (), maxlen=keep)
        window.append(snap)
        while window and window[0].scraped_at < now - scrape.window_seconds:
            window.popleft()
        dialect = dialects.DIALECTS[c.target.kind]
        signals = engine_signals.compute(list(window), dialect=dialect, info=info, now=now,
                                         stale_after_seconds=stale, min_snapshots=scrape.min_snapshots)
        signals.update(gpu_signals.compute(gpus.readings, unavailable=gpus.unavailable, now=now,
                                           stale_after_seconds=stale))
        if metrics is not None:
            metrics.set_signals(name, signals)
        observations[name] = Observation(c.target, tuple(window), signals, info, gpus)
        targets[name] = TargetResult(name, signals, info, gpus, len(window), scrape_error=snap.error,
                                     current_args=_current_args(name, signals, engine_args))
    for gone in set(state.windows) - set(targets):  # a target removed from the config
        del state.windows[gone]
        state.deferred.pop(gone, None)
        if metrics is not None:
            metrics.forget_target(gone)
    t = timed("signals", t)

    # 3. plan ------------------------------------------------------------------------------------------
    plans: dict[str, PlanLike] = {}
    if mode in ("recommend", "apply") and planner is not None:
        if should_stop():
            stopped = "stopping: skipped plan and act"
        else:
            for name, obs in observations.items():
                if targets[name].scrape_error:
                    continue  # a failed scrape is transient: no decision for this target this cycle
                try:
                    plan = planner(obs, now=now)
                except Exception as exc:  # a planner bug must not kill the daemon; say it every cycle
                    log.exception("planner failed for %s", name)
                    targets[name] = dataclasses.replace(targets[name], planner_error=f"{type(exc).__name__}: {exc}")
                    continue
                if plan is not None:
                    plans[name] = plan
                    targets[name] = dataclasses.replace(targets[name], plan=plan)
    t = timed("plan", t)

    # 4. act -------------------------------------------------------------------------------------------
    fresh: dict[str, PlanLike] = {}  # this cycle's plans going to the rollout
    released: dict[str, PlanLike] = {}  # deferred plans whose window has opened
    deferred_now: list[str] = []
    outcome: RolloutOutcome | None = None
    rollout_error: str | None = None
    window_open = maintenance.is_open(now) if maintenance is not None else None
    if mode == "apply" and rollout is not None and stopped is None:
        for name, plan in plans.items():
            if not plan.changes and not plan.actions:
                continue
            if plan.changes and plan.restart_needed and window_open is False:
                # a newer restart plan supersedes an older deferred one for the same target
                state.deferred[name] = Deferred(plan, now, _deferral_reason(maintenance, now))
                deferred_now.append(name)
            else:
                fresh[name] = plan
        if window_open is not False:
            released = {name: d.plan for name, d in state.deferred.items()
                        if name not in fresh and name in targets and not targets[name].scrape_error}
        if (fresh or released) and should_stop():
            stopped = "stopping: plans kept pending, not handed to the rollout"
            for name, plan in fresh.items():
                if plan.changes:
                    state.deferred[name] = Deferred(plan, now, "the tuner was stopping")
            fresh, released = {}, {}
        elif fresh or released:
            # released plans leave the queue; so does one superseded by a fresh plan with changes (an
            # actions-only plan, e.g. keep-warm requests, leaves a deferred restart where it is)
            for name in (*released, *(n for n, p in fresh.items() if p.changes)):
                state.deferred.pop(name, None)
            try:
                outcome = rollout({**released, **fresh}, now=now, maintenance_open=window_open,
                                  should_stop=should_stop,
                                  signals={name: tr.signals for name, tr in targets.items()})
                state.rollout_state = dict(outcome.state)
            except Exception as exc:  # the rollout journals its own state; the cycle reports and goes on
                log.exception("rollout failed")
                rollout_error = f"{type(exc).__name__}: {exc}"
    handed = {**released, **fresh}
    if metrics is not None:
        _count(metrics, mode, plans, handed, deferred_now, outcome, rollout_error, has_rollout=rollout is not None)
        for name, tr in targets.items():
            recommended = {change_json(c)["flag"]: change_json(c)["to"] for c in (tr.plan.changes if tr.plan else ())}
            metrics.set_engine_args(name, current=tr.current_args, recommended=recommended)
    t = timed("act", t)

    duration = t - t_start
    summary = _summary(number, mode, targets, plans, deferred_now, state.deferred, fresh, released, outcome,
                       rollout_error, stopped, has_rollout=rollout is not None, has_planner=planner is not None)
    result = CycleResult(
        number=number, mode=mode, started_at=now, duration_seconds=duration, summary=summary,
        targets=targets, step_seconds=dict(steps), deferred=dict(state.deferred), handed_over=tuple(handed),
        rollout=outcome, stopped=stopped,
    )
    if metrics is not None:
        metrics.observe_cycle(duration, finished_at=result.finished_at)
    state.last = result
    log.info(summary, extra={"tuner_cycle": result.record()})
    return result


def _collect(collectors: Sequence[Collecting], *, metrics: selfmetrics.TunerMetrics | None,
             max_workers: int) -> list[tuple[snapshots.Snapshot, EngineInfo, GpuInputs]]:
    def one(c: Collecting) -> tuple[snapshots.Snapshot, EngineInfo, GpuInputs]:
        name = c.target.name
        try:
            snap = c.scrape_engine()
        except Exception as exc:  # noqa: BLE001 - scrape() never raises; a fake or future source might
            snap = snapshots.Snapshot.failed(time.time(), f"{type(exc).__name__}: {exc}")
        if snap.ok:
            try:
                info = c.engine_info()
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, not raised
                info = EngineInfo(error=f"{type(exc).__name__}: {exc}")
        else:
            info = EngineInfo(error="not read: the /metrics scrape failed")
        try:
            gpus = c.read_gpus()
        except Exception as exc:  # noqa: BLE001 - one target's failure is reported, not raised
            gpus = GpuInputs(unavailable=f"{type(exc).__name__}: {exc}")
        if metrics is not None:
            if not snap.ok:
                metrics.count_scrape_error(target=name, source="engine")
            elif info.error:
                metrics.count_scrape_error(target=name, source="engine_info")
            if gpus.unavailable and c.target.gpu.kind != "none":
                metrics.count_scrape_error(target=name, source="gpu")
        return snap, info, gpus

    if len(collectors) <= 1:
        return [one(c) for c in collectors]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(max_workers, len(collectors)),
                                               thread_name_prefix="tuner-collect") as pool:
        return list(pool.map(one, collectors))


_CONFIG_FLAGS = (("block_size", "--block-size"), ("gpu_memory_utilization", "--gpu-memory-utilization"),
                 ("max_model_len", "--max-model-len"))


def _current_args(name: str, signals: Mapping[str, Signal],
                  engine_args: Callable[[str], Mapping[str, str]] | None) -> dict[str, str]:
    out = {flag: _text(signals[sig].value) for sig, flag in _CONFIG_FLAGS
           if sig in signals and signals[sig].value is not None}
    if engine_args is not None:
        try:
            out.update(engine_args(name))
        except Exception:  # the actuator may not know yet; the engine's own report stays
            log.debug("engine_args(%s) failed", name, exc_info=True)
    return out


def _deferral_reason(maintenance: MaintenanceWindows | None, now: float) -> str:
    nxt = maintenance.next_open(now) if maintenance is not None else None
    if nxt is None:
        return "outside the maintenance windows (none opens again)"
    when = dt.datetime.fromtimestamp(nxt, dt.UTC).strftime("%Y-%m-%d %H:%MZ")
    return f"outside the maintenance window; next opens {when}"


def _short_reason(item: Any) -> str:
    """A low-cardinality label: the guard's name, else the reason's first words without numbers."""
    guard = _text(_get(item, "guard"))
    if guard:
        return guard
    reason = _text(_get(item, "reason"))
    head = reason.split(":")[0].split("(")[0]
    words = [w for w in head.split() if not any(ch.isdigit() for ch in w)][:4]
    return " ".join(words) or "none"


def _count(metrics: selfmetrics.TunerMetrics, mode: str, plans: Mapping[str, PlanLike],
           handed: Mapping[str, PlanLike], deferred_now: Sequence[str], outcome: RolloutOutcome | None,
           rollout_error: str | None, *, has_rollout: bool) -> None:
    results = outcome.results if outcome is not None else {}
    for name, plan in plans.items():
        for item in plan.held:
            metrics.count_decision(rule=_text(_get(item, "rule", "rule_id")) or "unknown", outcome="held",
                                   reason=_short_reason(item))
        for change in plan.changes:
            rule = _text(_get(change, "rule", "rule_id")) or "unknown"
            if mode != "apply" or not has_rollout:
                how = "recommended"
            elif name in deferred_now:
                how = "deferred"
            elif name in handed:
                result = results.get(name)
                how = "failed" if rollout_error or (result is not None and result not in _OK_RESULTS) \
                    else "applied"
            else:
                how = "recommended"
            metrics.count_decision(rule=rule, outcome=how, reason=_short_reason(change))
    for target, result in results.items():
        metrics.count_restart(target=target, result=result)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _summary(number: int, mode: str, targets: Mapping[str, TargetResult], plans: Mapping[str, PlanLike],
             deferred_now: Sequence[str], deferred: Mapping[str, Deferred], fresh: Mapping[str, PlanLike],
             released: Mapping[str, PlanLike], outcome: RolloutOutcome | None, rollout_error: str | None,
             stopped: str | None, *, has_rollout: bool, has_planner: bool) -> str:
    def who(name: str) -> str:
        return "" if len(targets) == 1 else f"{name}: "

    parts: list[str] = []
    for name, t in targets.items():
        plan = plans.get(name)
        if t.scrape_error:
            parts.append(f"{who(name)}scrape failed ({t.scrape_error[:120]})")
        elif t.planner_error:
            parts.append(f"{who(name)}planner error ({t.planner_error[:120]})")
        elif mode == "observe" or not has_planner or (stopped and plan is None):
            parts.append(f"{who(name)}{_load_text(t.signals)}")
        elif plan is None:
            parts.append(f"{who(name)}no plan")
        elif name in deferred_now:
            parts.append(f"{who(name)}{_change_text(plan)} deferred ({deferred[name].reason})")
        elif name in fresh:
            parts.append(f"{who(name)}{_change_text(plan)} handed to the rollout")
        elif mode == "apply" and plan.changes and not has_rollout:
            parts.append(f"{who(name)}{plan_summary(plan)} (no rollout configured: not applied)")
        else:
            parts.append(f"{who(name)}{plan_summary(plan)}")
    for name, plan in released.items():
        parts.append(f"{name}: deferred {_change_text(plan)} handed to the rollout (maintenance window open)")
    waiting = [n for n in deferred if n not in deferred_now]
    if waiting:
        parts.append("still pending: " + ", ".join(waiting))
    if outcome is not None and outcome.summary:
        parts.append(f"rollout: {outcome.summary}")
    if rollout_error:
        parts.append(f"rollout error ({rollout_error[:160]})")
    if stopped:
        parts.append(stopped)
    if mode == "observe":
        ok = sum(1 for t in targets.values() if not t.scrape_error)
        head = f"observed {ok}/{len(targets)} target(s)"
        return _one_line(f"cycle {number}: {head}" + (f" ({'; '.join(parts)})" if parts else ""))
    return _one_line(f"cycle {number}: " + "; ".join(parts or ["no targets"]))


def _load_text(signals: Mapping[str, Signal]) -> str:
    def v(name: str, fmt: str) -> str:
        s = signals.get(name)
        return "?" if s is None or s.value is None else format(s.value, fmt)

    return f"running {v('requests_running', '.0f')}, waiting {v('requests_waiting', '.0f')}, " \
           f"kv {v('kv_cache_usage', '.0%')}"


# --- structured logs ----------------------------------------------------------------------------------------


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record; a cycle's record carries its ``record()`` under ``cycle``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        cycle = getattr(record, "tuner_cycle", None)
        if cycle is not None:
            out["cycle"] = cycle
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)
