"""Evaluating rules: (rules, signals, current args, streaks) → one ``Outcome`` per rule. Pure.

Conditions use three-valued logic: true, false, or unknown (a signal is None, a flag's value is not
known, a quantile is too coarse). Only *true* counts toward ``for: N``; unknown resets the streak like
false does — a rule never fires on data it could not read.

Coarse quantiles: with ``max_resolution`` set, a quantile whose bucket is wider is judged on the whole
bucket — if every value in [lower, upper] satisfies the comparison it is true, if none does it is
false, otherwise unknown. So "p95 queue time in the 0–0.3 s bucket" is a definite *no* for "> 0.5 s"
and an honest *don't know* for "> 0.2 s".

Every outcome carries a human reason that quotes the values it used, e.g.
``queue_time_mean_s 4.1 > 0.2; requests_running_max 4 ≥ 3.6 (0.9×--max-num-seqs 4)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from tuner.model import knobs, live
from tuner.rules import models
from tuner.rules.schema import AllOf, AnyOf, Comparison, Ref, Rule, Verify
from tuner.signals import SignalSet

Value = knobs.Value
Status = Literal["disabled", "not-applicable", "false", "unknown", "sustaining", "fired", "no-op", "blocked"]

_SYMBOL = {"<": "<", "<=": "≤", ">": ">", ">=": "≥", "==": "=", "!=": "≠"}
_NEGATION = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def fmt(value: float | bool | None) -> str:
    """Short human form: 4 → ``4``, 0.0123456 → ``0.01235``, True → ``on``."""
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "on" if value else "off"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


@dataclass(frozen=True, slots=True)
class Context:
    """What conditions and changes are evaluated against."""

    signals: SignalSet
    args: knobs.EngineArgs
    kind: knobs.EngineKind = "vllm"
    defaults: Mapping[str, Value] = field(default_factory=dict)
    """Known defaults for flags absent from ``args`` (knob name → value)."""
    platform: str | None = None
    """For block-size validity (``knobs.BLOCK_SIZES``); None: any positive size."""
    slo: models.SloSettings = field(default_factory=models.SloSettings)
    """The service level objectives conditions may compare with (``slo:``) and models aim at."""
    model: models.ModelSettings = field(default_factory=models.ModelSettings)
    """The engine models' parameters (``op: model``)."""
    live: live.LiveState = live.NONE
    """What the engine can change live and runs now: a live value wins over the command line's."""

    def flag_value(self, flag: str) -> knobs.Effective:
        knob = knobs.knob_for(flag)
        if knob is not None and self.live.available and knob.name in self.live.values:
            return knobs.Effective(self.live.values[knob.name], "live")
        return knobs.effective(flag, self.args, kind=self.kind, defaults=self.defaults)

    def flag_name(self, flag: str) -> str:
        """The target engine's spelling of a flag given in either engine's spelling."""
        return _flag_name(flag, self.kind)


Text = str | Callable[[], str]
"""A reason's text, or how to build it: most conditions are false or unknown and nobody reads why, so a
condition's text (a ``fmt`` of each number it quotes) is built only when it is read. A builder only formats
values taken when the condition was checked, so the text is what building it then would have given."""


def _resolved(obj: object, attr: str) -> str:
    """A lazy text attribute (``Text``) of an immutable ``obj``, built on first read and kept."""
    text = getattr(obj, attr)
    if not isinstance(text, str):
        text = text()
        object.__setattr__(obj, attr, text)
    return str(text)


class Truth:
    """A condition's three-valued truth, and the text of its deciding parts (``text``, built when first read)."""

    __slots__ = ("_text", "value")

    def __init__(self, value: bool | None, text: Text) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "_text", text)

    value: bool | None
    _text: Text

    @property
    def text(self) -> str:
        return _resolved(self, "_text")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Truth is immutable: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Truth):
            return NotImplemented
        return (self.value, self.text) == (other.value, other.text)

    def __hash__(self) -> int:
        return hash((self.value, self.text))

    def __repr__(self) -> str:
        return f"Truth(value={self.value!r}, text={self.text!r})"


def _number(value: Value | None) -> float | None:
    if value is None:
        return None
    return float(value)


def _ref_value(ctx: Context, name: str) -> tuple[float | None, Callable[[], str]]:
    """Current value of a signal or flag, and how to say it (or why it is unknown)."""
    if name.startswith("-"):
        eff = ctx.flag_value(name)
        kind = ctx.kind
        if eff.value is None:
            return None, lambda: f"{_flag_name(name, kind)} unknown ({eff.reason})"
        value = eff.value
        return _number(value), lambda: f"{_flag_name(name, kind)} {fmt(value)}"
    sig = ctx.signals.get(name)
    if sig is None or sig.value is None:
        why = sig.reason if sig is not None and sig.reason else "not computed"
        return None, lambda: f"{name} unknown ({why})"
    number = sig.value
    return number, lambda: f"{name} {fmt(number)}"


def _flag_name(flag: str, kind: knobs.EngineKind) -> str:
    knob = knobs.knob_for(flag)
    return (knob.flag(kind) if knob is not None else None) or flag


def _compare(left: float, op: str, right: float) -> bool:
    if op == "<":
        return left < right
    if op == "<=":
        return left <= right
    if op == ">":
        return left > right
    if op == ">=":
        return left >= right
    if op == "==":
        return math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-12)
    return not math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-12)


def _right_text(c: Comparison, right: float, ref_text: Callable[[], str] | None) -> str:
    if ref_text is not None:  # c.times
        return f"{fmt(right)} ({fmt(c.factor)}×{ref_text()})"
    if c.slo is not None:
        return f"{fmt(right)} (SLO {c.slo}" + (f" × {fmt(c.factor)})" if c.factor != 1 else ")")
    return fmt(c.factor)


def _check_comparison(c: Comparison, ctx: Context) -> Truth:
    # right side
    right = c.factor
    ref_text: Callable[[], str] | None = None
    if c.times is not None:
        ref, ref_text = _ref_value(ctx, c.times)
        if ref is None:
            return Truth(None, ref_text)
        right = c.factor * ref
    elif c.slo is not None:
        right = c.factor * ctx.slo.value(c.slo)

    # left side
    if c.flag is not None:
        left, left_text = _ref_value(ctx, c.flag)
        if left is None:
            return Truth(None, left_text)
        ok = _compare(left, c.op, right)
        return Truth(ok, lambda: f"{left_text()} {_SYMBOL[c.op if ok else _NEGATION[c.op]]} "
                                 f"{_right_text(c, right, ref_text)}")

    assert c.signal is not None
    sig = ctx.signals.get(c.signal)
    if sig is None or sig.value is None:
        why = sig.reason if sig is not None and sig.reason else "not computed"
        return Truth(None, lambda: f"{c.signal} unknown ({why})")
    coarse = c.max_resolution is not None and sig.bounds is not None and (
        sig.resolution is None or sig.resolution > c.max_resolution)
    if coarse:
        assert sig.bounds is not None
        lo, hi = sig.bounds
        at_lo, at_hi = _compare(lo, c.op, right), _compare(hi, c.op, right)
        if at_lo and at_hi:
            return Truth(True, lambda: f"{c.signal} in bucket {fmt(lo)}–{fmt(hi)} {_SYMBOL[c.op]} "
                                       f"{_right_text(c, right, ref_text)}")
        if not at_lo and not at_hi and c.op not in ("==", "!="):
            return Truth(False, lambda: f"{c.signal} in bucket {fmt(lo)}–{fmt(hi)} {_SYMBOL[_NEGATION[c.op]]} "
                                        f"{_right_text(c, right, ref_text)}")
        resolution = sig.resolution
        return Truth(None, lambda: f"{c.signal} in bucket {fmt(lo)}–{fmt(hi)}: too coarse to tell whether "
                                   f"{_SYMBOL[c.op]} {_right_text(c, right, ref_text)} (bucket width "
                                   f"{'unbounded' if resolution is None else fmt(resolution)} > "
                                   f"{fmt(c.max_resolution)} allowed)")
    value = sig.value
    ok = _compare(value, c.op, right)
    return Truth(ok, lambda: f"{c.signal} {fmt(value)} {_SYMBOL[c.op if ok else _NEGATION[c.op]]} "
                             f"{_right_text(c, right, ref_text)}")


def check(cond: Comparison | AllOf | AnyOf, ctx: Context) -> Truth:
    """Three-valued truth of a condition, with the text of the deciding parts."""
    if isinstance(cond, Comparison):
        return _check_comparison(cond, ctx)
    return _check_parts(cond.all if isinstance(cond, AllOf) else cond.any, every=isinstance(cond, AllOf), ctx=ctx)


def _check_parts(conds: Iterable[Comparison | AllOf | AnyOf], *, every: bool, ctx: Context) -> Truth:
    """``all`` (``every``): one false decides (False), else one unknown (None), else every part is true;
    ``any``: one true decides (True), else one unknown (None), else every part is false. The parts after the
    first decisive one are not checked (checking is pure: they could change neither the value nor the text)."""
    parts: list[Truth] = []
    for c in conds:
        part = check(c, ctx)
        if part.value is (not every):
            return Truth(not every, part._text)
        parts.append(part)
    unknown = next((p for p in parts if p.value is None), None)
    if unknown is not None:
        return Truth(None, unknown._text)
    return Truth(every, lambda: ("; " if every else " and ").join(p.text for p in parts))


# --- proposals -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proposal:
    """A rule's wish to change one flag. The planner's guards decide whether it becomes a change."""

    rule: str
    knob: str
    flag: str  # the target engine's spelling
    from_value: Value
    to_value: Value
    direction: int  # +1 up / on, -1 down / off
    reason: str
    priority: int = 50
    adds_load: bool = False
    experimental: bool = False
    verify: tuple[Verify, ...] = ()
    cooldown_seconds: float = 0.0
    breach: bool = False  # fires on a broken SLO: a live reversal is not held by hysteresis (Rule.breach)


class Outcome:
    """What one rule made of this cycle. ``streak``: consecutive true windows including this one. ``reason`` is
    built when first read (``Text``: the reason of a false or unknown condition is seldom read)."""

    __slots__ = ("_reason", "proposal", "rule", "status", "streak")

    rule: str
    status: Status
    streak: int
    proposal: Proposal | None
    _reason: Text

    def __init__(self, rule: str, status: Status, streak: int, reason: Text, proposal: Proposal | None = None
                 ) -> None:
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "streak", streak)
        object.__setattr__(self, "_reason", reason)
        object.__setattr__(self, "proposal", proposal)

    @property
    def reason(self) -> str:
        return _resolved(self, "_reason")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Outcome is immutable: cannot set {name}")

    def _key(self) -> tuple[str, Status, int, str, Proposal | None]:
        return self.rule, self.status, self.streak, self.reason, self.proposal

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Outcome):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Outcome(rule={self.rule!r}, status={self.status!r}, streak={self.streak!r}, "
                f"reason={self.reason!r}, proposal={self.proposal!r})")


def _bound(ctx: Context, refs: Iterable[Ref], static: float | None, *, pick: str
           ) -> tuple[float | None, str | None, str | None]:
    """The tightest bound: (value, what set it, why unknown)."""
    best: float | None = static
    source: str | None = None if static is None else f"{'max' if pick == 'min' else 'min'} {fmt(static)}"
    for ref in refs:
        raw, text = _ref_value(ctx, ref.name)
        if raw is None:
            return None, None, f"bound {ref.describe()}: {text()}"
        value = raw * ref.times + ref.plus
        if not math.isfinite(value):
            return None, None, f"bound {ref.describe()} = {fmt(value)} is not a finite number"
        tighter = best is None or (value < best if pick == "min" else value > best)
        if tighter:
            best, source = value, f"{ref.describe()} = {fmt(value)}"
    return best, source, None


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def propose(rule: Rule, ctx: Context, *, when_text: str, streak: int) -> Outcome:
    """The change ``rule.then`` asks for, bounded; or why there is none (no-op / blocked)."""
    then = rule.then
    knob = then.knob
    flag = knob.flag(ctx.kind) or then.flag
    current = ctx.flag_value(then.flag)
    sustained = f" (for {streak} windows)" if rule.when.for_ > 1 else ""
    if current.value is None:
        return Outcome(rule.id, "blocked", streak, f"{when_text}{sustained}; but the current value of "
                       f"{flag} is unknown: {current.reason}")
    cur = current.value

    # toggles
    if then.op == "toggle":
        target_bool = (not bool(cur)) if then.value is None else bool(then.value)
        if target_bool == bool(cur):
            return Outcome(rule.id, "no-op", streak, f"{flag} is already {fmt(bool(cur))}")
        return Outcome(rule.id, "fired", streak, f"{when_text}{sustained}", _proposal(
            rule, knob.name, flag, cur, target_bool, 1 if target_bool else -1, f"{when_text}{sustained}", ctx))

    c = float(cur) if not isinstance(cur, int) or abs(cur) < 2**63 else math.inf
    if not math.isfinite(c):  # a default given as text can be any size; knobs.RANGES bound only argv
        return Outcome(rule.id, "blocked", streak, f"{when_text}{sustained}; but the current value of {flag} "
                       f"({fmt(c)}) is not a finite number")
    # the raw target and the direction the rule means to move
    target: float
    if then.op == "set":
        if then.value_from is not None:
            raw, text = _ref_value(ctx, then.value_from.name)
            if raw is None:
                return Outcome(rule.id, "blocked", streak, f"{when_text}{sustained}; but the new value "
                               f"comes from {text()}")
            target = raw * then.value_from.times + then.value_from.plus
        else:
            assert then.value is not None and not isinstance(then.value, bool)
            target = float(then.value)
        intent = _sign(target - c)
    elif then.op == "scale":
        assert then.factor is not None
        target = c * then.factor
        intent = _sign(then.factor - 1)
        if knob.type == "int" and math.isfinite(target):
            rounded = float(round(target))
            if intent > 0 and rounded <= c:
                rounded = c + 1
            if intent < 0 and rounded >= c:
                rounded = c - 1
            target = rounded
    elif then.op == "model":
        if then.model == "concurrency":
            down = then.direction == "down"
            at_least = live_ceiling = None
            factor = ctx.model.live_raise_factor
            live = ctx.live.can_move(knob.name, c + 1) is None
            if not down and live:
                ceiling = ctx.live.envelope.get(knob.name)
                if factor > 1:
                    at_least = c * factor if ceiling is None else min(c * factor, ceiling)
                if ctx.model.live_raise_to_ceiling and not then.past_frontier:
                    live_ceiling = ceiling if ceiling is not None else then.max  # the bounds below cap it still
            estimate = models.concurrency(ctx.signals, ctx.model, utilisation=then.utilisation, slo=ctx.slo,
                                          down=down, at_least=at_least, past_frontier=then.past_frontier,
                                          restart_from=None if down or live else c,
                                          live_ceiling=live_ceiling, current=c)
            intent = -1 if down else 1  # a model that finds enough is a no-op, never a move the other way
        else:
            estimate = models.step_budget(ctx.signals, ctx.slo, current=c)
            intent = -1
        if estimate.value is None:
            return Outcome(rule.id, "blocked", streak, f"{when_text}{sustained}; but the {then.model} model "
                           f"cannot size it: {estimate.text}")
        target = estimate.value
        if _sign(target - c) != intent:
            return Outcome(rule.id, "no-op", streak, f"{when_text}{sustained}; but the {then.model} model finds "
                           f"{flag} {fmt(c)} enough: {estimate.text}")
        step = ctx.model.min_step
        if c > 0 and abs(target - c) < step * c:
            return Outcome(rule.id, "no-op", streak, f"{when_text}{sustained}; but the {then.model} model's "
                           f"{fmt(target)} is within {step:.0%} of {flag} {fmt(c)} (the estimate's noise): "
                           f"{estimate.text}")
        when_text = f"{when_text}{sustained}; {then.model} model: {estimate.text}"
        sustained = ""
    else:  # step
        assert then.values is not None
        valid = sorted(v for v in set(then.values)
                       if knob.name != "block_size" or knobs.block_size_ok(int(v), ctx.platform))
        intent = 1 if then.direction == "up" else -1
        candidates = [v for v in valid if v > c] if intent > 0 else [v for v in valid if v < c][::-1]
        if not candidates:
            return Outcome(rule.id, "no-op", streak, f"{flag} {fmt(c)} has no {then.direction}ward step in "
                           f"{', '.join(fmt(v) for v in valid) or '(no valid values)'}")
        target = candidates[0]
    if not math.isfinite(target):  # value_from × times past any float: never round it to an int
        return Outcome(rule.id, "blocked", streak, f"{when_text}{sustained}; but the new value of {flag} "
                       f"({fmt(target)}) is not a finite number")
    if intent == 0:
        return Outcome(rule.id, "no-op", streak, f"{flag} is already {fmt(c)}")

    lo, lo_src, lo_err = _bound(ctx, then.min_from, then.min, pick="max")
    hi, hi_src, hi_err = _bound(ctx, then.max_from, then.max, pick="min")
    if lo_err or hi_err:
        return Outcome(rule.id, "blocked", streak, f"{when_text}{sustained}; but {lo_err or hi_err}")
    if knob.type == "int":
        lo = None if lo is None else float(math.ceil(lo - 1e-9))
        hi = None if hi is None else float(math.floor(hi + 1e-9))
    if lo is not None and hi is not None and lo > hi:
        return Outcome(rule.id, "blocked", streak, f"{flag}: lower bound {fmt(lo)} ({lo_src}) is above the "
                       f"upper bound {fmt(hi)} ({hi_src})")
    bounded = target
    note = ""
    if hi is not None and bounded > hi:
        bounded, note = hi, f"capped at {fmt(hi)} by {hi_src}"
    if lo is not None and bounded < lo:
        bounded, note = lo, f"floored at {fmt(lo)} by {lo_src}"
    if knob.type == "float":
        bounded = round(bounded, 4)
    if then.op == "model" and note and c > 0 and _sign(bounded - c) == intent \
            and abs(bounded - c) < ctx.model.min_step * c:
        # a bound within the deadband is no change either: kv_concurrency_observed follows the sizes of
        # the requests in flight and crept 94 → 96 → 98 → … → 123 on the trace family, a rollout each
        return Outcome(rule.id, "no-op", streak, f"{when_text}{sustained}; but {note}, within "
                       f"{ctx.model.min_step:.0%} of {flag} {fmt(c)}")
    if _sign(bounded - c) != intent:
        where = "upper" if intent > 0 else "lower"
        src = hi_src if intent > 0 else lo_src
        verb = "raise" if intent > 0 else "lower"
        return Outcome(rule.id, "no-op", streak, f"{when_text}{sustained}; but {flag} {fmt(c)} is already at "
                       f"or past its {where} bound {fmt(bounded)} ({src}); this rule only would {verb} it")
    new: Value = int(bounded) if knob.type == "int" else bounded
    old: Value = int(c) if knob.type == "int" else c
    reason = f"{when_text}{sustained}" + (f"; {note}" if note else "")
    return Outcome(rule.id, "fired", streak, reason,
                   _proposal(rule, knob.name, flag, old, new, intent, reason, ctx))


def _proposal(rule: Rule, knob: str, flag: str, old: Value, new: Value, direction: int, reason: str,
              ctx: Context) -> Proposal:
    return Proposal(
        rule=rule.id, knob=knob, flag=flag, from_value=old, to_value=new, direction=direction,
        reason=reason, priority=rule.priority, adds_load=rule.adds_load, experimental=rule.experimental,
        verify=tuple(rule.verify), cooldown_seconds=rule.cooldown.total_seconds(), breach=rule.breach,
    )


def evaluate_rule(rule: Rule, ctx: Context, *, streak_before: int = 0) -> Outcome:
    if not rule.enabled:
        return Outcome(rule.id, "disabled", 0, "disabled in the rule file")
    if ctx.kind not in rule.engines:
        return Outcome(rule.id, "not-applicable", 0, f"applies to {', '.join(rule.engines)}, not {ctx.kind}")
    if rule.then.past_frontier:
        why = ctx.live.can_move(rule.then.knob.name, 1)
        if why is not None:
            return Outcome(rule.id, "not-applicable", 0, f"a step past the TPOT SLO frontier is taken live only: {why}")
    when = rule.when  # its parts as they are: `When.condition` would build (and validate) an AllOf every cycle
    truth = _check_parts(when.all if when.all is not None else when.any or (), every=when.all is not None, ctx=ctx)
    if truth.value is None:
        return Outcome(rule.id, "unknown", 0, truth._text)
    if truth.value is False:
        return Outcome(rule.id, "false", 0, truth._text)
    streak = streak_before + 1
    if streak < rule.when.for_least:
        # the value it would move to, for a dry run to say (the planner takes proposals of "fired" only)
        would = propose(rule, ctx, when_text=truth.text, streak=streak).proposal
        return Outcome(rule.id, "sustaining", streak,
                       f"true in {streak} of {rule.when.for_least} consecutive windows: {truth.text}", would)
    outcome = propose(rule, ctx, when_text=truth.text, streak=streak)
    if streak < rule.when.for_ and outcome.proposal is not None:
        # enough evidence for a live change only: a change that needs a restart waits for `for` windows
        p = outcome.proposal
        why = ctx.live.can_move(p.knob, float(p.to_value)) if not isinstance(p.to_value, bool) else "a toggle"
        if why is not None:
            return Outcome(rule.id, "sustaining", streak,
                           f"true in {streak} of {rule.when.for_} consecutive windows (a restart needs them all; "
                           f"live: {why}): {truth.text}", p)
    return outcome


def evaluate(rules: Iterable[Rule], ctx: Context, *, streaks: Mapping[str, int] | None = None
             ) -> tuple[Outcome, ...]:
    """Every rule's outcome this cycle. ``streaks``: each rule's consecutive-true count so far."""
    before = streaks or {}
    return tuple(evaluate_rule(r, ctx, streak_before=before.get(r.id, 0)) for r in rules)


def next_streaks(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """The streaks to remember after this cycle (rules that were not true drop out)."""
    return {o.rule: o.streak for o in outcomes if o.streak > 0}
