"""What the planner remembers between cycles, as one frozen value with pure update functions.

Each target's ``History`` travels in its ``stepping.TargetState``: every step takes the plan's history
(streaks, idle, keep-warm), and ``pooling.book`` records what a finished rollout did — ``applied`` (the
change went out), ``restarted`` + ``failed_to_start`` / ``rejected`` (rolled back), ``rolled_out`` (the
tuner's own restart, warmed up by its rollout).

Nothing here reads a clock or a file; ``to_dict``/``from_dict`` give a JSON shape for the daemon's
state file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from tuner.model import knobs
from tuner.rules.schema import Verify

Fingerprint = tuple[tuple[str, str], ...]
DAY_SECONDS = 86400.0


@dataclass(frozen=True, slots=True)
class Change:
    """One flag change of a plan: ``flag`` from → to, because ``rule`` said ``reason``."""

    flag: str
    knob: str
    from_value: knobs.Value
    to_value: knobs.Value
    rule: str
    reason: str
    direction: int  # +1 up / on, -1 down / off
    adds_load: bool = False
    experimental: bool = False
    verify: tuple[Verify, ...] = ()
    live: bool = False  # applied to the running engine (no restart): the admission cap, the step budget
    breach: bool = False  # proposed by a rule that fires on a broken SLO (Rule.breach): a live reversal of it
                          # supersedes the verification in flight (machine Rule 6)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "flag": self.flag, "from": knobs.format_value(self.from_value),
            "to": knobs.format_value(self.to_value), "rule": self.rule, "reason": self.reason,
        }
        if self.live:
            out["live"] = True
        if self.experimental:
            out["experimental"] = True
        if self.verify:
            out["verify"] = [v.as_dict() for v in self.verify]
        return out


@dataclass(frozen=True, slots=True)
class FlagChange:
    """The last applied change of one knob: when, which way, by which rule."""

    at: float
    direction: int
    rule: str
    from_value: str
    to_value: str


def _frozen(d: Mapping[Any, Any] | None = None) -> Mapping[Any, Any]:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True, slots=True)
class History:
    cycle: int = 0
    """Cycles planned so far (the summary line's number)."""
    streaks: Mapping[str, int] = field(default_factory=_frozen)
    """Rule id → consecutive windows its condition has been true."""
    streak_since: Mapping[str, float] = field(default_factory=_frozen)
    """Rule id → where the evidence of its current streak begins: the start of the window it was first true
    on (a restart needs the evidence sustained ``restart_evidence_seconds``)."""
    changes: Mapping[str, FlagChange] = field(default_factory=_frozen)
    """Knob name → its last applied change (cooldown, hysteresis)."""
    restarts: tuple[float, ...] = ()
    """Times of restarts the tuner caused, newest last, the last day only (restart budget)."""
    bad_args: Mapping[Fingerprint, str] = field(default_factory=_frozen)
    """Crash memory: command lines (``EngineArgs.fingerprint``) the engine refused to start with or
    crashed on, with why. Never proposed again."""
    rejected_args: Mapping[Fingerprint, tuple[float, str]] = field(default_factory=_frozen)
    """Command lines rolled back because they did no good: fingerprint → (not before, why)."""
    idle_since: float | None = None
    """When the engine was last seen going idle (None: it is busy, or unknown)."""
    last_keep_warm: float | None = None
    """When the last keep-warm requests were planned."""
    last_restart_seen: float | None = None
    """Process start time of the last engine restart seen (each one gets a warm-up, the tuner's own excepted)."""
    own_restarts_until: float | None = None
    """When the tuner's last rollout of this replica finished: an engine start seen before then is the
    tuner's own restart, already warmed up by the rollout (no second warm-up, no "the engine restarted")."""
    power_capped: bool = False
    """A GPU power cap was planned for this target's GPUs and not yet restored (``gpu_control``)."""

    def restarts_within(self, seconds: float, *, now: float) -> int:
        return sum(1 for t in self.restarts if now - t < seconds)

    def is_bad(self, args: knobs.EngineArgs, *, now: float | None = None) -> str | None:
        """Why ``args`` must not be proposed (now), or None. ``now`` None: rejections never expire."""
        fp = args.fingerprint()
        if fp in self.bad_args:
            return self.bad_args[fp]
        if fp in self.rejected_args:
            until, why = self.rejected_args[fp]
            if now is None or now < until:
                left = "" if now is None else f"; not retried for another {until - now:.0f}s"
                return f"rolled back: {why}{left}"
        return None


def applied(history: History, changes: Iterable[Change], *, now: float) -> History:
    """The plan's changes went out (one restart, unless every one of them was live). Streaks restart:
    older windows show the old engine."""
    changes = list(changes)
    if not changes:
        return history
    last = dict(history.changes)
    for c in changes:
        last[c.knob] = FlagChange(now, c.direction, c.rule, knobs.format_value(c.from_value),
                                  knobs.format_value(c.to_value))
    restarts = history.restarts if all(c.live for c in changes) else _recent((*history.restarts, now), now=now)
    return replace(history, changes=_frozen(last), streaks=_frozen(), restarts=restarts, idle_since=None)


ROLLED_BACK = " (rolled back)"  # FlagChange.rule of a change its verification put back (``reverted``)


def reverted(history: History, changes: Iterable[Change], *, now: float) -> History:
    """A change put back by its verification (live or by restart): the knob moved back, the other way, so the
    cooldown and the hysteresis hold what would reverse that, halfway back at most (guards.bracket) — and a rule
    that fires on a broken SLO (``breach``) is not let past them again (guards.cooldown), but for its own live raise
    put back, retried halfway at once while the queue breaks the SLO (planner ``_retries``). A live lowering whose
    TPOT did not fall, tried again at once with another value, flapped 123 → 61 → 123 → 81 → 123 on the trace family
    (live-011 of seed 1, long prompts: the prefills, not the batch, set the TPOT there); by restart, 12 → 216, 289,
    288, 290 went out 97-370 s after each rollback, a restart of the replica and one back each time (restart-000 of
    seed 3: the cooldown was never re-armed)."""
    last = dict(history.changes)
    for c in changes:
        last[c.knob] = FlagChange(now, -c.direction, c.rule + ROLLED_BACK, knobs.format_value(c.to_value),
                                  knobs.format_value(c.from_value))
    return replace(history, changes=_frozen(last))


def restarted(history: History, *, now: float) -> History:
    """A restart the tuner caused without a flag change (a rollback): it counts toward the budget."""
    return replace(history, restarts=_recent((*history.restarts, now), now=now), streaks=_frozen())


def rolled_out(history: History, *, now: float) -> History:
    """The tuner's rollout restarted and warmed this replica just now (whatever the verdict): its next
    engine start time is the tuner's own, and the warm-up counts as a keep-warm."""
    return replace(history, own_restarts_until=now, last_keep_warm=now)


def failed_to_start(history: History, args: knobs.EngineArgs, *, reason: str) -> History:
    """Crash memory: ``args`` never gets proposed again."""
    bad = dict(history.bad_args)
    bad[args.fingerprint()] = reason
    return replace(history, bad_args=_frozen(bad))


def rejected(history: History, args: knobs.EngineArgs, *, reason: str, now: float, for_seconds: float) -> History:
    """A change rolled back because it did no good (verification, a slow start): not proposed again
    before ``now + for_seconds`` (traffic changes; a refused start is ``failed_to_start``, for good)."""
    rejected = {fp: v for fp, v in history.rejected_args.items() if v[0] > now}  # forget expired ones
    rejected[args.fingerprint()] = (now + for_seconds, reason)
    return replace(history, rejected_args=_frozen(rejected))


def _recent(times: Iterable[float], *, now: float) -> tuple[float, ...]:
    return tuple(t for t in times if now - t < DAY_SECONDS)


# --- JSON ----------------------------------------------------------------------------------------------


def to_dict(history: History) -> dict[str, Any]:
    return {
        "cycle": history.cycle,
        "streaks": dict(history.streaks),
        "streak_since": dict(history.streak_since),
        "changes": {k: {"at": c.at, "direction": c.direction, "rule": c.rule, "from": c.from_value,
                        "to": c.to_value} for k, c in history.changes.items()},
        "restarts": list(history.restarts),
        "bad_args": [{"args": [list(p) for p in fp], "reason": why} for fp, why in history.bad_args.items()],
        "rejected_args": [{"args": [list(p) for p in fp], "until": until, "reason": why}
                          for fp, (until, why) in history.rejected_args.items()],
        "idle_since": history.idle_since,
        "last_keep_warm": history.last_keep_warm,
        "last_restart_seen": history.last_restart_seen,
        "own_restarts_until": history.own_restarts_until,
        "power_capped": history.power_capped,
    }


def from_dict(data: Mapping[str, Any]) -> History:
    changes = {k: FlagChange(float(c["at"]), int(c["direction"]), str(c["rule"]), str(c["from"]), str(c["to"]))
               for k, c in dict(data.get("changes", {})).items()}
    bad = {tuple((str(a), str(b)) for a, b in entry["args"]): str(entry["reason"])
           for entry in data.get("bad_args", [])}
    rejected = {tuple((str(a), str(b)) for a, b in entry["args"]): (float(entry["until"]), str(entry["reason"]))
                for entry in data.get("rejected_args", [])}
    return History(
        cycle=int(data.get("cycle", 0)),
        streaks=_frozen({str(k): int(v) for k, v in dict(data.get("streaks", {})).items()}),
        streak_since=_frozen({str(k): float(v) for k, v in dict(data.get("streak_since", {})).items()}),
        changes=_frozen(changes),
        restarts=tuple(float(t) for t in data.get("restarts", [])),
        bad_args=_frozen(bad),
        rejected_args=_frozen(rejected),
        idle_since=data.get("idle_since"),
        last_keep_warm=data.get("last_keep_warm"),
        last_restart_seen=data.get("last_restart_seen"),
        own_restarts_until=data.get("own_restarts_until"),
        power_capped=bool(data.get("power_capped", False)),
    )


def shifted(history: History, *, by: float) -> History:
    """Every time ``history`` holds moved by ``by`` seconds (the loop re-based on a stepped wall clock:
    ``daemon.clocks``). Engine start times are the engine's own clock, not the loop's: kept."""
    if not by:
        return history
    return replace(
        history,
        streak_since=_frozen({k: v + by for k, v in history.streak_since.items()}),
        changes=_frozen({k: replace(c, at=c.at + by) for k, c in history.changes.items()}),
        restarts=tuple(t + by for t in history.restarts),
        rejected_args=_frozen({k: (until + by, why) for k, (until, why) in history.rejected_args.items()}),
        idle_since=None if history.idle_since is None else history.idle_since + by,
        last_keep_warm=None if history.last_keep_warm is None else history.last_keep_warm + by,
        own_restarts_until=None if history.own_restarts_until is None else history.own_restarts_until + by,
    )


def latest_time(history: History) -> float | None:
    """The latest time ``history`` holds (for a state file written while the wall clock ran ahead)."""
    times = [*history.streak_since.values(), *(c.at for c in history.changes.values()), *history.restarts,
             *(t for t in (history.idle_since, history.last_keep_warm, history.own_restarts_until) if t is not None)]
    return max(times, default=None)
