"""``rules.models.concurrency``: Little's law with the batch exponent, a stable queue's requests inside, a
growing queue's backlog over ``backlog_seconds``, the TPOT SLO frontier (cap, overloaded, ``down``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuner.rules import models
from tuner.signals import Signal, missing

M = models.ModelSettings()
SLO = models.SloSettings()  # tpot_p99_s 0.1


def sig(**values):
    return {k: missing("absent") if v is None else Signal(float(v)) for k, v in values.items()}


def slots_for(rate, s0, n0, alpha=0.3):
    return (rate * s0 * n0 ** -alpha) ** (1 / (1 - alpha))


# the H200 open loop of test_planner: 32/s arriving, 8 running, a slot held 1.4 s; the queue grows 26/s
OPEN = dict(arrival_rate_per_s=32, slot_seconds_mean=1.4, requests_running_mean=8, requests_waiting_mean=60,
            in_system_growth_per_s=26, requests_running=8, requests_waiting=115, requests_running_max=8)
# the H200 closed loop (h200-queue-bound 005-007): 64 clients inside, arrivals throttled to completions
CLOSED = dict(arrival_rate_per_s=6.38, slot_seconds_mean=1.36, requests_running_mean=8, requests_waiting_mean=56,
              in_system_growth_per_s=0, requests_running=8, requests_waiting=56, requests_running_max=8)


def test_a_stable_queue_sizes_for_the_requests_inside():
    e = models.concurrency(sig(**CLOSED), M)
    assert e.value == 80 == math.ceil(64 / 0.8)
    assert "→ 8.98 in service (Little's law)" in e.text
    assert "the queue is stable, 64 requests inside (running + waiting) are the demand → 80" in e.text


def test_a_growing_queue_sizes_for_its_arrivals_and_a_backlog_served_over_the_horizon():
    e = models.concurrency(sig(**OPEN), M)
    little = slots_for(32, 1.4, 8)
    assert e.value == math.ceil(little / 0.8) == 118  # a backlog of 123 − 93.7 over 30 s needs only 98
    assert "the queue grows" not in e.text and "the queue is stable" not in e.text
    big = sig(**(OPEN | dict(requests_waiting=2000)))  # 2008 inside: the backlog's 30 s dominate
    e = models.concurrency(big, M)
    absorb = slots_for(32 + (2008 - little) / 30, 1.4, 8)
    assert e.value == math.ceil(absorb) and e.value > 118
    assert f"the queue grows: a backlog of {2008 - little:.3g} served within 30 s needs {e.value:g}" in e.text
    # never the whole backlog at once (the H200's 8 → 447 step the horizon was set against)
    assert e.value < 2008 / 0.8
    slower = models.concurrency(big, models.ModelSettings(backlog_seconds=120))
    assert slower.value < e.value


def test_the_tpot_frontier_caps_the_step_or_says_overloaded():
    # measured TPOT p99 0.045 s at a batch of 8 (requests_running_max: the batch the requests ran in): the SLO's
    # 0.1 s holds up to 8 × (0.1 / 0.045)^(1/0.3) = 114.6
    e = models.concurrency(sig(**OPEN, tpot_p99_s=0.045), M, slo=SLO)
    assert e.value == 114 and "capped at the TPOT SLO frontier 115 → 114" in e.text
    # 0.05 s: the frontier 80.6 is below the 93.7 Little's law needs in service — more replicas, not slots
    e = models.concurrency(sig(**OPEN, tpot_p99_s=0.05), M, slo=SLO)
    assert e.value == 80
    assert "overloaded: even the TPOT SLO frontier 80.6 cannot carry the arrivals (the pool needs more replicas)" in e.text
    # far from the SLO: no cap
    assert models.concurrency(sig(**OPEN, tpot_p99_s=0.006), M, slo=SLO).value == 118
    # no SLO, or the TPOT unknown: the frontier is said to be unknown and nothing is capped
    assert models.concurrency(sig(**OPEN, tpot_p99_s=0.05), M).text.endswith("no TPOT frontier (no SLO given)")
    e = models.concurrency(sig(**OPEN, tpot_p99_s=None), M, slo=SLO)
    assert e.value == 118 and "no TPOT frontier (tpot_p99_s unknown (absent))" in e.text


def test_down_lowers_to_the_frontier_at_most_half_the_batch_a_step():
    # 64 running at TPOT p99 0.2 s, twice the SLO: 64 × 0.5^(1/0.3) = 6.35, but one step keeps half the batch
    # (models.MAX_LOWERING: the α law is measured between 8 and 128 slots and extrapolates badly) → 32
    breached = dict(CLOSED, requests_running_mean=64, requests_waiting_mean=0, requests_running=64,
                    requests_waiting=0, arrival_rate_per_s=0.5, tpot_p99_s=0.2, requests_running_max=64)
    e = models.concurrency(sig(**breached), M, slo=SLO, down=True)
    assert e.value == 32 and e.text.endswith("TPOT SLO frontier 6.35; at most half the batch 64 in one step → 32")
    # a breach near the SLO: the frontier itself, 64 × (0.1 / 0.11)^(1/0.3) = 46.2 → 46
    near = models.concurrency(sig(**(breached | dict(tpot_p99_s=0.11))), M, slo=SLO, down=True)
    assert near.value == 46 and near.text.endswith("→ 46")
    # when the arrivals need more slots in service than the frontier allows (overloaded), never below that need
    # (fewer slots build a queue without end: every request would miss its TTFT)...
    e = models.concurrency(sig(**(breached | dict(arrival_rate_per_s=20))), M, slo=SLO, down=True)
    assert e.value == 32 and e.text.endswith("TPOT SLO frontier 6.35 (overloaded); not below the 24 the arrivals "
                                             "need (÷ 0.8 utilisation); at most half the batch 64 in one step → 32")
    # ...and nothing where that leaves today's mean batch within the utilisation headroom: it would clip the
    # batch's peaks only (171 and 64 ≥ 64 running × 0.8)
    for rate, need in ((80, 171), (40, 64)):
        e = models.concurrency(sig(**(breached | dict(arrival_rate_per_s=rate))), M, slo=SLO, down=True)
        assert e.value is None and e.text.endswith(
            f"TPOT SLO frontier 6.35: overloaded, the arrivals need {need} (÷ 0.8 utilisation), 64 running: a "
            "lowering would clip the peaks only"), e.text
    # without a frontier there is nothing to lower to
    assert models.concurrency(sig(**breached), M, down=True).value is None


def test_overloaded_lowering_to_the_median_frontier_is_an_opt_in():
    """``overload_lowering: median``: where the arrivals need more than the frontier and the median request misses
    its TPOT at today's batch, down to the median's frontier (half the batch at most a step) instead of nothing."""
    median = models.ModelSettings(overload_lowering="median")
    base = dict(CLOSED, requests_running_mean=64, requests_waiting_mean=0, requests_running=64, requests_waiting=0,
                arrival_rate_per_s=80, tpot_p99_s=0.2, requests_running_max=64)
    # the median at 0.11 s: its frontier 64 × (0.1 / 0.11)^(1/0.3) = 46.6; the shipped law: nothing (clips peaks)
    s = sig(**(base | dict(tpot_p50_s=0.11)))
    assert models.concurrency(s, M, slo=SLO, down=True).value is None
    e = models.concurrency(s, median, slo=SLO, down=True)
    assert e.value == 46 and e.text.endswith("TPOT SLO frontier 6.35 (overloaded); the median request misses its "
                                             "TPOT at 64 running: its frontier 46.6 → 46"), e.text
    # far past it: half the batch in one step
    e = models.concurrency(sig(**(base | dict(tpot_p50_s=0.3))), median, slo=SLO, down=True)
    assert e.value == 32 and e.text.endswith("at most half the batch 64 in one step → 32")
    # the median inside its SLO (the tail alone misses), or unknown: the need's rule as before
    for p50 in (0.09, None):
        e = models.concurrency(sig(**(base | dict(tpot_p50_s=p50))), median, slo=SLO, down=True)
        assert e.value is None and "clip the peaks only" in e.text
    # not overloaded: the frontier as ever, the setting plays no part
    calm = sig(**(base | dict(arrival_rate_per_s=0.5, tpot_p99_s=0.11, tpot_p50_s=0.3)))
    assert models.concurrency(calm, median, slo=SLO, down=True).value == 46


def test_unknown_inputs_and_no_traffic_size_nothing():
    e = models.concurrency(sig(**(CLOSED | dict(slot_seconds_mean=None))), M)
    assert e.value is None and "slot_seconds_mean unknown (absent)" in e.text
    # no arrivals but 56 waiting at the cap: a standing backlog is sized whatever the arrival rate (issue 25)
    e = models.concurrency(sig(**(CLOSED | dict(arrival_rate_per_s=0))), M)
    assert e.value == 80 and e.text.startswith("no arrivals in the window but 64 requests inside")
    e = models.concurrency(sig(**(CLOSED | dict(arrival_rate_per_s=0, requests_waiting_mean=0))), M)
    assert e.value is None and e.text.startswith("no traffic to size for (arrivals 0/s")


@given(lam=st.floats(0.1, 100), s0=st.floats(0.05, 10), n0=st.floats(1, 256), waiting=st.floats(0, 2000),
       growth=st.floats(0, 50), tpot=st.floats(0.001, 0.5))
def test_up_never_passes_the_frontier_and_down_is_the_frontier(lam, s0, n0, waiting, growth, tpot):
    s = sig(arrival_rate_per_s=lam, slot_seconds_mean=s0, requests_running_mean=n0, requests_waiting_mean=waiting,
            in_system_growth_per_s=growth, requests_running=n0, requests_waiting=waiting, tpot_p99_s=tpot,
            requests_running_max=n0)
    frontier = n0 * (SLO.tpot_p99_s / tpot) ** (1 / 0.3)
    up = models.concurrency(s, M, slo=SLO)
    free = models.concurrency(s, M)
    assert up.value is not None and free.value is not None and up.value >= 1
    assert free.value >= math.ceil(slots_for(lam, s0, n0) / 0.8 - 1e-9)  # Little's law ÷ utilisation at least
    # capped at the frontier, never below today's batch (a raise the frontier forbids is the lowering rule's)
    assert up.value == (free.value if free.value <= frontier
                        else max(1, math.floor(frontier + 1e-9), math.floor(n0)))
    down = models.concurrency(s, M, slo=SLO, down=True)
    # the frontier, at most half the batch in one step; when the arrivals need more (÷ utilisation) than the
    # frontier, never below that need, and nothing where that would leave the mean batch within the headroom
    expected = max(1, math.floor(frontier + 1e-9))
    need = math.ceil(slots_for(lam, s0, n0) / 0.8 - 1e-9)
    if expected < need:
        if max(need, math.floor(n0 * models.MAX_LOWERING)) >= n0 * 0.8:
            assert down.value is None and "clip the peaks only" in down.text
            return
        expected = need
    if expected < n0 * models.MAX_LOWERING:
        expected = max(1, math.floor(n0 * models.MAX_LOWERING))
    assert down.value == pytest.approx(expected)
