"""The post-rollout verdict (tuner.planning.verification): pure values in, a verdict with reasons out."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuner.planning import verification
from tuner.planning.history import Change
from tuner.rules.schema import Verify


def check(expect: str, *, experimental: bool = False, **kw: float) -> verification.Check:
    return verification.Check("r", Verify(signal="itl_p99_s", expect=expect, **kw), experimental=experimental)


@pytest.mark.parametrize(("expect", "kw", "before", "after", "ok"), [
    ("decrease", {"min_change": 0.2}, 1.0, 0.7, True),
    ("decrease", {"min_change": 0.2}, 1.0, 0.85, False),  # moved, but less than asked
    ("decrease", {"min_change": 0.0}, 1.0, 1.0, False),  # no movement is not a decrease
    ("decrease", {}, 0.0, 0.0, False),  # nothing to decrease from
    ("increase", {"min_change": 0.1}, 2.0, 2.3, True),
    ("increase", {"min_change": 0.1}, 2.0, 2.1, False),
    ("increase", {}, 0.0, 0.5, True),  # from zero: any rise is an increase
    ("no-increase", {"tolerance": 0.1}, 1.0, 1.1, True),
    ("no-increase", {"tolerance": 0.1}, 1.0, 1.2, False),
    ("no-increase", {"tolerance": 0.1}, 0.0, 0.0, True),
    ("no-increase", {"tolerance": 10}, 0.0, 0.01, False),  # a rise from zero is unbounded
    ("no-increase", {}, 0.5, 0.1, True),  # better is fine
    ("no-decrease", {"tolerance": 0.05}, 100.0, 96.0, True),
    ("no-decrease", {"tolerance": 0.05}, 100.0, 90.0, False),
])
def test_each_expectation(expect, kw, before, after, ok):
    good, text = verification.judge_check(check(expect, **kw), before, after)
    assert good is ok
    assert text.startswith("itl_p99_s (r) ") and ("ok" if ok else "failed") in text


def test_a_missing_value_fails_an_experiment_and_passes_an_established_rule_saying_so():
    ok, text = verification.judge_check(check("decrease", experimental=True), 1.0, None, "no request finished")
    assert not ok and "no value in the verification window (no request finished)" in text
    assert "only if shown to help" in text
    ok, text = verification.judge_check(check("no-increase"), None, 1.0)
    assert ok and "no value before the change" in text and "not judged" in text


def test_errors_fail_any_change_and_every_reason_is_listed_failures_first():
    checks = [check("no-increase", tolerance=0.1),
              verification.Check("s", Verify(signal="queue_time_mean_s", expect="decrease"))]
    v = verification.judge(checks, {"itl_p99_s": 0.1, "queue_time_mean_s": 4.0},
                           {"itl_p99_s": 0.1, "queue_time_mean_s": 1.0}, errors=0)
    assert v.ok
    assert v.reason == ("itl_p99_s (r) 0.1 → 0.1 (+0%): ok, itl_p99_s must not rise by > 10%; "
                        "queue_time_mean_s (s) 4 → 1 (-75%): ok, queue_time_mean_s must decrease by ≥ 5%; "
                        "no request errored, aborted or was rejected")
    v = verification.judge(checks, {"itl_p99_s": 0.1, "queue_time_mean_s": 4.0},
                           {"itl_p99_s": 0.5, "queue_time_mean_s": 1.0}, errors=3)
    assert not v.ok
    assert v.reason.startswith("3 requests errored, aborted or were rejected in the verification window; "
                               "itl_p99_s (r) 0.1 → 0.5 (+400%): failed")
    assert verification.judge([], {}, {}, errors=None).ok  # nothing to hold it to


def test_checks_come_from_the_plans_changes_and_survive_the_journal():
    v = Verify(signal="preemptions_per_s", expect="decrease", min_change=0.2)
    c = Change(flag="--max-num-seqs", knob="max_num_seqs", from_value=128, to_value=10, rule="kv-cap",
               reason="why", direction=-1, experimental=True, verify=(v,))
    (got,) = verification.checks_of([c, Change(flag="--x", knob="x", from_value=1, to_value=2, rule="plain",
                                                reason="", direction=1)])
    assert got == verification.Check("kv-cap", v, experimental=True)
    assert verification.Check.from_dict(got.as_dict()) == got


@given(before=st.floats(0, 1e6), after=st.floats(0, 1e6), tol=st.floats(0, 10))
def test_no_increase_never_passes_a_rise_beyond_the_tolerance(before, after, tol):
    ok, _ = verification.judge_check(check("no-increase", tolerance=tol), before, after)
    rel = (after - before) / before if before else (0.0 if after == 0 else math.inf)
    assert ok == (rel <= tol + 1e-9)
