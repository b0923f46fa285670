"""``tuner.signals.changes``: the arrivals' change point the decision window restarts at, on piecewise-Poisson
arrival series (generated: exact counts by Hypothesis, Poisson noise from a fixed seed)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tuner.model import dialects, snapshots
from tuner.signals import changes

DT = 2.0  # the default scrape interval
VLLM = dialects.VLLM


def snap(t: float, *, done: float, running: float = 0, waiting: float = 0) -> snapshots.Snapshot:
    text = (f"vllm:num_requests_running{{engine=\"0\"}} {running}\nvllm:num_requests_waiting{{engine=\"0\"}} {waiting}\n"
            f"vllm:request_success_total{{engine=\"0\",finished_reason=\"stop\"}} {done}\n")
    return snapshots.parse(text, t)


def series(counts: list[float], *, t0: float = 1000.0) -> list[snapshots.Snapshot]:
    """Scrapes DT apart whose intervals saw ``counts`` arrivals (all finished within the interval)."""
    out, done = [snap(t0, done=0)], 0.0
    for i, n in enumerate(counts):
        done += n
        out.append(snap(t0 + (i + 1) * DT, done=done))
    return out


def llr_at(counts: list[float], k: int) -> float:
    def ll(n: float, t: float) -> float:
        return n * math.log(n / t) if n > 0 else 0.0
    before, after = sum(counts[:k]), sum(counts[k:])
    return ll(before, k * DT) + ll(after, (len(counts) - k) * DT) - ll(before + after, len(counts) * DT)


def poisson(rng: random.Random, mean: float) -> int:
    """Knuth's method (means here are at most 120: e^-120 is still a normal double)."""
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


# --- arrivals by flow balance -------------------------------------------------------------------------------

def test_arrivals_are_finished_plus_the_growth_inside():
    snaps = [snap(0, done=0), snap(2, done=3, running=4, waiting=10), snap(4, done=5, running=4, waiting=6)]
    # 2 finished while 4 left the queue: the balance is −2 (an abort), taken as no arrivals
    assert changes.arrivals(snaps, VLLM) == [(0, 2, 3 + 14), (2, 2, 0)]


def test_arrivals_are_unreadable_across_a_failed_scrape_or_a_counter_reset():
    good = [snap(0, done=5), snap(2, done=9)]
    assert changes.arrivals([*good, snap(4, done=1)], VLLM) is None  # the engine restarted
    assert changes.arrivals([*good, snapshots.Snapshot.failed(4, "connection refused")], VLLM) is None
    partial = snapshots.parse("vllm:num_requests_running 0\n", 4)  # no success counter: not one engine's data
    assert changes.arrivals([*good, partial], VLLM) is None
    assert changes.latest(good[:1], VLLM) is None


# --- a change is found where it is ------------------------------------------------------------------------

@given(before=st.integers(3, 8), after=st.integers(2, 8), low=st.integers(20, 80), ratio=st.floats(2, 10),
       rise=st.booleans())
def test_a_rise_or_fall_of_two_times_is_found_at_the_scrape_it_began(before, after, low, ratio, rise):
    """Exact piecewise-constant counts: the split is at the first interval of the new rate, and the window
    restarts at that interval's first scrape."""
    high = low * ratio
    counts = [float(low if rise else high)] * before + [float(high if rise else low)] * after
    assume(llr_at(counts, before) >= changes.MIN_LLR)
    snaps = series(counts)
    point = changes.latest(snaps, VLLM, min_after=2)
    assert point is not None
    assert point.at == snaps[before].scraped_at
    assert point.before_per_s == pytest.approx(counts[0] / DT) and point.after_per_s == pytest.approx(counts[-1] / DT)
    assert point.llr == pytest.approx(llr_at(counts, before))


def test_a_noisy_doubling_is_found_at_the_right_scrape():
    """200 windows of 10 intervals, Poisson arrivals 20/s → 40/s (40 → 80 per 2 s) from interval 6 on, from a
    fixed seed (deterministic). Every doubling is found, at the scrape it began at or one off: moving the
    split one interval costs ~12 of log-likelihood on average at these counts, more than a 40-count
    interval's noise undoes in about 1 % of windows per side (4 of the 200 here)."""
    rng = random.Random(20261201)
    off = []
    for _ in range(200):
        counts = [float(poisson(rng, 40)) for _ in range(6)] + [float(poisson(rng, 80)) for _ in range(4)]
        snaps = series(counts)
        point = changes.latest(snaps, VLLM, min_after=2)
        assert point is not None, counts
        off.append(round((point.at - snaps[6].scraped_at) / DT))
        assert 1.5 <= point.after_per_s / point.before_per_s <= 3
    assert set(off) <= {-1, 0, 1} and off.count(0) >= 195, off


def test_a_smaller_move_or_too_few_counts_is_no_change():
    assert changes.latest(series([20.0] * 5 + [26.0] * 5), VLLM) is None  # 1.3×: inside the sizing's headroom
    assert changes.latest(series([1.0] * 5 + [2.0] * 5), VLLM) is None  # 2×, but 15 arrivals: LLR 1.1
    # the new regime must span min_after intervals: a jump in the last interval alone waits
    assert changes.latest(series([0.0] * 9 + [80.0]), VLLM, min_after=2).at == 1000 + 8 * DT
    assert changes.latest(series([0.0] * 9 + [80.0]), VLLM, min_after=1).at == 1000 + 9 * DT


# --- no change in a constant rate -----------------------------------------------------------------------------

def test_a_constant_rate_gives_no_change_point_in_200_windows():
    """Constant-rate Poisson arrivals, 200 windows of 10 intervals at 0.5-50 arrivals/s (fixed seed, so the
    test is deterministic). The bound that makes 0 the expected count: a false alarm needs 2·LLR ≥ 20 at one
    of at most 9 splits, P(χ²₁ ≥ 20) = 7.7e-6 each, so P(any in 200 windows) ≤ 200 × 9 × 7.7e-6 = 1.4 %."""
    bound = 200 * 9 * math.erfc(math.sqrt(changes.MIN_LLR))  # P(χ²₁ ≥ 2x) = erfc(√x)
    assert bound < 0.015
    rng = random.Random(7)
    alarms = []
    for _ in range(200):
        rate = rng.uniform(0.5, 50)
        counts = [float(poisson(rng, rate * DT)) for _ in range(10)]
        point = changes.latest(series(counts), VLLM, min_after=2)
        if point is not None:
            alarms.append((rate, counts, point))
    assert alarms == []
