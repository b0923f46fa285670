"""Histogram arithmetic over cumulative Prometheus buckets, the way ``histogram_quantile`` does it.

Buckets are ``(upper bound, cumulative count)`` pairs sorted by bound, the last one ``+Inf``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from tuner.signals import EXACT, Signal, missing

Buckets = Sequence[tuple[float, float]]


def problem(buckets: Buckets, count: float | None, counts: list[float] | None = None) -> str | None:
    """Why cumulative ``buckets`` cannot be a Prometheus histogram (None: they can): every count in
    [0, 2^53] and not below the one before it, and the ``+Inf`` bucket equal to ``_count`` (when given).
    ``counts``: the buckets' counts, where the caller has them already."""
    if counts is None:
        counts = [n for _, n in buckets]
    if counts and (counts[0] < 0 or sorted(counts) != counts):  # sorted(): C speed on the usual sorted list
        previous, bound_before = 0.0, None
        for bound, n in buckets:
            if n < previous:
                where = f"le={bound:g} holds {n:g}, less than " + (f"le={bound_before:g} ({previous:g})"
                                                                     if bound_before is not None else "0")
                return f"buckets are not cumulative ({where})"
            previous, bound_before = n, bound
    previous = counts[-1] if counts else 0.0
    if previous > EXACT:
        return f"a bucket count {previous:g} is outside [0, 2^53]"
    if count is not None and buckets and math.isinf(buckets[-1][0]) and buckets[-1][1] != count:
        return f"+Inf bucket {buckets[-1][1]:g} ≠ _count {count:g}"
    return None


def delta(new: Buckets, old: Buckets | None) -> list[tuple[float, float]] | None:
    """Bucket-wise ``new - old``. ``None`` when the layouts differ or a count went down (reset)."""
    if old is None:
        return list(new)
    if len(new) != len(old):
        return None
    if not new:
        return []
    bounds, counts = zip(*new, strict=True)
    bounds_old, counts_old = zip(*old, strict=True)
    # another layout (bounds compared as lists are: the same object, or equal), or a count that went down
    if bounds != bounds_old or any(map(operator.lt, counts, counts_old)):
        return None
    return list(zip(bounds, map(operator.sub, counts, counts_old), strict=True))


def quantile(q: float, buckets: Buckets, *, conservative: bool = False) -> Signal:
    """The q-quantile of cumulative ``buckets``.

    Linear interpolation inside the bucket, as Prometheus does; the lowest bucket starts at 0.
    The result carries the bucket's bounds and width: a p95 inside vLLM's first 0.3 s queue
    bucket says "somewhere in 0–0.3 s", and ``resolution`` lets a rule refuse it.
    With ``conservative=True`` the bucket's *upper* bound is returned instead (used for token
    lengths that set a floor: never under-estimate).
    """
    if not buckets or not math.isinf(buckets[-1][0]):
        return missing("histogram has no +Inf bucket")
    total = buckets[-1][1]
    if total <= 0:
        return missing("no observations in the window")
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return Signal(lower, f"above the highest finite bucket: ≥ {lower:g}", None, (lower, bound))
            if conservative:
                return Signal(bound, "upper bound of its bucket", bound - lower, (lower, bound))
            in_bucket = count - below
            frac = (rank - below) / in_bucket if in_bucket > 0 else 1.0
            return Signal(lower + (bound - lower) * frac, None, bound - lower, (lower, bound))
        lower, below = bound, count
    return missing("quantile not found")  # unreachable with a +Inf bucket


def highest_nonempty_bound(buckets: Buckets) -> Signal:
    """Upper bound of the highest bucket that holds any observation."""
    if not buckets or buckets[-1][1] <= 0:
        return missing("no observations")
    previous = 0.0
    lower = 0.0
    top: tuple[float, float] | None = None
    for bound, count in buckets:
        if count > previous:
            top = (lower, bound)
        previous, lower = count, bound
    assert top is not None
    lo, hi = top
    if math.isinf(hi):
        return Signal(lo, f"above the highest finite bucket: ≥ {lo:g}", None, top)
    return Signal(hi, "upper bound of its bucket", hi - lo, top)
