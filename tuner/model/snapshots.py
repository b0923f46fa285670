"""Snapshots: one scrape of one Prometheus text exposition, parsed into frozen samples.

Parsing uses prometheus_client's own text parser. A body that cannot be parsed does not raise: the
snapshot comes back with ``error`` set and no samples, so the window that contains it is marked invalid
and the cycle says why.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Sample:
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
    if keep_prefixes is not None:
        text = _wanted_lines(text, keep_prefixes)
    index: dict[str, list[Sample]] = {}
    dropped = 0
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                value = float(s.value)
                if math.isnan(value) or math.isinf(value):
                    dropped += 1
                    continue
                index.setdefault(s.name, []).append(Sample(s.name, MappingProxyType(dict(s.labels)), value))
    except Exception as exc:  # the parser raises ValueError, TypeError, IndexError... on junk
        first = text.lstrip()[:60].replace("\n", " ")
        return Snapshot.failed(
            scraped_at,
            f"not Prometheus text exposition ({type(exc).__name__}: {exc}); body starts {first!r}",
            source=source,
        )
    del dropped  # counted for debugging; a NaN series simply reads as absent
    return Snapshot(
        scraped_at=scraped_at,
        series=MappingProxyType({k: tuple(v) for k, v in index.items()}),
        source=source,
    )
