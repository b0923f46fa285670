"""Privileged GPU actions are off by default and tested only against a fake NVML."""

import pytest

from tests.support.fake_nvml import FakeGpu, FakeNvml
from tuner import config
from tuner.actuators import gpu_power
from tuner.errors import PermanentActuatorError
from tuner.signals import Signal


def sig(**values):
    return {k: Signal(v) for k, v in values.items()}


def test_disabled_by_default_and_refuses():
    settings = config.TunerSettings.model_validate({"targets": [{"name": "a", "metrics_url": "http://x/metrics"}]})
    assert settings.gpu_control.enabled is False
    fake = FakeNvml([FakeGpu()])
    control = gpu_power.GpuPowerControl(enabled=False, devices=[0], power_limit_w=500, nvml=fake)
    with pytest.raises(PermanentActuatorError, match="off by default"):
        control.apply(gpu_power.PowerDecision(True, "hot"))
    assert fake.privileged_calls == []


def test_power_cap_alone_is_not_thermal():
    assert gpu_power.decide(sig(thermal_throttle=0, temp_margin_c=18, power_capped=1), capped=False, margin_c=5) is None


def test_throttle_caps_then_clearing_restores():
    fake = FakeNvml([FakeGpu(), FakeGpu()])
    control = gpu_power.GpuPowerControl(enabled=True, devices=[0, 1], power_limit_w=100, nvml=fake)
    decision = gpu_power.decide(sig(thermal_throttle=1, temp_margin_c=2), capped=False, margin_c=5)
    assert decision is not None and decision.cap
    lines = control.apply(decision)
    # clamped to the board's lower constraint (200 W), on both configured GPUs
    assert [c[2] for c in fake.privileged_calls] == [(200_000,), (200_000,)]
    assert "200 W" in lines[0]
    assert gpu_power.decide(sig(thermal_throttle=1, temp_margin_c=2), capped=True, margin_c=5) is None
    back = gpu_power.decide(sig(thermal_throttle=0, temp_margin_c=20), capped=True, margin_c=5)
    assert back is not None and not back.cap
    control.apply(back)
    assert fake.privileged_calls[-1][2] == (700_000,)


def test_missing_data_changes_nothing():
    assert gpu_power.decide({}, capped=True, margin_c=5) is None
    assert gpu_power.decide(sig(thermal_throttle=None, temp_margin_c=None), capped=True, margin_c=5) is None


def test_no_permission_is_reported_not_raised():
    fake = FakeNvml([FakeGpu()], privileged=False)
    control = gpu_power.GpuPowerControl(enabled=True, devices=[0], power_limit_w=400, nvml=fake)
    (line,) = control.apply(gpu_power.PowerDecision(True, "hot"))
    assert "unchanged" in line
