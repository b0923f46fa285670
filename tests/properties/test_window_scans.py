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


def oracle_merged_buckets(snap, family):
    """``reads._merged_buckets`` as it was: every bucket sample summed per bound, then sorted."""
    samples = snap.samples(family + "_bucket")
    merged: dict[float, float] = {}
    for s in samples:
        le = s.labels.get("le")
        if le is None:
            continue
        try:
            bound = float(le)
        except ValueError:
            continue
        merged[bound] = merged.get(bound, 0.0) + s.value
    total_sum = sum(s.value for s in snap.samples(family + "_sum"))
    counts = snap.samples(family + "_count")
    total_count = sum(s.value for s in counts)
    cumulative = sorted(merged.items())
    why = hist.problem(cumulative, total_count if counts else None)
    if why is None and total_sum < 0:
        why = f"_sum {total_sum:g} is negative"
    return f"histogram {family}: {why}" if why else (cumulative, total_sum, total_count)


LES = ["0.1", "0.5", "1", "1.0", "1e0", "2.5", "10", "+Inf", "-0", "0", "NaN", "x", "-1"]


RISING = ["0.1", "0.5", "1", "2.5", "10", "+Inf"]
AGAIN = {"0.1": "1e-1", "0.5": ".5", "1": "1.0", "2.5": "2.50", "10": "1e1", "+Inf": "Inf"}  # one bound, two spellings


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["0", "1"]), st.sampled_from(LES) | st.none(),
                          st.sampled_from([0.0, -0.0, 1.0, 3.0, 7.5]) | st.floats(0, 1e6)),
                min_size=1, max_size=10),
       st.sampled_from(["rising", "rising", "two engines", "a bound twice", "a NaN bound", "any"]), st.integers(0, 3))
def test_a_histograms_buckets_are_what_the_summing_loop_made(buckets, layout, repeats):
    """The buckets of one histogram in a snapshot (``reads._merged_buckets``: the usual layout, one sample per bucket in
    rising order, known by its label mappings) against the loop that summed every sample per bound: generated layouts
    (two engines, a bound twice, in any order, written two ways, not a number, missing), parsed again and again (the
    layout found by the mappings' identities)."""
    family = "vllm:request_queue_time_seconds"
    values = sorted(v for *_, v in buckets)  # counts that rise with the lines, so the layout, not the counts, decides
    if layout == "any":
        buckets = [(e, le, v) for (e, le, _), v in zip(buckets, values, strict=True)]
    else:  # the usual case, one engine, the bounds in rising order, each once; or two engines; or a bound twice
        buckets = [("0", le, v) for le, v in zip(RISING, values, strict=False)]
        if layout == "two engines":
            buckets += [("1", le, v) for _, le, v in buckets]
        elif layout == "a bound twice":
            i = len(values) % len(buckets)
            buckets.insert(i + 1, ("0", AGAIN[buckets[i][1]], buckets[i][2]))
        elif layout == "a NaN bound":
            i = len(values) % len(buckets)
            buckets[i] = ("0", "NaN", buckets[i][2])
    les = ["" if le is None else f',le="{le}"' for _, le, _ in buckets]
    lines = [f'{family}_bucket{{engine="{e}"{le}}} {v!r}' for (e, _, v), le in zip(buckets, les, strict=True)]
    text = "\n".join([*lines, f"{family}_sum 4.5", f"{family}_count {buckets[-1][2]!r}"]) + "\n"
    for _ in range(1 + repeats):
        snap = snapshots.parse(text, 1.0)
        if not snap.ok:
            return  # the same series twice: refused before any bucket is read
        found = es.reads._merged_buckets(snap, dialects.VLLM, "queue_time")
        assert repr(found) == repr(oracle_merged_buckets(snap, family))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["vllm:a", "vllm:b", "other"]), st.sampled_from(["m", "n", "", None]),
                          st.sampled_from(["0", "1", None])), min_size=1, max_size=8),
       st.sampled_from(["model_name", "engine", "job"]), st.booleans())
def test_a_labels_values_are_what_the_label_sets_hold(series, label, filtered):
    """``Snapshot.label_values`` (found once per run of shared label mappings) against the label sets read anew."""
    lines = []
    for i, (name, model, engine) in enumerate(series):
        labels = [f'{k}="{v}"' for k, v in (("model_name", model), ("engine", engine), ("i", str(i))) if v is not None]
        lines.append(f"{name}{{{','.join(labels)}}} {i}")
    text = "\n".join(lines) + "\n"
    prefixes = ("vllm:",) if filtered else None
    for _ in range(2):  # the second time, the same mappings: found by their identities
        snap = snapshots.parse(text, 1.0, keep_prefixes=prefixes)
        sets = snap.label_sets(prefixes)
        assert snap.label_values(label, prefixes) == {lb[label] for lb in sets if label in lb}
