"""One snapshot read for the engine signals: a concept's gauge, counter or histogram in one scrape. Pure.

``signals.engine`` folds windows of these; ``Reading`` is what its window signals read of one snapshot,
read once and kept in the snapshot's memo while the snapshot stays in the target's window.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat

from tuner.model import dialects, snapshots
from tuner.signals import EXACT
from tuner.signals import histograms as hist

Snapshot = snapshots.Snapshot
Labels = Mapping[str, str]


# --- reading one snapshot ---------------------------------------------------------------------

def first_present(snap: Snapshot, names: Sequence[str]) -> str | None:
    for name in names:
        if name in snap.series or name in snap.nonfinite:
            return name
    return None


def gauge(snap: Snapshot, dialect: dialects.Dialect, concept: str, *, how: str = "sum") -> float | None:
    """The concept's gauge (summed, or the max, over label sets); None when absent or any sample is
    NaN/±Inf."""
    name = first_present(snap, dialect.candidates(concept))
    if name is None or name in snap.nonfinite:
        return None
    values = [s.value for s in snap.samples(name)]
    if not values:
        return None
    return max(values) if how == "max" else sum(values)


def _counter(snap: Snapshot, dialect: dialects.Dialect, concept: str,
             where: Callable[[Labels], bool] | None = None) -> tuple[float | None, str | None]:
    """(the counter summed over label sets, why it is unusable); (None, None) when absent."""
    for family in dialect.candidates(concept):
        for name in (family + "_total", family):
            if name in snap.nonfinite:
                return None, f"counter {name} holds NaN or ±Inf"
            samples = snap.series.get(name)
            if samples is not None:
                values = [s.value for s in samples] if where is None else \
                    [s.value for s in samples if where(s.labels)]
                total = sum(values)
                # all samples ≥ 0 and their sum ≤ 2^53 ⇔ every sample in [0, 2^53] (and the sum too)
                if total > EXACT or (values and min(values) < 0):
                    bad = min(values) if min(values) < 0 else max(values)
                    return None, f"counter {name} = {bad:g} is outside [0, 2^53]"
                return total, None
    return None, None


def counter(snap: Snapshot, dialect: dialects.Dialect, concept: str,
            where: Callable[[Labels], bool] | None = None) -> float | None:
    """The counter summed over label sets (those ``where`` accepts); None when absent or unusable."""
    return _counter(snap, dialect, concept, where)[0]


Histogram = tuple[list[tuple[float, float]], float, float]


def histogram(snap: Snapshot, dialect: dialects.Dialect, concept: str) -> Histogram | str | None:
    """Cumulative buckets summed over label sets, plus _sum and _count; a string says why they are
    unusable (NaN, not cumulative, +Inf ≠ _count); None when absent. Computed once per snapshot."""
    key = ("buckets", id(dialect), concept)
    if key not in snap.memo:
        snap.memo[key] = _merged_buckets(snap, dialect, concept)
    found: Histogram | str | None = snap.memo[key]
    return found


_BOUNDS: dict[str, float] = {}  # an ``le`` label's text → its bound (the same few dozen texts in every scrape)
_LABELS_OF, _VALUE_OF = operator.itemgetter(1), operator.itemgetter(2)  # Sample.labels, Sample.value
# a histogram's bucket samples' label mappings (their first one's id and their number: the value holds them all, to
# be compared by identity) → their bounds (``_rising_bounds``)
_LAYOUTS: dict[tuple[int, int], tuple[tuple[Labels, ...], list[float] | None]] = {}


def _merged_buckets(snap: Snapshot, dialect: dialects.Dialect, concept: str) -> Histogram | str | None:
    for family in dialect.candidates(concept):
        samples = snap.samples(family + "_bucket")
        if snap.nonfinite:
            bad = [n for n in (family + "_bucket", family + "_sum", family + "_count") if n in snap.nonfinite]
            if bad:
                return f"histogram series {bad[0]} holds NaN or ±Inf"
        if not samples:
            continue
        # the usual layout (one sample per bucket, in rising order: one engine) is known by the label mappings the
        # parser shares (the same ones in the same order in each scrape of a target): its buckets are its samples'
        # values beside their bounds, as summing per bound and sorting would give them (0.0 + each count, as the
        # sum starts; tests/properties/test_window_scans.py holds it to ``_summed``)
        labels = tuple(map(_LABELS_OF, samples))
        key = (id(labels[0]), len(labels))
        layout = _LAYOUTS.get(key)
        if layout is None or not all(map(operator.is_, layout[0], labels)):
            if len(_LAYOUTS) >= 10_000:
                _LAYOUTS.clear()
            layout = _LAYOUTS[key] = (labels, _rising_bounds(labels))
        bounds = layout[1]
        values: list[float] | None = None
        if bounds is None:
            cumulative = _summed(samples)
        else:
            values = list(map(operator.add, repeat(0.0), map(_VALUE_OF, samples)))
            cumulative = list(zip(bounds, values, strict=True))
        total_sum = sum(map(_VALUE_OF, snap.samples(family + "_sum")))
        counts = snap.samples(family + "_count")
        total_count = sum(map(_VALUE_OF, counts))
        why = hist.problem(cumulative, total_count if counts else None, values)
        if why is None and total_sum < 0:
            why = f"_sum {total_sum:g} is negative"
        return f"histogram {family}: {why}" if why else (cumulative, total_sum, total_count)
    return None


def _rising_bounds(labels: Sequence[Labels]) -> list[float] | None:
    """Each label set's ``le`` read as a bound, if every one has a bound and they rise strictly (else None)."""
    bounds: list[float] = []
    for lb in labels:
        le = lb.get("le")
        bound = _bound(le) if le is not None else None
        if bound is None or bound != bound or (bounds and bound <= bounds[-1]):
            return None
        bounds.append(bound)
    return bounds


def _bound(le: str) -> float | None:
    """An ``le`` label's bound (None: not a number), kept in ``_BOUNDS`` but for NaN (NaN ≠ NaN: no bound to share)."""
    bound = _BOUNDS.get(le)
    if bound is None:
        try:
            bound = float(le)
        except ValueError:
            return None
        if bound == bound and len(_BOUNDS) < 10_000:
            _BOUNDS[le] = bound
    return bound


def _summed(samples: Iterable[snapshots.Sample]) -> list[tuple[float, float]]:
    """The buckets of ``samples`` summed per bound (data-parallel engines each report theirs), sorted by bound;
    a sample without an ``le`` label, or with one that is not a number, is left out."""
    merged: dict[float, float] = {}
    for s in samples:
        le = s.labels.get("le")
        bound = _bound(le) if le is not None else None
        if bound is None:
            continue
        merged[bound] = merged.get(bound, 0.0) + s.value
    return sorted(merged.items())


def buckets(snap: Snapshot, dialect: dialects.Dialect, concept: str) -> Histogram | None:
    """Cumulative buckets summed over label sets, plus _sum and _count. None when absent or unusable."""
    found = histogram(snap, dialect, concept)
    return None if isinstance(found, str) else found


def cache_info(snap: Snapshot, dialect: dialects.Dialect) -> Mapping[str, str] | None:
    name = first_present(snap, dialect.candidates("cache_info"))
    if name is None:
        return None
    samples = snap.samples(name)
    return samples[0].labels if samples else None


def number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) or math.isinf(value) else value


# --- one snapshot's reading, taken once --------------------------------------------------------

_GAUGES = (("running", "sum"), ("waiting", "sum"), ("kv_usage", "max"))
_COUNTERS = ("request_success", "prompt_tokens", "generation_tokens", "preemptions", "prefix_hits", "prefix_queries")
_HISTOGRAMS = ("inference_time", "prompt_len", "generation_len", "queue_time", "ttft", "itl", "tpot", "e2e",
               "max_tokens")
REJECTED = "http_requests 4xx"  # the key of the rejected completions' counter in ``Reading.counters``


class Reading:
    """What the window signals read of one snapshot, read once when the snapshot first enters a window and
    kept in its ``memo``: a window of 40 snapshots is folded again at every cycle (twice: the long and the
    decision window), and re-reading its samples was most of a cycle's signal time (docs/performance.md).
    Each field is what the per-snapshot function named beside it returns, so a window folded from readings
    is the window recomputed from the samples (tests/properties/test_incremental_window.py)."""

    __slots__ = ("broken", "counters", "gauges", "hist_counts", "histograms", "start")

    def __init__(self, snap: Snapshot, d: dialects.Dialect) -> None:
        self.gauges = {c: gauge(snap, d, c, how=how) for c, how in _GAUGES}  # gauge()
        # ``why_absent`` where a NaN/±Inf sample, not absence, emptied the gauge
        self.broken = {c: (why if snap.nonfinite and (why := why_absent(snap, d, c)) != absent(d, c) else None)
                       for c, _ in _GAUGES}
        self.counters = {c: _counter(snap, d, c) for c in _COUNTERS}  # _counter()
        handlers = d.completion_handlers
        if handlers:
            self.counters[REJECTED] = _counter(
                snap, d, "http_requests", lambda lb: lb.get("handler") in handlers and lb.get("status") == "4xx")
        self.histograms = {c: histogram(snap, d, c) for c in _HISTOGRAMS}  # histogram()
        self.hist_counts = {c: (b[2] if isinstance(b, tuple) else None)  # histogram()' _count
                            for c, b in self.histograms.items()}
        self.start = gauge(snap, d, "process_start")


_READING_KEYS: dict[int, tuple[str, int]] = {}


def _reading_key(d: dialects.Dialect) -> tuple[str, int]:
    """The memo key of ``d``'s readings: one object per dialect, so that a snapshot's memo finds it by identity
    (a key made anew is compared item by item with the one stored, in a memo no other step touched lately)."""
    key = _READING_KEYS.get(id(d))
    if key is None:
        key = _READING_KEYS.setdefault(id(d), ("reading", id(d)))
    return key


def reading(snap: Snapshot, d: dialects.Dialect) -> Reading:
    """``snap``'s ``Reading`` for dialect ``d``, taken at the first call and kept in ``snap.memo``."""
    key = _reading_key(d)
    found = snap.memo.get(key)
    if found is None:
        found = snap.memo[key] = Reading(snap, d)
    read: Reading = found
    return read


def readings(snaps: Iterable[Snapshot], d: dialects.Dialect) -> list[Reading]:
    """``reading`` of each snapshot of a window (its key found once, not once per snapshot)."""
    key = _reading_key(d)
    out: list[Reading] = []
    for snap in snaps:
        memo = snap.memo
        found = memo.get(key)
        if found is None:
            found = memo[key] = Reading(snap, d)
        out.append(found)
    return out



def absent(d: dialects.Dialect, concept: str) -> str:
    names = d.candidates(concept)
    if not names:
        return f"{d.kind} does not expose this"
    return f"series {' / '.join(names)} absent"


def why_absent(snap: Snapshot, d: dialects.Dialect, concept: str) -> str:
    """Why a gauge read nothing: a NaN/±Inf sample, or the series is not there."""
    if snap.nonfinite:
        for name in d.candidates(concept):
            if name in snap.nonfinite:
                return f"series {name} holds NaN or ±Inf"
    return absent(d, concept)
