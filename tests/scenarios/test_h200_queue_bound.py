"""The queue-bound bad start on a REAL H200 (tests/fixtures/vllm/h200-queue-bound, recorded by
bench/gpu/capture.sh: vLLM 0.26.0, an 8B-shaped Llama with dummy weights, --max-num-seqs 8 under 64
closed-loop clients of vLLM's benchmark client), through the daemon's own step like the vLLM-cpu scenarios.

The recording starts before the load: 000-004 are idle (every gauge and counter 0), 005-007 are under load
(running 8, waiting 56, KV 1.3-1.7 %). Over the load alone the step is the 64 clients ÷ 0.8 = 80; over the
daemon's default 300 s window the 20 idle seconds before the load dilute the window's rates, and the
requests inside at the last scrape keep the step at 80 (the last test).
"""

from __future__ import annotations

import math

import pytest

from tests.scenarios.support import meta, replay
from tuner.model import knobs
from tuner.model.gpus import GpuInputs
from tuner.planning import planner, stepping

NAME = "h200-queue-bound"
H200 = planner.DecisionSettings(engine=planner.EngineFacts(platform="cuda", gpu_memory_gib=139, gpu_name="H200"))
NO_GPU = GpuInputs(unavailable="no GPU telemetry was recorded with this capture")
# the three loaded scrapes only (005-007, 10.04 s): the window a daemon holds once the load has lasted a window
LOADED = stepping.WindowSettings(window_seconds=10.5, min_snapshots=3)


def run(window: stepping.WindowSettings | None = None, *, apply: bool = False) -> list[stepping.Decision]:
    return replay(NAME, settings=H200, gpus=NO_GPU, window=window, apply=apply)


def test_the_capture_is_a_real_h200_queue_bound_start():
    m = meta(NAME)
    assert m["version"]["version"] == "0.26.0" and "H200" in m["hardware"]
    assert knobs.EngineArgs.parse(m["engine_args"]).get("--max-num-seqs") == "8"
    assert m["workload"]["max_concurrency"] == 64
    s = run()[-1].signals
    assert s["requests_running_max"].value == 8 and s["requests_waiting_max"].value == 56
    assert s["kv_cache_usage_max"].value < 0.02 and s["preemptions_per_s"].value == 0
    # the per-request TPOT histogram is there on vLLM 0.26: 80 requests finished by 007, 0.4065 s summed
    # → 5.08 ms per output token, what the benchmark client measured (mean TPOT 5.06 ms)
    tpot = s["tpot_mean_s"].value
    assert tpot == pytest.approx(0.40647388523137246 / 80)
    assert tpot == pytest.approx(m["benchmark"]["mean_tpot_ms"] / 1000, rel=0.02)
    assert s["tpot_p99_s"].bounds == (0.0, 0.01) and s["tpot_p50_s"].bounds == (0.0, 0.01)
    assert s["itl_p99_s"].bounds == (0.0, 0.01)  # at 8 slots no gap reaches 10 ms: decode has headroom


def test_one_step_to_the_clients_over_the_loaded_window():
    cycles = run(LOADED)
    first = next(i for i, c in enumerate(cycles) if c.plan is not None and c.plan.changes)
    assert first == 7  # 005, 006, 007: the rule holds for 3 consecutive windows (`for: 3`), then fires
    assert [h.guard for h in cycles[6].plan.held] == ["sustain"]
    last = cycles[-1]
    s = last.signals
    (change,) = last.plan.changes
    # window 005-007: running 8 and waiting 56 in every scrape, so the queue is stable (growth 0 ≤ 0.1 × λ) and
    # the 8 + 56 = 64 requests inside are the demand — more than Little's law on the throttled arrivals
    # (λ = 64 finished / 10.04 s = 6.38/s × S₀ 1.36 s at 8 running → 9.01); ⌈64 / 0.8 utilisation⌉ = 80
    inside = s["requests_running_mean"].value + s["requests_waiting_mean"].value
    assert inside == 64 and s["in_system_growth_per_s"].value == 0
    assert (change.flag, change.from_value, change.to_value, change.rule) == ("--max-num-seqs", 8, 80, "queue-slot-bound")
    assert change.to_value == math.ceil(64 / 0.8)
    assert "the queue is stable, 64 requests inside (running + waiting) are the demand" in change.reason
    assert "itl_p99_s 0.009943 < 0.1 (SLO itl_p99_s)" in change.reason  # the gate: decode has headroom
    # judged after the rollout on the per-request TPOT, bounded by its SLO
    assert [(v.signal, v.expect, v.slo) for v in change.verify] == [("tpot_p99_s", "at-most", "tpot_p99_s")]
    assert s["tpot_p99_s"].value <= 0.1
    applied = [ch for c in run(LOADED, apply=True) if c.plan is not None for ch in c.plan.changes]
    assert [(ch.flag, ch.from_value, ch.to_value) for ch in applied] == [("--max-num-seqs", 8, 80)]  # ONE step


def test_the_daemons_default_window_with_the_idle_start_jumps_in_one_step_too():
    """The daemon's default window (300 s) over the whole recording holds 20 idle seconds before the load:
    the means are diluted and the queue looks like it is still growing, so Little's law on the window's
    rates alone would size 8 → 10. The requests inside at the last scrape are demand too: 8 → 80, the same
    one step as over the loaded window (the replay of a bad start a daemon would see from its first cycle)."""
    cycles = run()
    last = cycles[-1]
    s = last.signals
    (change,) = last.plan.changes
    # window 000-007, 35.14 s: 80 finished + 64 now inside → λ = 144 / 35.14 = 4.10/s; growth 64 / 35.14 =
    # 1.82/s > 0.1 × λ (growing); S₀ = 109.42 s / 80 = 1.368 s at n₀ = 24 / 8 = 3 running (five idle scrapes
    # of 0): Little's law (4.10 × 1.368 × 3^-0.3)^(1/0.7) = 7.33 in service → ⌈7.33 / 0.8⌉ would be 10; but
    # 8 running + 56 waiting = 64 are inside now → ⌈64 / 0.8⌉ = 80
    assert s["requests_running_mean"].value == 3 and s["window_seconds"].value == pytest.approx(35.144)
    assert s["arrival_rate_per_s"].value == pytest.approx(144 / 35.144)
    lam, s0 = s["arrival_rate_per_s"].value, s["slot_seconds_mean"].value
    little = (lam * s0 * 3 ** -0.3) ** (1 / 0.7)
    assert little == pytest.approx(7.33, abs=0.01) and math.ceil(little / 0.8) == 10
    assert s["requests_running"].value + s["requests_waiting"].value == 64
    assert (change.from_value, change.to_value, change.rule) == (8, 80, "queue-slot-bound")
    assert "the load began inside the window (3 running on average, 8 now): the 64 requests inside now" in change.reason
    applied = [ch for c in run(apply=True) if c.plan is not None for ch in c.plan.changes]
    assert [(ch.flag, ch.from_value, ch.to_value) for ch in applied] == [("--max-num-seqs", 8, 80)]  # ONE step
