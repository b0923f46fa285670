"""A fake ``pynvml`` module: explicit per-GPU state, or a replay of a real recording.

``FakeNvml`` is a ``types.ModuleType`` holding exactly what ``tuner.sources.nvml.NvmlSource`` calls, the
constants it reads, pynvml's ``NVMLError`` hierarchy (``NVMLError(code)`` returns the matching subclass,
``NVMLError_NotSupported()`` carries code 3, as in the real module), and the privileged setters, which only
record what they were asked.

Every answer is looked up by a *call key*: the function name, then each non-handle argument, joined by ':'
(a list argument joins its items with ','), e.g. ``nvmlDeviceGetTemperatureThreshold:1`` or
``nvmlDeviceGetFieldValues:82``. bench/record_nvml.py records the real answers under the same keys, so
``FakeNvml.from_recording(data).load_sample(i)`` makes the fake answer exactly what the H200 answered.

    fake = FakeNvml([FakeGpu(temp_c=86, clocks_event_reasons=SW_THERMAL_SLOWDOWN)])
    fake.gpus[0].errors["nvmlDeviceGetPowerUsage"] = NVML_ERROR_NOT_SUPPORTED
    FakeNvml(driver_missing=True)   # nvmlInit raises NVMLError_LibraryNotFound
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, cast

# -- constants (values as in nvml.h / pynvml) ---------------------------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_TEMPERATURE_THRESHOLD_MEM_MAX = 2
NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3
NVML_CLOCK_SM = 1
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_VALUE_TYPE_UNSIGNED_INT = 1

_ERROR_NAMES = {
    NVML_ERROR_UNINITIALIZED: ("Uninitialized", "Uninitialized"),
    NVML_ERROR_INVALID_ARGUMENT: ("InvalidArgument", "Invalid Argument"),
    NVML_ERROR_NOT_SUPPORTED: ("NotSupported", "Not Supported"),
    NVML_ERROR_NO_PERMISSION: ("NoPermission", "Insufficient Permissions"),
    NVML_ERROR_NOT_FOUND: ("NotFound", "Not Found"),
    NVML_ERROR_DRIVER_NOT_LOADED: ("DriverNotLoaded", "Driver Not Loaded"),
    NVML_ERROR_LIBRARY_NOT_FOUND: ("LibraryNotFound", "NVML Shared Library Not Found"),
    NVML_ERROR_FUNCTION_NOT_FOUND: ("FunctionNotFound", "Function Not Found"),
    NVML_ERROR_GPU_IS_LOST: ("GpuIsLost", "GPU is lost"),
    NVML_ERROR_UNKNOWN: ("Unknown", "Unknown Error"),
}


class NVMLError(Exception):
    """Like pynvml's: ``NVMLError(code)`` builds the subclass for ``code``; ``.value`` is the code."""

    _by_code: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int = NVML_ERROR_UNKNOWN, *args: Any) -> Self:
        klass = NVMLError._by_code.get(value, cls) if cls is NVMLError else cls
        obj = cast(Self, Exception.__new__(klass))
        obj.value = value
        return obj

    def __init__(self, *args: Any) -> None:
        super().__init__()

    def __str__(self) -> str:
        return _ERROR_NAMES.get(self.value, ("", f"NVML Error with code {self.value}"))[1]


def _error_class(code: int, suffix: str) -> type[NVMLError]:
    def new(cls: type[NVMLError], *args: Any) -> NVMLError:
        return NVMLError.__new__(cls, code)

    klass = type(f"NVMLError_{suffix}", (NVMLError,), {"__new__": new, "__module__": __name__})
    NVMLError._by_code[code] = klass
    return klass


NVMLError_Uninitialized = _error_class(NVML_ERROR_UNINITIALIZED, "Uninitialized")
NVMLError_InvalidArgument = _error_class(NVML_ERROR_INVALID_ARGUMENT, "InvalidArgument")
NVMLError_NotSupported = _error_class(NVML_ERROR_NOT_SUPPORTED, "NotSupported")
NVMLError_NoPermission = _error_class(NVML_ERROR_NO_PERMISSION, "NoPermission")
NVMLError_NotFound = _error_class(NVML_ERROR_NOT_FOUND, "NotFound")
NVMLError_DriverNotLoaded = _error_class(NVML_ERROR_DRIVER_NOT_LOADED, "DriverNotLoaded")
NVMLError_LibraryNotFound = _error_class(NVML_ERROR_LIBRARY_NOT_FOUND, "LibraryNotFound")
NVMLError_FunctionNotFound = _error_class(NVML_ERROR_FUNCTION_NOT_FOUND, "FunctionNotFound")
NVMLError_GpuIsLost = _error_class(NVML_ERROR_GPU_IS_LOST, "GpuIsLost")
NVMLError_Unknown = _error_class(NVML_ERROR_UNKNOWN, "Unknown")


class ReplayMissError(Exception):
    """The code under test made a call the recording does not hold."""


def call_key(fn: str, *args: Any) -> str:
    parts = [",".join(map(str, a)) if isinstance(a, list | tuple) else str(a) for a in args]
    return ":".join([fn, *parts])


# -- state ------------------------------------------------------------------------------------------------


@dataclass
class FakeGpu:
    """One GPU's raw NVML answers (NVML units: °C ints, MHz, mW, %, bytes); defaults as read on an H200."""

    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-fake-0000-0000-000000000000"
    temp_c: int = 30
    mem_temp_c: int | None = 32  # None: the field comes back with nvmlReturn NOT_SUPPORTED
    shutdown_c: int = 95
    slowdown_c: int = 89
    mem_max_c: int = 95
    gpu_max_c: int = 87
    sm_clock_mhz: int = 345
    sm_clock_max_mhz: int = 1980
    power_mw: int = 75_000
    power_limit_mw: int = 700_000
    util_gpu: int = 0
    util_mem: int = 0
    mem_total: int = 150_754_820_096
    mem_used: int = 590_479_360
    clocks_event_reasons: int = 0x1  # gpu_idle
    errors: dict[str, int] = field(default_factory=dict)  # call key or bare function name → NVML error code
    handle_error: int | None = None  # nvmlDeviceGetHandleByIndex raises this code
    raw: dict[str, dict[str, Any]] | None = None  # replay: call key → {"ret": value} | {"err": code}
    locked_clocks: tuple[int, int] | None = None  # set by nvmlDeviceSetGpuLockedClocks

    def answer(self, key: str) -> Any:
        """The JSON-shaped answer for ``key`` (raises NVMLError for an error)."""
        if self.raw is not None:
            if key not in self.raw:
                raise ReplayMissError(key)
            return _unpack(self.raw[key])
        fn = key.split(":", 1)[0]
        code = self.errors.get(key, self.errors.get(fn))
        if code is not None:
            raise NVMLError(code)
        return _unpack({"ret": self._computed(key)})

    def _computed(self, key: str) -> Any:
        temps = {
            NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: self.shutdown_c,
            NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: self.slowdown_c,
            NVML_TEMPERATURE_THRESHOLD_MEM_MAX: self.mem_max_c,
            NVML_TEMPERATURE_THRESHOLD_GPU_MAX: self.gpu_max_c,
        }
        fn, _, arg = key.partition(":")
        if fn == "nvmlDeviceGetTemperatureThreshold":
            if int(arg) not in temps:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            return temps[int(arg)]
        if fn in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo") and int(arg) != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if fn == "nvmlDeviceGetFieldValues":
            ok = self.mem_temp_c is not None
            return [
                {
                    "fieldId": int(arg),
                    "scopeId": 0,
                    "nvmlReturn": NVML_SUCCESS if ok else NVML_ERROR_NOT_SUPPORTED,
                    "valueType": NVML_VALUE_TYPE_UNSIGNED_INT,
                    "value": self.mem_temp_c if ok else 0,
                }
            ]
        sm = self.sm_clock_mhz
        if self.locked_clocks is not None:
            sm = max(self.locked_clocks[0], min(sm, self.locked_clocks[1]))
        simple = {
            "nvmlDeviceGetName": self.name,
            "nvmlDeviceGetUUID": self.uuid,
            "nvmlDeviceGetTemperature": self.temp_c,
            "nvmlDeviceGetClockInfo": sm,
            "nvmlDeviceGetMaxClockInfo": self.sm_clock_max_mhz,
            "nvmlDeviceGetPowerUsage": self.power_mw,
            "nvmlDeviceGetEnforcedPowerLimit": self.power_limit_mw,
            "nvmlDeviceGetUtilizationRates": {"gpu": self.util_gpu, "memory": self.util_mem},
            "nvmlDeviceGetMemoryInfo": {
                "total": self.mem_total,
                "free": self.mem_total - self.mem_used,
                "used": self.mem_used,
            },
            "nvmlDeviceGetCurrentClocksEventReasons": self.clocks_event_reasons,
            "nvmlDeviceGetCurrentClocksThrottleReasons": self.clocks_event_reasons,
        }
        if fn not in simple:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return simple[fn]


def _unpack(response: dict[str, Any]) -> Any:
    if "err" in response:
        code = response["err"]
        if isinstance(code, int):
            raise NVMLError(code)
        raise RuntimeError(f"recorded non-NVML failure: {code}")
    return response["ret"]


def _field_value(d: dict[str, Any]) -> types.SimpleNamespace:
    v = d["value"]
    value = types.SimpleNamespace(dVal=float(v), uiVal=v, ulVal=v, ullVal=v, sllVal=v, siVal=v, usVal=v)
    return types.SimpleNamespace(
        fieldId=d["fieldId"],
        scopeId=d.get("scopeId", 0),
        timestamp=0,
        latencyUsec=0,
        valueType=d["valueType"],
        nvmlReturn=d["nvmlReturn"],
        value=value,
    )


@dataclass(frozen=True)
class FakeHandle:
    index: int


# -- the module ---------------------------------------------------------------------------------------------


class FakeNvml(types.ModuleType):
    """A pynvml stand-in. ``gpus`` is mutable: change a FakeGpu between reads to simulate a new moment."""

    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    NVML_TEMPERATURE_THRESHOLD_MEM_MAX = NVML_TEMPERATURE_THRESHOLD_MEM_MAX
    NVML_TEMPERATURE_THRESHOLD_GPU_MAX = NVML_TEMPERATURE_THRESHOLD_GPU_MAX
    NVML_CLOCK_SM = NVML_CLOCK_SM
    NVML_FI_DEV_MEMORY_TEMP = NVML_FI_DEV_MEMORY_TEMP
    NVML_VALUE_TYPE_UNSIGNED_INT = NVML_VALUE_TYPE_UNSIGNED_INT

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_Unknown = NVMLError_Unknown

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        driver_missing: bool = False,
        init_error: int | None = None,
        privileged: bool = True,
    ) -> None:
        super().__init__("pynvml")
        self.gpus: list[FakeGpu] = gpus if gpus is not None else [FakeGpu()]
        self.init_error = NVML_ERROR_LIBRARY_NOT_FOUND if driver_missing else init_error
        self.privileged = privileged  # False: the setters raise NVMLError_NoPermission
        self.initialised = False
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []  # every call key, handle calls prefixed with "<index>/"
        self.privileged_calls: list[tuple[str, int, tuple[int, ...]]] = []
        self.samples: list[dict[str, Any]] = []  # from_recording
        self.replay_misses: list[str] = []  # calls a replayed sample could not answer (a test bug)

    # -- replay ---------------------------------------------------------------------------------------------

    @classmethod
    def from_recording(cls, recording: dict[str, Any] | str | Path) -> FakeNvml:
        """A fake holding every sample of a bench/record_nvml.py recording; sample 0 is loaded."""
        data = recording if isinstance(recording, dict) else json.loads(Path(recording).read_text())
        count = int(data["meta"]["device_count"])
        fake = cls([FakeGpu() for _ in range(count)])
        fake.samples = data["samples"]
        fake.load_sample(0)
        return fake

    def load_sample(self, i: int) -> dict[str, Any]:
        """Make every GPU answer what it answered in sample ``i``; returns that sample."""
        sample = self.samples[i]
        for index, gpu in enumerate(self.gpus):
            gpu.raw = dict(sample["calls"].get(str(index), {}))
        return sample

    # -- system -----------------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        self.init_calls += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self._check_init()
        self.shutdown_calls += 1
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self.calls.append("nvmlDeviceGetCount")
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self.calls.append(call_key("nvmlDeviceGetHandleByIndex", index))
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        code = self.gpus[index].handle_error
        if code is not None:
            raise NVMLError(code)
        return FakeHandle(index)

    # -- per-device reads -----------------------------------------------------------------------------------

    def _check_init(self) -> None:
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _ask(self, handle: FakeHandle, fn: str, *args: Any) -> Any:
        key = call_key(fn, *args)
        self.calls.append(f"{handle.index}/{key}")
        self._check_init()
        try:
            return self.gpus[handle.index].answer(key)
        except ReplayMissError:
            self.replay_misses.append(f"{handle.index}/{key}")
            raise

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return str(self._ask(handle, "nvmlDeviceGetName"))

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return str(self._ask(handle, "nvmlDeviceGetUUID"))

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        return int(self._ask(handle, "nvmlDeviceGetTemperature", sensor))

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeHandle, threshold: int) -> int:
        return int(self._ask(handle, "nvmlDeviceGetTemperatureThreshold", threshold))

    def nvmlDeviceGetFieldValues(
        self, handle: FakeHandle, field_ids: list[int]
    ) -> list[types.SimpleNamespace]:
        return [_field_value(d) for d in self._ask(handle, "nvmlDeviceGetFieldValues", list(field_ids))]

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        return int(self._ask(handle, "nvmlDeviceGetClockInfo", clock_type))

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        return int(self._ask(handle, "nvmlDeviceGetMaxClockInfo", clock_type))

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return int(self._ask(handle, "nvmlDeviceGetPowerUsage"))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        return int(self._ask(handle, "nvmlDeviceGetEnforcedPowerLimit"))

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> types.SimpleNamespace:
        return types.SimpleNamespace(**self._ask(handle, "nvmlDeviceGetUtilizationRates"))

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> types.SimpleNamespace:
        return types.SimpleNamespace(**self._ask(handle, "nvmlDeviceGetMemoryInfo"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return int(self._ask(handle, "nvmlDeviceGetCurrentClocksEventReasons"))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return int(self._ask(handle, "nvmlDeviceGetCurrentClocksThrottleReasons"))

    # -- privileged setters (recorded only; the opt-in actuator's tests read privileged_calls) ------------

    def _privileged(self, fn: str, handle: FakeHandle, *args: int) -> FakeGpu:
        self.calls.append(f"{handle.index}/{call_key(fn, *args)}")
        self._check_init()
        self.privileged_calls.append((fn, handle.index, tuple(args)))
        if not self.privileged:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        return self.gpus[handle.index]

    def nvmlDeviceSetGpuLockedClocks(self, handle: FakeHandle, min_mhz: int, max_mhz: int) -> None:
        self._privileged("nvmlDeviceSetGpuLockedClocks", handle, min_mhz, max_mhz).locked_clocks = (
            min_mhz,
            max_mhz,
        )

    def nvmlDeviceResetGpuLockedClocks(self, handle: FakeHandle) -> None:
        self._privileged("nvmlDeviceResetGpuLockedClocks", handle).locked_clocks = None

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: FakeHandle) -> list[int]:
        return [200_000, 700_000]  # an H200's range, as recorded

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeHandle) -> int:
        return 700_000

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeHandle, limit_mw: int) -> None:
        self._privileged("nvmlDeviceSetPowerManagementLimit", handle, limit_mw).power_limit_mw = limit_mw
