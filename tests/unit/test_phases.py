"""Issue 30's search (``bench.family.phases``): the switching oracle — the cap and the step budget set at each
phase's start to the pair that served that phase best — against the best single static pair, on the twin.
What it found (docs/evaluation.md, "Where per-phase flags have room"): no room below capacity, where a cap above
the demand serves every phase; room in the first seconds of a burst past capacity only."""

from __future__ import annotations

import pytest

from bench.family import phases, traces

GRID = {"caps": (64, 1024), "budgets": (2048, 8192)}


def test_a_phase_change_below_capacity_leaves_no_room() -> None:
    """Long requests, then chats, then long again, each under the pool's capacity: one pair serves them all."""
    trace = phases.draw("mixed", 1, 21)[0]
    assert len(trace.phases) == 3 and trace.phases[0].mix[0].prompt > 1024 > trace.phases[1].mix[0].prompt
    found = phases.search(trace, **GRID)
    assert found["room"] == pytest.approx(1.0, abs=0.01), found


def test_the_room_is_in_the_first_seconds_of_an_overload() -> None:
    """live-041 of the live family (seed 21): 106 s of 448/17-token requests at 1.1 × the pool's capacity, then a
    phase of long ones. A cap of 64 and a budget of 2,048 through the burst keep its first requests inside the
    ITL SLO where vLLM's defaults serve none of them; after it, the defaults. 1.57 × the best single pair — of a
    goodput that is a few per cent of the arrivals either way."""
    trace = next(t for t in phases.draw("live", 20, 21) if t.name == "live-041")
    found = phases.search(trace, **GRID)
    assert found["switching"][0] == [64, 2048] and found["best_static"] == [1024, 8192]
    assert found["room"] > 1.3 and found["per_phase_static"][0] == 0 < found["per_phase_switching"][0]
    assert found["switching_goodput"] < 0.1 * len(trace.requests) / trace.duration


def test_a_plan_sets_both_knobs_on_every_replica_at_its_time() -> None:
    """The oracle's arm is run, not computed: a plan that cuts the step budget to 16 tokens at 20 s takes the
    second phase's 2,000-token prompts past the TTFT SLO (125 steps each) and leaves the first phase's alone."""
    ph = (traces.Phase(20, rate0=5, rate1=5, mix=(traces.Mix(1.0, 2000, 50),)),) * 2
    trace = traces.build("two", 3, ph)
    same = phases.run(trace, [(0.0, (8, 8192))])
    cut = phases.run(trace, [(0.0, (8, 8192)), (20.0, (8, 16))])
    assert same.per_phase[1] > 0 and cut.per_phase == [same.per_phase[0], 0]
