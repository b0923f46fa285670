"""Fuzzing ``snapshots.parse``: arbitrary text, mutated real vLLM bodies, cuts at every byte, duplicated
and permuted lines, odd label escapes, huge numbers. Whatever comes in, a Snapshot comes out: valid with
finite samples and no duplicate series, or invalid with a one-line reason."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from functools import cache

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.support import FIXTURES, PROFILE, fuzz, tried
from tuner.model import dcgm, dialects, snapshots

# Scheduling (tests/conftest.py): one of the fast tier's longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 13

VLLM_BODIES = sorted((FIXTURES / "vllm").glob("*/*.prom"))
ALL_BODIES = sorted(FIXTURES.glob("**/*.prom"))
PREFIXES = [None, dialects.VLLM.parse_prefixes(), dialects.SGLANG.parse_prefixes(), dcgm.dcgm_keep_prefixes()]


@cache
def body(i: int) -> str:
    return ALL_BODIES[i % len(ALL_BODIES)].read_text()


@cache
def reference(text: str) -> snapshots.Snapshot:
    return snapshots.parse(text, 0.0)


def check(snap: snapshots.Snapshot, *, limits: snapshots.SeriesLimits = snapshots.DEFAULT_LIMITS) -> None:
    """What every snapshot must be, whatever the input."""
    assert isinstance(snap, snapshots.Snapshot)
    if not snap.ok:
        assert isinstance(snap.error, str) and snap.error and "\n" not in snap.error, repr(snap.error)
        assert snap.series == {}
        return
    total = 0
    for name, samples in snap.series.items():
        assert samples, name
        seen = set()
        for s in samples:
            assert s.name == name and isinstance(s.value, float) and math.isfinite(s.value), s
            assert isinstance(s.labels, Mapping)
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in s.labels.items())
            key = frozenset(s.labels.items())
            assert key not in seen, f"duplicate series {name}{dict(s.labels)} in a valid snapshot"
            seen.add(key)
        assert len(samples) <= limits.max_series_per_name
        total += len(samples)
    assert total <= limits.max_series


def parse(text: str, keep: tuple[str, ...] | None, **kw: object) -> snapshots.Snapshot:
    snap = snapshots.parse(text, 1.0, keep_prefixes=keep, **kw)  # type: ignore[arg-type]
    check(snap)
    return snap


@fuzz(2)
@given(st.text(max_size=600), st.sampled_from(PREFIXES), st.booleans())
def test_arbitrary_text(text, keep, newline):
    tried("arbitrary text")
    parse(text + ("\n" if newline else ""), keep)


@fuzz(1)
@given(st.binary(max_size=400), st.sampled_from(PREFIXES))
def test_arbitrary_bytes_as_a_scrape_would_decode_them(data, keep):
    tried("arbitrary bytes")
    parse(data.decode("utf-8", "replace") + "\n", keep)


_NUMBERS = st.one_of(
    st.floats().map(repr), st.integers().map(str), st.integers(-400, 400).map(lambda e: f"1e{e}"),
    st.sampled_from(["NaN", "nan", "+Inf", "-Inf", "inf", "Infinity", "-0", "0x10", "1_000", "1e400", "-1e999",
                     "1.7976931348623157e308", "4.9e-324", "", "+", "-", ".", "1e", "٣", "１"]),
    st.text("0123456789.eE+-", min_size=1, max_size=30),
    st.integers(1, 400).map(lambda n: "9" * n),
)
_LABEL_VALUE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).map(
    lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) | st.sampled_from(
    ["\\", '\\"', "\\n", "\\t", "\\u00e9", "é", "🙂", "a\\\\b", "", " ", "{", "}", ",", "="])
_LABEL_NAME = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,6}", fullmatch=True) | st.sampled_from(
    ["le", "engine", "__name__", "1bad", "a-b", "", "é"])
_NAME = st.sampled_from(["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                         "vllm:request_queue_time_seconds_bucket", "http_requests_total", "x", "a:b_c",
                         "DCGM_FI_DEV_GPU_TEMP", "sglang:num_queue_reqs", "9bad", "bad-name", ""])


@st.composite
def sample_lines(draw):
    labels = draw(st.lists(st.tuples(_LABEL_NAME, _LABEL_VALUE), max_size=4))
    sep = draw(st.sampled_from([",", ", ", " ,", ",,"]))
    text = sep.join(f'{k}="{v}"' for k, v in labels)
    trailing = draw(st.sampled_from(["", ",", " "]))
    braces = f"{{{text}{trailing}}}" if labels or draw(st.booleans()) else ""
    ts = draw(st.sampled_from(["", " 1700000000000", " -1", " 1.5", " x"]))
    space = draw(st.sampled_from([" ", "\t", "  ", ""]))
    return f"{draw(_NAME)}{braces}{space}{draw(_NUMBERS)}{ts}"


@st.composite
def meta_lines(draw):
    kind = draw(st.sampled_from(["# TYPE", "# HELP", "#", "# EOF", "#TYPE"]))
    typ = draw(st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped", "info", "bogus", "", "gauge x"]))
    return f"{kind} {draw(_NAME)} {typ}"


@fuzz(3)
@given(st.lists(sample_lines() | meta_lines(), max_size=25), st.sampled_from(PREFIXES), st.booleans())
def test_generated_exposition_with_odd_escapes_and_huge_numbers(lines, keep, newline):
    tried("generated exposition")
    text = "\n".join(lines) + ("\n" if newline else "")
    snap = parse(text, keep)
    if not newline and text:
        assert not snap.ok  # a body without its last newline is never read


@st.composite
def mutated_real_body(draw):
    text = body(draw(st.integers(0, len(ALL_BODIES) - 1)))
    lines = text.split("\n")
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["value", "duplicate", "drop", "swap", "garble", "label", "insert"]))
        line = lines[i]
        if op == "value" and " " in line and not line.startswith("#"):
            lines[i] = line.rsplit(" ", 1)[0] + " " + draw(_NUMBERS)
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "drop":
            del lines[i]
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], line
        elif op == "garble" and line:
            k = draw(st.integers(0, len(line) - 1))
            lines[i] = line[:k] + draw(st.text(max_size=3)) + line[k + 1:]
        elif op == "label" and "{" in line:
            lines[i] = line.replace("{", "{" + draw(_LABEL_NAME) + '="' + draw(_LABEL_VALUE) + '",', 1)
        elif op == "insert":
            lines.insert(i, draw(sample_lines()))
        if not lines:
            lines = [""]
    return "\n".join(lines)


@fuzz(3)
@given(mutated_real_body(), st.sampled_from(PREFIXES))
def test_mutated_real_bodies(text, keep):
    tried("mutated real body")
    parse(text, keep)


@fuzz(0.4)  # a permuted body leaves the fast path: ~40 ms a parse
@given(st.integers(0, len(VLLM_BODIES) - 1), st.integers(0, 2**32), st.sampled_from(PREFIXES))
def test_permuted_sample_lines_parse_or_are_refused(i, seed, keep):
    tried("permuted lines")
    lines = VLLM_BODIES[i].read_text().split("\n")[:-1]
    random.Random(seed).shuffle(lines)  # a seed, not st.randoms(): one draw instead of one per line
    parse("\n".join(lines) + "\n", keep)


@fuzz(1)
@given(st.integers(0, len(VLLM_BODIES) - 1), st.data())
def test_a_duplicated_sample_line_is_always_refused(i, data):
    tried("duplicated line")
    lines = VLLM_BODIES[i].read_text().split("\n")[:-1]
    samples = [k for k, line in enumerate(lines) if line and not line.startswith("#")]
    k = data.draw(st.sampled_from(samples))
    where = data.draw(st.integers(0, len(lines)))
    lines.insert(where, lines[k])
    snap = parse("\n".join(lines) + "\n", None)
    assert not snap.ok and "duplicate series" in snap.error


def test_every_cut_of_a_real_body():
    """Cut real bodies at every byte (a vLLM and an SGLang one in CI; every fixture in the long profile):
    a cut inside a line is refused, a cut at a line end reads a subset of the full body's samples."""
    paths = ALL_BODIES if PROFILE == "long" else [VLLM_BODIES[0], FIXTURES / "sglang" / "docs-production-metrics-llama8b.prom"]
    for path in paths:
        text = path.read_text()
        full = {(s.name, tuple(sorted(s.labels.items())), s.value) for v in reference(text).series.values() for s in v}
        for cut in range(len(text) + 1):
            tried("cut real body")
            piece = text[:cut]
            snap = parse(piece, None)
            if piece and not piece.isspace() and not piece.endswith("\n"):
                assert not snap.ok and "newline" in snap.error, cut
            elif snap.ok:
                got = {(s.name, tuple(sorted(s.labels.items())), s.value) for v in snap.series.values() for s in v}
                assert got <= full, cut


@fuzz(1)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 6))
def test_series_limits_hold_for_any_churn(per_name, total, names):
    tried("series limits")
    lines = [f'vllm:m{n}{{id="{i}"}} 1' for n in range(names) for i in range(per_name)]
    limits = snapshots.SeriesLimits(max_series=total, max_series_per_name=per_name)
    snap = snapshots.parse("\n".join(lines) + "\n", 0.0, limits=limits)
    check(snap, limits=limits)
    assert snap.ok == (per_name * names <= total)
    over = snapshots.parse("\n".join([*lines, f'vllm:m0{{id="{per_name}"}} 1']) + "\n", 0.0, limits=limits)
    assert not over.ok


def test_real_bodies_stay_valid():
    for path in ALL_BODIES:
        tried("real body")
        snap = parse(path.read_text(), None)
        assert snap.ok, (path, snap.error)
