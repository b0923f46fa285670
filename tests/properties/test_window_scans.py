"""The scans of a window that look for what went wrong (a count that went down, a restart, the last activity)
answer what the plain loops they replaced answered, kept here verbatim as the oracles: the scans take a shortcut
for the usual window (sorted counts, one process start, activity at the end)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.model import dialects, snapshots
from tuner.signals import engine as es
from tuner.signals import histograms as hist


def oracle_went_down(counts):
    for i, (a, b) in enumerate(zip(counts, counts[1:], strict=False)):  # noqa: RUF007 (the loop as it was)
        if a is not None and b is not None and b < a:
            return i
    return None


def oracle_restart(snaps, readings):
    starts = [r.start for r in readings]
    for a, b, sb in zip(starts, starts[1:], snaps[1:], strict=False):
        if a is not None and b is not None and a != b:
            return f"engine restarted inside the window (process start time changed by {sb.scraped_at:.0f})"
    return None


def oracle_idle(snaps, readings, d):
    finished = [r.counters["request_success"][0] for r in readings]
    last_active = None
    for i, (snap, r) in enumerate(zip(snaps, readings, strict=True)):
        running = r.gauges["running"] or 0.0
        waiting = r.gauges["waiting"] or 0.0
        moved = i > 0 and finished[i] is not None and finished[i - 1] is not None and finished[i] != finished[i - 1]
        if running > 0 or waiting > 0 or moved:
            last_active = snap.scraped_at
    if readings[-1].gauges["running"] is None:
        return es.missing(es.reads.absent(d, "running"))
    end = snaps[-1].scraped_at
    if last_active is None:
        return es.Signal(end - snaps[0].scraped_at, "no activity in the whole window: at least this long")
    return es.Signal(end - last_active)


counts = st.lists(st.none() | st.sampled_from([0.0, 1.0, 2.0, 5.0]) | st.floats(0, 1e6), min_size=1, max_size=12)
sorted_counts = st.lists(st.floats(0, 1e6), min_size=1, max_size=12).map(sorted)


@settings(max_examples=300, deadline=None)
@given(counts | sorted_counts)
def test_where_a_count_went_down_is_where_the_loop_found_it(values):
    assert es.went_down(values) == oracle_went_down(values)


reading = st.builds(
    lambda start, running, waiting, done: SimpleNamespace(
        start=start, gauges={"running": running, "waiting": waiting}, counters={"request_success": (done, None)}),
    st.none() | st.sampled_from([100.0, 100.0, 100.0, 250.0]),
    st.none() | st.sampled_from([0.0, 0.0, 1.0, 3.0]),
    st.none() | st.sampled_from([0.0, 0.0, 2.0]),
    st.none() | st.sampled_from([10.0, 10.0, 11.0, 40.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(reading, min_size=1, max_size=12), st.sampled_from(["vllm", "sglang"]))
def test_restart_and_idle_scans_answer_what_the_loops_answered(readings, kind):
    snaps = [snapshots.Snapshot(scraped_at=10.0 + 2 * i) for i in range(len(readings))]
    d = dialects.DIALECTS[kind]
    assert es._restart_between(snaps, readings) == oracle_restart(snaps, readings)
    assert es._idle(snaps, readings, d) == oracle_idle(snaps, readings, d)


def oracle_delta(new, old):
    if old is None:
        return list(new)
    if len(new) != len(old):
        return None
    out = []
    for (bound, n), (bound_old, o) in zip(new, old, strict=True):
        if (bound is not bound_old and bound != bound_old) or n < o:
            return None
        out.append((bound, n - o))
    return out


NAN = float("nan")
bound = st.sampled_from([0.1, 0.5, 1.0, float("inf"), NAN]) | st.floats(allow_nan=True)
count = st.sampled_from([0.0, 1.0, 3.0, float("inf")]) | st.floats(0, 1e9)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(bound, count), max_size=8), st.none() | st.lists(st.tuples(bound, count), max_size=8),
       st.booleans())
def test_a_histograms_change_is_what_the_bucket_loop_made(new, old, same_layout):
    """``histograms.delta`` (zipped at C speed) against the loop it replaced: the same buckets, or None for another
    layout (bounds the same object or equal: one NaN object matches itself only) or a count that went down."""
    if same_layout and old is not None:  # the usual case: the same bounds, the same objects
        old = [(b, o) for (b, _), (_, o) in zip(new, old + [(0.0, 0.0)] * len(new), strict=False)]
    assert repr(hist.delta(new, old)) == repr(oracle_delta(new, old))
