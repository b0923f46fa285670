"""dcgm-exporter snapshots -> GpuReading, checked against real captures in tests/fixtures/dcgm/.

Expected values were read off the fixture files by eye. Inline texts below are derived from those
fixtures (lines removed, a label renamed, a value replaced) and say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.model import gpus
from tuner.model.dcgm import dcgm_keep_prefixes, is_blank, readings_from_snapshot
from tuner.model.gpus import GpuReading
from tuner.model.snapshots import Snapshot, parse

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
MIB = 1024 * 1024
T0 = 1_700_000_000.0


def _text(name: str) -> str:
    return (FIXTURES / name).read_text()


def _readings(text: str, **kwargs: object) -> list[GpuReading]:
    snap = parse(text, T0, source="dcgm", keep_prefixes=dcgm_keep_prefixes())
    assert snap.ok, snap.error
    return readings_from_snapshot(snap, **kwargs)  # type: ignore[arg-type]


ALL_FIXTURES = sorted(p.name for p in FIXTURES.glob("*.prom"))


def test_every_fixture_is_listed_and_has_provenance() -> None:
    assert len(ALL_FIXTURES) >= 5
    for name in ALL_FIXTURES:
        first = _text(name).splitlines()[0]
        assert first.startswith("# source: "), name


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_fixture_parses_into_sane_readings(name: str) -> None:
    readings = _readings(_text(name))
    assert readings, name
    assert [r.index for r in readings] == sorted({r.index for r in readings})
    for r in readings:
        assert r.source == "dcgm"
        assert r.read_at == T0
        assert r.uuid is not None
        assert r.uuid.startswith("GPU-")
        for ratio in (r.gpu_util, r.dram_active, r.sm_active):
            assert ratio is None or 0.0 <= ratio <= 1.0
        if r.mem_used_bytes is not None and r.mem_total_bytes is not None:
            assert r.mem_used_bytes <= r.mem_total_bytes


def test_rtx4000ada_full_scrape() -> None:
    [r] = _readings(_text("rtx4000ada-k8s-full.prom"))
    assert r.index == 0
    assert r.uuid == "GPU-a8394b51-c086-568a-9f1a-c1e1c934c44c"
    assert r.name == "NVIDIA RTX 4000 Ada Generation"
    assert r.gpu_temp_c == 48
    assert r.mem_temp_c is None  # GDDR6 board prints 0
    assert r.sm_clock_mhz == 2310
    assert r.power_w == pytest.approx(40.979)
    assert r.gpu_util == 0.0
    assert r.mem_used_bytes == 1 * MIB
    assert r.mem_total_bytes == (1 + 20015 + 457) * MIB  # used + free + reserved
    assert r.dram_active == pytest.approx(0.003074)
    # Not in the default counter set, so not in this scrape.
    assert r.sm_active is None
    assert r.clocks_event_reasons is None
    assert r.slowdown_temp_c is None
    assert r.power_limit_w is None
    assert r.sm_clock_max_mhz is None


def test_h100_grep_filtered_sample_has_only_what_it_shows() -> None:
    readings = _readings(_text("h100x8-vllm-k8s-grep.prom"))
    assert [r.index for r in readings] == list(range(8))
    r0 = readings[0]
    assert r0.uuid == "GPU-c4529c8d-69c4-b61d-e0bc-7b2460096005"
    assert r0.name == "NVIDIA H100 80GB HBM3"
    assert r0.gpu_temp_c == 30
    assert r0.power_w == pytest.approx(113.611)
    assert r0.gpu_util == 0.0
    assert readings[7].gpu_temp_c == 26
    assert readings[7].power_w == pytest.approx(66.997)
    for r in readings:
        # grep kept temperature, power and utilisation only
        assert r.mem_temp_c is None
        assert r.sm_clock_mhz is None
        assert r.mem_used_bytes is None
        assert r.mem_total_bytes is None
        assert r.dram_active is None
        assert r.sm_active is None
        assert r.clocks_event_reasons is None


def test_h100_slowdown_temp_argument_fills_in() -> None:
    readings = _readings(_text("h100x8-vllm-k8s-grep.prom"), slowdown_temp_c=87.0)
    assert {r.slowdown_temp_c for r in readings} == {87.0}


def test_a100_mig_prefers_whole_gpu_series() -> None:
    [r] = _readings(_text("a100-mig-nvidia-docs.prom"))
    assert r.index == 0
    assert r.uuid == "GPU-34319582-d595-d1c7-d1d2-179bcfa61660"
    assert r.name is None  # this old exporter printed no modelName label
    assert r.gpu_temp_c == 61
    assert r.mem_temp_c == 69  # HBM2e reports a real memory temperature
    assert r.sm_clock_mhz == 1215
    assert r.power_w == pytest.approx(409.692)
    assert r.mem_used_bytes == 4845 * MIB
    assert r.mem_total_bytes == (4845 + 35690) * MIB  # no FB_RESERVED in this version
    # whole-GPU 0.690789 wins over GPU instance 13's 0.800339
    assert r.dram_active == pytest.approx(0.690789)
    assert r.gpu_util is None  # not printed


def test_mig_instances_only_are_combined() -> None:
    # Derived from a100-mig-nvidia-docs.prom: whole-GPU lines dropped, instance 13 kept, and a second
    # instance made by copying instance 13's lines with GPU_I_ID 14 and other values.
    inst = _text("a100-mig-nvidia-docs.prom").split("\n\n", 1)[1]
    other = (
        inst.replace('GPU_I_ID="13"', 'GPU_I_ID="14"').replace("0.800339", "0.25").replace("0.995687", "0.5")
    )
    fb = (
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-34319582-d595-d1c7-d1d2-179bcfa61660",device="nvidia0",'
        'GPU_I_PROFILE="1g.5gb",GPU_I_ID="13",Hostname="ub20-a100-k8s"} 100\n'
        'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-34319582-d595-d1c7-d1d2-179bcfa61660",device="nvidia0",'
        'GPU_I_PROFILE="1g.5gb",GPU_I_ID="14",Hostname="ub20-a100-k8s"} 300\n'
        'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-34319582-d595-d1c7-d1d2-179bcfa61660",device="nvidia0",'
        'GPU_I_PROFILE="1g.5gb",GPU_I_ID="13",Hostname="ub20-a100-k8s"} 4700\n'
        'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-34319582-d595-d1c7-d1d2-179bcfa61660",device="nvidia0",'
        'GPU_I_PROFILE="1g.5gb",GPU_I_ID="14",Hostname="ub20-a100-k8s"} 4500\n'
    )
    [r] = _readings(inst + other + fb)
    assert r.dram_active == pytest.approx(0.800339)  # the busiest instance
    assert r.mem_used_bytes == 400 * MIB  # summed over instances
    assert r.mem_total_bytes == (400 + 9200) * MIB
    assert r.gpu_temp_c is None


def test_duplicate_series_for_pods_sharing_a_gpu_are_not_summed() -> None:
    # Derived from rtx4000ada-k8s-full.prom: the FB_USED line repeated with another pod label, as
    # dcgm-exporter prints when several pods share one GPU.
    text = _text("rtx4000ada-k8s-full.prom")
    line = next(ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_FB_USED{"))
    text = text.replace(line, line + "\n" + line.replace('pod="cuda-75454ffb9f-8ljq7"', 'pod="other"'))
    [r] = _readings(text)
    assert r.mem_used_bytes == 1 * MIB


def test_t4_sm_active() -> None:
    readings = _readings(_text("t4x2-gke-sm-active.prom"))
    assert [r.index for r in readings] == [0, 1]
    assert readings[0].uuid == "GPU-84412445-5790-0b3f-f714-da8aa3b2c0b0"
    assert readings[1].uuid == "GPU-4812b59b-1f1a-430f-d8a4-69d2ee8c18bb"
    assert all(r.name == "Tesla T4" for r in readings)
    assert all(r.sm_active == 0.0 for r in readings)
    assert all(r.dram_active is None for r in readings)
    assert all(r.gpu_temp_c is None for r in readings)


def test_old_exporter_blank_sentinel_reads_as_none() -> None:
    [r] = _readings(_text("old-exporter-blank-sentinel.prom"))
    assert r.uuid == "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
    assert r.sm_clock_mhz == 139
    assert r.mem_temp_c is None  # printed 9223372036854775794
    assert r.gpu_temp_c is None


@pytest.mark.parametrize(
    ("value", "blank"),
    [
        (9223372036854775794.0, True),
        (1e19, True),  # anything at or above int64 blank as a float
        (2147483632.0, True),
        (2147483635.0, True),
        (140737488355328.0, True),
        (140737488355331.0, True),
        (0.0, False),
        (65.0, False),
        (81559.0, False),
        (2147483631.0, False),
    ],
)
def test_is_blank(value: float, blank: bool) -> None:
    assert is_blank(value) is blank


def test_sentinel_on_other_fields() -> None:
    # Derived from rtx4000ada-k8s-full.prom: GPU_TEMP and FB_FREE replaced by DCGM blanks.
    text = _text("rtx4000ada-k8s-full.prom")
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("DCGM_FI_DEV_GPU_TEMP{"):
            lines[i] = ln.rsplit(" ", 1)[0] + " 9223372036854775794"
        if ln.startswith("DCGM_FI_DEV_FB_FREE{"):
            lines[i] = ln.rsplit(" ", 1)[0] + " 2147483633"
    [r] = _readings("\n".join(lines) + "\n")
    assert r.gpu_temp_c is None
    assert r.mem_used_bytes == 1 * MIB
    assert r.mem_total_bytes is None  # free unknown -> total unknown
    assert r.sm_clock_mhz == 2310


def test_lowercase_hostname_label_and_hostname_filter() -> None:
    # Derived from rtx4000ada-k8s-full.prom: 'Hostname' renamed to 'hostname', as dcgm-exporter
    # HEAD d5e5f51 prints (no release carries it yet, so no real capture exists).
    text = _text("rtx4000ada-k8s-full.prom").replace("Hostname=", "hostname=")
    assert 'Hostname="' not in text
    [r] = _readings(text, hostname="lke529760-766837-0a634ab30000")
    assert r.gpu_temp_c == 48
    assert _readings(text, hostname="some-other-node") == []
    # The capitalised spelling filters the same way.
    original = _text("rtx4000ada-k8s-full.prom")
    assert len(_readings(original, hostname="lke529760-766837-0a634ab30000")) == 1
    assert _readings(original, hostname="some-other-node") == []


def test_hostname_filter_keeps_series_without_host_label() -> None:
    # old-exporter-blank-sentinel.prom has no Hostname label at all (as with --no-hostname).
    [r] = _readings(_text("old-exporter-blank-sentinel.prom"), hostname="anything")
    assert r.sm_clock_mhz == 139


def test_filter_by_gpu_index() -> None:
    text = _text("h100x8-vllm-k8s-grep.prom")
    readings = _readings(text, gpus=[1, 6])
    assert [r.index for r in readings] == [1, 6]
    assert readings[0].gpu_temp_c == 29
    assert readings[0].power_w == pytest.approx(68.347)
    assert readings[1].gpu_temp_c == 28
    assert readings[1].uuid == "GPU-e64d69ca-b4b3-59b2-e78c-94f26c4db365"
    assert _readings(text, gpus=[]) == []
    assert _readings(text, gpus=[42]) == []


@pytest.mark.parametrize("metric", ["DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"])
def test_clock_event_mask_under_either_name(metric: str) -> None:
    # No real capture carries field 112 (it is not in the default counters). Derived from
    # rtx4000ada-k8s-full.prom: its GPU_TEMP line with the metric renamed and the value 96 (0x20|0x40).
    text = _text("rtx4000ada-k8s-full.prom")
    line = next(ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_TEMP{"))
    extra = line.replace("DCGM_FI_DEV_GPU_TEMP", metric).rsplit(" ", 1)[0] + " 96"
    [r] = _readings(text + extra + "\n")
    assert r.clocks_event_reasons == gpus.SW_THERMAL_SLOWDOWN | gpus.HW_THERMAL_SLOWDOWN
    assert gpus.reason_names(r.clocks_event_reasons) == ["sw_thermal_slowdown", "hw_thermal_slowdown"]


def test_new_clock_event_name_wins_over_alias() -> None:
    text = _text("rtx4000ada-k8s-full.prom")
    line = next(ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_TEMP{"))
    new = line.replace("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS").rsplit(" ", 1)[0] + " 1"
    old = line.replace("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS").rsplit(" ", 1)[0] + " 4"
    [r] = _readings(text + new + "\n" + old + "\n")
    assert r.clocks_event_reasons == gpus.GPU_IDLE


def test_failed_or_foreign_snapshots_give_nothing() -> None:
    assert readings_from_snapshot(Snapshot.failed(T0, "connection refused")) == []
    assert _readings('vllm:num_requests_running{model_name="m"} 3.0\n') == []
    # a series without a usable gpu label (e.g. an NVSwitch entity) is ignored
    assert _readings('DCGM_FI_DEV_GPU_TEMP{nvswitch="0"} 40\nDCGM_FI_DEV_GPU_TEMP{gpu="x"} 40\n') == []


def test_keep_prefixes_cover_every_field_read() -> None:
    prefixes = dcgm_keep_prefixes()
    full = readings_from_snapshot(parse(_text("rtx4000ada-k8s-full.prom"), T0))
    kept = _readings(_text("rtx4000ada-k8s-full.prom"))
    assert full == kept
    assert "DCGM_FI_PROF_DRAM_ACTIVE" in prefixes
    assert "DCGM_FI_PROF_SM_ACTIVE" in prefixes
    assert not any(p.startswith("DCGM_FI_DEV_PCIE") for p in prefixes)
