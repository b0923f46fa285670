"""Privileged GPU actions through NVML: lowering the power limit while a GPU is thermally throttled,
and restoring the default afterwards. OFF unless ``gpu_control.enabled`` is set. When to do it is a guard
action of the plan (``planning.guards.power``), so it shows in the cycle line, ``/status`` and metrics.

These calls change hardware settings and need root (``NVMLError_NoPermission`` otherwise). The tuner
never makes them by default, never on GPUs it was not given, and only within the board's own limit
constraints. Tested against a fake NVML only (tests/unit/test_gpu_power.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tuner.errors import PermanentActuatorError

log = logging.getLogger("tuner.gpu_control")


@dataclass(frozen=True, slots=True)
class PowerResult:
    """What one power action did: a line per GPU, and the failures among them (NVML's words)."""

    lines: tuple[str, ...]
    errors: tuple[str, ...] = ()


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

    def apply(self, *, cap: bool, reason: str) -> PowerResult:
        """Lower the power limit (``cap``) or restore the board's default on every configured GPU; one
        line per GPU saying what happened. The decision is the planner's (``guards.power``)."""
        nvml = self._lib()
        results, errors = [], []
        for index in self.devices:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            try:
                if cap:
                    low, high = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
                    target = int(min(max(self.power_limit_w * 1000, low), high))
                else:
                    target = int(nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle))
                nvml.nvmlDeviceSetPowerManagementLimit(handle, target)
                results.append(f"GPU {index}: power limit {target / 1000:.0f} W ({reason})")
            except nvml.NVMLError as exc:
                results.append(f"GPU {index}: power limit unchanged: {exc}")
                errors.append(results[-1])
        self.capped = cap
        for line in results:
            log.warning("%s", line)
        return PowerResult(tuple(results), tuple(errors))
