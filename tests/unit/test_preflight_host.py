"""check-config's host checks: what `run` needs of this host beyond the file — PID 1 is systemd for the
systemd actuator, the engine units are installed, NVML loads for an `nvml` GPU source — and the checks it
could not make, said as such (the real-systemd cases are in tests/processes/test_systemd_units.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tuner import config
from tuner.daemon import preflight
from tuner.sources import nvml


def settings(tmp: Path, **extra: Any) -> config.TunerSettings:
    return config.parse({
        "mode": "apply",
        "targets": [{"name": "a", "metrics_url": "http://127.0.0.1:8001/metrics", "args": ["--max-num-seqs", "8"]},
                    {"name": "b", "metrics_url": "http://127.0.0.1:8002/metrics", "args": ["--max-num-seqs", "8"]}],
        "actuator": {"kind": "systemd", "env_dir": str(tmp / "env")},
        "daemon": {"state_file": str(tmp / "state.json"), "listen_port": 0},
        "rollout": {"journal_file": str(tmp / "journal.jsonl")},
        **extra,
    })


def test_the_systemd_actuator_needs_pid_1_to_be_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "SYSTEMD_BOOTED", tmp_path / "run-systemd-system")  # not booted with systemd
    problems = preflight.preflight(settings(tmp_path), tmp_path)
    assert any(k == "actuator" and w.startswith("PID 1 is not systemd here") for k, w in problems), problems


def test_a_systemctl_that_cannot_answer_is_a_check_not_made(tmp_path: Path) -> None:
    unchecked: list[str] = []
    s = settings(tmp_path, actuator={"kind": "systemd", "env_dir": str(tmp_path / "env"), "systemctl": ["false"]})
    problems = preflight.preflight(s, tmp_path, unchecked=unchecked)
    assert not [p for p in problems if p[0].startswith("actuator")], problems
    assert unchecked == ["PID 1 is systemd: actuator.systemctl runs 'false', not this host's systemctl",
                         "the engine units exist: `false show` exited 1: "]


def test_observe_mode_says_it_did_not_check_the_actuators_host(tmp_path: Path) -> None:
    unchecked: list[str] = []
    assert preflight.preflight(settings(tmp_path, mode="observe"), tmp_path, unchecked=unchecked) == []
    assert unchecked and "mode is observe" in unchecked[0]


def test_an_nvml_source_needs_nvml_to_load_here(tmp_path: Path) -> None:
    why = nvml.NvmlSource().probe()
    if why is None:
        pytest.skip("NVML loads on this host (the H200 case): nothing to refuse")
    s = settings(tmp_path, mode="observe",
                 targets=[{"name": "a", "metrics_url": "http://127.0.0.1:8001/metrics", "gpu": {"kind": "nvml"}}])
    problems = preflight.preflight(s, tmp_path)
    (problem,) = [p for p in problems if p[0] == "targets[0].gpu"]
    assert problem[1].startswith(f"NVML does not load here ({why})")


class _Nvml:
    """An NVML with two GPUs (pynvml's calls the probe makes)."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        if index >= 2:
            raise RuntimeError("Invalid Argument")
        return object()


def test_the_probe_asks_for_the_gpus_configured() -> None:
    assert nvml.NvmlSource([0, 1], nvml=_Nvml()).probe() is None  # type: ignore[arg-type]
    assert nvml.NvmlSource([0, 3], nvml=_Nvml()).probe() == "GPU 3: RuntimeError: Invalid Argument"  # type: ignore[arg-type]
