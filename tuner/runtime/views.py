"""What a cycle shows: its one summary line, its structured log record, ``/status``,
``/recommendations``, and what it counts in the self-metrics. Formatting only: nothing here decides."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Mapping
from typing import Any

from tuner.model import knobs, live
from tuner.planning import planner, pooling
from tuner.runtime import selfmetrics
from tuner.runtime.results import CycleResult, RolloutOutcome
from tuner.runtime.scheduling import MaintenanceWindows
from tuner.signals import Signal, reports, value_of

_OK = frozenset({"ok"})
_CYCLE_PREFIX = re.compile(r"^\s*cycle \d+:\s*")


def plan_summary(plan: planner.Plan) -> str:
    """The plan's own line without its leading ``cycle N:`` (the cycle line has its own)."""
    return _CYCLE_PREFIX.sub("", " ".join(plan.summary().split()))


def deferral_reason(maintenance: MaintenanceWindows | None, now: float) -> str:
    nxt = maintenance.next_open(now) if maintenance is not None else None
    if nxt is None:
        return "outside the maintenance windows (none opens again)"
    when = dt.datetime.fromtimestamp(nxt, dt.UTC).strftime("%Y-%m-%d %H:%MZ")
    return f"outside the maintenance window; next opens {when}"


def _load_text(signals: Mapping[str, Signal]) -> str:
    def v(name: str, fmt: str) -> str:
        value = value_of(signals, name)
        return "?" if value is None else format(value, fmt)

    return f"running {v('requests_running', '.0f')}, waiting {v('requests_waiting', '.0f')}, " \
           f"kv {v('kv_cache_usage', '.0%')}"


def summary(result: CycleResult, *, has_rollout: bool) -> str:
    """The cycle's ONE line."""
    targets, admission = result.targets, result.admission
    change = admission.hand_over if admission is not None else None
    deferred = result.pending.plan.target if admission is not None and admission.deferred_now and result.pending \
        else None

    def who(name: str) -> str:
        return "" if len(targets) == 1 else f"{name}: "

    parts: list[str] = []
    for name, t in targets.items():
        plan = t.plan
        if t.scrape_error:
            parts.append(f"{who(name)}scrape failed ({t.scrape_error[:120]})")
        elif t.planner_error:
            parts.append(f"{who(name)}planner error ({t.planner_error[:120]})")
        elif t.held:
            parts.append(f"{who(name)}held: {t.held[:200]}")
        elif plan is None:
            parts.append(f"{who(name)}{_load_text(t.signals)}")
        elif name == deferred and result.pending is not None:
            parts.append(f"{who(name)}{_changes(plan)} deferred ({result.pending.reason})")
        elif change is not None and name == change.leader and not admission_released(result):
            parts.append(f"{who(name)}{change.text()} handed to the rollout")
        elif change is not None and plan.changes and _same(plan, change):
            parts.append(f"{who(name)}{_changes(plan)} (in the pool's change)")
        elif result.mode == "apply" and plan.changes and not has_rollout:
            parts.append(f"{who(name)}{plan_summary(plan)} (no rollout configured: not applied)")
        else:
            parts.append(f"{who(name)}{plan_summary(plan)}")
    if change is not None and admission_released(result):
        parts.append(f"deferred {change.text()} handed to the rollout (maintenance window open)")
    if admission is not None and admission.dropped:
        parts.append(f"pending change dropped ({admission.dropped})")
    if result.pool is not None and result.pool.refused:
        parts.append(result.pool.refused)
    if result.pending is not None and not (admission is not None and admission.deferred_now):
        parts.append(f"still pending: {_changes(result.pending.plan)} ({result.pending.reason})")
    if result.rollout is not None and result.rollout.summary:
        parts.append(f"rollout: {result.rollout.summary}")
    if result.rollout_error:
        parts.append(f"rollout error ({result.rollout_error[:160]})")
    if result.stopped:
        parts.append(result.stopped)
    if result.mode == "observe":
        ok = sum(1 for t in targets.values() if not t.scrape_error)
        head = f"observed {ok}/{len(targets)} target(s)"
        return _one_line(f"cycle {result.number}: {head}" + (f" ({'; '.join(parts)})" if parts else ""))
    return _one_line(f"cycle {result.number}: " + "; ".join(parts or ["no targets"]))


def admission_released(result: CycleResult) -> bool:
    return result.admission is not None and result.admission.released


def _same(plan: planner.Plan, change: pooling.PoolChange) -> bool:
    return {(c.flag, c.to_value) for c in plan.changes} <= {(c.flag, c.to_value) for c in change.changes}


def _changes(plan: planner.Plan) -> str:
    return ", ".join(f"{c.flag} {c.as_dict()['from']}→{c.as_dict()['to']}" for c in plan.changes) or plan_summary(plan)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def gist(result: CycleResult) -> tuple[Any, ...]:
    """What a cycle's line says, without what changes every cycle (its number, load figures, time left on a
    cooldown): two cycles with the same gist say the same thing, and the daemon logs it once
    (``cycle.run_cycle``) — then again when it changes, and every ``REPEAT_SECONDS``."""
    targets = tuple(
        (name, t.scrape_error is not None, t.planner_error is not None,
         tuple((c.flag, c.as_dict()["to"], c.rule) for c in t.plan.changes) if t.plan is not None else None,
         tuple(a.kind for a in t.plan.actions) if t.plan is not None else None,
         tuple(sorted({(h.rule, h.guard) for h in t.plan.held})) if t.plan is not None else None)
        for name, t in sorted(result.targets.items()))
    pending = tuple((c.flag, c.as_dict()["to"]) for c in result.pending.plan.changes) if result.pending else None
    handed = result.handed_over.id if result.handed_over is not None else None
    rollout = result.rollout.summary if result.rollout is not None else None
    return (result.mode, targets, pending, handed, rollout, result.rollout_error, result.stopped,
            result.pool.refused if result.pool is not None else None)


REPEAT_SECONDS = 600.0  # an unchanged line is said again this often, so a quiet log still shows the tuner alive


# --- structured views ----------------------------------------------------------------------------------


def _pending_json(pending: pooling.Pending | None) -> dict[str, Any] | None:
    if pending is None:
        return None
    return {"target": pending.plan.target, "since": pending.since, "reason": pending.reason,
            "plan": pending.plan.as_dict()}


def _change_json(change: pooling.PoolChange | None) -> dict[str, Any] | None:
    if change is None:
        return None
    return {"id": change.id, "leader": change.leader, "changes": [c.as_dict() for c in change.changes],
            "args": {name: a.argv() for name, a in change.new_args.items()}}


def record(result: CycleResult) -> dict[str, Any]:
    """The structured form of a cycle (one JSON log record)."""
    return {
        "cycle": result.number,
        "mode": result.mode,
        "summary": result.summary,
        "duration_seconds": round(result.duration_seconds, 6),
        "steps": {k: round(v, 6) for k, v in result.step_seconds.items()},
        "targets": {
            name: {"scrape_error": t.scrape_error, "snapshots": t.snapshots,
                   "plan": t.plan.as_dict() if t.plan is not None else None, "planner_error": t.planner_error,
                   "held": t.held}
            for name, t in result.targets.items()
        },
        "pending": _pending_json(result.pending),
        "handed_over": _change_json(result.handed_over),
        "refused": result.pool.refused if result.pool is not None else None,
        "rollout": dataclasses.asdict(result.rollout) if result.rollout is not None else None,
        "stopped": result.stopped,
    }


def status(result: CycleResult) -> dict[str, Any]:
    """``/status``: targets with their last signals, the pending change, the rollout."""
    return {
        "cycle": result.number,
        "mode": result.mode,
        "summary": result.summary,
        "started_at": result.started_at,
        "finished_at": result.finished_at,
        "targets": {
            name: reports.report(t.signals, info=t.info, readings=t.gpus.readings, extra={
                "window": {"snapshots": t.snapshots, "scrape_error": t.scrape_error},
                "gpu_unavailable": t.gpus.unavailable,
                "current_args": dict(t.current_args),
                "plan": t.plan.as_dict() if t.plan is not None else None,
                "planner_error": t.planner_error,
                "held": t.held,
                "live": _live_json(t.live),
            }) for name, t in result.targets.items()
        },
        "pending": _pending_json(result.pending),
        "rollout": {"summary": result.rollout.summary, "results": dict(result.rollout.results),
                    **dict(result.rollout.state)} if result.rollout is not None else None,
    }


def _live_json(state: live.LiveState) -> dict[str, Any]:
    if not state.available:
        return {"available": False, "why_not": state.why_not}
    return {"available": True, "via": state.via, "values": dict(state.values), "envelope": dict(state.envelope),
            "not_live": dict(state.not_live), "seq": state.seq, "refused": state.refused, "pids": list(state.pids)}


def recommendations(result: CycleResult) -> dict[str, Any]:
    """``/recommendations``: every proposed change and every held proposal, per target."""
    recs: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    for name, t in result.targets.items():
        if t.plan is None:
            continue
        recs += [{"target": name, **c.as_dict()} for c in t.plan.changes]
        held += [{"target": name, **h.as_dict()} for h in t.plan.held]
    return {"cycle": result.number, "mode": result.mode, "at": result.finished_at,
            "recommendations": recs, "held": held, "pending": _pending_json(result.pending)}


# --- self-metrics ----------------------------------------------------------------------------------------


def count(metrics: selfmetrics.TunerMetrics, mode: str, plans: Mapping[str, planner.Plan],
          pool: pooling.PoolPlan | None, admission: pooling.Admission | None, outcome: RolloutOutcome | None,
          rollout_error: str | None, *, has_rollout: bool) -> None:
    """``tuner_decisions_total`` and ``tuner_restarts_total``. A replica's change that is the pool's
    change shares its outcome (applied, failed, deferred); any other change is only recommended. The
    ``reason`` label is the guard for a held decision and ``fired`` for a change (low cardinality). A
    change is ``applied`` once handed to the rollout; how the rollout ended is ``tuner_restarts_total``'s
    ``result`` (``count_finished``), counted when it finishes. A decision the next cycle makes again
    (the same recommendation, the same hold) is not counted again (``TunerMetrics.count_decisions``)."""
    results = outcome.results if outcome is not None else {}
    handed = admission.hand_over if admission is not None else None
    deferred = admission.pending if admission is not None and admission.deferred_now else None
    if handed is not None:
        failed = rollout_error is not None or any(r not in _OK for r in results.values())
        pooled, how = handed.changes, "failed" if failed else "applied"
    elif deferred is not None:
        pooled, how = deferred.plan.changes, "deferred"
    else:
        pooled, how = (), "recommended"
    keys = {(c.flag, c.to_value) for c in pooled}
    for target, plan in plans.items():
        decided = {(h.rule, "held", h.guard, "") for h in plan.held}
        for c in plan.changes:
            outcome_of = how if mode == "apply" and has_rollout and (c.flag, c.to_value) in keys else "recommended"
            decided.add((c.rule, outcome_of, "fired", f"{c.flag}={knobs.format_value(c.to_value)}"))
        metrics.count_decisions(target, decided)
    count_finished(metrics, outcome)


def count_finished(metrics: selfmetrics.TunerMetrics, outcome: RolloutOutcome | None) -> None:
    """``tuner_restarts_total`` for a rollout that finished — in a cycle or between cycles (a rollout in
    flight has no results yet); ``tuner_live_changes_total`` instead when it changed the running engines
    without a restart."""
    live_rollout = outcome is not None and outcome.state.get("kind") == "live"
    for target, result in (outcome.results if outcome is not None else {}).items():
        if live_rollout:
            metrics.count_live_change(target=target, result=result)
        else:
            metrics.count_restart(target=target, result=result)
