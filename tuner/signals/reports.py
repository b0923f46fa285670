"""Turning signals into the JSON and table shapes the CLI prints (pure)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuReading, reason_names
from tuner.signals import DOMAINS, VOCABULARY, Signal


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


DOCS_HEADER = """\
# Signals

Signals are the public vocabulary of rule files: named, engine-agnostic values computed by pure
functions over a window of two or more snapshots (engine) or over the latest readings (GPU).

- A value that cannot be computed is `null` with a reason (series absent, too few snapshots, a
  counter reset, a failed scrape in the window, stale data) — never 0 and never a negative rate.
- Quantiles come from histogram bucket *deltas* over the window, interpolated linearly inside the
  bucket as Prometheus' `histogram_quantile` does, and carry the bucket's `bounds` and `resolution`
  (its width). vLLM's queue and e2e buckets start at 0.3 s: a `queue_time_p95_s` inside `0–0.3` is
  "somewhere below 300 ms", not a measurement. Prefer the `_mean_s` signals where buckets are coarse;
  rules can refuse coarse values with `max_resolution`.
- Token-length quantiles (`prompt_tokens_p99`, `max_tokens_p99`) report the bucket's *upper* bound, so
  a `--max-model-len` floor built on them is never too low. vLLM's token buckets are 1-2-5 steps capped
  at the current max_model_len.
- Two per-token latencies, from two vLLM histograms with the same buckets: `itl_*` counts **every gap
  between two output tokens** (`vllm:inter_token_latency_seconds`), so one long prefill step that stalls a
  whole batch shows up in its p99 as many slow gaps; `tpot_*` counts **each finished request once**, at
  its own mean gap (`vllm:request_time_per_output_token_seconds`, TPOT), which is what a user streaming
  one answer feels. `itl_p99_s` finds stalls; `tpot_p99_s` judges the per-request speed. SGLang has no
  TPOT histogram: the `tpot_*` signals are `null` there.
- Engine series are summed over data-parallel `engine` labels (KV usage: the fullest engine).
- GPU signals aggregate the engine's GPUs worst-first: max temperature, min margin, any-of flags.
- Every value lies in its **domain** (last column) or is `null` with a reason: KV usage 57, a negative
  gauge, 1e308 or NaN never reach a rule, and nothing is clamped. Counts, rates and durations stop at
  2^53, past which a float64 holds no exact count. A series with a NaN/±Inf sample is unknown as a
  whole (a data-parallel sum never skips the bad engine), a counter sample outside [0, 2^53] voids its
  rate, and a histogram must be cumulative with its `+Inf` bucket equal to its `_count`.
- A scrape Prometheus would refuse is a failed scrape: an empty or cut body, a series twice, more than
  50,000 series (5,000 per metric name), a value beyond the float64 range.

Generated from `tuner/signals/__init__.py:VOCABULARY` and `DOMAINS` (a test keeps this file in sync).

| signal | unit | source | computation | domain |
|---|---|---|---|---|
"""


def vocabulary_markdown() -> str:
    rows = []
    for kind, heading in (("engine", "engine load and latency"), ("config", "engine live configuration"),
                          ("gpu", "GPU")):
        rows.append(f"| **{heading}** | | | | |")
        for name, d in VOCABULARY.items():
            if d.kind == kind:
                rows.append(f"| `{name}` | {d.unit} | {d.source.replace('|', '&#124;')} | "
                            f"{d.computation.replace('|', '&#124;')} | {DOMAINS[name].describe()} |")
    return DOCS_HEADER + "\n".join(rows) + "\n"
