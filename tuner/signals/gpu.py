"""GPU signals: aggregate the latest readings of an engine's GPUs (worst case wins).

Temperatures are maxima, margins and clock ratios minima, throttle flags any-of. A GPU that did
not report a field does not count as 0: if no GPU reported it, the signal is None with a reason. A NaN
from any GPU, or a value outside the signal's domain (``signals.DOMAINS``), is None with a reason too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tuner.model import gpus
from tuner.signals import Signal, checked, missing

GPU_SIGNALS = ("gpu_temp_c", "mem_temp_c", "temp_margin_c", "thermal_throttle", "power_capped",
               "hw_slowdown", "sm_clock_ratio", "power_w", "power_limit_w", "gpu_util", "dram_active",
               "sm_active")


def compute(
    readings: Sequence[gpus.GpuReading] | None,
    *,
    unavailable: str | None = None,
    now: float | None = None,
    stale_after_seconds: float | None = None,
) -> dict[str, Signal]:
    """GPU signals from one reading per GPU. ``unavailable`` explains an empty/None reading list."""
    if readings is None or not readings:
        why = unavailable or "no GPU source configured for this target"
        return {name: missing(why) for name in GPU_SIGNALS}
    ok = [r for r in readings if r.error is None]
    if not ok:
        why = "; ".join(f"GPU {r.index}: {r.error}" for r in readings)
        return {name: missing(why) for name in GPU_SIGNALS}
    if now is not None and stale_after_seconds is not None:
        oldest = min(r.read_at for r in ok)
        if now - oldest > stale_after_seconds:
            why = f"stale: GPU readings are {now - oldest:.0f}s old (limit {stale_after_seconds:g}s)"
            return {name: missing(why) for name in GPU_SIGNALS}

    def agg(name: str, pick: Callable[[gpus.GpuReading], float | None],
            how: Callable[[list[float]], float]) -> Signal:
        values = [v for r in ok if (v := pick(r)) is not None]
        if not values:
            return missing(f"no GPU reported {name} ({ok[0].source})")
        if not all(math.isfinite(v) for v in values):  # max()/min() would skip a NaN or keep it by position
            bad = next(r for r in ok if (v := pick(r)) is not None and not math.isfinite(v))
            return missing(f"GPU {bad.index} reported {name} = {pick(bad)}: not a finite number")
        partial = len(values) < len(ok)
        return Signal(how(values), f"{len(values)} of {len(ok)} GPUs reported it" if partial else None)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    def margin(r: gpus.GpuReading) -> float | None:
        if r.slowdown_temp_c is None or r.gpu_temp_c is None:
            return None
        return r.slowdown_temp_c - r.gpu_temp_c

    def ratio(r: gpus.GpuReading) -> float | None:
        if r.sm_clock_mhz is None or not r.sm_clock_max_mhz:
            return None
        return r.sm_clock_mhz / r.sm_clock_max_mhz

    def flag(mask: int) -> Callable[[gpus.GpuReading], float | None]:
        return lambda r: None if r.clocks_event_reasons is None else float(bool(r.clocks_event_reasons & mask))

    out = {
        "gpu_temp_c": agg("gpu_temp_c", lambda r: r.gpu_temp_c, max),
        "mem_temp_c": agg("mem_temp_c", lambda r: r.mem_temp_c, max),
        "temp_margin_c": agg("temp_margin_c (needs a slowdown threshold)", margin, min),
        "thermal_throttle": agg("clock-event reasons", flag(gpus.THERMAL_MASK), max),
        "power_capped": agg("clock-event reasons", flag(gpus.SW_POWER_CAP), max),
        "hw_slowdown": agg("clock-event reasons", flag(gpus.HW_SLOWDOWN_MASK), max),
        "sm_clock_ratio": agg("sm_clock_ratio (needs the max SM clock)", ratio, min),
        "power_w": agg("power_w", lambda r: r.power_w, max),
        "power_limit_w": agg("power_limit_w", lambda r: r.power_limit_w, min),
        "gpu_util": agg("gpu_util", lambda r: r.gpu_util, mean),
        "dram_active": agg("dram_active", lambda r: r.dram_active, mean),
        "sm_active": agg("sm_active", lambda r: r.sm_active, mean),
    }
    return {name: checked(name, signal) for name, signal in out.items()}
