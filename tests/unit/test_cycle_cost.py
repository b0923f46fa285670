"""``make bench``'s shipped-cadence figure and its split (bench/cycle_cost.py) keep running, and the split
accounts for the whole cycle."""

from __future__ import annotations

import pytest

from bench import cycle_cost
from tuner.planning import planner, stepping
from tuner.signals import engine as engine_signals


def test_the_split_names_every_part_and_adds_up_to_the_cycle():
    texts = cycle_cost.engine_texts()
    split: dict[str, list[float]] = {}
    costs, interval, kept = cycle_cost.cadence_cycle(texts, 2, 2, split)
    assert interval == 2 and len(costs) == 2 and kept > 20  # the thinned long window is full
    assert set(split) == {"parse", "engine signals", "planner", "decision window", "rest of the step"}
    for i, cost in enumerate(costs):
        assert sum(v[i] for v in split.values()) == pytest.approx(cost)
    # the timers are taken off again
    assert stepping.decision_window.__module__ == stepping.__name__
    assert planner.plan.__module__ == planner.__name__
    assert engine_signals.compute.__module__ == engine_signals.__name__
