"""The GPU power cap: a guard action of the plan (planning.guards.power), carried out by the privileged
GpuPowerControl, which is off by default and tested only against a fake NVML."""

import pytest

from harness.fake_nvml import FakeGpu, FakeNvml
from tuner import config
from tuner.actuators import gpu_power
from tuner.errors import PermanentActuatorError
from tuner.model import knobs
from tuner.planning import guards, planner
from tuner.planning.history import History
from tuner.signals import Signal

SETTINGS = planner.DecisionSettings()
FRESH = History()


def sig(**values):
    return {k: Signal(v) for k, v in values.items()}


def plan(signals, history=FRESH, settings=SETTINGS, *, power_control=True):
    return planner.plan("a", signals, knobs.EngineArgs(), history, settings, rules=(), now=1000.0,
                        power_control=power_control)


def test_disabled_by_default_and_refuses():
    settings = config.TunerSettings.model_validate({"targets": [{"name": "a", "metrics_url": "http://x/metrics"}]})
    assert settings.gpu_control.enabled is False
    fake = FakeNvml([FakeGpu()])
    control = gpu_power.GpuPowerControl(enabled=False, devices=[0], power_limit_w=500, nvml=fake)
    with pytest.raises(PermanentActuatorError, match="off by default"):
        control.apply(cap=True, reason="hot")
    assert fake.privileged_calls == []
    # and the planner plans no power action unless gpu_control is enabled
    assert plan(sig(thermal_throttle=1, temp_margin_c=2), power_control=False).actions == ()


def test_power_cap_alone_is_not_thermal():
    assert guards.power(sig(thermal_throttle=0, temp_margin_c=18, power_capped=1), guards.ThermalSettings(),
                        capped=False) is None


def test_throttle_caps_then_clearing_restores_as_plan_actions():
    fake = FakeNvml([FakeGpu(), FakeGpu()])
    control = gpu_power.GpuPowerControl(enabled=True, devices=[0, 1], power_limit_w=100, nvml=fake)
    hot = plan(sig(thermal_throttle=1, temp_margin_c=2))
    (cap,) = hot.actions
    assert cap.kind == "power-cap" and "thermal throttling" in cap.reason
    assert hot.history.power_capped and "power-cap (" in hot.summary()
    lines = control.apply(cap=True, reason=cap.reason).lines
    # clamped to the board's lower constraint (200 W), on both configured GPUs
    assert [c[2] for c in fake.privileged_calls] == [(200_000,), (200_000,)]
    assert "200 W" in lines[0]
    still = plan(sig(thermal_throttle=1, temp_margin_c=2), hot.history)
    assert still.actions == () and still.history.power_capped  # capped already: nothing new
    back = plan(sig(thermal_throttle=0, temp_margin_c=20), still.history)
    (restore,) = back.actions
    assert restore.kind == "power-restore" and not back.history.power_capped
    control.apply(cap=False, reason=restore.reason)
    assert fake.privileged_calls[-1][2] == (700_000,)


def test_the_absolute_temperature_limit_caps_too():
    """The old power-cap decision re-implemented the thermal guard without max_temp_c; the guard has it."""
    settings = SETTINGS.model_copy(update={"thermal": guards.ThermalSettings(max_temp_c=82)})
    (cap,) = plan(sig(thermal_throttle=0, temp_margin_c=6, gpu_temp_c=83), settings=settings).actions
    assert cap.kind == "power-cap" and "max_temp_c 82" in cap.reason


def test_missing_data_changes_nothing():
    capped = History(power_capped=True)
    assert plan({}, capped).actions == ()
    assert plan(sig(thermal_throttle=None, temp_margin_c=None), capped).actions == ()


def test_no_permission_is_reported_not_raised():
    fake = FakeNvml([FakeGpu()], privileged=False)
    control = gpu_power.GpuPowerControl(enabled=True, devices=[0], power_limit_w=400, nvml=fake)
    result = control.apply(cap=True, reason="hot")
    (line,) = result.lines
    assert "unchanged" in line and result.errors == (line,)
