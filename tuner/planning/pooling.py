"""The pool's decision: every replica's plan → one change for the whole pool, when it may go out, and
what its rollout does to the tuner's state. Pure; ``now`` is passed in.

The targets of one configuration are one pool of interchangeable replicas (same model, same flags but
their ports). Each replica is planned on its own signals (``stepping.step``); the pool then rolls ONE
change out to every replica, one at a time, so the pool never runs mixed arguments longer than a
rollout takes. Three pure functions, called by the daemon and by ``replay`` alike:

- ``choose``: which change (the first replica by name whose plan has one), every replica's new
  arguments (``knobs.with_knob``, so each engine kind gets its own spelling — SGLang's chunked prefill
  is ``--chunked-prefill-size -1``, not ``true``), the checks its verification applies, everything its
  rollout needs (a live change: each replica's values before and after, and the command line it
  stands for; a restart: the live values to reset to the new envelope first), and the actions
  to take now: keep-warm, sleep and wake per replica; at most one GPU power action for the pool (a cap
  wins over a restore). Warm-ups tied to a restart are the rollout's own WARM step.
- ``admit``: maintenance windows. Outside every window a change is deferred, not dropped: it stays
  pending (a newer change replaces it) and goes out in the first cycle inside a window, recomputed
  against the arguments of that moment.
- ``book``: a finished rollout → the owned arguments and histories. A replica moved to the new arguments
  keeps them and books the change (cooldown, hysteresis, budget); one rolled back books the restart and
  remembers the arguments — for good when the engine could not run them, for ``reject_seconds`` when
  they did no good; when the pool rolled back, every other replica remembers them as rejected too.
  Every replica the rollout touched was restarted and warmed by it (``history.rolled_out``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tuner.model import knobs, live
from tuner.planning import guards, verification
from tuner.planning import history as history_mod
from tuner.planning.planner import DecisionSettings, Plan, known_defaults
from tuner.signals import SignalSet

Result = Literal["ok", "rolled_back", "failed"]


@dataclass(frozen=True, slots=True)
class PoolChange:
    """One change for the whole pool, as its rollout carries it."""

    id: str  # the rollout's id
    plan: Plan  # the plan that proposed it (the leader's): its changes go to every replica
    new_args: Mapping[str, knobs.EngineArgs]  # every replica's arguments after the change (live: it stands for)
    checks: tuple[verification.Check, ...]
    # live: each replica's values in force before the change (tuner knob → value), its rollback target
    before: Mapping[str, Mapping[str, int | None]] = field(default_factory=dict)
    # restart: the live knobs that go back to the startup value first, or the restarted engine would
    # apply the old live value inside its new envelope
    resets: tuple[str, ...] = ()

    @property
    def leader(self) -> str:
        return self.plan.target

    @property
    def changes(self) -> tuple[history_mod.Change, ...]:
        return self.plan.changes

    @property
    def live(self) -> bool:
        """Every change moves live (no restart): ``values`` go to every replica's running engine."""
        return all(c.live for c in self.changes)

    @property
    def values(self) -> dict[str, int]:
        """A live change's values: tuner knob → value."""
        return {c.knob: int(c.to_value) for c in self.changes}

    def text(self) -> str:
        """``--max-num-seqs 8→16``."""
        return ", ".join(f"{c.flag} {knobs.format_value(c.from_value)}→{knobs.format_value(c.to_value)}"
                         for c in self.changes)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    change: PoolChange | None = None
    refused: str | None = None  # why the wanted change cannot go out (a replica's new arguments are invalid)
    actions: tuple[tuple[str, guards.Action], ...] = ()  # (replica, action) to take now


def choose(plans: Mapping[str, Plan], args: Mapping[str, knobs.EngineArgs], *, kind: knobs.EngineKind,
           settings: DecisionSettings, signals: Mapping[str, SignalSet], now: float,
           lives: Mapping[str, live.LiveState] | None = None) -> PoolPlan:
    """The pool's plan for this cycle (``choose`` in the module docstring). ``args``: every replica's
    current arguments (the pool); ``signals``: each replica's, for the defaults its engine reports."""
    actions: list[tuple[str, guards.Action]] = []
    power: tuple[str, guards.Action] | None = None
    for name in sorted(plans):
        for action in plans[name].actions:
            if action.after_restart:
                continue  # the rollout's WARM step
            if action.kind in ("power-cap", "power-restore"):
                if power is None or (action.kind == "power-cap" and power[1].kind != "power-cap"):
                    power = (name, action)
                continue
            actions.append((name, action))
    if power is not None:
        actions.append(power)
    wanting = [name for name in sorted(plans) if plans[name].changes]
    if not wanting:
        return PoolPlan(actions=tuple(actions))
    change, refused = change_for(plans[wanting[0]], args, kind=kind, settings=settings, signals=signals, now=now,
                                 lives=lives)
    return PoolPlan(change=change, refused=refused, actions=tuple(actions))


def change_for(plan: Plan, args: Mapping[str, knobs.EngineArgs], *, kind: knobs.EngineKind,
               settings: DecisionSettings, signals: Mapping[str, SignalSet], now: float,
               lives: Mapping[str, live.LiveState] | None = None) -> tuple[PoolChange | None, str | None]:
    """``plan``'s changes applied to every replica's arguments — or, for a live change, to every replica's
    running engine, each of which must be able to take it live; or None and why not."""
    new_args: dict[str, knobs.EngineArgs] = {}
    checks = verification.checks_of(plan.changes, slo=settings.slo)
    if plan.changes and all(c.live for c in plan.changes):
        before: dict[str, dict[str, int | None]] = {}
        for name, current in args.items():
            state = (lives or {}).get(name, live.NONE)
            for c in plan.changes:
                why = state.can_move(c.knob, float(c.to_value))
                if why is not None:
                    return None, f"not changed live: {name}: {c.flag} {knobs.format_value(c.to_value)}: {why}"
            before[name] = {c.knob: state.values.get(c.knob) for c in plan.changes}
            new_args[name] = _with_changes(current, plan, kind)
        return PoolChange(id=f"l{int(now)}", plan=plan, new_args=new_args, checks=checks, before=before), None
    for name, current in args.items():
        after = _with_changes(current, plan, kind)
        defaults = known_defaults(signals.get(name, {}), settings, kind)
        problems = knobs.validate(after, kind, platform=settings.engine.platform, defaults=defaults)
        if problems:
            return None, f"not rolled out: {name}: {'; '.join(problems)}"
        new_args[name] = after
    live_now = any(state.available for state in (lives or {}).values())
    resets = tuple(sorted({c.knob for c in plan.changes if c.knob in live.LIVE_NAMES})) if live_now else ()
    return PoolChange(id=f"r{int(now)}", plan=plan, new_args=new_args, checks=checks, resets=resets), None


def _with_changes(args: knobs.EngineArgs, plan: Plan, kind: knobs.EngineKind) -> knobs.EngineArgs:
    for c in plan.changes:
        args = knobs.with_knob(args, c.knob, c.to_value, kind=kind)
    return args


@dataclass(frozen=True, slots=True)
class Pending:
    """A change waiting for a maintenance window: the plan that proposed it, since when, why."""

    plan: Plan
    since: float
    reason: str


@dataclass(frozen=True, slots=True)
class Admission:
    hand_over: PoolChange | None  # goes to the rollout now
    pending: Pending | None  # waits (for a window, or because the tuner is stopping)
    deferred_now: bool = False  # this cycle's change was deferred
    released: bool = False  # a pending change went out because a window is open
    dropped: str | None = None  # a pending change that no longer applies, and why
    supersedes: bool = False  # it goes out while the live rollout in flight verifies (machine Rule 6)


def continues(change: PoolChange, verifying: Sequence[history_mod.Change]) -> bool:
    """``change`` may supersede the verification of the live change in flight (machine Rule 6): live, only
    knobs that change moved, each the same direction and further — or back, by a rule that fires on a broken
    SLO (``breach``: the price of the change being verified breaks it, and the lowering does not wait for
    that verification's verdict). Never an experimental change, on either side: it is kept only on its own
    verdict (the trace family, live-108 of seed 7 from vLLM's defaults: kv-preemption-cap's 1024 → 254 was
    superseded by its own 254 → 147 before it was judged; that one's verdict, generation −20 %, put it back
    to 254, never to 1024, and the pool served 0.78 × the default it started from)."""
    if not change.live or not verifying or not change.changes:
        return False
    for c in change.changes:
        v = next((v for v in verifying if v.knob == c.knob and v.live), None)
        if v is None or v.direction == 0 or c.direction == 0 or v.experimental or c.experimental:
            return False
        if c.direction != v.direction:
            if not c.breach:
                return False
            continue
        if (float(c.to_value) - float(v.to_value)) * v.direction <= 0:
            return False
    return True



def why_continues(change: PoolChange, verifying: Sequence[history_mod.Change]) -> str:
    """Why ``change`` supersedes the verification in flight (``continues`` said it may), for the journal: a
    reversal by a breach rule, named, or else the next step the same way — which a breach rule's step may be too
    (queue-slot-bound's raise after a raise: nothing is reversed, so nothing is said of a broken price)."""
    turned = [c for c in change.changes
              if any(v.knob == c.knob and v.live and v.direction != c.direction for v in verifying)]
    if turned:
        return f"{turned[0].rule} fires on a broken SLO; its reversal does not wait for this verdict"
    return "the next live step the same way"

def admit(pool: PoolPlan, pending: Pending | None, *, window_open: bool | None, stopping: bool,
          closed_reason: str, now: float, args: Mapping[str, knobs.EngineArgs], kind: knobs.EngineKind,
          settings: DecisionSettings, signals: Mapping[str, SignalSet],
          lives: Mapping[str, live.LiveState] | None = None, in_flight: bool = False,
          verifying: Sequence[history_mod.Change] = ()) -> Admission:
    """``admit`` of the module docstring. ``window_open``: None when no windows are configured. A
    pending change is chosen again against ``args`` (the arguments of now) when it is released.
    ``in_flight``: a rollout is still being carried out; nothing goes out until it is booked (a fresh
    change is planned again then, against what that rollout left; a pending one keeps waiting) — except a
    live change that ``continues`` the live change being verified (``verifying``: its changes, when every
    replica runs them): it supersedes that verification at once (machine Rule 6)."""
    if in_flight:
        fresh = pool.change
        if fresh is not None and not stopping and continues(fresh, verifying):
            return Admission(fresh, pending, supersedes=True)
        return Admission(None, pending)
    fresh = pool.change
    if fresh is not None:
        if stopping:
            return Admission(None, Pending(fresh.plan, now, "the tuner was stopping"))
        if window_open is False and not fresh.live:  # a live change restarts nothing: no window needed
            return Admission(None, Pending(fresh.plan, now, closed_reason), deferred_now=True)
        return Admission(fresh, None)  # a fresh change supersedes anything pending
    if pending is None or window_open is False or stopping or not guards.paused(settings.paused).allowed:
        return Admission(None, pending)  # paused: a pending change waits too
    pinned = next((r for c in pending.plan.changes if not (r := guards.pinned(c.knob, c.flag, settings.pins)).allowed),
                  None)
    if pinned is not None:  # pinned since it was deferred
        return Admission(None, None, dropped=pinned.reason)
    change, refused = change_for(pending.plan, args, kind=kind, settings=settings, signals=signals, now=now,
                                 lives=lives)
    if change is None:
        return Admission(None, None, dropped=refused)
    return Admission(change, None, released=True)


@dataclass(frozen=True, slots=True)
class ReplicaOutcome:
    """How one replica left the rollout."""

    result: Result
    tried: knobs.EngineArgs  # the arguments the rollout moved it to
    reason: str = ""
    bad_args: bool = False  # the engine could not run them (never proposed again)


def book(histories: Mapping[str, history_mod.History], args: Mapping[str, knobs.EngineArgs], *,
         changes: Sequence[history_mod.Change], outcomes: Mapping[str, ReplicaOutcome],
         pool_new_args: Mapping[str, knobs.EngineArgs], rolled_back: bool, now: float, reject_seconds: float,
         ) -> tuple[dict[str, history_mod.History], dict[str, knobs.EngineArgs]]:
    """``book`` of the module docstring: the histories and owned arguments after a finished rollout."""
    hist, owned = dict(histories), dict(args)
    moved_live = bool(changes) and all(c.live for c in changes)  # nothing was restarted
    for name, out in outcomes.items():
        h = hist[name] if moved_live else history_mod.rolled_out(hist[name], now=now)
        if out.result == "ok":
            if not moved_live:  # a live change leaves the command line as it is
                owned[name] = out.tried
            h = history_mod.applied(h, changes, now=now)
        else:
            if not moved_live:
                h = history_mod.restarted(h, now=now)
            h = history_mod.reverted(h, changes, now=now)
            why = out.reason or "rolled back"
            h = history_mod.failed_to_start(h, out.tried, reason=why) if out.bad_args else \
                history_mod.rejected(h, out.tried, reason=why, now=now, for_seconds=reject_seconds)
        hist[name] = h
    if rolled_back:  # one replica failed: the pool stays on the old arguments
        for name in hist:
            if name not in outcomes and name in pool_new_args:
                hist[name] = history_mod.rejected(hist[name], pool_new_args[name],
                                                  reason="rolled back on another replica", now=now,
                                                  for_seconds=reject_seconds)
                # and booked as put back on this replica too: the pool's next change is planned on any
                # replica's history, and one without the rollback proposed it again 97 s later (restart-000
                # of seed 3: 12 → 216, 289, 288, 290, a restart and one back each)
                hist[name] = history_mod.reverted(hist[name], changes, now=now)
    return hist, owned
