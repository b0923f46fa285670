"""The journal oracle: the tuner's rollout journal read back, for the assertions and for the figures of
docs/performance.md ("Rollouts").

A replica's rollout is over when its state is one of the rollout machine's own terminal states
(``tuner.rollout.machine.TERMINAL``: done, rolled back, failed, failed while serving, and ``left``, a replica
gone for good), never a second list of them here.
"""

from __future__ import annotations

import collections
import contextlib
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.rollout import machine


def journal_records(path: Path) -> list[dict[str, Any]]:
    """The journal's complete records (a torn last line, which only a crash leaves, is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().split(b"\n"):
        if line.strip():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def events(records: Iterable[Mapping[str, Any]], rollout_id: str | None = None) -> list[Mapping[str, Any]]:
    return [r for r in records if r["kind"] == "event" and (rollout_id is None or r["rollout_id"] == rollout_id)]


def rollout_ids(records: Iterable[Mapping[str, Any]]) -> list[str]:
    return [r["rollout"]["id"] for r in records if r["kind"] == "rollout"]


# The rollout machine's terminal states (its own set): a replica there has left the rollout for good.
TERMINAL = frozenset(s.value for s in machine.TERMINAL)
# Those that halt the rollout: the replicas still pending are never started.
HALTING = frozenset(s.value for s in machine.FAILURES) | {machine.State.ROLLED_BACK.value}


def finished(records: Sequence[Mapping[str, Any]], rollout_id: str) -> bool:
    """Every replica of the rollout reached a terminal state of the rollout machine (``TERMINAL``: ``left``,
    a replica gone for good, is one), or the rollout halted (aborted, rolled back, failed) with nothing in
    flight."""
    begun = next((r["rollout"] for r in records if r["kind"] == "rollout" and r["rollout"]["id"] == rollout_id), None)
    if begun is None:
        return False
    last = dict.fromkeys(begun["order"], "pending")
    for e in events(records, rollout_id):
        last[e["replica"]] = e["to"]
    aborted = any(r["kind"] == "abort" and r["rollout_id"] == rollout_id for r in records)
    halted = aborted or any(s in HALTING for s in last.values()) or any(
        e["leg"] == "back" for e in events(records, rollout_id))
    return all(s in TERMINAL or (s == "pending" and halted) for s in last.values())


# States in which a replica is out of the load balancer (drained) or not running the old arguments.
OUT_OF_SERVICE = {"draining", "waiting_idle", "stopping", "starting", "waiting_healthy", "confirming_args",
                  "warming", "undraining", "rolling_back"}


def out_of_service(records: Iterable[Mapping[str, Any]], rollout_id: str) -> dict[str, list[tuple[float, float]]]:
    """Per replica, the [from, to) intervals (journal clock) it spent drained or restarting."""
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    since: dict[str, float] = {}
    for e in events(records, rollout_id):
        name, to = e["replica"], e["to"]
        if to in OUT_OF_SERVICE and name not in since:
            since[name] = e["at"]
        elif to not in OUT_OF_SERVICE and name in since:
            spans[name].append((since.pop(name), e["at"]))
    for name, t in since.items():
        spans[name].append((t, float("inf")))
    return dict(spans)


def overlaps(spans: Mapping[str, Sequence[tuple[float, float]]]) -> list[tuple[str, str, float, float]]:
    """Pairs of replicas out of service at the same time: (a, b, overlap start, overlap end)."""
    out = []
    names = sorted(spans)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for s1, e1 in spans[a]:
                for s2, e2 in spans[b]:
                    lo, hi = max(s1, s2), min(e1, e2)
                    if lo < hi:
                        out.append((a, b, lo, hi))
    return out


@dataclass
class ReplicaTiming:
    name: str
    drain_to_stopped: float | None = None  # drain → the old engine is gone (drain, idle wait, stop)
    start_seconds: float | None = None  # launched → /health and /v1/models answer (the restart time)
    trigger_to_serving: float | None = None  # the decision → new flags live and undrained (back in nginx)
    out_of_service_seconds: float | None = None  # drained → undrained


@dataclass
class RolloutTiming:
    rollout_id: str
    outcome: str
    trigger_to_done: float | None = None  # the decision → the last replica verified
    replicas: list[ReplicaTiming] = field(default_factory=list)


def timeline(records: Sequence[Mapping[str, Any]], rollout_id: str) -> RolloutTiming:
    """Durations of one rollout from the journal's own timestamps (the tuner's clock)."""
    decision = next((r for r in records if r["kind"] == "decision" and r.get("rollout") == rollout_id), None)
    begun = next(r for r in records if r["kind"] == "rollout" and r["rollout"]["id"] == rollout_id)
    t0 = decision["at"] if decision is not None else begun["at"]
    evs = events(records, rollout_id)
    last: dict[str, str] = {}
    timing = RolloutTiming(rollout_id, outcome="running")
    for name in begun["rollout"]["order"]:
        mine = [e for e in evs if e["replica"] == name and e["leg"] == "forward"]

        def at(to: str, _mine: list[Mapping[str, Any]] = mine) -> float | None:
            return next((e["at"] for e in reversed(_mine) if e["to"] == to), None)

        rt = ReplicaTiming(name)
        drained, stopped, started, healthy_at, undrained = (at("draining"), at("starting"), at("waiting_healthy"),
                                                            at("confirming_args"), at("verifying"))
        if drained is not None and stopped is not None:
            rt.drain_to_stopped = stopped - drained
        if started is not None and healthy_at is not None:
            rt.start_seconds = healthy_at - started
        if undrained is not None:
            rt.trigger_to_serving = undrained - t0
            if drained is not None:
                rt.out_of_service_seconds = undrained - drained
        timing.replicas.append(rt)
        for e in evs:
            if e["replica"] == name:
                last[name] = e["to"]
    states = set(last.values())
    if "done" in states and states <= {"done", "left"} and len(last) == len(begun["rollout"]["order"]):
        timing.outcome = "done"
        timing.trigger_to_done = max(e["at"] for e in evs if e["to"] == "done") - t0
    elif states & {"failed", "failed_serving"}:
        timing.outcome = "failed"
    elif "rolled_back" in states:
        timing.outcome = "rolled_back"
    return timing


def median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
