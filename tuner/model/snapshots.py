"""Snapshots: one scrape of one Prometheus text exposition, parsed into frozen samples.

Parsing uses prometheus_client's own text parser. A body that cannot be parsed does not raise: the
snapshot comes back with ``error`` set and no samples, so the window that contains it is marked invalid
and the cycle says why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]


class Sample(NamedTuple):
    """One sample line. A NamedTuple rather than a frozen dataclass: a cycle over hundreds of targets
    creates hundreds of thousands of these, and tuple construction is ~3× cheaper."""

    name: str
    labels: Labels
    value: float


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

    @property
    def ok(self) -> bool:
        return self.error is None

    def samples(self, name: str) -> tuple[Sample, ...]:
        return self.series.get(name, ())

    def names(self) -> Iterable[str]:
        return self.series.keys()

    @classmethod
    def failed(cls, scraped_at: float, error: str, *, source: str = "") -> Snapshot:
        return cls(scraped_at=scraped_at, error=error, source=source)


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
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"\\{}]|"[^"\\]*")*)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*'
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*)"[ \t]*(?:,|$)')

# Label sets repeat verbatim from one scrape to the next (and across replicas); sharing one frozen
# mapping per distinct label text keeps hundreds of windows of snapshots small in memory.
_LABELS_CACHE: dict[str, Labels] = {}
_LABELS_CACHE_MAX = 200_000
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
    labels: Labels = MappingProxyType(out)
    if len(_LABELS_CACHE) >= _LABELS_CACHE_MAX:
        _LABELS_CACHE.clear()
    _LABELS_CACHE[text] = labels
    return labels


_ALLOWED_SUFFIXES = {"summary": ("_count", "_sum", ""), "histogram": ("_count", "_sum", "_bucket")}


def _fast_parse(text: str, keep_prefixes: tuple[str, ...] | None = None) -> dict[str, list[Sample]] | None:
    """Parse the common exposition shape; None as soon as a line is not plainly of that shape.

    Equivalent to prometheus_client's parser on what it accepts (property-tested against it in
    tests/unit/test_snapshots.py); roughly 10× faster on vLLM expositions, which is what keeps one
    cycle over hundreds of targets within budget (docs/performance.md).
    """
    index: dict[str, list[Sample]] = {}
    # prometheus_client names a counter's samples `<TYPE name>_total` when they are written without
    # the suffix, but only for samples that directly follow their TYPE line; track that state.
    family, family_type = "", "untyped"
    allowed: tuple[str, ...] = ()
    lines = text.split("\n")
    if keep_prefixes is not None:  # cheap C-level prefix tests drop what the tuner never reads
        lines = [ln for ln in lines if ln.startswith(keep_prefixes)
                 or (ln.startswith(("# HELP ", "# TYPE ")) and ln[7:].startswith(keep_prefixes))]
    for line in lines:
        if not line or line[0] == "#":
            if not line:
                continue
            if not line.startswith("# "):
                return None
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if parts[1] == "TYPE" and len(parts) != 4:
                    return None
                if parts[2] != family:
                    family, family_type = parts[2], "untyped"
                if parts[1] == "TYPE":
                    family_type = parts[3]
                allowed = tuple(family + x for x in _ALLOWED_SUFFIXES.get(family_type, ("",)))
            continue
        if keep_prefixes is not None and "_created" in line.split("{", 1)[0]:
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            return None
        name, label_text, value_text = m.groups()
        try:
            value = float(value_text)
        except ValueError:
            return None
        if "_" in value_text:
            return None  # float() accepts 1_000; leave such oddities to the reference parser
        labels = _NO_LABELS if not label_text else _labels(label_text)
        if labels is None:
            return None
        if name not in allowed:
            family, family_type, allowed = "", "untyped", ()  # a stray sample ends the family, as in the reference
        elif family_type == "counter" and not family.endswith("_total"):
            name += "_total"
        if math.isnan(value) or math.isinf(value):
            continue
        index.setdefault(name, []).append(Sample(name, labels, value))
    return index


def parse(
    text: str,
    scraped_at: float,
    *,
    source: str = "",
    keep_prefixes: tuple[str, ...] | None = None,
) -> Snapshot:
    """Parse exposition text into a Snapshot; never raises on bad input.

    ``keep_prefixes`` restricts parsing to metric names starting with one of the prefixes.
    NaN and infinite sample values are dropped here, so a NaN gauge reads as a missing series
    (``None`` downstream) rather than as a number.
    """
    fast = _fast_parse(text, keep_prefixes)
    if fast == {} and keep_prefixes is not None:
        # Nothing we read was there. Is it exposition at all (another exporter) or junk (an HTML
        # page, a proxy's error text)? Only the full reference parse can tell; this case is rare.
        fast = None
    elif keep_prefixes is not None and fast is None:
        text = _wanted_lines(text, keep_prefixes)
    if fast is not None:
        return Snapshot(scraped_at=scraped_at, series=MappingProxyType({k: tuple(v) for k, v in fast.items()}),
                        source=source)
    index: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                value = float(s.value)
                if math.isnan(value) or math.isinf(value):
                    continue  # a NaN series reads as absent
                index.setdefault(s.name, []).append(Sample(s.name, MappingProxyType(dict(s.labels)), value))
    except Exception as exc:  # noqa: BLE001 - the parser raises ValueError, TypeError, IndexError… on junk
        first = text.lstrip()[:60].replace("\n", " ")
        return Snapshot.failed(
            scraped_at,
            f"not Prometheus text exposition ({type(exc).__name__}: {exc}); body starts {first!r}",
            source=source,
        )
    if keep_prefixes is not None:
        index = {k: v for k, v in index.items() if k.startswith(keep_prefixes) and "_created" not in k}
    return Snapshot(
        scraped_at=scraped_at,
        series=MappingProxyType({k: tuple(v) for k, v in index.items()}),
        source=source,
    )
