"""GPU readings: one GPU's telemetry at one moment, from dcgm-exporter or NVML.

Every field is optional: ``None`` means "this source did not report it", never zero.
Units are in the field names (``_c`` °C, ``_mhz``, ``_w`` watts, ``_bytes``); ratios are 0..1.
"""

from __future__ import annotations

from dataclasses import dataclass

# Clock-event ("throttle") reason bits, identical in NVML and DCGM (nvml.h nvmlClocksEventReason*).
GPU_IDLE = 0x1
APPLICATIONS_CLOCKS_SETTING = 0x2
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SYNC_BOOST = 0x10
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
DISPLAY_CLOCK_SETTING = 0x100

THERMAL_MASK = SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN
HW_SLOWDOWN_MASK = HW_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN

REASON_NAMES = {
    GPU_IDLE: "gpu_idle",
    APPLICATIONS_CLOCKS_SETTING: "applications_clocks_setting",
    SW_POWER_CAP: "sw_power_cap",
    HW_SLOWDOWN: "hw_slowdown",
    SYNC_BOOST: "sync_boost",
    SW_THERMAL_SLOWDOWN: "sw_thermal_slowdown",
    HW_THERMAL_SLOWDOWN: "hw_thermal_slowdown",
    HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
    DISPLAY_CLOCK_SETTING: "display_clock_setting",
}


def reason_names(mask: int) -> list[str]:
    """Human names of the bits set in a clock-event mask (unknown bits as hex)."""
    names = [name for bit, name in REASON_NAMES.items() if mask & bit]
    unknown = mask & ~sum(REASON_NAMES)
    if unknown:
        names.append(hex(unknown))
    return names


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one moment. ``index`` is the NVML/DCGM index as reported by the source."""

    index: int
    source: str  # "nvml" | "dcgm"
    read_at: float  # seconds since the epoch, the caller's clock
    uuid: str | None = None
    name: str | None = None
    gpu_temp_c: float | None = None
    mem_temp_c: float | None = None
    slowdown_temp_c: float | None = None
    shutdown_temp_c: float | None = None
    mem_max_temp_c: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    gpu_util: float | None = None  # 0..1
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    clocks_event_reasons: int | None = None  # bitmask, see the constants above
    dram_active: float | None = None  # DCGM_FI_PROF_DRAM_ACTIVE, 0..1
    sm_active: float | None = None  # DCGM_FI_PROF_SM_ACTIVE, 0..1
    error: str | None = None  # set when this GPU could not be read at all


@dataclass(frozen=True, slots=True)
class GpuInputs:
    """What one cycle read of a target's GPUs: one reading per GPU, or why there are none."""

    readings: tuple[GpuReading, ...] = ()
    unavailable: str | None = None
