"""Hypothesis: whatever the signals, args and history, a plan stays inside its bounds, never crosses the
max-model-len floor, never leaves a command line vLLM would refuse, and never exceeds the restart budget."""

import math
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuner.model import knobs
from tuner.planning import guards, model_len, planner
from tuner.planning import history as history_mod
from tuner.planning.history import History
from tuner.rules import loading
from tuner.signals import Signal, missing

REPO = Path(__file__).resolve().parents[2]
_rules = loading.load_all([REPO / "rules" / "default.yaml", REPO / "rules" / "seed-h100.yaml"])
# every rule on, including the ones that lower --max-model-len
RULES = tuple(r.model_copy(update={"enabled": True}) for r in _rules)
BY_ID = {r.id: r for r in RULES}

NUMERIC = {
    "requests_running": (0, 2048), "requests_running_max": (0, 2048), "requests_waiting": (0, 500),
    "requests_waiting_max": (0, 500), "kv_cache_usage": (0, 1), "kv_cache_usage_max": (0, 1),
    "preemptions_per_s": (0, 5), "queue_time_mean_s": (0, 30), "itl_p95_s": (0, 1), "itl_mean_s": (0, 0.5),
    "prompt_tokens_per_s": (0, 1e5), "kv_cache_max_concurrency": (1, 2000), "prompt_tokens_p99": (1, 65536),
    "max_tokens_p99": (1, 32768), "prompt_tokens_max": (1, 131072), "max_tokens_max": (1, 32768),
    "requests_rejected_per_s": (0, 1), "dram_active": (0, 1), "sm_active": (0, 1), "temp_margin_c": (-5, 60),
    "gpu_temp_c": (30, 95), "gpu_memory_utilization": (0.1, 0.95), "block_size": (16, 128),
}
FLAGS01 = ("thermal_throttle", "hw_slowdown", "power_capped")


# Shapes that make the default rules fire (random values alone rarely satisfy a conjunction).
TEMPLATES = [
    {},
    dict(requests_running_max=2048, requests_waiting_max=100, queue_time_mean_s=5, kv_cache_usage_max=0.1,
         preemptions_per_s=0, itl_p95_s=0.01, kv_cache_max_concurrency=2000),
    dict(requests_running_max=10, kv_cache_usage_max=0.99, preemptions_per_s=1, requests_waiting_max=50),
    dict(itl_p95_s=0.5, prompt_tokens_per_s=1000, itl_mean_s=0.1),
    dict(sm_active=0.9, dram_active=0.2, requests_running_max=10),
    dict(kv_cache_usage_max=0.95, kv_cache_usage=0.95, requests_rejected_per_s=0, prompt_tokens_p99=1000,
         max_tokens_p99=500, prompt_tokens_max=2000, max_tokens_max=1000),
]


@st.composite
def signal_sets(draw):
    out = {"window_seconds": Signal(300.0), "request_rate": Signal(draw(st.floats(0, 50))),
           "idle_seconds": Signal(draw(st.sampled_from([0.0, 30.0])))}
    template = draw(st.sampled_from(TEMPLATES))
    for name, (lo, hi) in NUMERIC.items():
        if name in template:
            scale = draw(st.floats(0.5, 1.0)) if template[name] > 1 else 1.0
            value = min(hi, max(lo, template[name] * scale))
        else:
            value = draw(st.none() | st.floats(lo, hi, allow_nan=False))
        out[name] = missing("absent") if value is None else Signal(value)
    for name in FLAGS01:
        out[name] = Signal(float(draw(st.sampled_from([0, 0, 1]))))
    return out


@st.composite
def arg_lists(draw):
    argv = []
    seqs = draw(st.integers(1, 2048))
    argv += ["--max-num-seqs", str(seqs)]
    if draw(st.booleans()):
        argv += ["--max-num-batched-tokens", str(draw(st.integers(seqs, 65536)))]
    argv += ["--max-model-len", str(draw(st.sampled_from([2048, 4096, 8192, 32768, 131072])))]
    if draw(st.booleans()):
        argv += ["--block-size", str(draw(st.sampled_from([16, 32, 64, 128])))]
    argv += draw(st.sampled_from([[], ["--enable-chunked-prefill"], ["--no-enable-chunked-prefill"]]))
    if draw(st.booleans()):
        argv += ["--gpu-memory-utilization", str(draw(st.sampled_from([0.5, 0.9, 0.94, 0.95])))]
    return knobs.EngineArgs.parse(argv)


@st.composite
def histories(draw, now=100_000.0):
    restarts = tuple(sorted(now - draw(st.floats(1, 86_000)) for _ in range(draw(st.integers(0, 10)))))
    changes = {}
    for knob in draw(st.lists(st.sampled_from(sorted(knobs.KNOBS)), max_size=3, unique=True)):
        changes[knob] = history_mod.FlagChange(now - draw(st.floats(1, 10_000)), draw(st.sampled_from([-1, 1])),
                                               "some-rule", "1", "2")
    streaks = {r.id: draw(st.integers(0, 12)) for r in RULES}
    return History(cycle=draw(st.integers(0, 1000)), streaks=streaks, changes=changes, restarts=restarts)


SETTINGS = st.builds(
    planner.DecisionSettings,
    thermal=st.builds(guards.ThermalSettings, step_down=st.booleans()),
    safety=st.builds(guards.SafetySettings, cooldown_seconds=st.sampled_from([0.0, 900.0]),
                     hysteresis_seconds=st.sampled_from([0.0, 3600.0]), max_restarts_per_hour=st.integers(0, 3),
                     max_restarts_per_day=st.integers(0, 10)),
    engine=st.builds(planner.EngineFacts, platform=st.sampled_from([None, "cuda", "cpu", "cuda-flashinfer"])),
)


def _ref(ref, sigs, ctx_args, defaults):
    if ref.signal is not None:
        s = sigs.get(ref.signal)
        return None if s is None or s.value is None else s.value * ref.times + ref.plus
    eff = knobs.effective(ref.flag, ctx_args, defaults=defaults)
    return None if eff.value is None else float(eff.value) * ref.times + ref.plus


def check_invariants(p, sigs, args, history, s, now):
    defaults = planner.known_defaults(sigs, s, "vllm")
    # one change per knob; experimental changes alone
    assert len({c.knob for c in p.changes}) == len(p.changes)
    if any(c.experimental for c in p.changes):
        assert len(p.changes) == 1
    # the command line vLLM would accept
    if p.changes:
        assert knobs.validate(p.args_after, "vllm", platform=s.engine.platform, defaults=defaults) == []
        assert p.restart_needed
        # the restart budget held before this plan
        assert history.restarts_within(3600, now=now) < s.safety.max_restarts_per_hour
        assert history.restarts_within(86400, now=now) < s.safety.max_restarts_per_day
    else:
        assert p.args_after == p.args_before
    floor = model_len.max_model_len_floor(sigs, s.safety)
    for c in p.changes:
        # the move is in its direction and different
        assert c.to_value != c.from_value
        # thermal: no load added while hot
        if guards.hot(sigs, s.thermal) is not None:
            assert not c.adds_load
        # max-model-len floor: a safety invariant whatever the rule said
        if c.knob == "max_model_len" and float(c.to_value) < float(c.from_value):
            assert floor.tokens is not None and c.to_value >= floor.tokens
        if c.rule == planner.THERMAL_RULE:
            assert s.thermal.step_down and c.to_value >= s.thermal.step_down_min
            continue
        then = BY_ID[c.rule].then
        value = float(c.to_value)
        lo = [then.min] if then.min is not None else []
        hi = [then.max] if then.max is not None else []
        lo += [v for r in then.min_from if (v := _ref(r, sigs, args, defaults)) is not None]
        hi += [v for r in then.max_from if (v := _ref(r, sigs, args, defaults)) is not None]
        if lo and c.knob != "max_model_len":
            assert value >= math.ceil(max(lo) - 1e-9) - 1e-9
        if hi:
            assert value <= max(hi) + 1e-9
        if then.op == "step" and c.knob == "block_size":
            assert knobs.block_size_ok(int(value), s.engine.platform)
        # cooldown and hysteresis were respected
        last = history.changes.get(c.knob)
        if last is not None:
            assert now - last.at >= max(s.safety.cooldown_seconds, BY_ID[c.rule].cooldown.total_seconds())
            if last.direction != c.direction:
                assert now - last.at >= s.safety.hysteresis_seconds


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sigs=signal_sets(), args=arg_lists(), history=histories(), s=SETTINGS)
def test_one_plan_respects_every_invariant(sigs, args, history, s):
    now = 100_000.0
    p = planner.plan("t", sigs, args, history, s, rules=RULES, now=now)
    check_invariants(p, sigs, args, history, s, now)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cycles=st.lists(signal_sets(), min_size=5, max_size=40), args=arg_lists(), s=SETTINGS,
       step=st.sampled_from([30.0, 300.0, 1200.0]))
def test_a_timeline_never_exceeds_the_restart_budget(cycles, args, s, step):
    history = History()
    now = 0.0
    restarts: list[float] = []
    for sigs in cycles:
        now += step
        p = planner.plan("t", sigs, args, history, s, rules=RULES, now=now)
        check_invariants(p, sigs, args, history, s, now)
        history = p.history
        if p.changes:
            restarts.append(now)
            history = history_mod.applied(history, p.changes, now=now)
            args = p.args_after
    for t in restarts:
        assert sum(1 for u in restarts if t - 3600 < u <= t) <= s.safety.max_restarts_per_hour
        assert sum(1 for u in restarts if t - 86400 < u <= t) <= s.safety.max_restarts_per_day
