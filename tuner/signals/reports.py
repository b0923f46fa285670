"""Turning signals into the JSON and table shapes the CLI prints (pure)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuReading, reason_names
from tuner.signals import VOCABULARY, Signal


def _clean(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return None
    return round(value, 6)


def report(signals: Mapping[str, Signal], *, info: EngineInfo | None = None,
           readings: Sequence[GpuReading] = (), extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"signals": {name: value|null}, "reasons": {name: why}, "quantiles": {...}, "engine": {...},
    "gpus": [...]}``; reasons are given for every null and for qualified values."""
    out: dict[str, Any] = {
        "signals": {name: _clean(s.value) for name, s in signals.items()},
        "reasons": {name: s.reason for name, s in signals.items() if s.reason},
        "quantiles": {
            name: {"bounds": [_clean(s.bounds[0]), _clean(s.bounds[1])], "resolution": _clean(s.resolution)}
            for name, s in signals.items() if s.bounds is not None
        },
        "engine": dataclasses.asdict(info) if info is not None else {},
        "gpus": [_gpu(r) for r in readings],
    }
    if extra:
        out.update(extra)
    return out


def _gpu(r: GpuReading) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    if r.clocks_event_reasons is not None:
        d["clocks_event_reason_names"] = reason_names(r.clocks_event_reasons)
    return d


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if value == int(value) and abs(value) < 1e12:
        return f"{int(value)}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.4g}"


def table(signals: Mapping[str, Signal], *, title: str = "") -> str:
    rows = []
    order = {name: i for i, name in enumerate(VOCABULARY)}
    for name, s in sorted(signals.items(), key=lambda kv: order.get(kv[0], len(order))):
        unit = VOCABULARY[name].unit if name in VOCABULARY else ""
        note = s.reason or ""
        if s.bounds is not None and s.reason is None:
            note = f"bucket {s.bounds[0]:g}–{s.bounds[1]:g}"
        rows.append((name, _fmt(s.value), unit, note))
    w0 = max((len(r[0]) for r in rows), default=4)
    w1 = max((len(r[1]) for r in rows), default=5)
    w2 = max((len(r[2]) for r in rows), default=4)
    lines = [title] if title else []
    lines += [f"{n:<{w0}}  {v:>{w1}}  {u:<{w2}}  {note}".rstrip() for n, v, u, note in rows]
    return "\n".join(lines)
