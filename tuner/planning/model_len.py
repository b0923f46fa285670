"""The ``floor`` guard: --max-model-len never below what the observed traffic needs, plus a margin, so no
request the engine took before is refused after the change (the planner asks it before ``engine``; the other
guards are in ``planning.guards``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.model import knobs
from tuner.planning.guards import Ruling, SafetySettings, allow, deny
from tuner.signals import SignalSet, reason_of, value_of


@dataclass(frozen=True, slots=True)
class Floor:
    tokens: int | None
    reason: str


def max_model_len_floor(signals: SignalSet, settings: SafetySettings) -> Floor:
    """The smallest --max-model-len that rejects no observed request, plus the margin.

    vLLM returns 400 when ``max_tokens > max_model_len`` or when the prompt alone reaches it; when
    prompt + max_tokens exceeds it, output is silently cut (engine-contract.md §4). So the need is the
    largest of: prompt_tokens_p99 + max_tokens_p99 (typical requests complete), prompt_tokens_max + 1
    and max_tokens_max (no request since start is refused). The token signals are bucket *upper*
    bounds already; one that fell above the highest finite bucket is only a lower bound, so the need
    is unknown. Without a prompt-length and a max_tokens signal the floor is unknown too, and no
    lowering is allowed.
    """
    names = ("prompt_tokens_p99", "max_tokens_p99", "prompt_tokens_max", "max_tokens_max")
    unbounded = [n for n in names if (s := signals.get(n)) is not None and s.value is not None
                 and s.bounds is not None and math.isinf(s.bounds[1])]
    if unbounded:
        # "≥ 2000" (above the highest finite bucket) is a lower bound: the real need is not known.
        n = unbounded[0]
        return Floor(None, f"{n} is above its highest finite bucket (≥ {value_of(signals, n):g}): the real need is "
                           "unknown (set --custom-histogram-buckets for finer token buckets)")
    p99, m99 = value_of(signals, "prompt_tokens_p99"), value_of(signals, "max_tokens_p99")
    pmax, mmax = value_of(signals, "prompt_tokens_max"), value_of(signals, "max_tokens_max")
    parts: list[tuple[float, str]] = []
    if p99 is not None and m99 is not None:
        parts.append((p99 + m99, f"prompt_tokens_p99 {p99:g} + max_tokens_p99 {m99:g}"))
    if pmax is not None:
        parts.append((pmax + 1, f"prompt_tokens_max {pmax:g} + 1"))
    if mmax is not None:
        parts.append((mmax, f"max_tokens_max {mmax:g}"))
    have_prompt = p99 is not None or pmax is not None
    have_output = m99 is not None or mmax is not None
    if not (have_prompt and have_output):
        missing = [n for n, v in (("prompt_tokens_p99", p99), ("prompt_tokens_max", pmax),
                                  ("max_tokens_p99", m99), ("max_tokens_max", mmax)) if v is None]
        return Floor(None, "observed need unknown (" + "; ".join(
            f"{n}: {reason_of(signals, n)}" for n in missing) + ")")
    need, what = max(parts)
    tokens = math.ceil(need * (1 + settings.max_model_len_margin))
    return Floor(tokens, f"{what} = {need:g}, + {settings.max_model_len_margin:.0%} margin = {tokens}")


def floor_check(to_value: knobs.Value, floor: Floor, *, from_value: knobs.Value | None = None) -> Ruling:
    if floor.tokens is None:
        return deny("floor", f"--max-model-len not lowered: {floor.reason}")
    if float(to_value) < floor.tokens:
        if from_value is not None and float(from_value) <= floor.tokens:
            return deny("floor", f"--max-model-len {knobs.format_value(from_value)} is already at the observed "
                                 f"need: {floor.reason}")
        return deny("floor", f"{knobs.format_value(to_value)} is below the observed need: {floor.reason}")
    return allow("floor", floor.reason)
