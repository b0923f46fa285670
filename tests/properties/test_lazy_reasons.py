"""A condition's reason is built when it is read (``rules.evaluation.Truth``, ``Outcome``): the text must be the
one the eager evaluation built, for any condition, signal values and command line.

The oracle below is the evaluation as it was before reasons became lazy (every condition's text built with
its value, every part of an ``all``/``any`` checked): kept verbatim here, so that a later change to the lazy
code that changes a text or a truth value fails against it.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.model.knobs import EngineArgs
from tuner.rules import evaluation, loading, models
from tuner.rules.evaluation import Context, fmt
from tuner.rules.schema import AllOf, AnyOf, Comparison
from tuner.signals import Signal, missing

# --- the oracle: the eager evaluation ----------------------------------------------------------------------

_SYMBOL = {"<": "<", "<=": "≤", ">": ">", ">=": "≥", "==": "=", "!=": "≠"}
_NEGATION = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def _eager_ref_value(ctx: Context, name: str) -> tuple[float | None, str]:
    if name.startswith("-"):
        eff = ctx.flag_value(name)
        shown = ctx.flag_name(name)
        if eff.value is None:
            return None, f"{shown} unknown ({eff.reason})"
        return float(eff.value), f"{shown} {fmt(eff.value)}"
    sig = ctx.signals.get(name)
    if sig is None or sig.value is None:
        why = sig.reason if sig is not None and sig.reason else "not computed"
        return None, f"{name} unknown ({why})"
    return sig.value, f"{name} {fmt(sig.value)}"


def _eager_comparison(c: Comparison, ctx: Context) -> tuple[bool | None, str]:
    right = c.factor
    right_text = fmt(c.factor)
    if c.times is not None:
        ref, ref_text = _eager_ref_value(ctx, c.times)
        if ref is None:
            return None, ref_text
        right = c.factor * ref
        right_text = f"{fmt(right)} ({fmt(c.factor)}×{ref_text})"
    elif c.slo is not None:
        right = c.factor * ctx.slo.value(c.slo)
        right_text = f"{fmt(right)} (SLO {c.slo}" + (f" × {fmt(c.factor)})" if c.factor != 1 else ")")
    if c.flag is not None:
        left, left_text = _eager_ref_value(ctx, c.flag)
        if left is None:
            return None, left_text
        ok = evaluation._compare(left, c.op, right)
        return ok, f"{left_text} {_SYMBOL[c.op if ok else _NEGATION[c.op]]} {right_text}"
    assert c.signal is not None
    sig = ctx.signals.get(c.signal)
    if sig is None or sig.value is None:
        why = sig.reason if sig is not None and sig.reason else "not computed"
        return None, f"{c.signal} unknown ({why})"
    coarse = c.max_resolution is not None and sig.bounds is not None and (
        sig.resolution is None or sig.resolution > c.max_resolution)
    if coarse:
        assert sig.bounds is not None
        lo, hi = sig.bounds
        at_lo, at_hi = evaluation._compare(lo, c.op, right), evaluation._compare(hi, c.op, right)
        bucket = f"{c.signal} in bucket {fmt(lo)}–{fmt(hi)}"
        if at_lo and at_hi:
            return True, f"{bucket} {_SYMBOL[c.op]} {right_text}"
        if not at_lo and not at_hi and c.op not in ("==", "!="):
            return False, f"{bucket} {_SYMBOL[_NEGATION[c.op]]} {right_text}"
        width = "unbounded" if sig.resolution is None else fmt(sig.resolution)
        return None, (f"{bucket}: too coarse to tell whether {_SYMBOL[c.op]} {right_text} "
                      f"(bucket width {width} > {fmt(c.max_resolution)} allowed)")
    ok = evaluation._compare(sig.value, c.op, right)
    return ok, f"{c.signal} {fmt(sig.value)} {_SYMBOL[c.op if ok else _NEGATION[c.op]]} {right_text}"


def _eager_check(cond: Comparison | AllOf | AnyOf, ctx: Context) -> tuple[bool | None, str]:
    if isinstance(cond, Comparison):
        return _eager_comparison(cond, ctx)
    every = isinstance(cond, AllOf)
    parts = [_eager_check(c, ctx) for c in (cond.all if isinstance(cond, AllOf) else cond.any)]
    decisive = next((p for p in parts if p[0] is (not every)), None)
    if decisive is not None:
        return not every, decisive[1]
    unknown = next((p for p in parts if p[0] is None), None)
    if unknown is not None:
        return None, unknown[1]
    return every, ("; " if every else " and ").join(p[1] for p in parts)


# --- generated inputs --------------------------------------------------------------------------------------

SIGNALS = ("queue_time_mean_s", "queue_time_p95_s", "requests_running_max", "kv_cache_usage_max")
FLAGS = ("--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill", "--max-running-requests")
NUMBERS = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.6, 4.0, 0.012345678, 1e16, -2.5, math.inf]) | st.floats(
    -1e6, 1e6, allow_nan=False)
POSITIVE = st.sampled_from([0.1, 0.3, 1.0, 2.5]) | st.floats(1e-3, 1e3)


@st.composite
def signal(draw: st.DrawFn) -> Signal:
    shape = draw(st.sampled_from(["value", "missing", "no reason", "quantile"]))
    if shape == "missing":
        return missing(draw(st.sampled_from(["series absent", "window invalid: scrape failed"])))
    if shape == "no reason":
        return Signal(None)
    value = draw(NUMBERS.filter(math.isfinite))
    if shape == "value":
        return Signal(value)
    lo = draw(st.sampled_from([0.0, 0.25, value]))
    hi = draw(st.sampled_from([value, value + 0.1, math.inf]))
    lo, hi = min(lo, hi), max(lo, hi)
    return Signal(value, resolution=None if math.isinf(hi) else hi - lo, bounds=(lo, hi))


@st.composite
def comparison(draw: st.DrawFn) -> dict[str, object]:
    side = draw(st.sampled_from(["signal", "flag"]))
    c: dict[str, object] = {side: draw(st.sampled_from(SIGNALS if side == "signal" else FLAGS)),
                            "op": draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))}
    right = draw(st.sampled_from(["value", "times", "slo", "slo factor"]))
    if right == "value":
        c["value"] = draw(NUMBERS.filter(math.isfinite))
    elif right == "times":
        c["times"] = draw(st.sampled_from(SIGNALS + FLAGS))
        if draw(st.booleans()):
            c["value"] = draw(NUMBERS.filter(math.isfinite))
    else:
        c["slo"] = draw(st.sampled_from(models.SLO_NAMES))
        if right == "slo factor":
            c["value"] = draw(st.sampled_from([1.0, 0.5, 2.0]))
    if side == "signal" and draw(st.booleans()):
        c["max_resolution"] = draw(POSITIVE)
    return c


conditions = st.recursive(comparison(), lambda inner: st.builds(
    lambda kind, parts: {kind: parts}, st.sampled_from(["all", "any"]), st.lists(inner, min_size=1, max_size=4)),
    max_leaves=8)

ARGS = st.sampled_from(["", "--max-num-seqs 4", "--max-num-seqs lots", "--max-num-seqs 8 --no-enable-chunked-prefill",
                        "--max-num-batched-tokens 2048 --enable-chunked-prefill", "--max-num-seqs 0"])


@st.composite
def contexts(draw: st.DrawFn) -> Context:
    signals = {name: draw(signal()) for name in SIGNALS if draw(st.booleans())}
    return Context(signals=signals, args=EngineArgs.from_string(draw(ARGS)),
                   kind=draw(st.sampled_from(["vllm", "sglang"])),
                   defaults=draw(st.sampled_from([{}, {"max_num_seqs": 16}, {"chunked_prefill": True}])))


def _condition(data: dict[str, object]) -> Comparison | AllOf | AnyOf:
    if "all" in data:
        return AllOf.model_validate(data)
    if "any" in data:
        return AnyOf.model_validate(data)
    return Comparison.model_validate(data)


# --- the properties -------------------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(conditions, contexts())
def test_a_lazy_condition_text_is_the_eager_one(data, ctx):
    cond = _condition(data)
    value, text = _eager_check(cond, ctx)
    truth = evaluation.check(cond, ctx)
    assert truth.value is value
    assert truth.text == text  # built now, after the check returned
    assert truth.text == text  # and once built, kept
    assert truth == evaluation.Truth(value, text) and repr(truth) == f"Truth(value={value!r}, text={text!r})"


@settings(max_examples=200, deadline=None)
@given(st.lists(conditions, min_size=1, max_size=3), st.sampled_from(["all", "any"]), contexts(),
       st.integers(0, 3))
def test_a_lazy_outcome_reason_is_the_eager_one(parts, kind, ctx, streak):
    """A rule's outcome quotes its condition's text: the same whether read at once or later."""
    rule = loading.parse({"rules": [{
        "id": "r", "when": {kind: parts, "for": 2}, "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2},
    }]}).rules[0]
    value, text = _eager_check(AllOf.model_validate({"all": parts}) if kind == "all"
                               else AnyOf.model_validate({"any": parts}), ctx)
    outcome = evaluation.evaluate_rule(rule, ctx, streak_before=streak)
    again = evaluation.evaluate_rule(rule, ctx, streak_before=streak)
    if value is None:
        assert (outcome.status, outcome.reason) == ("unknown", text)
    elif value is False:
        assert (outcome.status, outcome.reason) == ("false", text)
    else:
        assert text in outcome.reason
    assert outcome == again and hash(outcome) == hash(again) and repr(outcome) == repr(again)
