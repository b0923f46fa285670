"""Engine signals over a window of snapshots. Pure: snapshots (with their times) in, signals out.

Inputs are checked where they are read: a series holding NaN/±Inf (``Snapshot.nonfinite``) is unknown
as a whole (never a partial sum of the other engines), a counter sample outside [0, 2^53] voids its
rate, a histogram whose buckets are not cumulative or whose +Inf bucket differs from its ``_count``
voids what is computed from it. Outputs are checked by ``signals.checked`` (each signal's domain).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import cast

from tuner.model import dialects, snapshots
from tuner.model.engines import EngineInfo
from tuner.signals import Signal, checked, missing, reads
from tuner.signals import histograms as hist
from tuner.signals.reads import Histogram, Reading, buckets, counter, gauge, reading, readings

__all__ = ["ALL_SIGNALS", "CONFIG_SIGNALS", "IDENTITY_LABELS", "INFO_SIGNALS", "LATEST_SIGNALS", "NOT_COMPUTED",
           "WINDOW_SIGNALS", "Histogram", "Reading", "buckets", "compute", "counter", "gauge", "impossible", "reading",
           "readings"]

Snapshot = snapshots.Snapshot
Labels = Mapping[str, str]

WINDOW_SIGNALS = (
    "requests_running_max", "requests_waiting_max", "kv_cache_usage_max",
    "request_rate", "prompt_tokens_per_s", "generation_tokens_per_s", "preemptions_per_s",
    "requests_rejected_per_s", "prefix_cache_hit_rate",
    "queue_time_mean_s", "queue_time_p50_s", "queue_time_p95_s", "ttft_mean_s", "ttft_p50_s", "ttft_p95_s",
    "ttft_p99_s", "itl_mean_s", "itl_p50_s", "itl_p95_s", "itl_p99_s", "tpot_mean_s", "tpot_p50_s", "tpot_p99_s",
    "e2e_mean_s", "e2e_p95_s", "prompt_tokens_p99", "max_tokens_p99", "idle_seconds", "window_seconds",
    # the inputs of the concurrency model (planning/models.py)
    "requests_running_mean", "requests_waiting_mean", "in_system_growth_per_s", "arrival_rate_per_s",
    "slot_seconds_mean", "prompt_tokens_mean", "generation_tokens_mean", "kv_concurrency_observed",
    "queue_wait_expected_s",
)
LATEST_SIGNALS = ("requests_running", "requests_waiting", "kv_cache_usage", "prompt_tokens_max",
                  "max_tokens_max", "sleep_level")
INFO_SIGNALS = ("server_load",)
CONFIG_SIGNALS = ("block_size", "num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency",
                  "gpu_memory_utilization", "max_model_len")
ALL_SIGNALS = LATEST_SIGNALS + WINDOW_SIGNALS + CONFIG_SIGNALS + INFO_SIGNALS
_WINDOW_SET = frozenset(WINDOW_SIGNALS)
_SCRAPED_AT, _ERROR = attrgetter("scraped_at"), attrgetter("error")


# --- the window ------------------------------------------------------------------------------

def compute(
    window: Sequence[Snapshot],
    *,
    dialect: dialects.Dialect = dialects.VLLM,
    info: EngineInfo | None = None,
    now: float | None = None,
    stale_after_seconds: float | None = None,
    min_snapshots: int = 2,
    max_running: float | None = None,
    only: frozenset[str] | None = None,
) -> dict[str, Signal]:
    """All engine signals for one target. Every name in ``ALL_SIGNALS`` is present in the result, every
    value inside its domain (``signals.DOMAINS``) or ``None`` with a reason.

    ``max_running``: the engine's ``--max-num-seqs`` (its scheduler never runs more). A snapshot that
    breaks what one engine guarantees (``impossible``) counts as a failed scrape. ``only``: the window
    signals the caller reads (``planning.stepping`` reads a long window's slow signals only); the window
    signals outside it are left uncomputed (``NOT_COMPUTED``), in their places, and every other value is as
    without ``only``."""
    window = _checked_window(window, dialect, max_running)
    out = _compute(window, dialect=dialect, info=info, now=now, stale_after_seconds=stale_after_seconds,
                   min_snapshots=min_snapshots, only=only)
    return {name: signal if signal.value is None else checked(name, signal) for name, signal in out.items()}


def _compute(
    window: Sequence[Snapshot],
    *,
    dialect: dialects.Dialect,
    info: EngineInfo | None,
    now: float | None,
    stale_after_seconds: float | None,
    min_snapshots: int,
    only: frozenset[str] | None,
) -> dict[str, Signal]:
    out: dict[str, Signal] = {}
    snaps = sorted(window, key=_SCRAPED_AT)
    if not snaps:
        return {name: missing("no snapshots") for name in ALL_SIGNALS}
    errors = list(map(_ERROR, snaps))
    bad = [] if errors.count(None) == len(errors) else [i for i, e in enumerate(errors) if e is not None]
    newest_good = next((s for s in reversed(snaps) if s.error is None), None)

    out.update(_config_signals(newest_good, dialect, info))
    if info is not None and info.server_load is not None:
        out["server_load"] = Signal(float(info.server_load))
    else:
        why = f": {info.error}" if info is not None and info.error else ""
        out["server_load"] = missing(f"GET /load not read (sleep mode reads it) or unreadable{why}")

    latest = snaps[-1]
    if not latest.ok:
        why = f"latest scrape failed: {latest.error}"
        out.update({name: missing(why) for name in LATEST_SIGNALS + WINDOW_SIGNALS})
        return out
    if now is not None and stale_after_seconds is not None and now - latest.scraped_at > stale_after_seconds:
        why = f"stale: the latest scrape is {now - latest.scraped_at:.0f}s old (limit {stale_after_seconds:g}s)"
        out.update({name: missing(why) for name in LATEST_SIGNALS + WINDOW_SIGNALS})
        return out

    out.update(_latest_signals(latest, dialect))

    if bad:
        # A failed scrape invalidates the window it falls in. Later cycles use only the snapshots
        # after it, so one failure (an engine restarting) does not blind the tuner for a whole window.
        failed = snaps[bad[-1]]
        snaps = snaps[bad[-1] + 1:]
        if len(snaps) < min_snapshots:
            why = (f"window invalid: the scrape at {failed.scraped_at:.0f} failed: {failed.error} "
                   f"({len(snaps)} good snapshot(s) since; need {min_snapshots})")
            out.update({name: missing(why) for name in WINDOW_SIGNALS})
            return out
    span = snaps[-1].scraped_at - snaps[0].scraped_at
    if len(snaps) < min_snapshots or span <= 0:
        why = f"too few snapshots: {len(snaps)} spanning {span:g}s (need ≥ {min_snapshots} over > 0s)"
        out.update({name: missing(why) for name in WINDOW_SIGNALS})
        return out

    out.update(_window_signals(snaps, dialect, span, only))
    out["kv_concurrency_observed"] = _kv_concurrency(out)
    return out


IDENTITY_LABELS = ("model_name", "instance", "job")
"""Labels that name an engine: one scrape of one engine carries one value of each (data-parallel
ranks share them and differ in ``engine``, which is summed)."""


def impossible(snap: Snapshot, dialect: dialects.Dialect, max_running: float | None = None) -> str | None:
    """Why ``snap`` cannot be one engine's exposition, or None: two ``model_name``s or two instances in
    one body (a proxy merging engines: their sums would be believed as one engine's), or more requests
    running than the engine's ``--max-num-seqs`` lets its scheduler run."""
    prefixes = dialect.parse_prefixes()
    for label in IDENTITY_LABELS:
        values = snap.label_values(label, prefixes)  # each distinct label set read once
        if len(values) > 1:
            shown = ", ".join(sorted(v[:40] for v in values)[:3])
            return (f"one engine per scrape: the body holds {len(values)} values of {label} ({shown}"
                    f"{', …' if len(values) > 3 else ''}); point the target at one engine")
    if max_running is not None and max_running > 0:
        # per engine core: data-parallel ranks (the ``engine`` label) each run up to --max-num-seqs
        running = gauge(snap, dialect, "running", how="max")
        if running is not None and running > max_running:
            return (f"impossible exposition: {running:g} requests running, above the engine's "
                    f"--max-num-seqs {max_running:g} (not this engine's numbers?)")
    return None


_IMPOSSIBLE_KEYS: dict[tuple[int, float | None], tuple[str, int, float | None]] = {}


def _checked_window(window: Sequence[Snapshot], dialect: dialects.Dialect, max_running: float | None
                    ) -> list[Snapshot]:
    """Each snapshot of ``window``, or a failed one in its place where it breaks what one engine guarantees
    (``impossible``): found once per snapshot, not once per cycle it is in a window, and kept in its memo under a
    key that is one object per dialect and cap (the memo finds it by identity)."""
    key = _IMPOSSIBLE_KEYS.get((id(dialect), max_running))
    if key is None:
        if len(_IMPOSSIBLE_KEYS) >= 1_000:
            _IMPOSSIBLE_KEYS.clear()
        key = _IMPOSSIBLE_KEYS.setdefault((id(dialect), max_running), ("impossible", id(dialect), max_running))
    out = []
    for snap in window:
        if snap.error is None:
            memo = snap.memo
            why = memo.get(key, memo)  # the memo itself: not computed yet
            if why is memo:
                why = memo[key] = impossible(snap, dialect, max_running)
            if why is not None:
                snap = Snapshot.failed(snap.scraped_at, why, source=snap.source)
        out.append(snap)
    return out


def _kv_concurrency(out: Mapping[str, Signal]) -> Signal:
    """How many requests of the window's mean size the KV cache holds at once: a running request holds its
    prompt and the tokens generated so far (vLLM allocates blocks as it decodes), over its life on average
    the prompt and half its output. The H200's KV-bound run (docs/evidence-h200.md: 112,976 tokens of cache,
    3,072/512-token requests) ran 31-39 at once with the cache 97-99.9 % full: 34 = 112,976 ÷ (3,072 + 256),
    where the final size (3,584) says 31.5. On the trace family the final size held raises at 227-257 where the
    batch needed more than 384 (seed 13: p5 0.889 → 0.912; docs/rules.md, "The KV bound is the mean
    footprint"). A moment when more requests than that are near their end preempts one; the raise's gates
    (KV < 95 %, no preemptions) then hold the next step."""
    size = out.get("kv_cache_size_tokens")
    prompt, generated = out.get("prompt_tokens_mean"), out.get("generation_tokens_mean")
    for s in (size, prompt, generated):
        if s is None or s.value is None:
            return missing((s.reason if s is not None else None) or "KV size or request sizes unknown")
    assert size is not None and prompt is not None and generated is not None
    assert size.value is not None and prompt.value is not None and generated.value is not None
    per_request = prompt.value + generated.value / 2
    if per_request <= 0:
        return missing("no tokens per request in the window")
    return Signal(size.value / per_request)


def _latest_signals(snap: Snapshot, d: dialects.Dialect) -> dict[str, Signal]:
    """The signals of the window's newest snapshot, computed once per snapshot (a step reads two windows that
    end in the same one); the caller copies them out and never changes the dict."""
    key = ("latest", id(d))
    found: dict[str, Signal] | None = snap.memo.get(key)
    if found is None:
        found = snap.memo[key] = _latest(snap, d)
    return found


def _latest(snap: Snapshot, d: dialects.Dialect) -> dict[str, Signal]:
    out: dict[str, Signal] = {}
    for signal, concept, how in (
        ("requests_running", "running", "sum"),
        ("requests_waiting", "waiting", "sum"),
        ("kv_cache_usage", "kv_usage", "max"),
    ):
        value = gauge(snap, d, concept, how=how)
        out[signal] = Signal(value) if value is not None else missing(reads.why_absent(snap, d, concept))
    for signal, concept in (("prompt_tokens_max", "prompt_len"), ("max_tokens_max", "max_tokens")):
        b = reads.histogram(snap, d, concept)
        if isinstance(b, str):
            out[signal] = missing(b)
        else:
            out[signal] = hist.highest_nonempty_bound(b[0]) if b else missing(reads.absent(d, concept))
    out["sleep_level"] = _sleep_level(snap, d)
    return out


def _sleep_level(snap: Snapshot, d: dialects.Dialect) -> Signal:
    """0 awake, 1 weights offloaded, 2 weights and KV cache discarded: the deepest data-parallel engine."""
    name = reads.first_present(snap, d.candidates("sleep_state"))
    if name is None:
        return missing(reads.absent(d, "sleep_state"))
    if name in snap.nonfinite:
        return missing(reads.why_absent(snap, d, "sleep_state"))
    flags: dict[str, dict[str, float]] = {}
    for s in snap.samples(name):
        flags.setdefault(s.labels.get("engine", ""), {})[s.labels.get("sleep_state", "")] = s.value
    levels = []
    for states in flags.values():
        if states.get("discard_all") == 1:
            levels.append(2)
        elif states.get("weights_offloaded") == 1 or states.get("awake") == 0:
            levels.append(1)
        else:
            levels.append(0)
    return Signal(float(max(levels))) if levels else missing(f"{name} has no samples")



def _config_signals(snap: Snapshot | None, d: dialects.Dialect, info: EngineInfo | None
                    ) -> dict[str, Signal]:
    """The engine's configuration from the newest good snapshot (and ``/v1/models``), computed once per snapshot
    and what it reads of ``info``: a step's two windows end in the same one. The caller copies them out."""
    if snap is None:
        return _config(None, d, info)
    key = ("config", id(d), None if info is None else (info.max_model_len, info.error))
    found: dict[str, Signal] | None = snap.memo.get(key)
    if found is None:
        found = snap.memo[key] = _config(snap, d, info)
    return found


def _config(snap: Snapshot | None, d: dialects.Dialect, info: EngineInfo | None) -> dict[str, Signal]:
    labels = reads.cache_info(snap, d) if snap is not None else None
    where = " / ".join(d.candidates("cache_info"))

    def label(key: str) -> Signal:
        if labels is None:
            return missing(f"{where} absent" if where else f"{d.kind} does not expose cache_config_info")
        value = reads.number(labels.get(key))
        return Signal(value) if value is not None else missing(f"{where} has no numeric {key!r}")

    out = {
        "block_size": label("block_size"),
        "num_gpu_blocks": label("num_gpu_blocks"),
        "gpu_memory_utilization": label("gpu_memory_utilization"),
    }
    if info is not None and info.max_model_len is not None:
        out["max_model_len"] = Signal(float(info.max_model_len))
    else:
        out["max_model_len"] = missing(
            (info.error if info is not None and info.error else None)
            or "not in /metrics; read from GET /v1/models (live) or pass --max-model-len")

    size = label("kv_cache_size_tokens")
    if size.value is None and snap is not None:
        capacity = gauge(snap, d, "kv_capacity_tokens")
        if capacity is not None:
            size = Signal(capacity)
    blocks, block_size = out["num_gpu_blocks"].value, out["block_size"].value
    if size.value is None and blocks is not None and block_size is not None:
        size = Signal(blocks * block_size, "num_gpu_blocks × block_size")
    out["kv_cache_size_tokens"] = size

    concurrency = label("kv_cache_max_concurrency")
    mml = out["max_model_len"].value
    if concurrency.value is None and size.value is not None and mml:
        concurrency = Signal(size.value / mml, "kv_cache_size_tokens / max_model_len")
    out["kv_cache_max_concurrency"] = concurrency
    return out


_GAUGE_SIGNALS = ("requests_running_max", "requests_waiting_max", "kv_cache_usage_max", "requests_running_mean",
                  "requests_waiting_mean", "in_system_growth_per_s")
_RATE_SIGNALS = ("request_rate", "prompt_tokens_per_s", "generation_tokens_per_s", "preemptions_per_s",
                 "requests_rejected_per_s", "arrival_rate_per_s", "prefix_cache_hit_rate")
NOT_COMPUTED = missing("not computed (compute(only=...) was not asked for it)")


def _window_signals(snaps: Sequence[Snapshot], d: dialects.Dialect, span: float,
                    only: frozenset[str] | None = None) -> dict[str, Signal]:
    out: dict[str, Signal] = {"window_seconds": Signal(span)}

    def wanted(*names: str) -> bool:
        return only is None or not only.isdisjoint(names)

    def skip(*names: str) -> None:  # in the places they would have held, so the result keeps its order
        out.update(dict.fromkeys(names, NOT_COMPUTED))

    readings = reads.readings(snaps, d)
    if wanted(*_GAUGE_SIGNALS, "arrival_rate_per_s"):
        _gauges(out, snaps, readings, d, span)
    else:
        skip(*_GAUGE_SIGNALS)

    restarted = _restart_between(snaps, readings)

    def rate(concept: str) -> Signal:
        series, whys = zip(*[r.counters[concept] for r in readings], strict=True)  # (value, why unusable) each
        if any(whys):  # the first unusable one says why
            why, at = next((why, s) for why, s in zip(whys, snaps, strict=True) if why)
            return missing(f"{why} at {at.scraped_at:.0f}")
        if None in series:
            absent = reads.absent(d, "http_requests" if concept == reads.REJECTED else concept)
            return missing(absent if series[-1] is None else "series missing in part of the window")
        if restarted:
            return missing(restarted)
        values = list(series)
        back = went_down(values)
        if back is not None:
            return missing(f"counter reset between {snaps[back].scraped_at:.0f} and {snaps[back + 1].scraped_at:.0f} "
                           "(engine restarted?)")
        return Signal((values[-1] - values[0]) / span)

    if not wanted(*_RATE_SIGNALS):
        skip(*_RATE_SIGNALS)
    else:
        _rates(out, d, rate)

    folded: dict[str, Signal | tuple[list[tuple[float, float]], float, float]] = {}

    def histogram_window(concept: str) -> Signal | tuple[list[tuple[float, float]], float, float]:
        """``_histogram_window`` of the concept, once per window (the prompt lengths give a mean and a p99)."""
        found = folded.get(concept)
        if found is None:
            found = folded[concept] = _histogram_window(snaps, readings, d, concept, restarted)
        return found

    def mean_of(concept: str) -> Signal:
        window = histogram_window(concept)
        if isinstance(window, Signal):
            return window
        return Signal(window[1] / window[2]) if window[2] > 0 else missing("no requests finished in the window")

    for signal, concept in (("slot_seconds_mean", "inference_time"), ("prompt_tokens_mean", "prompt_len"),
                            ("generation_tokens_mean", "generation_len")):
        if not wanted(signal):
            skip(signal)
            continue
        out[signal] = mean_of(concept)
    if wanted("queue_wait_expected_s"):
        slot = mean_of("inference_time")
        if slot.value is None and not isinstance(histogram_window("inference_time"), Signal):
            slot = _slot_held(snaps, readings) or slot  # nothing finished: how long the slots have been held
        growth = out.get("in_system_growth_per_s")  # the queue a scrape from now, where the inside grows
        ahead = (max(0.0, growth.value) * (snaps[-1].scraped_at - snaps[-2].scraped_at)
                 if growth is not None and growth.value is not None and len(snaps) > 1 else 0.0)
        out["queue_wait_expected_s"] = _expected_wait(readings[-1], slot, ahead=ahead)
    else:
        skip("queue_wait_expected_s")

    for prefix in ("queue_time", "ttft", "itl", "tpot", "e2e"):  # the concept of the same name
        names = tuple(f"{prefix}_{suffix}" for suffix in ("mean_s", "p50_s", "p95_s", "p99_s"))
        if not wanted(*names):
            skip(*names)
            continue
        window = histogram_window(prefix)
        if isinstance(window, Signal):
            out.update(dict.fromkeys(names, window))
            continue
        deltas, dsum, dcount = window
        out[names[0]] = Signal(dsum / dcount) if dcount > 0 else missing("no observations in the window")
        out[names[1]] = hist.quantile(0.50, deltas)
        out[names[2]] = hist.quantile(0.95, deltas)
        out[names[3]] = hist.quantile(0.99, deltas)

    for signal, concept in (("prompt_tokens_p99", "prompt_len"), ("max_tokens_p99", "max_tokens")):
        if not wanted(signal):
            skip(signal)
            continue
        window = histogram_window(concept)
        out[signal] = window if isinstance(window, Signal) else hist.quantile(0.99, window[0], conservative=True)

    out["idle_seconds"] = _idle(snaps, readings, d) if wanted("idle_seconds") else NOT_COMPUTED
    return {k: v for k, v in out.items() if k in _WINDOW_SET}


def _slot_held(snaps: Sequence[Snapshot], readings: Sequence[Reading]) -> Signal | None:
    """A lower bound of the slot time where no request finished in the window: the requests running at the
    earliest scrape from which some ran without a break still hold their slots (none finished), so each has held
    one at least that long. None where no two scrapes show requests running. The trace family's live-013 of
    seed 7 (907-token outputs at a cap of 8, 3.5 arrivals/s a replica): 7 → 14 → 20 waiting over 6 s while no
    histogram had a value, the rule held until the first request finished at 10 s."""
    first = None
    for i in range(len(readings) - 1, -1, -1):
        running = readings[i].gauges["running"]
        if running is None or running < 1:
            break
        first = i
    if first is None:
        return None
    held = snaps[-1].scraped_at - snaps[first].scraped_at
    if held <= 0:
        return None
    return Signal(held, "at least: no request finished in the window, and those running have held their slots "
                  f"{held:.3g} s")


def _expected_wait(latest: Reading, slot: Signal, ahead: float = 0.0) -> Signal:
    """How long a request arriving by the next scrape waits for a slot: the W waiting ahead of it are admitted as
    slots free, and N running requests that each hold one S seconds on average free one every S / N: W · S / N.
    It reads the gauges now, where the queue-time and TTFT histograms observe a request only once it is admitted
    — at a pinned cap of long requests they stay flat for as long as it takes a slot to free (on the trace
    family, live-099 of seed 7: 8 slots, 2,403-token prompts, waiting 11 → 29 → 47 → 75 while the TTFT p99 read
    0.93 s, 8 s before any histogram showed the queue). ``ahead``: the requests that join the queue before the
    next scrape, where what is inside the engine grows over the window (growth × the scrape interval): the
    tuner acts on a scrape, so a queue that reaches the SLO one scrape from now has to be acted on now (the
    trace family, live-045 of seed 41: 16.4 requests/s of 2,715-token prompts from the first second, waiting
    at a cap of 8 read 0.75 s at 4 s and 11.5 s at 6 s; 0.89 → 0.92 × the best static)."""
    running, waiting = latest.gauges["running"], latest.gauges["waiting"]
    if running is None or waiting is None:
        return missing("running or waiting not read at the window's end")
    if slot.value is None:
        return missing(f"slot time unknown ({slot.reason})")
    if waiting <= 0:
        return Signal(0.0)
    if running < 1:
        return missing(f"{waiting:.0f} waiting and none running: no slot frees to serve them")
    return Signal((waiting + ahead) * slot.value / running, slot.reason)


def _gauges(out: dict[str, Signal], snaps: Sequence[Snapshot], readings: Sequence[Reading], d: dialects.Dialect,
            span: float) -> None:
    """The gauges' maxima and means over the window, and the growth of what is inside the engine."""
    series: dict[str, list[float] | None] = {}
    for signal, concept in (
        ("requests_running_max", "running"),
        ("requests_waiting_max", "waiting"),
        ("kv_cache_usage_max", "kv_usage"),
    ):
        values = [r.gauges[concept] for r in readings]
        known = [v for v in values if v is not None]
        broken = next(((r.broken[concept], s) for r, s in zip(readings, snaps, strict=True) if r.broken[concept]), None)
        if broken is not None:  # a maximum that skips a NaN sample is not the window's maximum
            out[signal] = missing(f"{broken[0]} at {broken[1].scraped_at:.0f}")
            series[concept] = None
        else:
            out[signal] = Signal(max(known)) if known else missing(reads.absent(d, concept))
            series[concept] = [v for v in values if v is not None] if len(known) == len(values) else None
    for signal, concept in (("requests_running_mean", "running"), ("requests_waiting_mean", "waiting")):
        vals = series.get(concept)
        out[signal] = Signal(sum(vals) / len(vals)) if vals else missing(
            out[f"{signal[:-5]}_max"].reason or "not read in every snapshot of the window")
    running, waiting = series.get("running"), series.get("waiting")
    if running and waiting:
        # requests that arrived and are still inside the engine: the growth of running + waiting
        out["in_system_growth_per_s"] = Signal(((running[-1] + waiting[-1]) - (running[0] + waiting[0])) / span)
    else:
        out["in_system_growth_per_s"] = missing("running or waiting not read in every snapshot of the window")


def _rates(out: dict[str, Signal], d: dialects.Dialect, rate: Callable[[str], Signal]) -> None:
    """The counters' rates over the window (``rate`` of a counter's concept), and what is derived from them."""
    out["request_rate"] = rate("request_success")
    out["prompt_tokens_per_s"] = rate("prompt_tokens")
    out["generation_tokens_per_s"] = rate("generation_tokens")
    out["preemptions_per_s"] = rate("preemptions")
    handlers = d.completion_handlers
    if handlers:
        out["requests_rejected_per_s"] = rate(reads.REJECTED)
    else:
        out["requests_rejected_per_s"] = missing(f"{d.kind} does not expose per-handler HTTP status counts")

    served, growth = out["request_rate"], out["in_system_growth_per_s"]
    if served.value is None or growth.value is None:
        out["arrival_rate_per_s"] = missing(served.reason or growth.reason or "unknown")
    else:
        # every request that arrived either finished, is still inside (its growth), or was turned away
        rejected = out["requests_rejected_per_s"].value or 0.0
        out["arrival_rate_per_s"] = Signal(max(0.0, served.value + growth.value + rejected))

    hits, queries = rate("prefix_hits"), rate("prefix_queries")
    if hits.value is None or queries.value is None:
        out["prefix_cache_hit_rate"] = missing(hits.reason or queries.reason or "absent")
    elif queries.value <= 0:
        out["prefix_cache_hit_rate"] = missing("no prefix-cache queries in the window")
    else:
        out["prefix_cache_hit_rate"] = Signal(hits.value / queries.value)


def _histogram_window(snaps: Sequence[Snapshot], readings: Sequence[Reading], d: dialects.Dialect, concept: str,
                      restarted: str | None) -> Signal | tuple[list[tuple[float, float]], float, float]:
    """The histogram's change over the window (last minus first), read as a counter is: a count that
    went down anywhere inside the window (a reset that came back above the first value by the end)
    voids it, not only one that ends lower."""
    first, last = snaps[0], snaps[-1]
    new, old = readings[-1].histograms[concept], readings[0].histograms[concept]  # reads.histogram(), read once
    for found, at in ((new, last), (old, first)):
        if isinstance(found, str):
            return missing(f"{found} at {at.scraped_at:.0f}")
    assert not isinstance(new, str) and not isinstance(old, str)
    if new is None:
        return missing(reads.absent(d, concept))
    if restarted:
        return missing(restarted)
    if old is None:
        return missing("series appeared during the window")
    deltas = hist.delta(new[0], old[0])
    if deltas is None:
        return missing("bucket counts went down or bucket layout changed (engine restarted?)")
    dsum, dcount = new[1] - old[1], new[2] - old[2]
    if dcount < 0 or dsum < 0:
        return missing("histogram count went down (engine restarted?)")
    back = went_down([r.hist_counts[concept] for r in readings])
    if back is not None:
        return missing(f"histogram reset between {snaps[back].scraped_at:.0f} and {snaps[back + 1].scraped_at:.0f} "
                       "(engine restarted?)")
    return deltas, dsum, dcount


def went_down(counts: Sequence[float | None]) -> int | None:
    """Where a count went down: the first ``i`` with ``counts[i + 1] < counts[i]``, both known; None when none did
    (the usual window: a sorted list, found at C speed)."""
    if None not in counts and sorted(cast(list[float], counts)) == counts:
        return None
    for i, (a, b) in enumerate(itertools.pairwise(counts)):
        if a is not None and b is not None and b < a:
            return i
    return None


def _restart_between(snaps: Sequence[Snapshot], readings: Sequence[Reading]) -> str | None:
    starts = [r.start for r in readings]
    if len(set(starts)) <= 1:  # one process start all along (or none read): the usual window, at C speed
        return None
    for a, b, sb in zip(starts, starts[1:], snaps[1:], strict=False):
        if a is not None and b is not None and a != b:
            return f"engine restarted inside the window (process start time changed by {sb.scraped_at:.0f})"
    return None


def _idle(snaps: Sequence[Snapshot], readings: Sequence[Reading], d: dialects.Dialect) -> Signal:
    """Seconds since the last snapshot that showed activity; the window span if none did."""
    last_active: float | None = None
    for i in range(len(readings) - 1, -1, -1):  # from the newest: the first active one is the last
        r = readings[i]
        running = r.gauges["running"] or 0.0
        waiting = r.gauges["waiting"] or 0.0
        done = r.counters["request_success"][0]
        before = readings[i - 1].counters["request_success"][0] if i > 0 else None
        moved = done is not None and before is not None and done != before
        if running > 0 or waiting > 0 or moved:
            last_active = snaps[i].scraped_at
            break
    if readings[-1].gauges["running"] is None:
        return missing(reads.absent(d, "running"))
    end = snaps[-1].scraped_at
    if last_active is None:
        return Signal(end - snaps[0].scraped_at, "no activity in the whole window: at least this long")
    return Signal(end - last_active)
