"""Sleep mode decisions over a REAL recording: vLLM 0.26.0 on an NVIDIA H200 put to sleep and woken by
``tuner.actuators.sleeping.SleepControl`` (tests/fixtures/gpu/h200-vllm026-sleep-wake.json, recorded by
bench/gpu_sleep_wake.py; the source line of the file says how).

What the recording established and these tests hold the tuner to:
- ``vllm:engine_sleep_state`` reads awake / level 1 / level 2 as the ``sleep_level`` signal;
- a request sent to a sleeping engine left ``vllm:num_requests_waiting`` and ``_running`` at 0 for the
  whole 10 s it waited; only ``GET /load`` (``--enable-server-load-tracking``) counted it — so the wake
  decision needs ``server_load``;
- level 1 freed the GPU memory (120.4 → 2.4 GiB) and woke in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

from tuner.model import snapshots
from tuner.planning import guards
from tuner.signals import Signal, missing
from tuner.signals import engine as engine_signals

REC = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "h200-vllm026-sleep-wake.json").read_text())
ON = guards.IdleSettings(sleep_after_seconds=600)


def sleep_level(metrics: dict) -> float | None:
    snap = snapshots.parse("\n".join(metrics["sleep_lines"]) + "\n", scraped_at=float(metrics["t"]))
    return engine_signals.compute([snap])["sleep_level"].value


def test_the_recorded_sleep_state_gauge_reads_as_sleep_levels() -> None:
    assert "vLLM 0.26.0" in REC["source"] and "H200" in REC["source"]
    assert sleep_level(REC["1_awake"]["metrics"]) == 0
    assert sleep_level(REC["2_sleep_level1"]["metrics_after"]) == 1
    assert sleep_level(REC["5_sleep_level2"]["metrics_after_sleep"]) == 2
    assert sleep_level(REC["4_wake"]["metrics_after"]) == 0


def test_a_request_waiting_on_the_sleeping_engine_wakes_it_only_through_server_load() -> None:
    samples = REC["3_request_while_asleep"]["samples"]
    assert samples and not REC["3_request_while_asleep"]["done_before_wake"]
    for s in samples:
        assert s["vllm:num_requests_waiting"] == 0 and s["vllm:num_requests_running"] == 0  # the gauges stand still
        signals = {"sleep_level": Signal(1.0), "requests_waiting": Signal(s["vllm:num_requests_waiting"]),
                   "requests_running": Signal(s["vllm:num_requests_running"]),
                   "server_load": Signal(float(s["server_load"]))}
        wake = guards.sleep_or_wake(signals, ON, now=s["t"], since=None)
        assert wake is not None and wake.kind == "wake", s
        # without load tracking the same moment looks like a quiet sleeper: it would never be woken
        blind = {**signals, "server_load": missing("GET /load unreadable")}
        assert guards.sleep_or_wake(blind, ON, now=s["t"], since=None) is None


def test_level_one_frees_the_gpu_and_wakes_fast() -> None:
    awake = REC["1_awake"]["memory"]["nvml_used_gib"]
    asleep = REC["2_sleep_level1"]["memory_after"]["nvml_used_gib"]
    assert awake > 100 and asleep < 5  # 120.4 → 2.4 GiB on the recording
    assert REC["2_sleep_level1"]["return"] is None and REC["4_wake"]["return"] is None  # SleepControl: success
    assert REC["4_wake"]["duration_s"] < 2
    assert guards.IdleSettings.model_fields["sleep_level"].annotation.__args__ == (1,)  # level 2 is not offered
