import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.model import dialects, snapshots

# Scheduling (tests/conftest.py): one of the fast tier's longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 16

TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1.0
"""


def test_parse_indexes_samples_by_sample_name():
    snap = snapshots.parse(TEXT, 100.0)
    assert snap.ok
    assert snap.scraped_at == 100.0
    (s,) = snap.samples("vllm:prompt_tokens_total")
    assert s.value == 1234.0
    assert s.labels == {"engine": "0", "model_name": "m"}
    assert snap.samples("nope") == ()


def test_keep_prefixes_drops_other_families_and_created_series():
    snap = snapshots.parse(TEXT, 0.0, keep_prefixes=("vllm:",))
    assert set(snap.names()) == {"vllm:num_requests_running", "vllm:prompt_tokens_total"}


def test_nan_and_inf_values_read_as_absent():
    snap = snapshots.parse("a NaN\nb +Inf\nc 1\n", 0.0)
    assert snap.ok
    assert set(snap.names()) == {"c"}


@pytest.mark.parametrize(
    "body",
    [
        "<!DOCTYPE html><html><body>Not Found</body></html>\n",
        'vllm:x{engine="0" 1\n',
        "vllm:x one\n",
        "\x00\x01\x02\n",
    ],
)
def test_junk_gives_an_invalid_snapshot_not_an_exception(body):
    snap = snapshots.parse(body, 5.0, source="test")
    assert not snap.ok
    assert "not Prometheus text exposition" in snap.error
    assert snap.series == {}


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_arbitrary_text_never_raises(text):
    snap = snapshots.parse(text, 0.0)
    assert snap.ok or snap.error
    for samples in snap.series.values():
        for s in samples:
            assert not math.isnan(s.value)


def _line(name, labels, value):
    body = ",".join(k + '="' + v + '"' for k, v in labels.items())
    return f"{name}{{{body}}} {value}"


LINE = st.builds(
    _line,
    st.from_regex(r"[a-z_:][a-z0-9_:]{0,20}", fullmatch=True),
    st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True),
                    st.text(st.characters(blacklist_characters='"\\\n', blacklist_categories=("Cs",)), max_size=8),
                    max_size=3),
    st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "x"])),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(LINE, max_size=20), st.integers(min_value=0, max_value=400))
def test_adversarial_exposition_never_raises(lines, cut):
    text = "\n".join(lines) + "\n"
    for body in (text, text[:cut]):
        snap = snapshots.parse(body, 1.0, keep_prefixes=("a", "b", "v"))
        assert snap.ok or snap.error


# --- the fast path must agree with prometheus_client's parser ---------------------------------

def _reference(text):
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            v = float(s.value)
            if not (math.isnan(v) or math.isinf(v)):
                out.setdefault(s.name, []).append((dict(s.labels), v))
    return out


def _ours(snap):
    return {k: [(dict(s.labels), s.value) for s in v] for k, v in snap.series.items()}


FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures").glob("**/*.prom"))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fast_path_equals_reference_parser_on_every_real_fixture(path):
    text = path.read_text()
    assert snapshots._fast_parse(text) is not None, "real captures should take the fast path"
    assert _ours(snapshots.parse(text, 0.0)) == _reference(text)


TYPED = st.lists(
    st.tuples(
        st.from_regex(r"[a-z][a-z0-9_]{0,10}(_total)?", fullmatch=True),
        st.sampled_from(["counter", "gauge", "untyped", None]),
        st.lists(LINE, min_size=1, max_size=4),
    ),
    max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(TYPED)
def test_fast_path_agrees_with_reference_or_defers(families):
    lines = []
    for fam, typ, samples in families:
        if typ:
            lines.append(f"# TYPE {fam} {typ}")
        lines += [fam + s[s.index("{"):] if s.startswith("~") else s for s in samples]
    text = "\n".join(lines) + "\n"
    try:
        expected = _reference(text)
    except Exception:
        expected = None
    snap = snapshots.parse(text, 0.0)  # never raises
    if expected is not None:  # where the reference accepts, we read exactly the same samples ...
        if not snap.ok:  # ... or refuse what Prometheus refuses and prometheus_client lets through
            assert any(why in (snap.error or "") for why in ("empty body", "duplicate series", "out of range"))
            return
        assert _ours(snap) == expected


def test_junk_is_caught_even_when_no_wanted_line_is_in_it():
    snap = snapshots.parse("<html><body>502 Bad Gateway</body></html>\n", 0.0, keep_prefixes=("vllm:",))
    assert not snap.ok
    other = snapshots.parse("node_load1 0.5\n", 0.0, keep_prefixes=("vllm:",))
    assert other.ok
    assert other.series == {}


# --- what Prometheus would reject is an invalid snapshot, with a reason --------------------------------

WAITING = '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 27.0\n'


def test_a_duplicate_series_makes_the_snapshot_invalid_naming_the_series():
    # seen in the field: the same series twice was summed, "27 waiting" read as 12,372
    body = WAITING + 'vllm:num_requests_waiting{engine="0",model_name="m"} 12345.0\n'
    snap = snapshots.parse(body, 0.0, keep_prefixes=("vllm:",))
    assert not snap.ok and snap.series == {}
    assert 'duplicate series vllm:num_requests_waiting{engine="0",model_name="m"}' in snap.error


@pytest.mark.parametrize("second", [
    'vllm:num_requests_waiting{model_name="m",engine="0"} 1\n',   # the same label set, permuted
    'vllm:num_requests_waiting{model_name="m", engine="0",} 1\n',  # spaces and a trailing comma
    'vllm:num_requests_waiting{engine="0",model_name="m"} 1 1700000000000\n',  # with a timestamp
    'vllm:num_requests_waiting{engine="0",model_name="\\u"} 2\nvllm:num_requests_waiting{engine="0",model_name="\\u"} 1\n',
])
def test_duplicates_are_found_however_the_labels_are_spelled_and_on_both_parse_paths(second):
    snap = snapshots.parse(WAITING + second, 0.0)
    assert not snap.ok and "duplicate series vllm:num_requests_waiting" in snap.error


def test_a_duplicate_holding_an_escaped_newline_is_named_on_one_line():
    # found by tests/fuzz (test_mutated_real_bodies): the unescaped label value broke the one-line error
    line = 'vllm:num_requests_waiting{le="a\\n\\"b\\\\"} 0.0\n'
    snap = snapshots.parse(line + line, 0.0)
    assert not snap.ok and "\n" not in snap.error
    assert 'duplicate series vllm:num_requests_waiting{le="a\\n\\"b\\\\"} in one exposition' in snap.error


def test_distinct_label_sets_are_not_duplicates():
    body = WAITING + 'vllm:num_requests_waiting{engine="1",model_name="m"} 3\n'
    snap = snapshots.parse(body, 0.0)
    assert snap.ok and sum(s.value for s in snap.samples("vllm:num_requests_waiting")) == 30


def test_series_churn_beyond_the_limits_makes_the_snapshot_invalid():
    churn = "".join(f'vllm:num_requests_waiting{{engine="{i}",model_name="m"}} 1\n' for i in range(100_000))
    snap = snapshots.parse(churn, 0.0, keep_prefixes=("vllm:",))
    assert not snap.ok
    assert "vllm:num_requests_waiting has 100000 series" in snap.error and "per metric name" in snap.error
    small = snapshots.SeriesLimits(max_series=3, max_series_per_name=2)
    two = WAITING + 'vllm:num_requests_waiting{engine="1",model_name="m"} 3\n'
    assert snapshots.parse(two, 0.0, limits=small).ok
    three = two + 'vllm:num_requests_waiting{engine="2",model_name="m"} 3\n'
    assert "has 3 series" in (snapshots.parse(three, 0.0, limits=small).error or "")
    total = two + "a 1\nb 1\n"
    assert "4 series in total" in (snapshots.parse(total, 0.0, limits=small).error or "")


def test_real_vllm_bodies_are_far_inside_the_default_limits():
    """The defaults must fit real vLLM with room for data-parallel engines and many HTTP handlers: a
    vLLM 0.32 body has ~460 series, its largest metric name 24 (a histogram's buckets)."""
    biggest_total = biggest_name = 0
    for path in FIXTURES:
        snap = snapshots.parse(path.read_text(), 0.0)
        assert snap.ok, path
        biggest_total = max(biggest_total, sum(len(v) for v in snap.series.values()))
        biggest_name = max(biggest_name, *(len(v) for v in snap.series.values()))
    limits = snapshots.DEFAULT_LIMITS
    assert biggest_total * 64 <= limits.max_series and biggest_name * 64 <= limits.max_series_per_name


@pytest.mark.parametrize("keep", [None, ("vllm:",)])
def test_a_body_cut_inside_a_value_is_invalid_on_every_path(keep):
    # a metrics file cut inside "27.0" would read as 2
    cut = WAITING[: WAITING.index("27.0") + 1]
    snap = snapshots.parse(cut, 0.0, keep_prefixes=keep)
    assert not snap.ok and "does not end with a newline" in snap.error
    assert not snapshots.parse("", 0.0).ok and "empty" in snapshots.parse(" \n", 0.0).error


@pytest.mark.parametrize(("body", "why"), [
    ("# TYPE vllm:x bogus\nvllm:x 1\n", "metric type"),
    ('vllm:x{a="1",a="2"} 1\n', "not Prometheus text exposition"),
    ("vllm:x 1e400\n", "out of range"),
    ("vllm:x -1e999\n", "out of range"),
])
def test_what_prometheus_rejects_is_rejected(body, why):
    snap = snapshots.parse(body, 0.0)
    assert not snap.ok and why in snap.error


def test_nan_and_inf_samples_are_remembered_so_a_partial_sum_is_not_taken():
    body = 'vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:kv_cache_usage_perc{engine="1"} 0.5\nc +Inf\n'
    snap = snapshots.parse(body, 0.0)
    assert snap.ok and snap.nonfinite == frozenset({"vllm:kv_cache_usage_perc", "c"})


@settings(max_examples=150, deadline=None)
@given(st.lists(LINE, max_size=20), st.sampled_from([None, ("a",), ("a", "b"), ("v", "zz")]),
       st.sampled_from([None, ("a",), ("a", "b"), ("v", "zz")]))
def test_a_snapshots_label_sets_are_its_samples_labels(lines, keep, prefixes):
    """``Snapshot.label_sets``: every label set of the samples named with one of ``prefixes``, each once, whatever
    filter the body was parsed under and whichever parser read it (the reference parser shares no mappings)."""
    snap = snapshots.parse("\n".join(lines) + "\n", 1.0, keep_prefixes=keep)
    expected = {frozenset(s.labels.items()) for name, samples in snap.series.items()
                if prefixes is None or name.startswith(prefixes) for s in samples}
    for _ in range(2):  # computed, then kept
        found = snap.label_sets(prefixes)
        assert {frozenset(labels.items()) for labels in found} == expected
        assert len({id(labels) for labels in found}) == len(found)


def test_the_next_body_from_a_source_is_read_from_its_changed_lines_and_carries_its_label_sets():
    """A target's next scrape (``parse(source=)``): the lines that did not change are read as before (their samples are
    the same objects), and where every label mapping is the one in its place last time, the label sets the last
    snapshot's memo found are the new one's without reading its samples again (tests/properties/
    test_incremental_window.py holds both to a parse with nothing remembered, on generated bodies)."""
    keep = dialects.VLLM.parse_prefixes()
    first = "vllm:num_requests_running{model_name=\"a\"} 1\nvllm:num_requests_waiting{model_name=\"a\"} 2\n"
    url = "http://carry-test:8000/metrics"
    snapshots.parse(first, 1.0, source=url, keep_prefixes=keep)  # a first body from there: nothing kept yet
    one = snapshots.parse(first, 2.0, source=url, keep_prefixes=keep)
    sets = one.label_sets()
    two = snapshots.parse(first.replace("} 2", "} 5"), 3.0, source=url, keep_prefixes=keep)
    assert two.samples("vllm:num_requests_running")[0] is one.samples("vllm:num_requests_running")[0]
    assert two.samples("vllm:num_requests_waiting")[0].value == 5.0
    assert two.memo[("label sets", None)] is sets
    three = snapshots.parse(first.replace('"a"} 2', '"b"} 2'), 4.0, source=url, keep_prefixes=keep)
    assert ("label sets", None) not in three.memo  # another mapping: read anew
    assert three.label_values("model_name") == {"a", "b"}


def test_the_bodies_kept_per_source_are_bounded_and_the_least_recent_goes(monkeypatch):
    """A Kubernetes leader sees pods come and go: each new pod's URL is a new source. The bodies kept for the
    next parse are bounded (``_SOURCES_MAX``), the least recently parsed source going first, and a source
    whose body was dropped is simply read in full again."""
    monkeypatch.setattr(snapshots, "_SOURCES_MAX", 3)
    monkeypatch.setattr(snapshots, "_PREVIOUS", {})
    monkeypatch.setattr(snapshots, "_ONCE", {})
    keep = dialects.VLLM.parse_prefixes()
    body = "vllm:num_requests_running{model_name=\"a\"} 1\n"
    urls = [f"http://pod-{i}:8000/metrics" for i in range(5)]
    for url in urls:
        for t in (1.0, 2.0):  # kept from a source's second body on
            snapshots.parse(body, t, source=url, keep_prefixes=keep)
    snapshots.parse(body, 3.0, source=urls[2], keep_prefixes=keep)  # pod-2 parsed again: the most recent
    assert [url for url, _ in snapshots._PREVIOUS] == [urls[3], urls[4], urls[2]]
    again = snapshots.parse(body.replace("} 1", "} 7"), 4.0, source=urls[0], keep_prefixes=keep)
    assert again.samples("vllm:num_requests_running")[0].value == 7.0  # dropped: read in full
    assert len(snapshots._PREVIOUS) == 3 and urls[3] not in {url for url, _ in snapshots._PREVIOUS}
