"""Judging a change after the rollout: the replica's signals over its verification window against the
same signals before the change. Pure: values in, a verdict with its reasons out.

Two kinds of evidence decide:

- **harm**, always: requests that errored, were aborted or rejected inside the window (counted by the
  engine itself) fail the change, whatever rule made it;
- **the rules' own checks** (``verify:`` in the rule file, each one ``decrease``/``increase`` by at
  least ``min_change`` or ``no-increase``/``no-decrease`` within ``tolerance``). All must hold.

A check that cannot be judged (the signal is missing before or after, e.g. no request finished in the
window) fails an *experimental* change — it stays only if it is shown to help — and passes any other
change with the reason said, since its rule's effect is established (docs/evidence.md).

Relative changes are taken against the baseline; a zero baseline cannot decrease, and any rise from
zero is an unbounded worsening. Quantile signals are bucket bounds, so equal values mean "same bucket".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tuner.planning.history import Change
from tuner.rules.models import SloSettings
from tuner.rules.schema import Verify

Values = Mapping[str, float | None]


@dataclass(frozen=True, slots=True)
class Check:
    """One rule's check, as the rollout carries it."""

    rule: str
    verify: Verify
    experimental: bool = False
    bound: float | None = None  # at-most: the bound, resolved when the change was decided (an SLO may move)
    waiver_bound: float | None = None  # at-most with unless_above: that signal's bound, resolved likewise

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"rule": self.rule, "experimental": self.experimental, **self.verify.as_dict()}
        if self.bound is not None:
            out["bound"] = self.bound
        if self.waiver_bound is not None:
            out["waiver_bound"] = self.waiver_bound
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Check:
        fields = {k: v for k, v in data.items() if k not in ("rule", "experimental", "bound", "waiver_bound")}
        bound, waiver = data.get("bound"), data.get("waiver_bound")
        return cls(rule=str(data["rule"]), verify=Verify.model_validate(fields),
                   experimental=bool(data.get("experimental", False)),
                   bound=float(bound) if isinstance(bound, int | float) else None,
                   waiver_bound=float(waiver) if isinstance(waiver, int | float) else None)


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: str  # one line: every check's result, the failing ones first


def checks_of(changes: Iterable[Change], *, slo: SloSettings | None = None) -> tuple[Check, ...]:
    """The checks of a plan's changes; an ``at-most`` check's bound and its waiver's are resolved now (``slo``:
    the SLOs)."""
    slo = slo or SloSettings()

    def resolved(value: float | None, name: str | None) -> float:
        return value if value is not None else slo.value(name or "")

    def check(c: Change, v: Verify) -> Check:
        w = v.unless_above
        return Check(rule=c.rule, verify=v, experimental=c.experimental,
                     bound=resolved(v.value, v.slo) if v.expect == "at-most" else None,
                     waiver_bound=resolved(w.value, w.slo) if w is not None else None)

    return tuple(check(c, v) for c in changes for v in c.verify)


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _relative(before: float, after: float) -> float:
    """(after - before) / before; ±inf for a move away from zero, 0 for 0 → 0."""
    if before == 0:
        return 0.0 if after == 0 else math.copysign(math.inf, after)
    return (after - before) / abs(before)


def judge_check(check: Check, before: float | None, after: float | None,
                why_missing: str | None = None, *, waiver_after: float | None = None) -> tuple[bool, str]:
    """One check's verdict and its one-line reason. ``waiver_after``: the value after the change of the
    signal an at-most check's ``unless_above`` names (above its bound, the check is waived)."""
    v = check.verify
    name = f"{v.signal} ({check.rule})"
    w = v.unless_above
    if v.expect == "at-most" and w is not None and waiver_after is not None:
        wbound = check.waiver_bound if check.waiver_bound is not None else w.value
        if wbound is not None and waiver_after > wbound:
            return True, (f"{name} waived: {w.signal} {_fmt(waiver_after)} > {_fmt(wbound)} after the change "
                          "(still short of the demand: putting it back moves the misses, not removes them)")
    if v.expect == "at-most":
        limit = check.bound if check.bound is not None else v.value
        if after is None or limit is None:
            text = f"{name}: no value in the verification window" + (f" ({why_missing})" if why_missing else "")
            if check.experimental:
                return False, f"{text}; an experimental change stays only if shown to help"
            return True, f"{text}; not judged"
        ok = after <= limit + 1e-12
        return ok, f"{name} {_fmt(after)} {'≤' if ok else '>'} {_fmt(limit)}: {'ok' if ok else 'failed'}, {v.describe()}"
    if before is None or after is None:
        which = "before the change" if before is None else "in the verification window"
        text = f"{name}: no value {which}" + (f" ({why_missing})" if why_missing else "")
        if check.experimental:
            return False, f"{text}; an experimental change stays only if shown to help"
        return True, f"{text}; not judged"
    rel = _relative(before, after)
    move = f"{_fmt(before)} → {_fmt(after)}" + (f" ({rel:+.0%})" if math.isfinite(rel) else "")
    slack = 1e-9  # 1.0 → 1.1 is a 10 % rise, whatever binary floating point says
    if v.expect == "decrease":
        ok = -rel >= v.min_change - slack and after < before
    elif v.expect == "increase":
        ok = rel >= v.min_change - slack and after > before
    elif v.expect == "no-increase":
        ok = rel <= v.tolerance + slack
    else:
        ok = -rel <= v.tolerance + slack
    return ok, f"{name} {move}: {'ok' if ok else 'failed'}, {v.describe()}"


def judge(checks: Sequence[Check], before: Values, after: Values, *, errors: float | None,
          why_missing: Mapping[str, str] | None = None) -> Verdict:
    """The verdict on one replica. ``errors``: requests errored/aborted/rejected inside the window
    (None: the engine's counters could not be read — then only the checks decide)."""
    failed: list[str] = []
    passed: list[str] = []
    if errors is not None and errors > 0:
        failed.append(f"{errors:.0f} requests errored, aborted or were rejected in the verification window")
    for check in checks:
        name = check.verify.signal
        waiver = check.verify.unless_above
        ok, text = judge_check(check, before.get(name), after.get(name), (why_missing or {}).get(name),
                               waiver_after=after.get(waiver.signal) if waiver is not None else None)
        (passed if ok else failed).append(text)
    if errors is None:
        passed.append("error counters unreadable")
    elif errors == 0:
        passed.append("no request errored, aborted or was rejected")
    parts = failed + passed
    return Verdict(ok=not failed, reason="; ".join(parts))
