"""The rule-file schema (pydantic v2): what a rule may say, checked before anything runs.

A rule file::

    version: 1
    rules:
      - id: queue-slot-bound                 # ^[a-z][a-z0-9-]*$, unique across all loaded files
        description: Requests queue while every sequence slot is busy and KV is not the limit.
        priority: 50                         # higher wins a conflict on the same flag
        adds_load: true                      # frozen by the thermal guard
        cooldown: 15m                        # 90s, 15m, 2h, 1d or seconds
        evidence: docs/evidence.md#queue-slot-bound
        when:
          for: 3                             # consecutive windows
          all:
            - {signal: queue_time_mean_s, op: ">", value: 0.2}
            - {signal: requests_running_max, op: ">=", value: 0.9, times: --max-num-seqs}
            - any: [...]
        then:
          flag: --max-num-seqs               # either engine's spelling; SGLang gets --max-running-requests
          op: scale                          # set | scale | step | toggle
          factor: 2
          max: 1024
          max_from: [{signal: kv_cache_max_concurrency}]

Signals must be in ``tuner.signals.VOCABULARY`` and flags in ``tuner.model.knobs.FLAGS``; anything
else fails validation with the file, the rule id and the field (see ``loading``). Every number must be
finite, and a ``then:`` cannot leave its knob's hard range (``knobs.RANGES``): ``value``, ``values``,
``min`` and ``max`` must lie inside it, and a ``factor`` must be one that could keep some value inside
it (at most high/low, at least low/high). A dynamic target (``value_from``, ``max_from``) is checked
when it is computed: the planner's engine validation refuses a proposal outside the range.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tuner.model import bounds, knobs
from tuner.signals import VOCABULARY

RULE_ID = r"^[a-z][a-z0-9-]*$"
Op = Literal["<", "<=", ">", ">=", "==", "!="]
EngineKind = Literal["vllm", "sglang"]
SloName = Literal["ttft_p99_s", "itl_p99_s", "tpot_p99_s"]  # the fields of rules.models.SloSettings

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def _duration(value: Any) -> Any:
    """``90``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"`` → timedelta (anything else: pydantic's own parsing)."""
    if isinstance(value, bool):  # YAML's yes/no/on/off
        raise ValueError("expected a duration such as 90s, 15m, 2h or 1d")
    if isinstance(value, int | float):
        return _seconds(value if isinstance(value, float) or abs(value) < 2**63 else math.inf)
    if isinstance(value, str) and not value.startswith("P"):  # "P..." is ISO 8601: pydantic parses it
        m = _DURATION.match(value)
        if m is None:
            raise ValueError(f"expected a duration such as 90s, 15m, 2h or 1d; got {value!r}")
        return _seconds(float(m.group(1)) * _UNIT_SECONDS[m.group(2)])
    return value


_MAX_DURATION_SECONDS = bounds.MAX_DURATION_SECONDS  # ten years: a longer cooldown is a typo


def _seconds(seconds: float) -> timedelta:
    if not 0 <= seconds <= _MAX_DURATION_SECONDS:  # also false for NaN
        raise ValueError(f"expected a duration from 0 to 10 years (e.g. 90s, 15m, 2h or 1d); got {seconds:g} s")
    return timedelta(seconds=seconds)


Duration = Annotated[timedelta, BeforeValidator(_duration)]


def _finite(value: Any) -> Any:
    """One message for `.nan`/`.inf` where a field takes a number or a boolean (not one per union member)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number; got {value}")
    return value


class _Model(BaseModel):
    # allow_inf_nan=False: `.inf`/`.nan` in a rule file is a mistake, and an infinite bound or factor
    # would overflow when a proposal is rounded to an integer.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True,
                              populate_by_name=True, allow_inf_nan=False)


def _check_signal(name: str) -> str:
    if name not in VOCABULARY:
        close = [n for n in VOCABULARY if n.split("_")[0] == name.split("_")[0]]
        hint = f"; similar: {', '.join(close[:6])}" if close else "; see docs/signals.md"
        raise ValueError(f"unknown signal {name!r}{hint}")
    return name


def _check_flag(flag: str) -> str:
    if knobs.knob_for(flag) is None:
        raise ValueError(f"unknown flag {flag!r}; the tuner turns: {', '.join(knobs.known_flags())}")
    return knobs.normalize_flag(flag)


def _check_ref(ref: str) -> str:
    """A ``times:`` reference: a flag (starts with ``-``) or a signal."""
    return _check_flag(ref) if ref.startswith("-") else _check_signal(ref)


class _SignalOrFlag(_Model):
    """Validators shared by everything that names a signal or a flag."""

    @field_validator("signal", check_fields=False)
    @classmethod
    def _signal(cls, v: str | None) -> str | None:
        return None if v is None else _check_signal(v)

    @field_validator("flag", check_fields=False)
    @classmethod
    def _flag(cls, v: str | None) -> str | None:
        return None if v is None else _check_flag(v)


class Comparison(_SignalOrFlag):
    """``signal`` (or a ``flag``'s current value) compared with ``value`` [× the current value of ``times``]."""

    signal: str | None = None
    """A signal from the vocabulary (docs/signals.md)."""
    flag: str | None = None
    """Instead of a signal: the effective value of a flag (booleans compare as 1/0)."""
    op: Op
    """How the left side compares with the right side."""
    value: float | None = None
    """The constant on the right side, or the multiplier when ``times`` or ``slo`` is given (default 1)."""
    slo: SloName | None = None
    """Compare with the service level objective of that name (``decisions.slo``) instead of a constant."""
    times: str | None = None
    """A flag (``--max-num-seqs``) or signal: the right side becomes ``value × its current value``."""
    max_resolution: float | None = Field(default=None, gt=0)
    """Refuse a histogram quantile whose bucket is wider than this (in the signal's unit): the
    condition is then unknown, not true. None: accept any resolution."""

    @field_validator("times")
    @classmethod
    def _times(cls, v: str | None) -> str | None:
        return None if v is None else _check_ref(v)

    @model_validator(mode="after")
    def _one_side(self) -> Comparison:
        if (self.signal is None) == (self.flag is None):
            raise ValueError("give exactly one of `signal:` or `flag:`, e.g. "
                             "{signal: queue_time_mean_s, op: \">\", value: 0.2}")
        if self.value is None and self.times is None and self.slo is None:
            raise ValueError("give the right side: `value:`, `times:` or `slo:`, e.g. "
                             "{signal: ttft_p99_s, op: \">\", slo: ttft_p99_s}")
        if self.times is not None and self.slo is not None:
            raise ValueError("give at most one of `times:` and `slo:`")
        return self

    @property
    def factor(self) -> float:
        """The constant, or the multiplier of ``times``/``slo`` (1 when not given)."""
        return 1.0 if self.value is None else self.value


class AllOf(_Model):
    all: list[Condition] = Field(min_length=1)
    """True when every condition is true."""


class AnyOf(_Model):
    any: list[Condition] = Field(min_length=1)
    """True when at least one condition is true."""


def _condition_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        if "all" in v:
            return "all"
        if "any" in v:
            return "any"
        return "compare"
    if isinstance(v, AllOf):
        return "all"
    if isinstance(v, AnyOf):
        return "any"
    if isinstance(v, Comparison):
        return "compare"
    return None


Condition = Annotated[
    Annotated[Comparison, Tag("compare")] | Annotated[AllOf, Tag("all")] | Annotated[AnyOf, Tag("any")],
    Discriminator(_condition_kind, custom_error_type="condition",
                  custom_error_message="expected a condition: {signal, op, value}, {all: [...]} or {any: [...]}"),
]


class When(_Model):
    """The rule's condition: ``all`` or ``any`` of conditions, sustained ``for`` consecutive windows."""

    all: list[Condition] | None = None
    """True when every condition is true."""
    any: list[Condition] | None = None
    """True when at least one condition is true."""
    for_: int = Field(default=1, ge=1, alias="for")
    """Consecutive evaluation windows (cycles) the condition must hold before the rule fires a change that
    needs a restart."""
    for_live: int | None = Field(default=1, ge=1)
    """The same for a change the engine takes live (no restart; undone in a second): evidence proportional
    to cost. One confident decision window by default. None: as ``for``. Never more than ``for``."""

    @property
    def for_least(self) -> int:
        """The fewest windows after which the rule may fire anything (a live change)."""
        return self.for_ if self.for_live is None else min(self.for_live, self.for_)

    @model_validator(mode="after")
    def _one(self) -> When:
        if (self.all is None) == (self.any is None):
            raise ValueError("give exactly one of `all:` or `any:`")
        if not (self.all or self.any):
            raise ValueError("the condition list is empty")
        return self

    @property
    def condition(self) -> AllOf | AnyOf:
        return AllOf(all=self.all) if self.all is not None else AnyOf(any=self.any or [])


class Ref(_SignalOrFlag):
    """A value taken from the current signals or flags: ``times × (signal | flag) + plus``."""

    signal: str | None = None
    """A signal from the vocabulary."""
    flag: str | None = None
    """A flag's effective value."""
    times: float = 1.0
    """Multiplier."""
    plus: float = 0.0
    """Added after multiplying."""

    @model_validator(mode="after")
    def _one(self) -> Ref:
        if (self.signal is None) == (self.flag is None):
            raise ValueError("give exactly one of `signal:` or `flag:`")
        return self

    @property
    def name(self) -> str:
        return self.signal or self.flag or ""

    def describe(self) -> str:
        out = self.name if self.times == 1 else f"{self.times:g}×{self.name}"
        return out + (f" {self.plus:+g}" if self.plus else "")


class Then(_Model):
    """What to change. Every change needs an engine restart (vLLM has no runtime endpoint for these)."""

    flag: str
    """The flag, in either engine's spelling; the knob table maps it to the target's engine."""
    op: Literal["set", "scale", "step", "toggle", "model"]
    """set: to ``value`` / ``value_from``; scale: × ``factor``; step: to the next entry of ``values``
    in ``direction``; toggle: a boolean flag to ``value`` (true/false; omitted: the opposite); model: to
    what ``model`` computes from the signals (one measured step; rules/models.py, docs/rules.md)."""
    model: Literal["concurrency", "step-budget"] | None = None
    """model: ``concurrency`` (the sequence slots the traffic needs: Little's law on the arrival rate
    and the slot time, with headroom; raises only) or ``step-budget`` (the per-step token budget for the
    ITL SLO; lowers only)."""
    utilisation: float | None = Field(default=None, gt=0, le=1)
    """model concurrency: the slots' busy share at steady state (default ``decisions.model.utilisation``)."""
    value: Annotated[float | bool | None, BeforeValidator(_finite)] = None
    """set: the new value; toggle: the state to switch to."""
    value_from: Ref | None = None
    """set: take the new value from a signal or flag (× times + plus)."""
    factor: float | None = Field(default=None, gt=0)
    """scale: the multiplier (2 doubles, 0.5 halves); ints are rounded, always moving by ≥ 1."""
    values: list[float] | None = None
    """step: the allowed values (the platform's validity check filters them, e.g. block sizes)."""
    direction: Literal["up", "down"] | None = None
    """step: which neighbour to move to. model concurrency: ``down`` lowers to the TPOT SLO frontier
    (default: up, to what the traffic needs)."""
    past_frontier: bool = False
    """model concurrency, up: one live step (× ``decisions.model.live_raise_factor``) past the TPOT SLO
    frontier, and only when even the frontier cannot carry the arrivals (overloaded); otherwise no change."""
    min: float | None = None
    """Never go below this."""
    max: float | None = None
    """Never go above this."""
    min_from: list[Ref] = []
    """Dynamic lower bounds (the largest wins), e.g. ``[{flag: --max-num-seqs}]``."""
    max_from: list[Ref] = []
    """Dynamic upper bounds (the smallest wins), e.g. ``[{signal: kv_cache_max_concurrency}]``.
    An unknown bound holds the rule (never guess a ceiling)."""

    @field_validator("flag")
    @classmethod
    def _flag(cls, v: str) -> str:
        return _check_flag(v)

    @field_validator("value", "min", "max")
    @classmethod
    def _in_range(cls, v: float | bool | None, info: ValidationInfo) -> float | bool | None:
        if v is not None and not isinstance(v, bool):
            _check_in_range(info, v)
        return v

    @field_validator("values")
    @classmethod
    def _values_in_range(cls, v: list[float] | None, info: ValidationInfo) -> list[float] | None:
        for value in v or ():
            _check_in_range(info, value)
        return v

    @field_validator("factor")
    @classmethod
    def _factor(cls, v: float | None, info: ValidationInfo) -> float | None:
        knob = _knob_of(info)
        if v is None or knob is None or knob.range is None or knob.range.low <= 0:
            return v
        widest = knob.range.high / knob.range.low
        if not 1 / widest <= v <= widest:
            raise ValueError(f"factor {v:g} would take any {info.data['flag']} out of its hard range "
                             f"({knob.range.describe()}); a factor must lie within [1/{widest:g}, {widest:g}]")
        return v

    @property
    def knob(self) -> knobs.Knob:
        knob = knobs.knob_for(self.flag)
        assert knob is not None  # validated
        return knob

    @model_validator(mode="after")
    def _op_fields(self) -> Then:
        knob = self.knob
        needs = {"set": "value or value_from", "scale": "factor", "step": "values and direction"}
        if self.op == "model" and self.model is None:
            raise ValueError("op model needs `model: concurrency` or `model: step-budget`")
        if self.op != "model" and (self.model is not None or self.utilisation is not None):
            raise ValueError("`model:` and `utilisation:` go with op model")
        if self.op == "model" and self.direction is not None and self.model != "concurrency":
            raise ValueError("`direction:` goes with op step or model concurrency")
        if self.past_frontier and (self.model != "concurrency" or self.direction == "down"):
            raise ValueError("`past_frontier:` goes with op model, model concurrency, upwards")
        if self.op == "model" and knob.type != "int":
            raise ValueError(f"op model computes a count; {self.flag} is {knob.type}")
        if self.op == "set" and (self.value is None) == (self.value_from is None):
            raise ValueError(f"op set needs exactly one of {needs['set']}")
        if self.op == "scale" and self.factor is None:
            raise ValueError("op scale needs `factor:` (e.g. 2 to double)")
        if self.op == "step" and (not self.values or self.direction is None):
            raise ValueError("op step needs `values:` (the allowed list) and `direction: up|down`")
        if self.op == "toggle" and knob.type != "bool":
            raise ValueError(f"op toggle needs a boolean flag; {self.flag} is {knob.type}")
        if self.op != "toggle" and knob.type == "bool":
            raise ValueError(f"{self.flag} is a boolean flag: use op toggle")
        if self.op == "toggle" and self.value is not None and not isinstance(self.value, bool):
            raise ValueError("op toggle: `value:` must be true or false")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} > max {self.max:g}")
        return self


def _knob_of(info: ValidationInfo) -> knobs.Knob | None:
    """The knob of the ``flag`` validated before this field (None if the flag itself was invalid)."""
    flag = info.data.get("flag")
    return knobs.knob_for(flag) if isinstance(flag, str) else None


def _check_in_range(info: ValidationInfo, value: float) -> None:
    knob = _knob_of(info)
    if knob is None or knob.range is None:
        return
    why = knob.range.problem(value)
    if why is not None:
        raise ValueError(f"{info.data['flag']}: {why}")


class Waiver(_Model):
    """When an ``at-most`` check does not apply: while ``signal`` stays above ``value`` or the SLO ``slo``
    after the change (queue-slot-bound's: the TTFT tail still misses its SLO, so the cap is still short of
    the demand and putting it back would only move the misses from the TPOT to the TTFT)."""

    signal: str
    value: float | None = None
    slo: SloName | None = None

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str) -> str:
        return _check_signal(v)

    @model_validator(mode="after")
    def _one_bound(self) -> Waiver:
        if (self.value is None) == (self.slo is None):
            raise ValueError("unless_above takes exactly one of `value:` and `slo:`")
        return self

    def as_dict(self) -> dict[str, object]:
        return {"signal": self.signal, **({"slo": self.slo} if self.slo is not None else {"value": self.value})}


class Verify(_Model):
    """One check of a change, after the rollout: the replica's signals over its verification window
    against the same signals before the change (the window the rule fired on). A rule may list several;
    every one must hold, or the replica is rolled back and the rollout stops."""

    signal: str
    """The signal to compare."""
    expect: Literal["decrease", "increase", "no-increase", "no-decrease", "at-most"]
    """``decrease``/``increase``: the change must move the signal this way by at least ``min_change``.
    ``no-increase``/``no-decrease``: it must not move the other way by more than ``tolerance``.
    ``at-most``: after the change it must stay at or below ``value`` or the SLO named by ``slo`` (a price
    bounded absolutely, whatever it was before)."""
    value: float | None = None
    """For at-most: the bound (in the signal's unit)."""
    slo: SloName | None = None
    """For at-most: the bound is this SLO (``decisions.slo``)."""
    min_change: float = Field(default=0.05, ge=0)
    """For decrease/increase: the least relative improvement that counts (0.05 = 5 %)."""
    tolerance: float = Field(default=0.1, ge=0)
    """For no-increase/no-decrease: the largest relative worsening accepted (0.1 = 10 %)."""
    unless_above: Waiver | None = None
    """For at-most: the check is waived while this other signal stays above its bound after the change."""

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str) -> str:
        return _check_signal(v)

    @model_validator(mode="after")
    def _fields_fit_expect(self) -> Verify:
        if self.expect in ("decrease", "increase") and "tolerance" in self.model_fields_set:
            raise ValueError(f"expect {self.expect} takes min_change, not tolerance")
        if self.expect in ("no-increase", "no-decrease") and "min_change" in self.model_fields_set:
            raise ValueError(f"expect {self.expect} takes tolerance, not min_change")
        if self.expect == "at-most" and (self.value is None) == (self.slo is None):
            raise ValueError("expect at-most takes exactly one of `value:` and `slo:`")
        if self.expect != "at-most" and self.unless_above is not None:
            raise ValueError(f"expect {self.expect} compares with the baseline: `unless_above:` goes with at-most")
        if self.expect != "at-most" and (self.value is not None or self.slo is not None):
            raise ValueError(f"expect {self.expect} compares with the baseline: `value:`/`slo:` go with at-most")
        return self

    def as_dict(self) -> dict[str, object]:
        """The fields that mean something for ``expect`` (what journals and plans show)."""
        if self.expect == "at-most":
            bound = {"slo": self.slo} if self.slo is not None else {"value": self.value}
            waiver = {"unless_above": self.unless_above.as_dict()} if self.unless_above is not None else {}
            return {"signal": self.signal, "expect": self.expect, **bound, **waiver}
        amount = ("min_change", self.min_change) if self.expect in ("decrease", "increase") else \
            ("tolerance", self.tolerance)
        return {"signal": self.signal, "expect": self.expect, amount[0]: amount[1]}

    def describe(self) -> str:
        if self.expect == "at-most":
            text = f"{self.signal} must stay ≤ " + (f"the SLO {self.slo}" if self.slo else f"{self.value:g}")
            w = self.unless_above
            if w is not None:
                text += f" unless {w.signal} stays above " + (f"the SLO {w.slo}" if w.slo else f"{w.value:g}")
            return text
        if self.expect in ("decrease", "increase"):
            return f"{self.signal} must {self.expect} by ≥ {self.min_change:.0%}"
        worse = "rise" if self.expect == "no-increase" else "fall"
        return f"{self.signal} must not {worse} by > {self.tolerance:.0%}"


def _checks(value: Any) -> Any:
    """``verify:`` takes one check or a list of them."""
    if value is None:
        return []
    return [value] if isinstance(value, dict) else value


class Rule(_Model):
    id: str = Field(pattern=RULE_ID)
    """Lower-case words joined by dashes; appears in logs, plans and metric labels."""
    description: str = ""
    """One or two sentences: what the rule notices and why the change helps."""
    enabled: bool = True
    """A disabled rule is loaded and validated but never evaluated."""
    engines: list[EngineKind] = ["vllm", "sglang"]
    """Engine kinds the rule applies to."""
    priority: int = 50
    """Higher wins a conflict over the same flag in one cycle."""
    when: When
    then: Then
    cooldown: Duration = timedelta(minutes=15)
    """After this rule's change, the flag is not changed again for this long (the planner's per-flag
    cooldown applies as well; the longer wins)."""
    adds_load: bool = False
    """The change lets the GPU do more work at once; the thermal guard freezes such changes."""
    breach: bool = False
    """The rule fires while an SLO is broken (the price a raise pays: TPOT over its SLO). A live change it
    proposes that reverses the last one is not held by the live hysteresis: lowering is as fast as raising
    when the price breaks the SLO, and as slow as hysteresis wants when it does not (docs/rules.md#cadence)."""
    experimental: bool = False
    """The effect is not established: the change goes out alone, is verified and rolled back unless
    ``verify`` shows it helped."""
    verify: Annotated[list[Verify], BeforeValidator(_checks)] = []
    """Checks of the change after the rollout (one mapping or a list); all must hold or the replica is
    rolled back. Required for experimental rules; optional for others."""
    evidence: str | None = None
    """Where the measured effect is written up, e.g. docs/evidence.md#queue-slot-bound."""

    @model_validator(mode="after")
    def _consistent(self) -> Rule:
        if self.experimental and not self.verify:
            raise ValueError("an experimental rule needs `verify: {signal: ..., expect: decrease|increase}`")
        for kind in self.engines:
            if self.then.knob.flag(kind) is None:
                raise ValueError(f"{kind} has no flag for {self.then.flag}")
        return self


class RuleFile(_Model):
    version: Literal[1] = 1
    """Schema version of the file."""
    rules: list[Rule]
    """The rules, evaluated in file order (ties in priority go to the earlier rule)."""

    @model_validator(mode="after")
    def _unique(self) -> RuleFile:
        unique([r.id for r in self.rules], what="rule ids")
        return self


def unique(names: list[str], *, what: str) -> None:
    """Raise ValueError naming every repeated name (rule ids, target names)."""
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{what} must be unique; repeated: {', '.join(dupes)}")


AllOf.model_rebuild()
AnyOf.model_rebuild()
When.model_rebuild()
