"""Where the traffic changed inside a window: the change point the decision window restarts at. Pure.

A decision has to be made on data from the regime it is for. A window that spans the quiet minutes before a
load rise averages them in (the H200 ``h200-fit`` run: a 300 s window whose first three minutes were idle
read 6.0 arrivals/s per replica where 14.6 were arriving), and a window that spans the tuner's own change
mixes two engines. ``planning.stepping`` therefore decides on a short *decision window* that starts at the
latest of: ``decision_seconds`` ago, the tuner's last change, and the change point found here.

The arrivals between two scrapes come from flow balance, as ``arrival_rate_per_s`` does: every request that
arrived in the interval either finished (``request_success`` grew), or is still inside (running + waiting
grew). The intervals' counts are treated as Poisson, and the one split that best explains them as two
rates is taken when its log-likelihood ratio over one rate is at least ``min_llr`` and the two rates differ
by at least ``min_ratio`` (binary segmentation with one split: the newest change is the one that matters).

The constants: ``min_llr`` 10 is a false-alarm rate below 1e-4 per window for the split's χ²₁ statistic
(2·LLR = 20) even after the search over the split points of a 10-interval window (a Bonferroni factor
of 10); ``min_ratio`` 1.5 ignores the rate moving by less than the headroom the sizing keeps anyway
(``decisions.model.utilisation`` 0.8 sizes for 1.25 × the arrivals).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from tuner.model import dialects, snapshots
from tuner.signals import reads

MIN_LLR = 10.0
MIN_RATIO = 1.5


@dataclass(frozen=True, slots=True)
class ChangePoint:
    at: float  # the scrape time the new regime starts at (the window restarts here)
    before_per_s: float
    after_per_s: float
    llr: float

    def describe(self) -> str:
        return (f"arrivals changed {self.before_per_s:.3g}/s → {self.after_per_s:.3g}/s at {self.at:.0f} "
                f"(log-likelihood ratio {self.llr:.1f})")


def arrivals(snaps: Sequence[snapshots.Snapshot], dialect: dialects.Dialect
             ) -> list[tuple[float, float, float]] | None:
    """Per scrape interval: (start time, seconds, arrivals) by flow balance; None when a count is unreadable
    (a failed scrape, a missing series, a counter that went back: the window is not one engine's)."""
    points: list[tuple[float, float, float]] = []  # (time, finished, finished + running + waiting)
    if any(s.error is not None for s in snaps):
        return None
    for s, read in zip(snaps, reads.readings(snaps, dialect), strict=True):  # counter() and gauge(), read once
        done = read.counters["request_success"][0]
        running, waiting = read.gauges["running"], read.gauges["waiting"]
        if done is None or running is None or waiting is None:
            return None
        points.append((s.scraped_at, done, done + running + waiting))
    out: list[tuple[float, float, float]] = []
    for (t0, d0, in0), (t1, d1, in1) in itertools.pairwise(points):
        if t1 <= t0 or d1 < d0:
            return None
        out.append((t0, t1 - t0, max(0.0, in1 - in0)))
    return out


def _ll(count: float, seconds: float) -> float:
    """Poisson log-likelihood (up to terms that cancel) of ``count`` events in ``seconds`` at the MLE rate."""
    return count * math.log(count / seconds) if count > 0 else 0.0


def latest(snaps: Sequence[snapshots.Snapshot], dialect: dialects.Dialect, *, min_llr: float = MIN_LLR,
           min_ratio: float = MIN_RATIO, min_after: int = 1) -> ChangePoint | None:
    """The change point of the module docstring, or None (no change, or the counts cannot be read).
    ``min_after``: the fewest intervals the new regime must span."""
    intervals = arrivals(sorted(snaps, key=attrgetter("scraped_at")), dialect)
    if intervals is None or len(intervals) < 1 + min_after:
        return None
    total_n = sum(n for _, _, n in intervals)
    total_t = sum(t for _, t, _ in intervals)
    whole = _ll(total_n, total_t)
    best: ChangePoint | None = None
    n_before = t_before = 0.0
    for k in range(1, len(intervals) - min_after + 1):
        _, t, n = intervals[k - 1]
        n_before, t_before = n_before + n, t_before + t
        n_after, t_after = total_n - n_before, total_t - t_before
        llr = _ll(n_before, t_before) + _ll(n_after, t_after) - whole
        r0, r1 = n_before / t_before, n_after / t_after
        lo, hi = min(r0, r1), max(r0, r1)
        if llr < min_llr or (lo > 0 and hi / lo < min_ratio):
            continue
        if best is None or llr > best.llr:
            best = ChangePoint(at=intervals[k][0], before_per_s=r0, after_per_s=r1, llr=llr)
    return best
