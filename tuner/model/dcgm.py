"""dcgm-exporter scrapes -> GpuReading, one per ``gpu`` label. Pure: no I/O, no clock.

What dcgm-exporter prints (see tests/fixtures/dcgm/ for real captures):

- One series per GPU per field, named exactly after the DCGM field (``DCGM_FI_DEV_GPU_TEMP``), with
  labels ``gpu``, ``UUID`` (``uuid`` with ``--use-old-namespace``), ``pci_bus_id``, ``device``,
  ``modelName``, ``Hostname`` (lowercase ``hostname`` from dcgm-exporter HEAD d5e5f51 on; absent with
  ``--no-hostname``), ``DCGM_FI_DRIVER_VERSION`` and, with Kubernetes mapping, ``container``,
  ``namespace``, ``pod``.
- Units: temperatures °C, clocks MHz, power W, ``DCGM_FI_DEV_GPU_UTIL`` percent 0..100,
  ``DCGM_FI_DEV_FB_*`` MiB, ``DCGM_FI_PROF_*`` ratios 0..1.
- ``DCGM_FI_DEV_MEMORY_TEMP`` is 0 on GDDR boards (no sensor): read as None.
- Blank values are skipped by current exporters; very old ones printed DCGM's blank sentinels
  (``9223372036854775794`` = DCGM_INT64_NOT_SUPPORTED). Every DCGM blank (int32, int64, fp64) is
  read as None.
- The clock-event ("throttle") bitmask is not in the default counter set; it appears only when an
  operator adds field 112 to the CSV, as ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` or under its old name
  ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``. Both are read; the new name wins if both are present.

MIG. With MIG on, dcgm-exporter prints series carrying ``GPU_I_PROFILE``/``GPU_I_ID`` for each GPU
instance, all with the parent's ``gpu`` label, and (depending on its ``-d`` device option) may or may
not also print whole-GPU series without ``GPU_I_ID``. The tuner guards whole physical GPUs, so this
module keeps **one reading per physical GPU** and, field by field:

1. uses the whole-GPU series when there is one;
2. otherwise combines the instance series: framebuffer MiB (used/free/reserved/total) are **summed**
   (each instance owns a slice of memory); every other field takes the **maximum** over instances
   (temperatures, clocks and power are device-wide and merely repeated per instance; for utilisation
   ratios the busiest instance is the conservative reading); clock-event masks are OR-ed.

Series that differ only in Kubernetes labels (one GPU shared by several pods) repeat the same value;
they are de-duplicated per (gpu, GPU_I_ID) by keeping the first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tuner.model.gpus import GpuReading
from tuner.model.snapshots import Sample, Snapshot

SOURCE = "dcgm"

GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
MEMORY_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
SLOWDOWN_TEMP = "DCGM_FI_DEV_SLOWDOWN_TEMP"
SHUTDOWN_TEMP = "DCGM_FI_DEV_SHUTDOWN_TEMP"
MEM_MAX_OP_TEMP = "DCGM_FI_DEV_MEM_MAX_OP_TEMP"
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
MAX_SM_CLOCK = "DCGM_FI_DEV_MAX_SM_CLOCK"
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
ENFORCED_POWER_LIMIT = "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"
POWER_MGMT_LIMIT = "DCGM_FI_DEV_POWER_MGMT_LIMIT"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
DRAM_ACTIVE = "DCGM_FI_PROF_DRAM_ACTIVE"
SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
CLOCKS_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
CLOCK_THROTTLE_REASONS = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"  # pre-rename alias of field 112

_MIB = 1024 * 1024

# Fields whose per-MIG-instance values add up to the GPU's (framebuffer slices).
_SUMMED = frozenset({FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL})

_ALL_FIELDS: tuple[str, ...] = (
    GPU_TEMP,
    MEMORY_TEMP,
    SLOWDOWN_TEMP,
    SHUTDOWN_TEMP,
    MEM_MAX_OP_TEMP,
    SM_CLOCK,
    MAX_SM_CLOCK,
    POWER_USAGE,
    ENFORCED_POWER_LIMIT,
    POWER_MGMT_LIMIT,
    GPU_UTIL,
    FB_USED,
    FB_FREE,
    FB_RESERVED,
    FB_TOTAL,
    DRAM_ACTIVE,
    SM_ACTIVE,
    CLOCKS_EVENT_REASONS,
    CLOCK_THROTTLE_REASONS,
)

# DCGM blank values (dcgm_structs.h): DCGM_INT32_BLANK 0x7ffffff0 .. +3, DCGM_INT64_BLANK
# 0x7ffffffffffffff0 .. +3, DCGM_FP64_BLANK 140737488355328.0 .. +3. As floats the int64 ones all
# round to 2**63, so anything that large is blank.
_INT32_BLANK = 0x7FFFFFF0
_INT64_BLANK_AS_FLOAT = float(0x7FFFFFFFFFFFFFF0)
_FP64_BLANK = 140737488355328.0


def is_blank(value: float) -> bool:
    """True for a DCGM "no value" sentinel (blank / not found / not supported / no permission)."""
    return (
        value >= _INT64_BLANK_AS_FLOAT
        or _INT32_BLANK <= value <= _INT32_BLANK + 3
        or _FP64_BLANK <= value <= _FP64_BLANK + 3
    )


def dcgm_keep_prefixes() -> tuple[str, ...]:
    """Metric-name prefixes worth parsing from a dcgm-exporter body (``snapshots.parse(keep_prefixes=)``).

    These are the exact field names read here; as prefixes they also let through a few longer names
    (``DCGM_FI_DEV_FB_USED_PERCENT``), which is harmless.
    """
    return _ALL_FIELDS


def _hostname(labels: Mapping[str, str]) -> str | None:
    host = labels.get("Hostname")
    if host is None:
        host = labels.get("hostname")
    return host


def _gpu_index(labels: Mapping[str, str]) -> int | None:
    raw = labels.get("gpu")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


@dataclass(slots=True)
class _Gpu:
    """Per-GPU accumulator: field -> instance key ("" = whole GPU) -> first value seen."""

    uuid: str | None = None
    name: str | None = None
    values: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, field_name: str, instance: str, value: float) -> None:
        self.values.setdefault(field_name, {}).setdefault(instance, value)

    def get(self, field_name: str) -> float | None:
        by_instance = self.values.get(field_name)
        if not by_instance:
            return None
        if "" in by_instance:
            return by_instance[""]
        if field_name in _SUMMED:
            return sum(by_instance.values())
        return max(by_instance.values())

    def mask(self, field_name: str) -> int | None:
        by_instance = self.values.get(field_name)
        if not by_instance:
            return None
        if "" in by_instance:
            return int(by_instance[""])
        out = 0
        for v in by_instance.values():
            out |= int(v)
        return out


def _first_not_none(*values: float | None) -> float | None:
    for v in values:
        if v is not None:
            return v
    return None


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _selected(
    samples: Iterable[Sample],
    wanted: Callable[[int], bool],
    hostname: str | None,
) -> Iterable[tuple[int, Sample]]:
    for s in samples:
        index = _gpu_index(s.labels)
        if index is None or not wanted(index):
            continue
        if hostname is not None:
            host = _hostname(s.labels)
            # A series with no host label comes from an exporter run with --no-hostname: it can
            # only describe the node it runs on, so the filter keeps it.
            if host is not None and host != hostname:
                continue
        yield index, s


def readings_from_snapshot(
    snapshot: Snapshot,
    *,
    slowdown_temp_c: float | None = None,
    gpus: Sequence[int] | None = None,
    hostname: str | None = None,
) -> list[GpuReading]:
    """One GpuReading per ``gpu`` label found in a dcgm-exporter snapshot, sorted by index.

    ``slowdown_temp_c`` fills ``GpuReading.slowdown_temp_c`` when the exporter does not print
    ``DCGM_FI_DEV_SLOWDOWN_TEMP`` (it is not in the default counters); a per-GPU exporter value wins.
    ``gpus`` keeps only these indices; ``hostname`` keeps only series whose ``Hostname``/``hostname``
    label equals it (pass it when one body holds several nodes, e.g. a federated scrape: without it,
    series of different hosts with the same ``gpu`` index are merged, first value winning). A failed
    snapshot, or one with no DCGM series, gives ``[]``. Every field the exporter did not print (or
    printed as a DCGM blank) is None.
    """
    if not snapshot.ok:
        return []
    wanted_set = None if gpus is None else frozenset(gpus)

    def wanted(index: int) -> bool:
        return wanted_set is None or index in wanted_set

    per_gpu: dict[int, _Gpu] = {}
    for field_name in _ALL_FIELDS:
        for index, s in _selected(snapshot.samples(field_name), wanted, hostname):
            acc = per_gpu.setdefault(index, _Gpu())
            if acc.uuid is None:
                acc.uuid = s.labels.get("UUID") or s.labels.get("uuid") or None
            if acc.name is None:
                acc.name = s.labels.get("modelName") or None
            if is_blank(s.value):
                continue
            acc.add(field_name, s.labels.get("GPU_I_ID", ""), s.value)

    readings: list[GpuReading] = []
    for index in sorted(per_gpu):
        g = per_gpu[index]
        mem_temp = g.get(MEMORY_TEMP)
        if mem_temp is not None and mem_temp <= 0:
            mem_temp = None  # GDDR boards report 0: no memory sensor
        used = g.get(FB_USED)
        free = g.get(FB_FREE)
        reserved = g.get(FB_RESERVED)
        total = g.get(FB_TOTAL)
        if total is None and used is not None and free is not None:
            total = used + free + (reserved or 0.0)
        mask = g.mask(CLOCKS_EVENT_REASONS)
        if mask is None:
            mask = g.mask(CLOCK_THROTTLE_REASONS)
        readings.append(
            GpuReading(
                index=index,
                source=SOURCE,
                read_at=snapshot.scraped_at,
                uuid=g.uuid,
                name=g.name,
                gpu_temp_c=g.get(GPU_TEMP),
                mem_temp_c=mem_temp,
                slowdown_temp_c=_first_not_none(g.get(SLOWDOWN_TEMP), slowdown_temp_c),
                shutdown_temp_c=g.get(SHUTDOWN_TEMP),
                mem_max_temp_c=g.get(MEM_MAX_OP_TEMP),
                sm_clock_mhz=g.get(SM_CLOCK),
                sm_clock_max_mhz=g.get(MAX_SM_CLOCK),
                power_w=g.get(POWER_USAGE),
                power_limit_w=_first_not_none(g.get(ENFORCED_POWER_LIMIT), g.get(POWER_MGMT_LIMIT)),
                gpu_util=_scaled(g.get(GPU_UTIL), 0.01),
                mem_used_bytes=_scaled(used, _MIB),
                mem_total_bytes=_scaled(total, _MIB),
                clocks_event_reasons=mask,
                dram_active=g.get(DRAM_ACTIVE),
                sm_active=g.get(SM_ACTIVE),
            )
        )
    return readings
