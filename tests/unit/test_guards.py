"""Guards, including the thermal guard against a real H200 NVML recording and a fake NVML in throttle states."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.fake_nvml import FakeGpu, FakeNvml
from tuner.model import gpus, knobs
from tuner.model.gpus import GpuReading
from tuner.planning import guards, model_len, planner
from tuner.planning import history as history_mod
from tuner.planning.history import Change, History
from tuner.rules import loading
from tuner.signals import Signal, missing
from tuner.signals import gpu as gpu_signals
from tuner.sources.nvml import NvmlSource

H200 = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "h200-matmul.json"
THERMAL = guards.ThermalSettings()
SAFETY = guards.SafetySettings()
IDLE = guards.IdleSettings()


def sig(**values):
    return {k: missing("absent") if v is None else Signal(float(v)) for k, v in values.items()}


def nvml_signals(fake):
    return gpu_signals.compute(NvmlSource(nvml=fake, clock=lambda: 1000.0).read())


# --- thermal ---------------------------------------------------------------------------------------------

def test_real_h200_power_capped_at_full_load_is_not_thermal():
    recording = json.loads(H200.read_text())
    fake = FakeNvml.from_recording(recording)
    loaded = 0
    for i, sample in enumerate(recording["samples"]):
        fake.load_sample(i)
        signals = nvml_signals(fake)
        assert guards.hot(signals, THERMAL) is None, (i, signals)
        v = guards.thermal(signals, THERMAL, adds_load=True)
        assert v.allowed, v
        if sample["phase"] == "load" and signals["power_capped"].value == 1:
            loaded += 1
            assert v.reason == "power-capped, which is not thermal"
            assert signals["temp_margin_c"].value >= 15  # 69-72 °C against a 89 °C slowdown
    assert loaded > 40  # the recording really is at its power cap under load
    assert not fake.replay_misses


def test_real_h200_readings_from_the_recording_json_agree():
    sample = json.loads(H200.read_text())["samples"][40]
    readings = [GpuReading(**r) for r in sample["readings"]]
    signals = gpu_signals.compute(readings)
    assert signals["power_capped"].value == 1 and signals["thermal_throttle"].value == 0
    assert guards.thermal(signals, THERMAL, adds_load=True).allowed


@pytest.mark.parametrize("bits", [gpus.SW_THERMAL_SLOWDOWN, gpus.HW_THERMAL_SLOWDOWN,
                                  gpus.SW_THERMAL_SLOWDOWN | gpus.SW_POWER_CAP])
def test_fake_nvml_thermal_throttle_freezes_load_adding_changes(bits):
    fake = FakeNvml([FakeGpu(temp_c=86, clocks_event_reasons=bits, power_mw=700_000)])
    signals = nvml_signals(fake)
    v = guards.thermal(signals, THERMAL, adds_load=True)
    assert not v.allowed and v.guard == "thermal"
    assert "thermal throttling" in v.reason and "GPU 86 °C, 3 °C below its slowdown temperature" in v.reason
    assert v.reason.startswith("frozen: ") and v.reason.endswith("this change adds load")
    ok = guards.thermal(signals, THERMAL, adds_load=False)
    assert ok.allowed and "adds no load" in ok.reason


def test_fake_nvml_power_cap_alone_is_not_thermal():
    fake = FakeNvml([FakeGpu(temp_c=65, clocks_event_reasons=gpus.SW_POWER_CAP, power_mw=699_000)])
    assert guards.thermal(nvml_signals(fake), THERMAL, adds_load=True).allowed


def test_margin_absolute_limit_and_hw_slowdown():
    assert "2 °C below" in guards.hot(sig(temp_margin_c=2, gpu_temp_c=87), THERMAL)
    assert guards.hot(sig(temp_margin_c=6, gpu_temp_c=83), THERMAL) is None
    seed = guards.ThermalSettings(max_temp_c=82)
    assert "≥ max_temp_c 82" in guards.hot(sig(temp_margin_c=6, gpu_temp_c=83), seed)
    assert "hardware slowdown" in guards.hot(sig(hw_slowdown=1), THERMAL)
    assert guards.hot(sig(hw_slowdown=1), guards.ThermalSettings(freeze_on_hw_slowdown=False)) is None
    # no GPU telemetry at all: nothing to freeze on
    assert guards.thermal(sig(temp_margin_c=None, thermal_throttle=None), THERMAL, adds_load=True).allowed


# --- window and idle -------------------------------------------------------------------------------------

def test_window_needs_rates():
    v = guards.window({"window_seconds": missing("too few snapshots: 1 spanning 0s")})
    assert not v.allowed and "too few snapshots" in v.reason
    v = guards.window({"window_seconds": Signal(30), "request_rate": missing("engine restarted inside the window")})
    assert not v.allowed and "restarted" in v.reason
    assert guards.window(sig(window_seconds=30, request_rate=1)).allowed


def test_idle_needs_enough_requests():
    v = guards.idle(sig(window_seconds=60, request_rate=0.1), IDLE)
    assert not v.allowed and "6 requests finished in the 1m window (need ≥ 10)" in v.reason
    assert guards.idle(sig(window_seconds=60, request_rate=1), IDLE).allowed
    assert not guards.idle(sig(window_seconds=60), IDLE).allowed
    assert guards.requests_in_window(sig(window_seconds=10, request_rate=2)) == 20


def test_idle_since_carries_across_windows():
    h = History()
    assert guards.idle_since(sig(idle_seconds=0), h, now=100) is None
    assert guards.idle_since(sig(idle_seconds=30), h, now=100) == 70
    lower_bound = {"idle_seconds": Signal(300, "no activity in the whole window: at least this long")}
    assert guards.idle_since(lower_bound, History(idle_since=50), now=1000) == 50
    assert guards.idle_since(lower_bound, History(idle_since=900), now=1000) == 700
    assert guards.idle_since({}, History(idle_since=5), now=10) == 5


def test_sleep_mode_is_off_by_default_and_sleeps_after_idle_then_wakes_on_demand():
    awake = sig(sleep_level=0, requests_waiting=0, requests_running=0)
    assert guards.sleep_or_wake(awake, IDLE, now=10_000, since=0) is None  # off by default
    on = guards.IdleSettings(sleep_after_seconds=900, sleep_level=1)
    assert guards.sleep_or_wake(awake, on, now=1000, since=300) is None  # idle 700 s < 900 s
    nap = guards.sleep_or_wake(awake, on, now=1300, since=300)
    assert nap is not None and (nap.kind, nap.level, nap.label()) == ("sleep", 1, "sleep (level 1)")
    assert "idle for 16m40s (sleep after 15m)" in nap.reason
    asleep = sig(sleep_level=1, requests_waiting=0, requests_running=0)
    assert guards.sleep_or_wake(asleep, on, now=5000, since=300) is None  # asleep and quiet: stay asleep
    wake = guards.sleep_or_wake(sig(sleep_level=1, requests_waiting=3, requests_running=0), on, now=5000, since=None)
    assert wake is not None and wake.kind == "wake" and "3 requests on a sleeping engine" in wake.reason
    # keep-warm requests are not sent to an engine sleep mode put to sleep (they would wait for a wake)
    assert guards.keep_warm(asleep, History(), on, now=10_000, since=0) is None
    assert guards.keep_warm(asleep, History(), IDLE, now=10_000, since=0) is not None  # sleep mode off
    # an engine that does not report vllm:engine_sleep_state is never put to sleep
    assert guards.sleep_or_wake(sig(sleep_level=None), on, now=10_000, since=0) is None


def test_keep_warm_after_long_idle_and_not_again_too_soon():
    a = guards.keep_warm({}, History(), IDLE, now=1000, since=300)
    assert a.kind == "keep-warm" and a.requests == 10 and a.max_tokens == 1 and "idle for 11m40s" in a.reason
    assert guards.keep_warm({}, History(), IDLE, now=1000, since=500) is None
    assert guards.keep_warm({}, History(last_keep_warm=900), IDLE, now=1000, since=0) is None
    assert guards.keep_warm({}, History(), IDLE, now=1000, since=None) is None
    never = guards.IdleSettings(keep_warm_after_seconds=None)
    assert guards.keep_warm({}, History(), never, now=1000, since=0) is None


def test_warm_up():
    a = guards.warm_up(IDLE, reason="r")
    assert a.after_restart and a.as_dict()["kind"] == "warm-up"
    assert guards.warm_up(guards.IdleSettings(warm_up_after_restart=False), reason="r") is None


# --- safety ----------------------------------------------------------------------------------------------

def change(knob="max_num_seqs", direction=1, rule="queue-slot-bound"):
    return Change(flag="--max-num-seqs", knob=knob, from_value=4, to_value=8, rule=rule, reason="", direction=direction)


def test_cooldown_says_how_long_is_left():
    h = history_mod.applied(History(), [change()], now=1000)
    v = guards.cooldown("max_num_seqs", "--max-num-seqs", h, rule_cooldown_seconds=0, settings=SAFETY, now=1000 + 648)
    assert not v.allowed and v.reason == "cooldown 4m12s left (--max-num-seqs changed 10m48s ago by queue-slot-bound)"
    longer = guards.cooldown("max_num_seqs", "--max-num-seqs", h, rule_cooldown_seconds=3600, settings=SAFETY,
                             now=1000 + 1000)
    assert not longer.allowed and "43m20s left" in longer.reason
    assert guards.cooldown("max_num_seqs", "f", h, rule_cooldown_seconds=0, settings=SAFETY, now=1900).allowed
    assert guards.cooldown("block_size", "f", h, rule_cooldown_seconds=0, settings=SAFETY, now=1001).allowed


def test_hysteresis_blocks_only_reversals():
    h = history_mod.applied(History(), [change(direction=1)], now=0)
    assert guards.hysteresis("max_num_seqs", "--max-num-seqs", 1, h, settings=SAFETY, now=60).allowed
    v = guards.hysteresis("max_num_seqs", "--max-num-seqs", -1, h, settings=SAFETY, now=60)
    assert not v.allowed and "was raised 4→8 by queue-slot-bound 1m ago; no reversal for 59m" in v.reason
    assert guards.hysteresis("max_num_seqs", "f", -1, h, settings=SAFETY, now=3601).allowed
    down = history_mod.applied(History(), [change(direction=-1)], now=0)
    assert "was lowered" in guards.hysteresis("max_num_seqs", "f", 1, down, settings=SAFETY, now=1).reason


def test_a_reversal_halfway_back_at_most_passes_the_hysteresis_and_no_further():
    h = history_mod.applied(History(), [change(direction=1)], now=0)  # 4 → 8: the bracket of a lowering is [8, 6]
    kw = {"settings": SAFETY, "now": 60}
    assert [guards.within_bracket("max_num_seqs", -1, h, v, live=False, **kw) for v in (9, 8, 7, 6, 5, None)] == \
        [False, False, True, True, False, False]  # 8 is where it stands: not a move inside the bracket
    assert not guards.within_bracket("max_num_seqs", 1, h, 9, **kw)  # the same direction: no bracket
    assert guards.hysteresis("max_num_seqs", "f", -1, h, settings=SAFETY, now=60, to_value=6).allowed
    assert not guards.hysteresis("max_num_seqs", "f", -1, h, settings=SAFETY, now=60, to_value=5).allowed


def test_restart_budget_per_hour_and_day():
    h = History(restarts=(0.0, 1000.0))
    v = guards.restart_budget(h, SAFETY, now=1800)
    assert not v.allowed and "2 restart(s) in the last hour (max 2); next in 30m" in v.reason
    assert guards.restart_budget(h, SAFETY, now=3601).allowed
    day = History(restarts=tuple(float(t) for t in range(0, 8 * 4000, 4000)))
    v = guards.restart_budget(day, SAFETY, now=8 * 4000)
    assert not v.allowed and "8 restart(s) in the last 24h" in v.reason
    assert "0/2 this hour" in guards.restart_budget(History(), SAFETY, now=0).reason


@pytest.mark.parametrize("setting", ["max_restarts_per_hour", "max_restarts_per_day"])
def test_a_budget_of_0_says_no_restart_is_allowed_and_never_lifts(setting: str) -> None:
    """A budget of 0 is a hold that never lifts: its reason must not promise a next restart ("next in 1h")."""
    safety = guards.SafetySettings(**{setting: 0})
    for h in (History(), History(restarts=(0.0,))):
        v = guards.restart_budget(h, safety, now=10.0)
        assert not v.allowed and v.until is None
        assert v.reason == f"restart budget: no restart is allowed (safety.{setting} is 0)"


@given(st.lists(st.floats(0, 86_000), max_size=12), st.floats(0, 3_000), st.floats(0.001, 500),
       st.sampled_from([SAFETY, guards.SafetySettings(max_restarts_per_hour=0),
                        guards.SafetySettings(max_restarts_per_day=0)]))
def test_a_budget_hold_names_itself_whatever_its_countdown_reads(restarts: list[float], after: float,
                                                                 later: float, safety: guards.SafetySettings) -> None:
    """A hold of the restart budget is one hold until it lifts: the daemon says it once, keyed on the guard and
    the instant it lifts (``until``), while its reason counts down every second (dispatching.tend). A budget of
    0 never lifts (no restart to age out of the window): no instant, or the key would move with the clock."""
    h = History(restarts=tuple(sorted(restarts)))
    now = max(restarts, default=0.0) + after
    first, second = (guards.restart_budget(h, safety, now=t) for t in (now, now + later))
    if first.allowed:
        assert first.until is None
        return
    assert first.until is None or first.until > now
    if second.allowed or (first.until is not None and first.until <= now + later):
        return
    assert (second.guard, second.until) == (first.guard, first.until)


def test_crash_memory():
    args = knobs.EngineArgs.from_string("--max-num-seqs 8")
    h = history_mod.failed_to_start(History(), args, reason="CUDA out of memory")
    v = guards.crash_memory(knobs.EngineArgs.from_string("--max-num-seqs=8"), h)
    assert not v.allowed and "CUDA out of memory" in v.reason
    assert guards.crash_memory(args.with_value("--max-num-seqs", 16), h).allowed


def test_max_model_len_floor():
    f = model_len.max_model_len_floor(sig(prompt_tokens_p99=1000, max_tokens_p99=500, prompt_tokens_max=2000,
                                       max_tokens_max=500), SAFETY)
    assert f.tokens == 2202 and "prompt_tokens_max 2000 + 1 = 2001" in f.reason  # the largest need wins
    f = model_len.max_model_len_floor(sig(prompt_tokens_p99=1000, max_tokens_p99=1000), SAFETY)
    assert f.tokens == 2200
    f = model_len.max_model_len_floor(sig(max_tokens_max=8192, prompt_tokens_max=100), SAFETY)
    assert f.tokens == 9012  # clients asking max_tokens=8192 get a 400 below that
    unknown = model_len.max_model_len_floor(sig(prompt_tokens_p99=1000), SAFETY)
    assert unknown.tokens is None and "max_tokens_p99" in unknown.reason
    assert not model_len.floor_check(4096, unknown).allowed
    assert not model_len.floor_check(2000, f).allowed
    assert model_len.floor_check(9012, f).allowed
    above = {"prompt_tokens_max": Signal(2000, "above the highest finite bucket: ≥ 2000", None, (2000, float("inf"))),
             "max_tokens_max": Signal(100)}
    f = model_len.max_model_len_floor(above, SAFETY)
    assert f.tokens is None and "≥ 2000" in f.reason and "custom-histogram-buckets" in f.reason


def test_engine_constraints():
    bad = knobs.EngineArgs.from_string("--max-num-seqs 512 --max-num-batched-tokens 256")
    v = guards.engine_constraints(bad, "vllm", platform=None, defaults={})
    assert not v.allowed and v.guard == "engine"
    assert guards.engine_constraints(knobs.EngineArgs(), "vllm", platform=None, defaults={}).allowed


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59.4, "1m"), (252, "4m12s"), (7200, "2h"),
                                               (90061, "1d1h"), (-5, "0s")])
def test_duration(seconds, text):
    assert guards.duration(seconds) == text


# --- a restart's evidence: sustained and payback ----------------------------------------------------------

@given(since=st.floats(0, 1000), held=st.floats(0, 200), window=st.floats(0.1, 300))
def test_sustained_counts_from_where_the_first_true_window_began(since, held, window):
    """`streak_since` is where the evidence began (the start of the window the rule was first true on);
    the current window's span is not added again: a window that grew from 4 s after a change point to 20 s
    must not count 16 s of evidence from before the change."""
    h = History(streak_since={"r": since})
    now = since + held
    held = now - since  # as the guard computes it
    v = guards.sustained("r", sig(window_seconds=window), h, SAFETY, now=now)
    assert v.allowed == (held >= SAFETY.restart_evidence_seconds), (v, held)
    if not v.allowed:
        assert v.reason == (f"after {guards.duration(SAFETY.restart_evidence_seconds - held)} more of sustained evidence (a restart needs 1m; "
                            f"true for {guards.duration(held)} so far)")


def test_sustained_on_a_first_window_is_its_span_and_the_guard_can_be_off():
    fresh = History()
    assert guards.sustained("r", sig(window_seconds=90), fresh, SAFETY, now=0).allowed  # one long window
    v = guards.sustained("r", sig(window_seconds=20), fresh, SAFETY, now=0)
    assert not v.allowed and "true for 20s so far" in v.reason
    off = guards.SafetySettings(restart_evidence_seconds=0)
    assert guards.sustained("r", sig(window_seconds=None), fresh, off, now=0).allowed


def test_the_planner_books_a_streaks_evidence_from_its_first_windows_start():
    """A 4 s window first true at t=100 (just after a change point), then 20 s windows: the evidence begins
    at 96 and is 96 + 60 = 156 ready, not at 100 + 60 − 20 = 140 (the current window's span added)."""
    rules = loading.parse({"rules": [{"id": "r", "when": {"all": [{"signal": "request_rate", "op": ">", "value": 0}]},
                                      "then": {"flag": "--block-size", "op": "set", "value": 32}}]}).rules
    busy = {"request_rate": Signal(5.0), "requests_rejected_per_s": Signal(0.0)}
    h = History()
    for now, window in ((100, 4), (110, 20), (140, 20), (155, 20), (156, 20)):
        p = planner.plan("e", {**busy, "window_seconds": Signal(float(window))}, knobs.EngineArgs.from_string(
            "--block-size 16"), h, planner.DecisionSettings(idle=guards.IdleSettings(min_requests_per_window=0)),
            rules=rules, now=float(now))
        assert h.streak_since.get("r", 96.0) == 96.0 and p.history.streak_since["r"] == 96.0
        if now < 156:
            assert not p.changes and [x.guard for x in p.held] == ["sustained"], (now, p.held)
        else:
            assert [c.to_value for c in p.changes] == [32]
        h = p.history


def payback(*, arrivals, served, running, waiting, to=80.0, knob="max_num_seqs"):
    signals = sig(arrival_rate_per_s=arrivals, request_rate=served, requests_running=running,
                  requests_waiting=waiting)
    return guards.payback(signals, SAFETY, knob=knob, from_value=8, to_value=to, alpha=0.3)


def test_payback_weighs_the_completions_gained_against_the_restart():
    # the H200 bad start: a closed loop (arrivals = completions 6.38/s), 64 inside: 8 → 64 busy slots serve
    # 6.38 × 8^0.7 = 27.4/s; 21 more per second over 600 s beats 6.38/s × 120 s lost
    v = payback(arrivals=6.38, served=6.38, running=8, waiting=56)
    assert v.allowed and "6.38 → 27.4 completions/s" in v.reason
    # nobody waiting: more slots serve no one more
    v = payback(arrivals=6.38, served=6.38, running=8, waiting=0)
    assert not v.allowed and v.reason.startswith("a restart does not pay back: 6.38 → 6.38 completions/s")
    # an open loop gains at most its unmet arrivals: 15 % more for 600 s < 120 s of everything
    assert not payback(arrivals=1.15, served=1.0, running=8, waiting=50).allowed
    assert payback(arrivals=2.0, served=1.0, running=8, waiting=50).allowed  # 600 more > 120 lost


@given(served=st.floats(0.01, 100), share=st.floats(1.0, 10), waiting=st.floats(0, 500), to=st.floats(9, 1024))
def test_payback_is_a_gain_over_the_horizon_against_the_restart_cost(served, share, waiting, to):
    v = payback(arrivals=served * share, served=served, running=8, waiting=waiting, to=to)
    slots = min(to, max(8.0, 8 + waiting))
    predicted = served * (slots / 8) ** 0.7
    if share > 1.1:
        predicted = min(predicted, served * share)
    gain, cost = (predicted - served) * SAFETY.payback_horizon_seconds, served * SAFETY.restart_cost_seconds
    if abs(gain - cost) > 1e-6 * cost:
        assert v.allowed == (gain > cost), (v, gain, cost)


def test_payback_tests_only_more_slots_with_known_rates():
    assert payback(arrivals=1, served=1, running=8, waiting=0, knob="block_size").allowed
    assert payback(arrivals=1, served=1, running=8, waiting=0, to=4).allowed  # a lowering
    assert "not tested" in payback(arrivals=None, served=1, running=8, waiting=0).reason
    assert "not tested" in payback(arrivals=1, served=0, running=8, waiting=0).reason


# --- history ---------------------------------------------------------------------------------------------

def test_history_updates_and_json_roundtrip():
    h = History(streaks={"a": 2})
    h = history_mod.applied(h, [change()], now=100)
    assert h.streaks == {} and h.restarts == (100,) and h.changes["max_num_seqs"].to_value == "8"
    assert history_mod.applied(h, [], now=200) is h
    h = history_mod.restarted(h, now=200)
    h = history_mod.rejected(h, knobs.EngineArgs.from_string("--block-size 64"), reason="no effect", now=200,
                             for_seconds=3600)
    assert h.restarts_within(3600, now=250) == 2
    h = history_mod.applied(h, [change()], now=200 + 86400)
    assert h.restarts == (200 + 86400,)  # older than a day: pruned
    again = history_mod.from_dict(json.loads(json.dumps(history_mod.to_dict(h))))
    assert again == h
    assert history_mod.from_dict({}) == History()


def test_a_rejected_command_line_is_refused_until_its_time_a_crashed_one_for_good():
    bad, meh = knobs.EngineArgs.from_string("--max-num-seqs 0"), knobs.EngineArgs.from_string("--block-size 64")
    h = history_mod.failed_to_start(History(), bad, reason="exited with status 1")
    h = history_mod.rejected(h, meh, reason="itl_mean_s did not decrease", now=1000, for_seconds=600)
    assert guards.crash_memory(bad, h, now=10**9).allowed is False
    held = guards.crash_memory(meh, h, now=1300)
    assert not held.allowed and "itl_mean_s did not decrease" in held.reason and "300s" in held.reason
    assert guards.crash_memory(meh, h, now=1600).allowed
    # a later rejection forgets the expired ones
    h = history_mod.rejected(h, bad, reason="x", now=5000, for_seconds=10)
    assert list(h.rejected_args) == [bad.fingerprint()]


def test_change_as_dict():
    c = Change(flag="--block-size", knob="block_size", from_value=16, to_value=32, rule="r", reason="why",
               direction=1, experimental=True)
    assert c.as_dict() == {"flag": "--block-size", "from": "16", "to": "32", "rule": "r", "reason": "why",
                           "experimental": True}
