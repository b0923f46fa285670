"""NvmlSource against a replayed H200 recording and a fake pynvml."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.fake_nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    FakeGpu,
    FakeNvml,
    NVMLError,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
)
from tuner.model import gpus
from tuner.model.gpus import GpuReading
from tuner.sources.nvml import NvmlSource

RECORDING = Path(__file__).parents[1] / "fixtures" / "nvml" / "h200-matmul.json"
LOGGER = "tuner.sources.nvml"


@pytest.fixture(scope="module")
def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDING.read_text())
    return data


def _source(fake: FakeNvml, now: float = 1000.0, **kw: Any) -> NvmlSource:
    return NvmlSource(nvml=fake, clock=lambda: now, **kw)


# -- replay of the real H200 --------------------------------------------------------------------------------


def test_replay_rebuilds_every_reading_made_on_the_h200(recording: dict[str, Any]) -> None:
    fake = FakeNvml.from_recording(recording)
    t = [0.0]
    source = NvmlSource([recording["meta"]["gpu"]], nvml=fake, clock=lambda: t[0])
    assert len(recording["samples"]) > 50
    for i, sample in enumerate(recording["samples"]):
        fake.load_sample(i)
        t[0] = sample["t"]
        expected = [GpuReading(**r) for r in sample["readings"]]
        assert source.read() == expected, f"sample {i} ({sample['phase']})"
    assert fake.replay_misses == []
    source.close()
    assert fake.shutdown_calls == 1


def test_recording_shows_an_h200_idle_then_power_capped(recording: dict[str, Any]) -> None:
    readings = [GpuReading(**r) for s in recording["samples"] for r in s["readings"]]
    first = readings[0]
    assert first.name == "NVIDIA H200"
    assert (first.slowdown_temp_c, first.shutdown_temp_c, first.mem_max_temp_c) == (89.0, 95.0, 95.0)
    assert first.power_limit_w == 700.0
    assert first.clocks_event_reasons == gpus.GPU_IDLE
    assert all(r.error is None and r.mem_temp_c is not None for r in readings)
    capped = [r for r in readings if r.clocks_event_reasons == gpus.SW_POWER_CAP]
    assert len(capped) > 30
    assert all(r.power_w is not None and r.power_w > 500 for r in capped)
    assert all(r.sm_clock_mhz is not None and r.sm_clock_mhz < 1980 for r in capped)
    assert not any(r.clocks_event_reasons and r.clocks_event_reasons & gpus.THERMAL_MASK for r in readings)


# -- fields ------------------------------------------------------------------------------------------------


def test_units_are_converted() -> None:
    fake = FakeNvml([FakeGpu(power_mw=691_718, power_limit_mw=700_000, util_gpu=99, sm_clock_mhz=1425)])
    (r,) = _source(fake, now=42.0).read()
    assert r.read_at == 42.0
    assert r.source == "nvml"
    assert r.power_w == pytest.approx(691.718)
    assert r.power_limit_w == 700.0
    assert r.gpu_util == pytest.approx(0.99)
    assert r.sm_clock_mhz == 1425.0
    assert r.mem_temp_c == 32.0
    assert r.mem_total_bytes == 150_754_820_096.0


@pytest.mark.parametrize(
    ("fn", "field"),
    [
        ("nvmlDeviceGetName", "name"),
        ("nvmlDeviceGetUUID", "uuid"),
        ("nvmlDeviceGetTemperature", "gpu_temp_c"),
        ("nvmlDeviceGetFieldValues", "mem_temp_c"),
        ("nvmlDeviceGetTemperatureThreshold:1", "slowdown_temp_c"),
        ("nvmlDeviceGetTemperatureThreshold:0", "shutdown_temp_c"),
        ("nvmlDeviceGetTemperatureThreshold:2", "mem_max_temp_c"),
        ("nvmlDeviceGetClockInfo", "sm_clock_mhz"),
        ("nvmlDeviceGetMaxClockInfo", "sm_clock_max_mhz"),
        ("nvmlDeviceGetPowerUsage", "power_w"),
        ("nvmlDeviceGetEnforcedPowerLimit", "power_limit_w"),
        ("nvmlDeviceGetUtilizationRates", "gpu_util"),
        ("nvmlDeviceGetMemoryInfo", "mem_used_bytes"),
        ("nvmlDeviceGetMemoryInfo", "mem_total_bytes"),
    ],
)
def test_a_not_supported_call_leaves_only_its_field_none(fn: str, field: str) -> None:
    healthy = _source(FakeNvml()).read()[0]
    fake = FakeNvml([FakeGpu(errors={fn: NVML_ERROR_NOT_SUPPORTED})])
    (r,) = _source(fake).read()
    assert getattr(r, field) is None
    assert getattr(healthy, field) is not None
    assert r.error is None
    others = {k for k in GpuReading.__slots__ if getattr(healthy, k) is not None} - {field}
    if fn == "nvmlDeviceGetMemoryInfo":
        others -= {"mem_used_bytes", "mem_total_bytes"}
    assert {k for k in others if getattr(r, k) != getattr(healthy, k)} == set()


def test_memory_temperature_field_not_supported_is_none_not_zero() -> None:
    (r,) = _source(FakeNvml([FakeGpu(mem_temp_c=None)])).read()
    assert r.mem_temp_c is None
    assert r.gpu_temp_c == 30.0


def test_any_nvml_error_leaves_a_field_none() -> None:
    fake = FakeNvml(
        [
            FakeGpu(
                errors={
                    "nvmlDeviceGetPowerUsage": NVML_ERROR_NO_PERMISSION,
                    "nvmlDeviceGetTemperature": NVML_ERROR_GPU_IS_LOST,
                }
            )
        ]
    )
    (r,) = _source(fake).read()
    assert (r.power_w, r.gpu_temp_c) == (None, None)
    assert r.power_limit_w == 700.0


def test_clock_event_reasons_fall_back_to_the_deprecated_call() -> None:
    fake = FakeNvml(
        [
            FakeGpu(
                clocks_event_reasons=0x4,
                errors={"nvmlDeviceGetCurrentClocksEventReasons": NVML_ERROR_FUNCTION_NOT_FOUND},
            )
        ]
    )
    (r,) = _source(fake).read()
    assert r.clocks_event_reasons == gpus.SW_POWER_CAP
    assert "0/nvmlDeviceGetCurrentClocksThrottleReasons" in fake.calls


def test_clock_event_reasons_none_when_both_calls_fail() -> None:
    errors = {
        "nvmlDeviceGetCurrentClocksEventReasons": NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetCurrentClocksThrottleReasons": NVML_ERROR_NOT_SUPPORTED,
    }
    (r,) = _source(FakeNvml([FakeGpu(errors=errors)])).read()
    assert r.clocks_event_reasons is None


@pytest.mark.parametrize(
    ("mask", "names", "thermal"),
    [
        (0x0, [], False),
        (gpus.GPU_IDLE, ["gpu_idle"], False),
        (gpus.SW_POWER_CAP, ["sw_power_cap"], False),
        (gpus.SW_THERMAL_SLOWDOWN, ["sw_thermal_slowdown"], True),
        (gpus.HW_THERMAL_SLOWDOWN | gpus.HW_SLOWDOWN, ["hw_slowdown", "hw_thermal_slowdown"], True),
        (gpus.SW_POWER_CAP | gpus.SW_THERMAL_SLOWDOWN, ["sw_power_cap", "sw_thermal_slowdown"], True),
    ],
)
def test_throttle_masks_pass_through(mask: int, names: list[str], thermal: bool) -> None:
    (r,) = _source(FakeNvml([FakeGpu(clocks_event_reasons=mask)])).read()
    assert r.clocks_event_reasons == mask
    assert gpus.reason_names(mask) == names
    assert bool(mask & gpus.THERMAL_MASK) is thermal


def test_a_hot_gpu_near_its_slowdown_threshold() -> None:
    gpu = FakeGpu(temp_c=87, mem_temp_c=93, sm_clock_mhz=1200, clocks_event_reasons=gpus.SW_THERMAL_SLOWDOWN)
    (r,) = _source(FakeNvml([gpu])).read()
    assert r.slowdown_temp_c is not None
    assert r.gpu_temp_c is not None
    assert r.slowdown_temp_c - r.gpu_temp_c == 2.0
    assert (r.mem_max_temp_c, r.mem_temp_c) == (95.0, 93.0)
    assert r.clocks_event_reasons == 0x20


def test_readings_follow_state_changes_between_reads() -> None:
    fake = FakeNvml([FakeGpu()])
    source = _source(fake)
    assert source.read()[0].clocks_event_reasons == gpus.GPU_IDLE
    fake.gpus[0].clocks_event_reasons = gpus.HW_THERMAL_SLOWDOWN
    fake.gpus[0].temp_c = 90
    r = source.read()[0]
    assert (r.clocks_event_reasons, r.gpu_temp_c) == (0x40, 90.0)
    assert fake.init_calls == 1
    assert fake.calls.count("nvmlDeviceGetHandleByIndex:0") == 1  # handles are kept


# -- GPUs, handles, availability --------------------------------------------------------------------------


def test_all_gpus_by_default_or_the_chosen_indices() -> None:
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}") for i in range(3)])
    assert [r.uuid for r in _source(fake).read()] == ["GPU-0", "GPU-1", "GPU-2"]
    fake2 = FakeNvml([FakeGpu(uuid=f"GPU-{i}") for i in range(3)])
    assert [(r.index, r.uuid) for r in _source(fake2, indices=[2]).read()] == [(2, "GPU-2")]


def test_a_gpu_without_a_handle_gives_an_error_reading() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(handle_error=NVML_ERROR_GPU_IS_LOST)])
    ok, lost = _source(fake, now=7.0).read()
    assert (ok.error, ok.name) == (None, "NVIDIA H200")
    assert lost == GpuReading(index=1, source="nvml", read_at=7.0, error=lost.error)
    assert "GPU is lost" in (lost.error or "")
    assert _source(FakeNvml(), indices=[5]).read()[0].error is not None


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        (FakeNvml(driver_missing=True), "NVMLError_LibraryNotFound: NVML Shared Library Not Found"),
        (FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED), "NVMLError_DriverNotLoaded: Driver Not Loaded"),
    ],
)
def test_driver_missing_returns_nothing_and_logs_once(
    fake: FakeNvml, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(fake)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert source.read() == []
        assert source.read() == []
        assert source.read() == []
    assert source.unavailable_reason == reason
    assert [r.getMessage() for r in caplog.records] == [f"NVML unavailable: {reason}"]
    assert fake.init_calls == 1
    source.close()  # nothing to shut down
    assert fake.shutdown_calls == 0


def test_pynvml_not_importable(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    source = NvmlSource()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert source.read() == []
        assert source.read() == []
    assert source.unavailable_reason is not None
    assert source.unavailable_reason.startswith("pynvml not importable")
    assert len(caplog.records) == 1


def test_real_pynvml_without_a_driver_never_raises() -> None:
    """On a machine with a driver this reads real GPUs; without one it is the unavailable path."""
    source = NvmlSource()
    readings = source.read()
    assert (readings == []) == (source.unavailable_reason is not None)
    source.close()


def test_close_shuts_down_and_a_later_read_initialises_again() -> None:
    fake = FakeNvml()
    source = _source(fake)
    assert len(source.read()) == 1
    source.close()
    assert (fake.shutdown_calls, fake.initialised) == (1, False)
    assert len(source.read()) == 1
    assert fake.init_calls == 2


def test_a_broken_module_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml()
    fake.nvmlDeviceGetCount = "not callable"  # type: ignore[assignment,method-assign]
    source = _source(fake)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert source.read() == []
    assert source.unavailable_reason is not None


# -- the fake itself ---------------------------------------------------------------------------------------


def test_fake_errors_behave_like_pynvml() -> None:
    err = NVMLError(NVML_ERROR_NOT_SUPPORTED)
    assert type(err) is NVMLError_NotSupported
    assert err.value == NVML_ERROR_NOT_SUPPORTED
    assert str(err) == "Not Supported"
    assert NVMLError_LibraryNotFound().value == 12
    assert isinstance(NVMLError_NoPermission(), NVMLError)


def test_fake_privileged_setters_record_calls() -> None:
    fake = FakeNvml()
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlDeviceSetGpuLockedClocks(h, 1200, 1500)
    fake.nvmlDeviceSetPowerManagementLimit(h, 500_000)
    fake.nvmlDeviceResetGpuLockedClocks(h)
    assert fake.privileged_calls == [
        ("nvmlDeviceSetGpuLockedClocks", 0, (1200, 1500)),
        ("nvmlDeviceSetPowerManagementLimit", 0, (500_000,)),
        ("nvmlDeviceResetGpuLockedClocks", 0, ()),
    ]
    assert (fake.gpus[0].power_limit_mw, fake.gpus[0].locked_clocks) == (500_000, None)

    denied = FakeNvml(privileged=False)
    denied.nvmlInit()
    with pytest.raises(NVMLError_NoPermission):
        denied.nvmlDeviceSetGpuLockedClocks(denied.nvmlDeviceGetHandleByIndex(0), 1200, 1500)
    assert denied.privileged_calls == [("nvmlDeviceSetGpuLockedClocks", 0, (1200, 1500))]
