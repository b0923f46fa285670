"""Class 1 of issue 28: a step of the wall clock, either way, moves nothing inside the loop.

Before: snapshots were stamped with the wall clock. After a step back of an hour, every snapshot taken
before it was "in the future": it never left the window and sorted as the latest, so for an hour every
cycle reported the 40 requests that waited before the step while the engine had 0. A clock that ran fast
and was corrected did the same, and a state file written then held cooldowns an hour ahead.

Generated: a run of cycles against an engine whose queue changes at a generated cycle, with the wall
clock stepped (±1 s to ±2 h, one or several times, before or after the change) while the monotonic
clock runs on — the daemon's wiring: the engine client stamps snapshots with the loop's clock
(``runtime.clocks.LoopClock``) and ``run_cycle`` reads the same clock. The promise, at every cycle: no
snapshot in a window is later than the cycle's time, the window is in order and no longer than its
span, the queue reported is the engine's own of that moment, and each step is logged once. And a state
file written while the clock ran ahead loads with nothing later than now.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuner import config
from tuner.model import snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.model.live import NONE, LiveState
from tuner.planning import history as history_mod
from tuner.runtime import clocks, cycle
from tuner.runtime.state import TunerState

INTERVAL = 10.0
WINDOW = 60.0
T0 = 1_790_000_000.0

BODY = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %(waiting)s
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} %(done)s
"""


class Times:
    """A wall clock that steps when told, over a monotonic clock that never does."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.offset = T0 - self.mono

    def wall(self) -> float:
        return self.mono + self.offset

    def monotonic(self) -> float:
        return self.mono


class Engine:
    """A collector stamping its snapshots with the loop's clock, as the daemon's engine client does."""

    def __init__(self, stamp: object) -> None:
        self.target = config.Target(name="e", metrics_url="http://127.0.0.1:1/metrics")
        self.stamp = stamp
        self.waiting = 40
        self.done = 0

    def scrape_engine(self) -> snapshots.Snapshot:
        self.done += 5
        return snapshots.parse(BODY % {"waiting": self.waiting, "done": self.done}, self.stamp(),  # type: ignore[operator]
                               keep_prefixes=("vllm:",))

    def engine_info(self) -> EngineInfo:
        return EngineInfo(model="m", max_model_len=4096, version="0.32.0")

    def read_gpus(self) -> GpuInputs:
        return GpuInputs(unavailable="none")

    def read_live(self) -> LiveState:
        return NONE


SETTINGS = config.parse({"mode": "observe", "scrape": {"interval_seconds": INTERVAL, "window_seconds": WINDOW,
                                                      "min_snapshots": 2},
                         "targets": [{"name": "e", "metrics_url": "http://127.0.0.1:1/metrics"}]})

steps = st.lists(st.tuples(st.integers(1, 30), st.sampled_from([-1, 1]), st.floats(1.5, 7200)),
                 min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps, change_at=st.integers(1, 30))
def test_a_wall_clock_step_moves_nothing_inside_the_loop(steps: list[tuple[int, int, float]], change_at: int,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    times = Times()
    clock = clocks.LoopClock(wall=times.wall, monotonic=times.monotonic)
    engine = Engine(clock.now)
    state = TunerState.fresh(SETTINGS.targets)
    by_cycle: dict[int, float] = {}
    for at, sign, size in steps:
        by_cycle[at] = by_cycle.get(at, 0.0) + sign * size
    with caplog.at_level(logging.WARNING, logger="tuner.clock"):
        for n in range(1, 36):
            times.mono += INTERVAL
            if n in by_cycle:
                times.offset += by_cycle[n]
            if n == change_at:
                engine.waiting = 0
            result = cycle.run_cycle(state, settings=SETTINGS, collectors=[engine], clock=clock)
            now = result.started_at
            window = state.targets["e"].window
            assert all(s.scraped_at <= now for s in window), f"cycle {n}: a snapshot after the cycle's time"
            times_in = [s.scraped_at for s in window]
            assert times_in == sorted(times_in), f"cycle {n}: the window is out of order"
            assert times_in[-1] - times_in[0] <= WINDOW, f"cycle {n}: the window spans {times_in[-1] - times_in[0]}s"
            waiting = result.targets["e"].signals["requests_waiting"].value
            assert waiting == engine.waiting, f"cycle {n}: {waiting} waiting reported, the engine has {engine.waiting}"
            assert abs(now - times.wall()) <= clock.tolerance_seconds + 1e-6, "the loop was not re-based"
    said = [r for r in caplog.records if "stepped" in r.getMessage()]
    assert len(said) == len(by_cycle) - sum(1 for v in by_cycle.values() if abs(v) <= clock.tolerance_seconds)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ahead=st.floats(2, 30 * 86400))
def test_a_state_file_written_while_the_clock_ran_ahead_holds_nothing_in_the_future(
        tmp_path: Path, ahead: float) -> None:
    path = tmp_path / "state.json"
    now = T0
    state = TunerState.fresh(SETTINGS.targets, path=path)
    hist = history_mod.History(changes={"max_num_seqs": history_mod.FlagChange(now + ahead, 1, "r", "8", "16")},
                               restarts=(now + ahead - 1,), idle_since=now + ahead - 5)
    state.set_history("e", hist)
    state.save()
    loaded = TunerState.load(path, SETTINGS.targets, now=now)
    latest = history_mod.latest_time(loaded.history("e"))
    assert latest is not None and latest <= now + 1.0
