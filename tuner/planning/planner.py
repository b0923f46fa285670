"""The planner: one cycle's signals + current args + history → one ``Plan``. Pure; ``now`` is passed in.

How a cycle is decided (each step's "no" becomes a ``Held`` with the guard's reason):

1. Gate the window: unreadable (failed/stale/restarted) or idle (< min requests) → no decision; every
   streak resets. Keep-warm and post-restart warm-up actions are still planned.
2. Evaluate every rule (``rules.evaluation``): streaks grow on true, reset on false/unknown. A rule
   that is true but not yet for ``for`` windows is held as ``sustain``; one whose change is a no-op or
   cannot be computed is held as ``bounds``.
3. Optionally (``thermal.step_down``) add a thermal step-down of --max-num-seqs.
4. Walk the proposals by priority (higher first, then file order). One change per flag: a later
   proposal for a flag already changed is held as ``conflict``. Each proposal passes thermal, floor,
   cooldown, hysteresis, crash memory and engine validation *on top of the changes accepted so far*.
5. Experimental changes go out alone (their effect must be attributable): if anything else was
   accepted, they wait (``experimental``); if several are, the first wins.
6. The restart budget gates the whole change set (every change needs a restart).

Invariants (tested with hypothesis): no change leaves its rule's bounds, no plan exceeds the restart
budget, no --max-model-len change goes below the observed-need floor, and ``args_after`` passes
``knobs.validate``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, Field, field_validator

from tuner.model import bounds, knobs
from tuner.model import live as live_mod
from tuner.planning import guards, model_len
from tuner.planning.history import ROLLED_BACK, Change, History
from tuner.rules import evaluation, models
from tuner.rules.schema import Rule
from tuner.signals import SignalSet

THERMAL_RULE = "thermal-step-down"


class _Model(bounds.Settings, BaseModel):  # model.bounds: finite numbers, durations a scheduler holds
    pass


class EngineFacts(_Model):
    """What the tuner cannot read from /metrics but needs to know an absent flag's value."""

    platform: str | None = None
    """Attention platform for block-size validity and vLLM's defaults: cuda, cpu, cuda-flashinfer, ...
    (see knobs.BLOCK_SIZES). None: block sizes are not checked beyond > 0."""
    gpu_memory_gib: float | None = Field(default=None, gt=0)
    """Memory per GPU, for vLLM's documented --max-num-seqs / --max-num-batched-tokens defaults
    on CUDA (H200: 139). None: those defaults are unknown unless given in ``defaults``."""
    gpu_name: str | None = None
    """GPU model name (vLLM's defaults differ for A100)."""
    parallel: int = Field(default=1, ge=1)
    """Tensor × pipeline parallel size (scales the CPU defaults)."""
    defaults: dict[str, str] = {}
    """Known values of flags the command line leaves out, e.g. {"--max-num-seqs": "1024"}. These
    win over the documented defaults; the live engine's own report (block size, memory fraction,
    max model length) wins over both."""

    @field_validator("defaults")
    @classmethod
    def _known(cls, v: dict[str, str]) -> dict[str, str]:
        knobs.parse_defaults(f"{k}={val}" for k, val in v.items())  # raises ValueError with the list
        return v


class DecisionSettings(_Model):
    """Guards and planner settings: the ``decisions:`` section of the config file."""

    thermal: guards.ThermalSettings = guards.ThermalSettings()
    idle: guards.IdleSettings = guards.IdleSettings()
    safety: guards.SafetySettings = guards.SafetySettings()
    engine: EngineFacts = EngineFacts()
    slo: models.SloSettings = models.SloSettings()
    """The service level the rules steer to: they compare the tail with it (a queue-bound engine whose
    TTFT p99 misses it is still queue-bound) and the step-budget model aims at it."""
    model: models.ModelSettings = models.ModelSettings()
    """Parameters of the engine models rules compute one-step targets with (rules/models.py)."""
    paused: bool | str = False
    """Pause the tuner (KEDA's ``paused``): true, or why. It still observes and says what it would do, and
    changes nothing: every proposal and action is held (``paused``); a rollout in flight finishes.
    ``vllm-tuner pause`` / ``resume`` switch the same at runtime, across restarts (docs/operating.md)."""
    pins: dict[str, str] = {}
    """Engine flags the tuner leaves alone (VPA's per-container ``mode: Off``): flag → why, e.g.
    {"--max-model-len": "the clients need 32k"}. ``vllm-tuner pin`` / ``unpin`` add and remove pins at runtime."""

    @field_validator("pins")
    @classmethod
    def _pinnable(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = [flag for flag in v if knobs.knob_for(flag) is None]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a flag the tuner changes; expected one of "
                             f"{', '.join(knobs.known_flags())}")
        return v


# Guards that say *when*, not whether: a change they hold is what the law moves to once they pass, and a
# dry run (``recommend``, ``replay``) reports it as such, with the time (issue 25: "HELD with no value" was
# no answer to "what should my flags be").
TIME_GUARDS = frozenset({"sustain", "sustained", "cooldown", "hysteresis", "budget"})


@dataclass(frozen=True, slots=True)
class Held:
    """A rule that wanted something (or could not be evaluated) and a guard that said no, with why. ``would``:
    the change it holds (flag, from, to), where the rule computed one — for a guard of ``TIME_GUARDS`` the
    value the law moves to once that guard's time passed (``later``)."""

    rule: str  # "*" when the whole cycle was held
    guard: str
    reason: str
    would: tuple[str, knobs.Value, knobs.Value] | None = None

    @property
    def later(self) -> bool:
        """A change held only for time (``TIME_GUARDS``): it applies once the guard's time passed."""
        return self.would is not None and self.guard in TIME_GUARDS

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "guard": self.guard, "reason": self.reason}
        if self.would is not None:
            flag, before, after = self.would
            out["would"] = {"flag": flag, "from": knobs.format_value(before), "to": knobs.format_value(after)}
        return out


@dataclass(frozen=True, slots=True)
class Plan:
    target: str
    cycle: int
    at: float
    kind: knobs.EngineKind
    changes: tuple[Change, ...]
    held: tuple[Held, ...]
    actions: tuple[guards.Action, ...]
    args_before: knobs.EngineArgs
    args_after: knobs.EngineArgs
    outcomes: tuple[evaluation.Outcome, ...]
    history: History
    """The history after this cycle was observed (streaks, idle, keep-warm). If the changes are
    applied, continue with ``history_mod.applied(plan.history, plan.changes, now=...)``."""

    @property
    def restart_needed(self) -> bool:
        """A change needs a restart unless it is live (the admission cap or the step budget moved inside
        the engine's startup envelope, ``model.live``)."""
        return any(not c.live for c in self.changes)

    @property
    def is_noop(self) -> bool:
        return not self.changes and not self.actions

    def summary(self) -> str:
        """One line: ``cycle 812: no action (kv-pressure: cooldown 4m12s left)``."""
        head = f"cycle {self.cycle}:"
        parts: list[str] = []
        if self.changes:
            parts.append(", ".join(f"{c.flag} {knobs.format_value(c.from_value)}→"
                                   f"{knobs.format_value(c.to_value)} ({c.rule}{', live' if c.live else ''})"
                                   for c in self.changes) + ("; restart needed" if self.restart_needed else ""))
        for a in self.actions:
            parts.append(f"{a.label()} ({a.reason})")
        if not parts:
            why = self._main_hold()
            return f"{head} no action ({why})"
        return f"{head} " + "; ".join(parts)

    def _main_hold(self) -> str:
        order = ("paused", "window", "idle", "thermal", "budget", "crash", "engine", "floor", "cooldown", "hysteresis",
                 "conflict", "experimental", "bounds", "sustain", "pinned")
        ranked = sorted(self.held, key=lambda h: order.index(h.guard) if h.guard in order else len(order))
        if not ranked:
            return "no rule matched"
        h = ranked[0]
        return h.reason if h.rule == "*" else f"{h.rule}: {h.reason}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "cycle": self.cycle,
            "at": self.at,
            "recommendations": [c.as_dict() for c in self.changes],
            "held": [h.as_dict() for h in self.held],
            "actions": [a.as_dict() for a in self.actions],
            "restart_needed": self.restart_needed,
            "args": self.args_after.argv(),
            "summary": self.summary(),
        }


def known_defaults(signals: SignalSet, settings: DecisionSettings, kind: knobs.EngineKind
                   ) -> dict[str, knobs.Value]:
    """Values for flags absent from the command line: documented < configured < live engine."""
    facts = settings.engine
    documented = knobs.documented_defaults(kind, platform=facts.platform, gpu_memory_gib=facts.gpu_memory_gib,
                                           gpu_name=facts.gpu_name, parallel=facts.parallel)
    configured = knobs.parse_defaults(f"{k}={v}" for k, v in facts.defaults.items())
    live: dict[str, knobs.Value] = {}
    for signal, knob in (("block_size", "block_size"), ("gpu_memory_utilization", "gpu_memory_utilization"),
                         ("max_model_len", "max_model_len")):
        sig = signals.get(signal)
        if sig is not None and sig.value is not None:
            live[knob] = int(sig.value) if knobs.KNOBS[knob].type == "int" else sig.value
    return knobs.merged_defaults(documented, configured, live)


def thermal_step_down(signals: SignalSet, ctx: evaluation.Context, settings: guards.ThermalSettings
                      ) -> evaluation.Proposal | None:
    """While thermally throttled: --max-num-seqs × step_down_factor (never below step_down_min)."""
    if not settings.step_down:
        return None
    why = guards.hot(signals, settings)
    if why is None:
        return None
    current = ctx.flag_value("max_num_seqs")
    if current.value is None or isinstance(current.value, bool):
        return None
    cur = int(current.value)
    new = max(settings.step_down_min, int(cur * settings.step_down_factor))
    if new >= cur:
        return None
    flag = ctx.flag_name("--max-num-seqs")
    return evaluation.Proposal(
        rule=THERMAL_RULE, knob="max_num_seqs", flag=flag, from_value=cur, to_value=new, direction=-1,
        reason=f"{why}: fewer concurrent sequences, less heat", priority=1_000_000,
    )


def plan(
    target: str,
    signals: SignalSet,
    args: knobs.EngineArgs,
    history: History,
    settings: DecisionSettings,
    *,
    rules: Iterable[Rule],
    kind: knobs.EngineKind = "vllm",
    now: float,
    restarted_at: float | None = None,
    power_control: bool = False,
    live: live_mod.LiveState = live_mod.NONE,
    regime_since: float | None = None,
) -> Plan:
    """Decide this cycle for one target.

    ``signals``: engine + GPU signals of the current window. ``history``: from the previous cycle's
    ``Plan.history`` (updated with ``history.applied`` if it was applied). ``restarted_at``: the
    engine's process start time when the step saw it change (plans a warm-up once per restart, unless
    the tuner's own rollout restarted and warmed it). ``power_control``: plan GPU power caps
    (``gpu_control.enabled``; privileged, off by default). ``regime_since``: when the arrivals last changed regime
    (the change point the decision window restarted at, ``stepping``): a live change made before it no longer
    holds the next one (``_regime_passed``).
    """
    rules = list(rules)
    cycle = history.cycle + 1
    defaults = known_defaults(signals, settings, kind)
    platform = settings.engine.platform
    ctx = evaluation.Context(signals=signals, args=args, kind=kind, defaults=defaults, platform=platform,
                             slo=settings.slo, model=settings.model, live=live)
    held: list[Held] = []
    actions: list[guards.Action] = []
    outcomes: tuple[evaluation.Outcome, ...] = ()
    accepted: list[Change] = []
    args_after = args

    gate = guards.window(signals)
    stop = guards.paused(settings.paused)
    if not stop.allowed:  # said first, whatever else holds
        held.append(Held("*", stop.guard, stop.reason))
    raise_only: guards.Ruling | None = None  # the idle guard, waived for a raise of the cap alone
    if gate.allowed:
        gate = guards.idle(signals, settings.idle)
        if not gate.allowed:
            slots = ctx.flag_value("--max-num-seqs").value
            backlog = guards.backlog_at_cap(signals, float(slots) if isinstance(slots, int | float) else None)
            if backlog is not None:
                raise_only = guards.deny(gate.guard, f"{gate.reason}; only a raise of the cap goes out on a "
                                                     f"queue at the cap ({backlog})")
                gate = guards.allow("idle", backlog)
    if not gate.allowed:
        held.append(Held("*", gate.guard, gate.reason))
    else:
        outcomes = evaluation.evaluate(rules, ctx, streaks=history.streaks)
        proposals: list[evaluation.Proposal] = []
        for o in outcomes:
            if o.status == "fired" and o.proposal is not None:
                proposals.append(o.proposal)
            elif o.status == "sustaining":
                p = o.proposal
                held.append(Held(o.rule, "sustain", o.reason,
                                 (p.flag, p.from_value, p.to_value) if p is not None else None))
            elif o.status in ("no-op", "blocked"):
                held.append(Held(o.rule, "bounds", o.reason))
        step_down = thermal_step_down(signals, ctx, settings.thermal)
        if step_down is not None:
            proposals.insert(0, step_down)
        if raise_only is not None:
            held.extend(Held(p.rule, raise_only.guard, raise_only.reason, (p.flag, p.from_value, p.to_value))
                        for p in proposals if not _raises_cap(p))
            proposals = [p for p in proposals if _raises_cap(p)]
        accepted, args_after, more_held = _choose(proposals, ctx, signals, history, settings, now=now,
                                                   regime_since=regime_since)
        held.extend(more_held)

    if any(not c.live for c in accepted):
        budget = guards.restart_budget(history, settings.safety, now=now)
        if not budget.allowed:
            held.extend(Held(c.rule, budget.guard, budget.reason, (c.flag, c.from_value, c.to_value))
                        for c in accepted)
            accepted, args_after = [], args

    since = guards.idle_since(signals, history, now=now)
    last_keep_warm = history.last_keep_warm
    last_restart_seen = history.last_restart_seen
    new_restart = restarted_at is not None and restarted_at != history.last_restart_seen
    if new_restart:
        last_restart_seen = restarted_at
        own = history.own_restarts_until
        if own is not None and restarted_at is not None and restarted_at <= own:
            new_restart = False  # the tuner's own rollout restarted it and warmed it up already
    power_capped = history.power_capped
    if power_control:
        cap = guards.power(signals, settings.thermal, capped=power_capped)
        if cap is not None:
            actions.append(cap)
            power_capped = cap.kind == "power-cap"
    if any(not c.live for c in accepted):
        flags = ", ".join(c.flag for c in accepted if not c.live)
        warm = guards.warm_up(settings.idle, reason=f"the restart for {flags}")
        if warm is not None:
            actions.append(warm)
    elif new_restart:
        warm = guards.warm_up(settings.idle, reason="the engine restarted")
        if warm is not None:
            actions.append(replace(warm, after_restart=False))
    else:
        nap = guards.sleep_or_wake(signals, settings.idle, now=now, since=since)
        if nap is not None:
            actions.append(nap)
        elif (keep := guards.keep_warm(signals, history, settings.idle, now=now, since=since)) is not None:
            actions.append(keep)
            last_keep_warm = now

    if not stop.allowed and actions:  # paused: no action either (keep-warm, sleep, power caps)
        held.extend(Held("*", stop.guard, f"{stop.reason}; not done: {a.label()}") for a in actions)
        actions = []
        power_capped, last_keep_warm = history.power_capped, history.last_keep_warm

    streaks = evaluation.next_streaks(outcomes)
    # a new streak's evidence begins where the window it was first true on began (guards.sustained)
    span = signals.get("window_seconds")
    first = now - (span.value if span is not None and span.value is not None else 0.0)
    streak_since = {r: (history.streak_since.get(r, first) if r in history.streaks else first) for r in streaks}
    next_history = replace(
        history, cycle=cycle, streaks=_frozen(streaks), streak_since=_frozen(streak_since), idle_since=since,
        last_keep_warm=last_keep_warm, last_restart_seen=last_restart_seen, power_capped=power_capped,
    )
    return Plan(target=target, cycle=cycle, at=now, kind=kind, changes=tuple(accepted), held=tuple(held),
                actions=tuple(actions), args_before=args, args_after=args_after, outcomes=outcomes,
                history=next_history)


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


def _floored(p: evaluation.Proposal, floor: model_len.Floor) -> evaluation.Proposal:
    """A --max-model-len lowering that undershoots the observed need is raised to the floor (if that is
    still a lowering); the floor guard then only has to refuse what cannot be floored."""
    if floor.tokens is None or float(p.to_value) >= floor.tokens or floor.tokens >= float(p.from_value):
        return p
    return replace(p, to_value=floor.tokens,
                   reason=f"{p.reason}; floored at {floor.tokens} by observed need ({floor.reason})")


def _bracketed(p: evaluation.Proposal, history: History, settings: DecisionSettings, *, now: float,
               live: bool) -> evaluation.Proposal:
    """A reversal within the hysteresis period (live or by restart), clamped halfway back (``guards.bracket``);
    unchanged when the halfway point is within the model's deadband of today's value (the hysteresis then
    holds it)."""
    span = guards.bracket(p.knob, p.direction, history, settings=settings.safety, now=now, live=live)
    if span is None or isinstance(p.to_value, bool):
        return p
    _, half = span
    at, to = float(p.from_value), float(p.to_value)  # from today's value (an operator may have moved it)
    if (to - half) * p.direction <= 0:  # already within the bracket
        return p
    clamped: float = round(half, 4) if isinstance(p.to_value, float) else \
        (math.floor(half) if p.direction > 0 else math.ceil(half))
    if abs(clamped - at) < settings.model.min_step * max(abs(at), 1e-9) or (clamped - at) * p.direction <= 0:
        return p
    return replace(p, to_value=clamped, reason=f"{p.reason}; halfway back at most within the hysteresis → "
                                               f"{knobs.format_value(clamped)}")


def _retries(p: evaluation.Proposal, history: History, *, live: bool) -> bool:
    """``p``, live, adds capacity on a broken SLO (a breach rule that adds load: the queue misses its TTFT) after
    the knob's last change, the same rule's, was put back by its verification (``history.reverted``:
    queue-slot-bound's raise is verified on its price, the median TPOT). It is tried again halfway toward the value
    put back (``_bracketed``) and at once (``guards.cooldown``): the hysteresis grants a breach rule no exception
    against a verdict, so unclamped it held the next raise for the whole live hysteresis while the queue grew at the
    value put back (the trace family, seed 31's live-006: 8 → 642 put back to 8 on its TPOT at +32 s, then held at 8
    for 516 s with 400-800 waiting, 0.087 × the best static; bisected at once, 8 → 325 at +36 s, 0.81 ×). A lowering
    put back is not retried so: its verdict said the lowering did not help, and a smaller one would not either
    (live-011 of seed 1 flapped 123 → 61 → 123 → 81 → 123). By restart nothing changes: a restart costs a replica,
    and the hysteresis holds it."""
    last = history.changes.get(p.knob)
    return live and p.breach and p.adds_load and last is not None and last.rule == p.rule + ROLLED_BACK


def _verdicts(p: evaluation.Proposal, candidate: knobs.EngineArgs, ctx: evaluation.Context, signals: SignalSet,
              history: History, settings: DecisionSettings, *, now: float, floor: model_len.Floor | None,
              live: bool = False) -> Iterator[guards.Ruling]:
    """The guards one proposal must pass, in order (lazily: the first "no" is the reason). A live change
    has the live cooldown and hysteresis and needs no start-up validation (the command line stays)."""
    yield guards.paused(settings.paused)
    yield guards.pinned(p.knob, p.flag, settings.pins)
    yield guards.thermal(signals, settings.thermal, adds_load=p.adds_load)
    if p.knob == "max_model_len" and p.direction < 0:
        assert floor is not None
        yield model_len.floor_check(p.to_value, floor, from_value=p.from_value)
    yield guards.cooldown(p.knob, p.flag, history, rule_cooldown_seconds=p.cooldown_seconds,
                          settings=settings.safety, now=now, live=live, direction=p.direction, breach=p.breach,
                          experiment=p.rule if p.experimental else None,
                          retry_to=float(p.to_value) if _retries(p, history, live=live) else None)
    if p.rule != THERMAL_RULE:  # cooling down beats not flapping
        yield guards.hysteresis(p.knob, p.flag, p.direction, history, settings=settings.safety, now=now,
                                live=live, breach=p.breach, to_value=float(p.to_value))
    yield guards.crash_memory(candidate, history, now=now)
    if not live:
        yield guards.engine_constraints(candidate, ctx.kind, platform=ctx.platform, defaults=dict(ctx.defaults))
        if p.rule != THERMAL_RULE:  # a restart: evidence proportional to its cost
            yield guards.sustained(p.rule, signals, history, settings.safety, now=now)
            yield guards.payback(signals, settings.safety, knob=p.knob, from_value=float(p.from_value),
                                 to_value=float(p.to_value), alpha=settings.model.tpot_exponent)


def _regime_passed(knob: str, history: History, regime_since: float | None) -> History:
    """``history`` as the live guards read it for ``knob``: its last change forgotten where the arrivals changed
    regime after it. Its cooldown, hysteresis and bracket guard a reversal judged on the load it was made in; a new
    load is judged on its own window (issue 25: a decision before a change point is superseded when the regime
    changes). The trace family, seed 13's live-152: 113 → 132 by slots-past-frontier, put back in a phase of
    1,668/106-token requests; at +218 s a flood of 98 short requests/s began, and the hysteresis held every raise
    at 113 — "lowered 132→113 … no reversal for 8m" — while 1,000 waited at a TPOT p99 of 0.025 s."""
    last = history.changes.get(knob)
    if regime_since is None or last is None or last.at >= regime_since:
        return history
    return replace(history, changes={k: v for k, v in history.changes.items() if k != knob})


def _raises_cap(p: evaluation.Proposal) -> bool:
    """A raise of the admission cap (``--max-num-seqs``; SGLang's ``--max-running-requests``)."""
    return p.knob == "max_num_seqs" and p.direction > 0


def _choose(
    proposals: Sequence[evaluation.Proposal],
    ctx: evaluation.Context,
    signals: SignalSet,
    history: History,
    settings: DecisionSettings,
    *,
    now: float,
    regime_since: float | None = None,
) -> tuple[list[Change], knobs.EngineArgs, list[Held]]:
    """Steps 4 and 5 of the module docstring."""
    held: list[Held] = []
    accepted: list[tuple[evaluation.Proposal, Change]] = []
    args_after = ctx.args
    floor: model_len.Floor | None = None
    order = {id(p): i for i, p in enumerate(proposals)}
    for p in sorted(proposals, key=lambda p: (-p.priority, order[id(p)])):
        taken = next((c for _, c in accepted if c.knob == p.knob), None)
        if taken is not None:
            held.append(Held(p.rule, "conflict", f"{p.flag} is already changed this cycle by {taken.rule} "
                             "(higher priority)"))
            continue
        if p.knob == "max_model_len" and p.direction < 0:
            floor = floor or model_len.max_model_len_floor(signals, settings.safety)
            p = _floored(p, floor)
        movable = ctx.live.can_move(p.knob, float(p.to_value)) is None
        guarded = _regime_passed(p.knob, history, regime_since) if movable else history
        # a breach rule's live reversal goes whole (the hysteresis lets it), unless it retries a raise put back; by
        # restart the hysteresis grants a breach rule nothing, so its reversal is clamped halfway like any other's
        # (unclamped, the restart mode's queue held a put-back raise for the whole hour: seed 37's restart-029)
        if (not (p.breach and movable) or _retries(p, guarded, live=movable)) and not isinstance(p.to_value, bool):
            p = _bracketed(p, guarded, settings, now=now, live=movable)
        # the command line as it would be: what crash and rejection memory key on, for a live change too
        candidate = knobs.with_knob(args_after, p.knob, p.to_value, kind=ctx.kind)
        live = ctx.live.can_move(p.knob, float(p.to_value)) is None
        verdicts = _verdicts(p, candidate, ctx, signals, guarded if live else history, settings, now=now,
                             floor=floor, live=live)
        denied = next((v for v in verdicts if not v.allowed), None)
        if denied is not None:
            held.append(Held(p.rule, denied.guard, denied.reason, (p.flag, p.from_value, p.to_value)))
            continue
        change = Change(flag=p.flag, knob=p.knob, from_value=p.from_value, to_value=p.to_value, rule=p.rule,
                        reason=p.reason, direction=p.direction, adds_load=p.adds_load,
                        experimental=p.experimental, verify=p.verify, live=live, breach=p.breach)
        accepted.append((p, change))
        if not live:
            args_after = candidate

    chosen = [c for _, c in accepted]
    experimental = [c for c in chosen if c.experimental]
    if experimental and len(chosen) > 1:
        regular = [c for c in chosen if not c.experimental]
        keep = regular or experimental[:1]
        for c in (c for c in chosen if c not in keep):
            other = ", ".join(k.rule for k in keep)
            held.append(Held(c.rule, "experimental", f"an experimental change goes out alone so its effect "
                             f"can be measured; waiting for {other}", (c.flag, c.from_value, c.to_value)))
        chosen = keep
    if any(c.live for c in chosen) and any(not c.live for c in chosen):
        for c in chosen:  # the restart re-sizes the engine anyway; the live change is decided on the new one
            if c.live:
                held.append(Held(c.rule, "conflict", f"{c.flag} would change live, but a restart goes out this "
                                 "cycle; decided again on the restarted engine", (c.flag, c.from_value, c.to_value)))
        chosen = [c for c in chosen if not c.live]
    if len(chosen) == len(accepted):
        return chosen, args_after, held
    args_after = ctx.args
    for c in chosen:
        if not c.live:
            args_after = knobs.with_knob(args_after, c.knob, c.to_value, kind=ctx.kind)
    verdict = guards.engine_constraints(args_after, ctx.kind, platform=ctx.platform, defaults=dict(ctx.defaults))
    if not verdict.allowed:  # the kept subset alone is invalid: change nothing this cycle
        held.extend(Held(c.rule, verdict.guard, verdict.reason) for c in chosen)
        return [], ctx.args, held
    return chosen, args_after, held
