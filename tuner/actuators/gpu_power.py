"""Privileged GPU actions through NVML: lowering the power limit while a GPU is thermally throttled,
and restoring the default afterwards. OFF unless ``gpu_control.enabled`` is set.

These calls change hardware settings and need root (``NVMLError_NoPermission`` otherwise). The tuner
never makes them by default, never on GPUs it was not given, and only within the board's own limit
constraints. Tested against a fake NVML only (tests/unit/test_gpu_power.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tuner.errors import PermanentActuatorError
from tuner.signals import Signal

log = logging.getLogger("tuner.gpu_control")


@dataclass(frozen=True, slots=True)
class PowerDecision:
    cap: bool  # True: lower the limit; False: restore the default
    reason: str


def decide(signals: Mapping[str, Signal], *, capped: bool, margin_c: float) -> PowerDecision | None:
    """Pure: cap while thermally throttled or inside the margin; restore once clear. None: no change.

    ``power_capped`` alone is not a reason: a loaded H200 sits at its power cap far from its slowdown
    temperature (docs/gpu-telemetry.md).
    """
    throttle = signals.get("thermal_throttle")
    margin = signals.get("temp_margin_c")
    hot = bool(throttle and throttle.value) or bool(margin and margin.value is not None and margin.value < margin_c)
    known = (throttle is not None and throttle.value is not None) or (margin is not None and margin.value is not None)
    if hot and not capped:
        why = "thermal slowdown reported" if throttle and throttle.value else \
            f"temperature margin {margin.value if margin else None:.0f} °C < {margin_c:g} °C"
        return PowerDecision(True, why)
    if capped and known and not hot:
        return PowerDecision(False, "thermal condition cleared")
    return None


class GpuPowerControl:
    def __init__(self, *, enabled: bool, devices: Sequence[int], power_limit_w: float,
                 nvml: ModuleType | None = None) -> None:
        self.enabled = enabled
        self.devices = tuple(devices)
        self.power_limit_w = power_limit_w
        self._nvml = nvml
        self.capped = False

    def _lib(self) -> Any:
        if not self.enabled:
            raise PermanentActuatorError("gpu_control is disabled: privileged GPU actions are off by default")
        if self._nvml is None:
            import pynvml

            self._nvml = pynvml
        self._nvml.nvmlInit()
        return self._nvml

    def apply(self, decision: PowerDecision) -> list[str]:
        """Carry out a decision on every configured GPU; one line per GPU saying what happened."""
        nvml = self._lib()
        results = []
        for index in self.devices:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            try:
                if decision.cap:
                    low, high = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
                    target = int(min(max(self.power_limit_w * 1000, low), high))
                else:
                    target = int(nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle))
                nvml.nvmlDeviceSetPowerManagementLimit(handle, target)
                results.append(f"GPU {index}: power limit {target / 1000:.0f} W ({decision.reason})")
            except nvml.NVMLError as exc:
                results.append(f"GPU {index}: power limit unchanged: {exc}")
        self.capped = decision.cap
        for line in results:
            log.warning("%s", line)
        return results
