"""GPU telemetry straight from NVML (the ``pynvml`` module of ``nvidia-ml-py``).

``NvmlSource.read()`` never raises. Without a usable driver it logs ``NVML unavailable: <reason>`` once and
returns ``[]`` from then on. A single NVML call that fails (NotSupported, NoPermission, ...) leaves its field
``None``; a GPU whose handle cannot be had comes back as a ``GpuReading`` with ``error`` set.

Imports stdlib and (lazily) pynvml only, so it also runs on a bare GPU box (see bench/record_nvml.py).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from tuner.model.gpus import GpuReading

log = logging.getLogger(__name__)

SOURCE = "nvml"

# nvml.h values, used when an old pynvml lacks the constant.
_DEFAULTS = {
    "NVML_SUCCESS": 0,
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN": 0,
    "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
    "NVML_TEMPERATURE_THRESHOLD_MEM_MAX": 2,
    "NVML_CLOCK_SM": 1,
    "NVML_FI_DEV_MEMORY_TEMP": 82,
}
# nvmlValueType_t → member of the nvmlValue_t union.
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class NvmlSource:
    """Reads the GPUs ``indices`` (all GPUs when ``None``) through ``nvml`` (``pynvml`` when ``None``)."""

    def __init__(
        self,
        indices: Sequence[int] | None = None,
        *,
        nvml: ModuleType | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._wanted = list(indices) if indices is not None else None
        self._nvml = nvml
        self._clock = clock
        self._indices: list[int] | None = None  # set once NVML is initialised
        self._handles: dict[int, Any] = {}
        self.unavailable_reason: str | None = None

    def read(self) -> list[GpuReading]:
        try:
            nvml = self._init()
            if nvml is None or self._indices is None:
                return []
            now = self._clock()
            return [self._read_gpu(nvml, index, now) for index in self._indices]
        except Exception:  # a bug here must not take the daemon down
            log.exception("NVML read failed")
            return []

    def probe(self) -> str | None:
        """None if NVML loads and every GPU asked for answers, else why not (``check-config``; releases
        NVML again)."""
        try:
            nvml = self._init()
            if nvml is None or self._indices is None:
                return self.unavailable_reason or "NVML did not load"
            for index in self._indices:
                try:
                    nvml.nvmlDeviceGetHandleByIndex(index)
                except Exception as exc:  # noqa: BLE001 - a GPU asked for that is not there
                    return f"GPU {index}: {_describe(exc)}"
            return None
        finally:
            self.close()

    def close(self) -> None:
        if self._indices is None or self._nvml is None:
            return
        self._indices = None
        self._handles.clear()
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()

    # -- internals ---------------------------------------------------------------------------------------

    def _init(self) -> ModuleType | None:
        if self.unavailable_reason is not None:
            return None
        if self._indices is not None and self._nvml is not None:
            return self._nvml
        try:
            if self._nvml is None:
                self._nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            self._unavailable(f"pynvml not importable ({_describe(exc)})")
            return None
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - LibraryNotFound, DriverNotLoaded, ... all mean "no NVML"
            self._unavailable(_describe(exc))
            return None
        try:
            wanted = self._wanted if self._wanted is not None else range(int(nvml.nvmlDeviceGetCount()))
        except Exception as exc:  # noqa: BLE001
            self._unavailable(f"cannot count GPUs ({_describe(exc)})")
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return None
        self._indices = list(wanted)
        return nvml

    def _unavailable(self, reason: str) -> None:
        self.unavailable_reason = reason
        log.warning("NVML unavailable: %s", reason)

    def _read_gpu(self, nvml: ModuleType, index: int, now: float) -> GpuReading:
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as exc:  # noqa: BLE001 - one lost GPU must not hide the others
                error = f"no handle: {_describe(exc)}"
                return GpuReading(index=index, source=SOURCE, read_at=now, error=error)
            self._handles[index] = handle

        def const(name: str) -> Any:
            return getattr(nvml, name, _DEFAULTS[name])

        def call(fn: str, *args: Any) -> Any:
            try:
                return getattr(nvml, fn)(handle, *args)
            except Exception as exc:  # noqa: BLE001 - NotSupported & co: this field stays None
                log.debug("GPU %d: %s failed: %s", index, fn, _describe(exc))
                return None

        def num(value: Any, scale: float = 1.0) -> float | None:
            return None if value is None else float(value) / scale

        def threshold(name: str) -> float | None:
            return num(call("nvmlDeviceGetTemperatureThreshold", const(name)))

        util = call("nvmlDeviceGetUtilizationRates")
        memory = call("nvmlDeviceGetMemoryInfo")
        return GpuReading(
            index=index,
            source=SOURCE,
            read_at=now,
            uuid=call("nvmlDeviceGetUUID"),
            name=call("nvmlDeviceGetName"),
            gpu_temp_c=num(call("nvmlDeviceGetTemperature", const("NVML_TEMPERATURE_GPU"))),
            mem_temp_c=self._mem_temp(call("nvmlDeviceGetFieldValues", [const("NVML_FI_DEV_MEMORY_TEMP")])),
            slowdown_temp_c=threshold("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
            shutdown_temp_c=threshold("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
            mem_max_temp_c=threshold("NVML_TEMPERATURE_THRESHOLD_MEM_MAX"),
            sm_clock_mhz=num(call("nvmlDeviceGetClockInfo", const("NVML_CLOCK_SM"))),
            sm_clock_max_mhz=num(call("nvmlDeviceGetMaxClockInfo", const("NVML_CLOCK_SM"))),
            power_w=num(call("nvmlDeviceGetPowerUsage"), 1000.0),
            power_limit_w=num(call("nvmlDeviceGetEnforcedPowerLimit"), 1000.0),
            gpu_util=None if util is None else float(util.gpu) / 100.0,
            mem_used_bytes=None if memory is None else float(memory.used),
            mem_total_bytes=None if memory is None else float(memory.total),
            clocks_event_reasons=self._event_reasons(call),
        )

    def _mem_temp(self, values: Any) -> float | None:
        if not values:
            return None
        field = values[0]
        if field.nvmlReturn != getattr(self._nvml, "NVML_SUCCESS", 0):
            return None
        return float(getattr(field.value, _VALUE_MEMBERS.get(field.valueType, "uiVal")))

    @staticmethod
    def _event_reasons(call: Callable[..., Any]) -> int | None:
        mask = call("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:  # old driver/pynvml: the deprecated name carries the same mask
            mask = call("nvmlDeviceGetCurrentClocksThrottleReasons")
        return None if mask is None else int(mask)
