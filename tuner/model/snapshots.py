"""Snapshots: one scrape of one Prometheus text exposition, parsed into frozen samples.

A fast parser reads the common shape of an exposition; anything else goes to prometheus_client's own
text parser. A body that cannot be parsed does not raise: the snapshot comes back with ``error`` set and
no samples, so the window that contains it is marked invalid and the cycle says why.

``parse`` is the one place where an exposition is validated, for every path that reads one (HTTP
scrapes, saved ``.prom`` files, recordings). What Prometheus' own scrape loop refuses is refused here
too (``model/textparse/promparse.go``, ``scrape/scrape.go``):

- an empty body, or one whose last line has no newline (Prometheus' parser needs a line break after
  every sample; a body cut inside ``27`` would read as ``2``);
- a line that is not exposition, an unknown ``# TYPE``, a label name twice in one series;
- a value outside the float64 range (``1e400``: Go's ParseFloat fails with ErrRange);
- more series than ``SeriesLimits`` allow, per metric name or in total (Prometheus' ``sample_limit``:
  label churn must not turn into one summed gauge).

Stricter than Prometheus, on purpose: the same series (metric name and label set, whatever the label
order) twice in one body makes the whole snapshot invalid, naming it. Prometheus keeps the first sample
and drops the second with a warning ("duplicate sample for timestamp"); a tuner that sums samples cannot
tell which one is true (27 waiting read as 12,372). A label with an empty value is kept as written (not
dropped as Prometheus does), so ``x{a=""}`` and ``x`` count as two series here.

With ``keep_prefixes`` only the lines the tuner reads are parsed and validated, which keeps a cycle over
hundreds of targets cheap; a malformed line in a family the tuner never reads does not void the scrape.
NaN and ±Inf values are valid exposition: such a sample is left out and its sample name is listed in
``Snapshot.nonfinite``, so signals read the whole series as unknown (never a partial sum of the rest).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain, compress, count
from operator import itemgetter, ne
from sys import intern
from types import MappingProxyType
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]


class Sample(NamedTuple):
    """One sample line. A NamedTuple rather than a frozen dataclass: a cycle over hundreds of targets
    creates hundreds of thousands of these, and tuple construction is ~3× cheaper."""

    name: str
    labels: Labels
    value: float


_LABELS_OF = itemgetter(1)  # Sample.labels
_STARTS: dict[tuple[str, ...], dict[str, bool]] = {}  # per prefixes: whether a sample name starts with one of them


_EMPTY: Mapping[str, tuple[Sample, ...]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One scrape. ``scraped_at`` is seconds since the epoch (the caller's clock, passed in).

    ``series`` maps a *sample* name (``vllm:prompt_tokens_total``, ``..._bucket``) to its samples.
    ``error`` is set when the scrape or the parse failed; such a snapshot holds no samples.
    """

    scraped_at: float
    series: Mapping[str, tuple[Sample, ...]] = field(default_factory=lambda: _EMPTY)
    error: str | None = None
    source: str = ""
    nonfinite: frozenset[str] = frozenset()
    """Sample names that had a NaN or ±Inf sample (left out of ``series``): read them as unknown."""
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)
    """What pure functions of this snapshot computed once (``signals.engine``: a histogram's merged buckets);
    a window of 40 snapshots is read again at every cycle, and re-merging each bucket list was most of a
    cycle's time (``python -m bench.cycle_cost``). Not part of the value: equality and hashing ignore it."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def samples(self, name: str) -> tuple[Sample, ...]:
        return self.series.get(name, ())

    def names(self) -> Iterable[str]:
        return self.series.keys()

    def label_sets(self, prefixes: tuple[str, ...] | None = None) -> tuple[Labels, ...]:
        """The label sets of the samples whose name starts with one of ``prefixes`` (of every sample: None), each
        mapping once (the parser shares one per distinct set), computed once per snapshot: an engine's identity
        and the one-engine check (``signals.engine.impossible``) read them, not every sample's labels again."""
        key = ("label sets", prefixes)
        found: tuple[Labels, ...] | None = self.memo.get(key)
        if found is None:
            series = self.series
            chosen: Iterable[tuple[Sample, ...]] = series.values()
            if prefixes is not None:
                starts = _STARTS.get(prefixes)
                if starts is None:
                    starts = _STARTS.setdefault(prefixes, {})
                inside = []
                for name, samples in series.items():
                    under = starts.get(name)
                    if under is None:
                        under = starts[name] = name.startswith(prefixes)
                    if under:
                        inside.append(samples)
                chosen = inside
            if prefixes is not None and len(inside) == len(series):
                found = self.label_sets()  # a body parsed under the same filter: every sample's
            else:  # each mapping once, in the order first seen (at C speed)
                every = list(map(_LABELS_OF, chain.from_iterable(chosen)))
                found = tuple(dict(zip(map(id, every), every, strict=True)).values())
            self.memo[key] = found
        return found

    def label_values(self, label: str, prefixes: tuple[str, ...] | None = None) -> frozenset[str]:
        """The values ``label`` takes in ``label_sets(prefixes)`` (in those that hold it), computed once per snapshot
        (and carried to a target's next scrape where it has the same label mappings: ``_CARRIED``) for the identity
        checks (``signals.engine.impossible``, ``planning.identities``)."""
        key = ("label values", label, prefixes)
        found: frozenset[str] | None = self.memo.get(key)
        if found is None:
            found = self.memo[key] = frozenset(lb[label] for lb in self.label_sets(prefixes) if label in lb)
        return found

    @classmethod
    def failed(cls, scraped_at: float, error: str, *, source: str = "") -> Snapshot:
        return cls(scraped_at=scraped_at, error=error, source=source)


@dataclass(frozen=True, slots=True)
class SeriesLimits:
    """How many series one exposition may hold (Prometheus' ``sample_limit``, per name and in total).

    A vLLM 0.32 body (one engine, one model) has ~460 series, ~155 of them in the families the tuner
    reads, and its largest metric name has 24 (a latency histogram's buckets). The defaults leave room
    for 64 data-parallel engines and many HTTP handlers, and stop label churn (a request id or a
    timestamp as a label value) long before it costs memory or sums into one number."""

    max_series: int = 50_000
    """Series in the parsed part of one body (all of it without ``keep_prefixes``)."""
    max_series_per_name: int = 5_000
    """Series of one sample name (``vllm:num_requests_waiting``; a histogram's ``_bucket`` on its own)."""


DEFAULT_LIMITS = SeriesLimits()

# The metric types of Prometheus' text format 0.0.4 (promparse.go refuses any other).
PROMETHEUS_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})
_REFERENCE_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "unknown"})  # prometheus_client's names
_INF_SPELLINGS = frozenset({"inf", "infinity"})


class _Rejected(Exception):
    """Raised by the fast parser for input that no parser may accept (not merely an unusual shape)."""


def _wanted_lines(text: str, prefixes: tuple[str, ...]) -> str:
    """Keep only the sample lines (and their HELP/TYPE lines) whose name starts with a prefix.

    A vLLM exposition carries hundreds of series the tuner never reads (``_created`` timestamps,
    HTTP size summaries, Python GC stats). Dropping them before the parser runs is what keeps one
    cycle over hundreds of targets cheap; the parser still sees well-formed exposition.
    """
    out = []
    for line in text.splitlines():
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[2].startswith(prefixes):
                out.append(line)
            continue
        if line.startswith(prefixes) and "_created" not in line.partition("{")[0].partition(" ")[0]:
            out.append(line)
    return "\n".join(out) + "\n"


# The common shape of a sample line: name, optional {labels} whose values hold no backslash, value,
# optional timestamp. Anything else (escapes, odd spacing, junk) goes to prometheus_client's parser.
_LINE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"\\{}]|"[^"\\]*")*)\})?[ \t]+(\S+)([ \t]+-?[0-9]+)?[ \t]*'
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*)"[ \t]*(?:,|$)')

# Label sets repeat verbatim from one scrape to the next (and across replicas); sharing one frozen
# mapping per distinct label set keeps hundreds of windows of snapshots small in memory. The sharing is
# by label *set* (``_CANONICAL``), not by text: two spellings of one set (another order, spaces, a
# trailing comma) give the very same object, so the duplicate-series check compares identities.
_LABELS_CACHE: dict[str, Labels] = {}
_CANONICAL: dict[tuple[tuple[str, str], ...], Labels] = {}
_LABELS_CACHE_MAX = 200_000
_SOURCES_MAX = 1_024  # sources whose last body is remembered (_PREVIOUS; ~28 KiB each), the least recent evicted
_NO_LABELS: Labels = MappingProxyType({})


def _labels(text: str) -> Labels | None:
    cached = _LABELS_CACHE.get(text)
    if cached is not None:
        return cached
    out: dict[str, str] = {}
    pos, end = 0, len(text)
    while pos < end:
        m = _LABEL.match(text, pos)
        if m is None or m.end() == pos:
            return None
        if m.group(1) in out:
            return None  # duplicate label: let the reference parser decide
        out[m.group(1)] = m.group(2)
        pos = m.end()
    if not out:
        labels = _NO_LABELS
    else:
        key = tuple(sorted(out.items()))
        labels = _CANONICAL.get(key) or _CANONICAL.setdefault(key, MappingProxyType(out))
    _LABELS_CACHE[text] = labels
    return labels


# A series' text repeats verbatim from one scrape to the next (only its value moves): the part of a sample line
# before its value, ``name{labels} `` up to and including the last space, maps to what the line regex and
# ``_labels`` made of it, so a known series costs a slice, a dict lookup and a float() instead of the regex
# (most of a parse: ``python -m bench.cycle_cost``, docs/performance.md). Only lines that matched the regex
# without a timestamp are entered; a line read through an entry is one the regex reads the same way (the value
# after the last space holds no whitespace, else the line takes the regex path: see ``_fast_parse``).
# Kept per ``keep_prefixes``: under a filter, the text of a series that is not read maps to _SKIP, so the
# filter costs a lookup too (a filter holding whitespace caches nothing: see ``_fast_parse``).
_SERIES_CACHE: dict[tuple[str, ...] | None, dict[str, tuple[str, Labels]]] = {}
_SKIP: tuple[str, Labels] = ("", MappingProxyType({}))


# What a comment line says (the same HELP and TYPE lines come in every scrape), per ``keep_prefixes``:
# _REFUSED (not exposition), _OTHER (a comment the format ignores, or one of a family not read), or
# (family, its TYPE or None for a HELP line).
_REFUSED: tuple[str, str | None] = ("", "refused")
_OTHER: tuple[str, str | None] = ("", None)
_COMMENTS: dict[tuple[str, ...] | None, dict[str, tuple[str, str | None]]] = {}
_ALLOWED: dict[tuple[str, str], tuple[str, ...]] = {}

# Per source (a target's URL) and ``keep_prefixes``: the last body's lines, what each said, the places of those read,
# where each name's samples came from, its snapshot's memo. The next body's lines with the same text in the same place
# (a gauge that did not move, an empty bucket, HELP/TYPE, families not read) are found at C speed and not read again
# (docs/performance.md). Kept from a source's second body on (``_ONCE``: a file read once keeps nothing).
_PREVIOUS: dict[tuple[str, tuple[str, ...] | None], tuple[list[str], list[Any], list[int],
                                                           dict[str, tuple[list[int], bool]] | None, dict[Any, Any]]] = {}
_CARRIED = frozenset({"label sets", "label values"})  # a memo's, by names and mappings only
_ONCE: dict[tuple[str, tuple[str, ...] | None], None] = {}


class _NotFinite(NamedTuple):
    """A sample line whose value is NaN or ±Inf (or out of the float64 range): named in ``nonfinite``, or refused."""

    name: str
    labels: Labels
    value: float
    text: str


_REFUSE = ("", "a line only the reference parser may read")


def _comment(line: str, keep_prefixes: tuple[str, ...] | None) -> tuple[str, str | None]:
    if keep_prefixes is not None and not (line.startswith(("# HELP ", "# TYPE ")) and
                                          line[7:].startswith(keep_prefixes)):
        return _OTHER  # dropped unread, whatever it holds
    if not line.startswith("# "):
        return _REFUSED
    parts = line.split(None, 3)
    if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
        if parts[1] == "TYPE" and (len(parts) != 4 or parts[3] not in PROMETHEUS_TYPES):
            return _REFUSED
        return (parts[2], parts[3] if parts[1] == "TYPE" else None)
    return _OTHER


def _allowed(family: str, family_type: str) -> tuple[str, ...]:
    """The sample names a family of this type may hold (a histogram's ``_bucket``, ``_sum``, ``_count``)."""
    key = (family, family_type)
    found = _ALLOWED.get(key)
    if found is None:
        found = _ALLOWED[key] = tuple(family + x for x in _ALLOWED_SUFFIXES.get(family_type, ("",)))
    return found


def _trim_label_caches() -> None:
    """Called between parses only, so that identities stay comparable within one body."""
    if (len(_LABELS_CACHE) >= _LABELS_CACHE_MAX or len(_CANONICAL) >= _LABELS_CACHE_MAX
            or sum(map(len, _SERIES_CACHE.values())) >= _LABELS_CACHE_MAX
            or sum(map(len, _COMMENTS.values())) >= _LABELS_CACHE_MAX or len(_ALLOWED) >= _LABELS_CACHE_MAX
            or sum(map(len, _STARTS.values())) >= _LABELS_CACHE_MAX or len(_ONCE) >= _LABELS_CACHE_MAX):
        _LABELS_CACHE.clear()
        _CANONICAL.clear()
        _SERIES_CACHE.clear()
        _COMMENTS.clear()
        _ALLOWED.clear()
        _STARTS.clear()
        _PREVIOUS.clear()  # (its reads hold the label mappings of before: with the others, never alone)
        _ONCE.clear()


MAX_TIMESTAMP_SKEW_SECONDS = 600.0
"""A sample that carries its own timestamp (rare: engines leave it out) further than this from the
scrape's time is not read as now — years-old data replayed by a cache or a proxy would be believed."""

_ALLOWED_SUFFIXES = {"summary": ("_count", "_sum", ""), "histogram": ("_count", "_sum", "_bucket")}


def _fast_parse(text: str, keep_prefixes: tuple[str, ...] | None = None,
                nonfinite: set[str] | None = None, source: str = "", memo: dict[Any, Any] | None = None
                ) -> dict[str, list[Sample]] | None:
    """Parse the common exposition shape; None as soon as a line is not plainly of that shape.

    Equivalent to prometheus_client's parser on what it accepts (property-tested against it in
    tests/unit/test_snapshots.py); roughly 10× faster on vLLM expositions, which is what keeps one
    cycle over hundreds of targets within budget (docs/performance.md). Names of NaN/±Inf samples go
    to ``nonfinite``; a value outside the float64 range raises ``_Rejected``. ``source``: only the lines that
    differ from the last body from there are read again (``_PREVIOUS``). ``memo``: the new snapshot's, given what
    the last one's found of its label sets where each sample has the label mapping its place had (``_CARRIED``).

    Two passes: what each line says on its own (a pure function of its text and ``keep_prefixes``: a Sample, a
    HELP or TYPE line's family and type, _SKIP, _NotFinite, _REFUSE), then the lines read, in order, through the
    state a family's lines share."""
    # A line is read when it starts with one of ``keep_prefixes`` (a HELP or TYPE line: its family does), and
    # that is decided once per series text: a series text ends with the space before the value, so a prefix
    # without whitespace that starts one line with that text starts every such line, or none of them.
    series_cache = _SERIES_CACHE.get(keep_prefixes)
    cacheable = (series_cache is not None or keep_prefixes is None
                 or not any(c.isspace() for p in keep_prefixes for c in p))
    if series_cache is None:
        series_cache = _SERIES_CACHE.setdefault(keep_prefixes, {}) if cacheable else {}
    comments = _COMMENTS.setdefault(keep_prefixes, {})
    isfinite, new_tuple = math.isfinite, tuple.__new__
    lines = text.split("\n")
    key = (source, keep_prefixes)
    before = _PREVIOUS.get(key) if source else None
    plan: dict[str, tuple[list[int], bool]] | None
    if before is not None and len(before[0]) == len(lines):
        # the same lines in the same places (the usual next body of a target): only those whose text changed
        reads, read_lines, plan = before[1].copy(), before[2], before[3]
        changed: Iterable[int] = compress(count(), map(ne, lines, before[0]))
    else:
        reads, read_lines, plan, changed = [_SKIP] * len(lines), None, None, range(len(lines))
    same_labels = True  # every sample read in its place has the label mapping of the sample there before
    read: Any
    for i in changed:
        line = lines[i]
        if not line:
            read = _SKIP
        elif line[0] == "#":
            read = comments.get(line)
            if read is None:
                read = comments[line] = _comment(line, keep_prefixes)
            read = _SKIP if read is _OTHER else _REFUSE if read is _REFUSED else read
        else:
            cut = line.rfind(" ") + 1
            known = series_cache.get(line[:cut]) if cut > 1 else None
            read = None
            if known is _SKIP:
                read = _SKIP
            else:
                value_text = line[cut:]
                if known is not None and value_text and "_" not in value_text and value_text.strip() == value_text:
                    # a series seen before, its value one word (no whitespace at either end: strip() gives it back
                    # as it is): float() reads a word as the regex's \S+ does, and refuses any whitespace inside it
                    # (then the line takes the regex path below, which decides)
                    try:
                        value = float(value_text)
                    except ValueError:
                        known = None
                else:
                    known = None
                if known is not None:
                    name, labels = known  # under a filter, never a _created series (those are _SKIP, below)
                elif keep_prefixes is not None and not line.startswith(keep_prefixes):
                    if cut > 1 and cacheable:
                        series_cache[line[:cut]] = _SKIP
                    read = _SKIP
                elif keep_prefixes is not None and "_created" in line.split("{", 1)[0]:
                    if cut > 1 and cacheable and "_created" in line[:cut].split("{", 1)[0]:
                        series_cache[line[:cut]] = _SKIP  # the name holds it: so does every line with this text
                    read = _SKIP
                else:
                    m = _LINE.fullmatch(line)
                    if m is None:
                        read = _REFUSE
                    else:
                        name, label_text, value_text, stamp = m.groups()
                        # a sample with its own timestamp: the reference parser reads it, and parse checks it;
                        # float() accepts 1_000: leave such oddities to the reference parser
                        try:
                            number = float(value_text) if stamp is None and "_" not in value_text else None
                        except ValueError:
                            number = None
                        parsed = None if number is None else _NO_LABELS if not label_text else _labels(label_text)
                        if parsed is None or number is None:
                            read = _REFUSE
                        else:
                            name, labels, value = intern(name), parsed, number
                            series_cache[line[:m.start(3)]] = (name, labels)
                if read is None:
                    read = (new_tuple(Sample, (name, labels, value)) if isfinite(value)  # Sample() without its __new__
                            else _NotFinite(name, labels, value, value_text))
        if read_lines is not None and (read.__class__ is not Sample or (was := reads[i]).__class__ is not Sample
                                       or read[0] is not was[0] or read[1] is not was[1]):  # (names are interned)
            was = reads[i]
            if read.__class__ is Sample:
                same_labels = False  # another mapping (or another name, or a sample where none was: no plan)
            if (read is _SKIP) != (was is _SKIP):
                read_lines = plan = None  # a line read now where one was skipped, or the other way round
            elif (plan is not None and read is not _SKIP and (read.__class__ is not Sample or was.__class__ is not Sample
                                                               or read[0] != was[0]) and read != was):
                plan = None  # another name, HELP or TYPE than before in this place
        reads[i] = read
    index: dict[str, list[Sample]] = {}
    if plan is not None:
        # each line read says what it said before but for values: each sample goes where its place's sample went
        for name, (places, renamed) in plan.items():
            index[name] = ([new_tuple(Sample, (name, r[1], r[2])) for r in map(reads.__getitem__, places)] if renamed
                           else list(map(reads.__getitem__, places)))
        if same_labels and memo is not None and before is not None:  # (list(): a copy at once, whatever reads it)
            memo.update((k, v) for k, v in list(before[4].items()) if isinstance(k, tuple) and k[0] in _CARRIED)
    else:
        if read_lines is None:
            read_lines = [i for i, r in enumerate(reads) if r is not _SKIP]
        plan = {} if source else None
        # prometheus_client names a counter's samples `<TYPE name>_total` when they are written without
        # the suffix, but only for samples that directly follow their TYPE line; track that state.
        family, family_type = "", "untyped"
        allowed: tuple[str, ...] = ()
        for place in read_lines:
            read = reads[place]
            kind = read.__class__
            if kind is Sample or kind is _NotFinite:
                name = read[0]
                if name not in allowed:
                    family, family_type, allowed = "", "untyped", ()  # a stray sample ends the family, as in the reference
                    renamed = False
                else:
                    renamed = family_type == "counter" and not family.endswith("_total")
                    if renamed:
                        name += "_total"
                if kind is _NotFinite:
                    plan = None  # read again each time: it says why
                    if read.value == read.value and read.text.lstrip("+-").lower() not in _INF_SPELLINGS:
                        raise _Rejected(f"the value {read.text} of {name} is out of range for a float64")
                    if nonfinite is not None:
                        nonfinite.add(name)
                    continue
                sample = new_tuple(Sample, (name, read[1], read[2])) if renamed else read
                samples = index.get(name)
                if samples is None:
                    index[name] = [sample]
                    if plan is not None:
                        plan[name] = ([place], renamed)
                else:
                    samples.append(sample)
                    if plan is not None:
                        plan[name][0].append(place)
            elif read is _REFUSE:
                return None
            else:  # a HELP or TYPE line of a family read
                named, typed = read
                if named != family:
                    family, family_type = named, "untyped"
                if typed is not None:
                    family_type = typed
                allowed = _allowed(family, family_type)
    if source:
        assert read_lines is not None  # (None only while the places of the lines read were being found again)
        if key in _PREVIOUS or key in _ONCE:  # (re)entered last: the order is recency, the least recent goes
            _PREVIOUS.pop(key, None)
            _PREVIOUS[key] = (lines, reads, read_lines, plan, {} if memo is None else memo)
            if len(_PREVIOUS) > _SOURCES_MAX:
                del _PREVIOUS[next(iter(_PREVIOUS))]
        else:
            _ONCE[key] = None  # a file read once (``replay``) keeps nothing; a target scraped again does
    return index


def parse(
    text: str,
    scraped_at: float,
    *,
    source: str = "",
    keep_prefixes: tuple[str, ...] | None = None,
    limits: SeriesLimits = DEFAULT_LIMITS,
) -> Snapshot:
    """Parse and validate exposition text into a Snapshot; never raises on bad input (see the module
    docstring for what makes a snapshot invalid).

    ``keep_prefixes`` restricts parsing to metric names starting with one of the prefixes.
    NaN and infinite sample values are dropped here and their names listed in ``nonfinite``, so a NaN
    gauge reads as unknown (``None`` downstream) rather than as a number.
    """
    if not text or text.isspace():
        return Snapshot.failed(scraped_at, "empty body", source=source)
    if text[-1] != "\n":
        # prometheus_client always ends the exposition with a newline, and Prometheus' own parser needs a
        # line break after every sample: a body without one was cut, maybe inside a value.
        return Snapshot.failed(scraped_at, "body does not end with a newline (truncated?)", source=source)
    _trim_label_caches()
    nonfinite: set[str] = set()
    memo: dict[Any, Any] = {}
    try:
        fast = _fast_parse(text, keep_prefixes, nonfinite, source, memo)
    except _Rejected as exc:
        return Snapshot.failed(scraped_at, f"not valid Prometheus text exposition: {exc}", source=source)
    if fast == {} and keep_prefixes is not None and not nonfinite:
        # Nothing we read was there. Is it exposition at all (another exporter) or junk (an HTML
        # page, a proxy's error text)? Only the full reference parse can tell; this case is rare.
        fast = None
    elif keep_prefixes is not None and fast is None:
        text = _wanted_lines(text, keep_prefixes)
    if fast is not None:
        return _snapshot(fast, nonfinite, scraped_at, source=source, limits=limits, shared_labels=True, memo=memo)
    index: dict[str, list[Sample]] = {}
    nonfinite.clear()
    skew = 0.0  # the largest distance of a sample's own timestamp from the scrape's time
    try:
        for family in text_string_to_metric_families(text):
            if family.type not in _REFERENCE_TYPES:
                return Snapshot.failed(scraped_at, f"not valid Prometheus text exposition: {family.name} has "
                                       f"type {family.type!r}, not one of Prometheus' text format "
                                       f"({', '.join(sorted(PROMETHEUS_TYPES))})", source=source)
            for s in family.samples:
                if s.timestamp is not None and scraped_at > 0:
                    skew = max(skew, abs(scraped_at - float(s.timestamp)))
                value = float(s.value)
                if math.isnan(value) or math.isinf(value):
                    nonfinite.add(s.name)  # a NaN series reads as unknown
                    continue
                index.setdefault(s.name, []).append(Sample(s.name, MappingProxyType(dict(s.labels)), value))
    except Exception as exc:  # noqa: BLE001 - the parser raises ValueError, TypeError, IndexError… on junk
        # described, never quoted: the parser's message holds the offending line, and a body can echo
        # a request's headers (an Authorization header, base64 of user:password) back at the tuner
        return Snapshot.failed(
            scraped_at,
            f"not Prometheus text exposition ({type(exc).__name__}: {str(exc).partition(':')[0][:60]}; "
            f"{len(text)} characters, "
            f"{text.count(chr(10))} lines; the body is not copied here)",
            source=source,
        )
    if skew > MAX_TIMESTAMP_SKEW_SECONDS:
        return Snapshot.failed(scraped_at, f"sample timestamps are {skew:.0f}s away from the scrape's time (limit "
                               f"{MAX_TIMESTAMP_SKEW_SECONDS:g}s): old data replayed, or a clock far off; not "
                               "read as now", source=source)
    if keep_prefixes is not None:
        index = {k: v for k, v in index.items() if k.startswith(keep_prefixes) and "_created" not in k}
        nonfinite = {k for k in nonfinite if k.startswith(keep_prefixes) and "_created" not in k}
    return _snapshot(index, nonfinite, scraped_at, source=source, limits=limits, shared_labels=False)


def _snapshot(index: dict[str, list[Sample]], nonfinite: set[str], scraped_at: float, *, source: str,
              limits: SeriesLimits, shared_labels: bool, memo: dict[Any, Any] | None = None) -> Snapshot:
    """The Snapshot of a parsed index, or an invalid one: too many series, or a series twice.

    ``shared_labels``: every label mapping comes from ``_labels`` (one object per label set), so a
    duplicate is two samples with the *same* mapping object; otherwise label sets are compared."""
    series: dict[str, tuple[Sample, ...]] = {}
    total = 0
    per_name = limits.max_series_per_name
    for name, samples in index.items():
        n = len(samples)
        total += n
        if n > 1:
            if n > per_name:
                return Snapshot.failed(scraped_at, f"{name} has {n} series, more than the limit of {per_name} "
                                       "per metric name (label churn?)", source=source)
            distinct = (len(set(map(id, map(_LABELS_OF, samples)))) if shared_labels
                        else len({frozenset(s.labels.items()) for s in samples}))
            if distinct != n:
                return Snapshot.failed(scraped_at, _duplicate(name, samples), source=source)
        series[name] = tuple(samples)
    if total > limits.max_series:
        return Snapshot.failed(scraped_at, f"{total} series in total, more than the limit of {limits.max_series} "
                               "(label churn?)", source=source)
    return Snapshot(scraped_at=scraped_at, series=MappingProxyType(series), source=source,
                    nonfinite=frozenset(nonfinite) if nonfinite else frozenset(), memo={} if memo is None else memo)


def _duplicate(name: str, samples: Iterable[Sample]) -> str:
    seen: set[frozenset[tuple[str, str]]] = set()
    for s in samples:
        key = frozenset(s.labels.items())
        if key in seen:
            # escaped as in the exposition, so a label value holding a newline keeps the message on one line
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
            return (f"duplicate series {name}{{{text}}} in one exposition: Prometheus refuses the second "
                    "sample; the tuner refuses the scrape rather than guess which one is true")
        seen.add(key)
    return f"duplicate series in {name}"  # unreachable: the caller counted fewer distinct label sets


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
