"""run_cycle with fake collectors, a small real rule set and a fake rollout: windows, modes, the one-line
summary, maintenance windows (deferred, not dropped), metrics and the structured log record. The
decisions are the real planner's (planning.stepping.step); only the engines and the rollout are fakes."""

from __future__ import annotations

import calendar
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tuner import config
from tuner.model import snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.model.live import NONE, LiveState
from tuner.planning import pooling
from tuner.planning.guards import Action
from tuner.rules import loading
from tuner.runtime import cycle, logs, selfmetrics, views
from tuner.runtime.results import RolloutOutcome
from tuner.runtime.scheduling import MaintenanceWindows
from tuner.runtime.state import TunerState

BODY = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %(running)s
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %(waiting)s
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.01
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} %(done)s
"""

# Saturday 2026-06-06 01:00:00 UTC; the window below is 02:00-03:59 UTC every day
T0 = float(calendar.timegm((2026, 6, 6, 1, 0, 0)))
WINDOW = "* 2-3 * * *"


class FakeCollector:
    """Serves scripted /metrics bodies; ``fail`` makes the next scrape fail like a refused connection."""

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self.target = config.Target(name=name, metrics_url=f"http://127.0.0.1:1/{name}/metrics")
        self.clock = clock
        self.running, self.waiting, self.done = 8, 112, 0
        self.step = 5  # requests finished per scrape
        self.fail: str | None = None

    def scrape_engine(self) -> snapshots.Snapshot:
        self.done += self.step
        if self.fail:
            return snapshots.Snapshot.failed(self.clock(), self.fail)
        body = BODY % {"running": self.running, "waiting": self.waiting, "done": self.done}
        return snapshots.parse(body, self.clock(), keep_prefixes=("vllm:",))

    def engine_info(self) -> EngineInfo:
        return EngineInfo(model="m", max_model_len=4096, version="0.32.0")

    def read_gpus(self) -> GpuInputs:
        return GpuInputs(unavailable="no GPU source configured for this target")

    def read_live(self) -> LiveState:
        return NONE


# Two rules over the fake engine's gauges: more slots while requests wait, and a KV rule that never fires.
RULES = tuple(loading.parse({"rules": [
    {"id": "queue-pressure", "description": "requests wait", "priority": 50, "cooldown": "15m",
     "when": {"for": 1, "all": [{"signal": "requests_waiting_max", "op": ">=", "value": 1}]},
     "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 1024}},
    {"id": "kv-pressure", "description": "KV full", "priority": 40,
     "when": {"for": 1, "all": [{"signal": "kv_cache_usage_max", "op": ">=", "value": 0.95}]},
     "then": {"flag": "--max-num-seqs", "op": "set", "value": 4}},
]}))


@dataclass
class FakeRollout:
    """Records what it is handed; ``book``: book a handed change as a rollout would (every replica ok)."""

    state: TunerState | None = None
    calls: list[tuple[tuple[tuple[str, Action], ...], pooling.PoolChange | None]] = field(default_factory=list)
    result: str = "ok"
    busy: bool = False  # books every change at once: never a rollout in flight
    verifying: tuple[Any, ...] = ()  # ... so never one to supersede

    def __call__(self, actions: Sequence[tuple[str, Action]], change: pooling.PoolChange | None, *, now: float,
                 signals: Mapping[str, Any], should_stop: Callable[[], bool]) -> RolloutOutcome:
        self.calls.append((tuple(actions), change))
        self.signals = signals
        if change is None:
            return RolloutOutcome(summary="; ".join(f"{n}: {a.label()}" for n, a in actions))
        if self.state is not None and self.result == "ok":
            outcomes = {n: pooling.ReplicaOutcome("ok", a) for n, a in change.new_args.items()}
            self.state.book(*pooling.book(self.state.histories(), self.state.args, changes=change.changes,
                                          outcomes=outcomes, pool_new_args=change.new_args, rolled_back=False,
                                          now=now, reject_seconds=3600))
        return RolloutOutcome(summary=f"{', '.join(change.new_args)} restarted ({self.result})",
                              results=dict.fromkeys(change.new_args, self.result), state={"phase": "idle"})


class Harness:
    def __init__(self, mode: str = "observe", *, names: Sequence[str] = ("engine-0",), interval: float = 30,
                 window: float = 90) -> None:
        self.now = T0
        self.settings = config.parse({
            "mode": mode,
            "targets": [{"name": n, "metrics_url": f"http://127.0.0.1:1/{n}/metrics",
                         "args": ["--max-num-seqs", "8"]} for n in names],
            "scrape": {"interval_seconds": interval, "window_seconds": window, "min_snapshots": 2},
            # the cycle's mechanics, not the restart's evidence (tests/unit/test_guards.py has that)
            "decisions": {"idle": {"min_requests_per_window": 0, "keep_warm_after_seconds": None},
                          "safety": {"restart_evidence_seconds": 0}},
        })
        self.collectors = [FakeCollector(n, lambda: self.now) for n in names]
        self.state = TunerState.fresh(self.settings.targets)
        self.metrics = selfmetrics.TunerMetrics()

    def run(self, *, advance: float = 30, **kwargs: Any) -> cycle.CycleResult:
        kwargs.setdefault("rules", RULES)
        result = cycle.run_cycle(self.state, settings=self.settings, collectors=self.collectors,
                                 metrics=self.metrics, now=self.now, **kwargs)
        self.now += advance
        return result


def test_observe_mode_summary_and_signals() -> None:
    h = Harness()
    first = h.run()
    assert first.summary == "cycle 1: observed 1/1 target(s) (running 8, waiting 112, kv 1%)"
    second = h.run()
    assert second.number == 2
    t = second.targets["engine-0"]
    assert t.signals["requests_waiting"].value == 112
    assert t.signals["request_rate"].value == pytest.approx(5 / 30)  # 5 more successes per 30 s
    assert t.signals["max_model_len"].value == 4096
    assert t.plan is None
    assert "\n" not in second.summary
    v = h.metrics.registry.get_sample_value
    assert v("tuner_signal_requests", {"target": "engine-0", "signal": "requests_waiting"}) == 112
    assert v("tuner_cycle_duration_seconds_count") == 2
    for step in cycle.STEPS:
        assert v("tuner_cycle_step_duration_seconds_count", {"step": step}) == 2


def test_the_window_keeps_window_seconds_of_snapshots() -> None:
    h = Harness(window=90)
    for _ in range(6):
        result = h.run()
    # snapshots at 0, 30, …, 150 s; the window at 150 s reaches back to 60 s
    assert result.targets["engine-0"].snapshots == 4
    assert [s.scraped_at - T0 for s in h.state.targets["engine-0"].window] == [60, 90, 120, 150]


def test_recommend_mode_plans_with_the_real_planner_and_says_what_it_said() -> None:
    h = Harness("recommend")
    first = h.run()  # one snapshot: no window yet
    assert first.summary == "cycle 1: no action (no decision: too few snapshots: 1 spanning 0s (need ≥ 2 over > 0s))"
    rollout = FakeRollout()
    result = h.run(dispatcher=rollout)
    assert rollout.calls == []  # recommend never hands anything over
    assert result.summary == ("cycle 2: --max-num-seqs 8→16 (queue-pressure); restart needed; "
                              "warm-up ×10 after the restart (the restart for --max-num-seqs)")
    assert views.recommendations(result)["recommendations"] == [{
        "target": "engine-0", "flag": "--max-num-seqs", "from": "8", "to": "16", "rule": "queue-pressure",
        "reason": "requests_waiting_max 112 ≥ 1"}]
    v = h.metrics.registry.get_sample_value
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "recommended",
                                       "reason": "fired"}) == 1
    assert v("tuner_engine_arg_info", {"target": "engine-0", "flag": "--max-num-seqs", "value": "16",
                                       "kind": "recommended"}) == 1
    assert v("tuner_engine_arg_info", {"target": "engine-0", "flag": "--max-num-seqs", "value": "8",
                                       "kind": "current"}) == 1


def test_apply_without_windows_hands_the_pool_change_to_the_rollout_and_books_it() -> None:
    h = Harness("apply", names=("engine-0", "engine-1"))
    rollout = FakeRollout(h.state)
    h.run(dispatcher=rollout)
    result = h.run(dispatcher=rollout)
    ((actions, change),) = rollout.calls
    assert actions == () and change is not None and change.leader == "engine-0"
    assert {n: a.argv() for n, a in change.new_args.items()} == {
        "engine-0": ["--max-num-seqs", "16"], "engine-1": ["--max-num-seqs", "16"]}
    assert result.summary == ("cycle 2: engine-0: --max-num-seqs 8→16 handed to the rollout; "
                              "engine-1: --max-num-seqs 8→16 (in the pool's change); "
                              "rollout: engine-0, engine-1 restarted (ok)")
    assert views.status(result)["rollout"] == {"summary": "engine-0, engine-1 restarted (ok)",
                                               "results": {"engine-0": "ok", "engine-1": "ok"}, "phase": "idle"}
    assert h.state.args["engine-1"].argv() == ["--max-num-seqs", "16"]
    v = h.metrics.registry.get_sample_value
    assert v("tuner_restarts_total", {"target": "engine-0", "result": "ok"}) == 1
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "applied",
                                       "reason": "fired"}) == 2
    # booked: the next cycle is held by the cooldown, on the new arguments
    after = h.run(dispatcher=rollout)
    assert len(rollout.calls) == 1
    assert "cooldown" in after.summary


def test_changes_outside_the_maintenance_window_are_deferred_not_dropped() -> None:
    h = Harness("apply")
    windows = MaintenanceWindows([WINDOW])
    rollout = FakeRollout(h.state)
    h.run(dispatcher=rollout, maintenance=windows, advance=30)
    first = h.run(dispatcher=rollout, maintenance=windows, advance=1800)  # 01:00:30
    assert rollout.calls == []
    assert first.summary == ("cycle 2: --max-num-seqs 8→16 deferred (outside the maintenance window; "
                             "next opens 2026-06-06 02:00Z)")
    assert first.pending is not None and first.pending.plan.target == "engine-0"

    h.collectors[0].waiting = 0  # the queue drains: the rule stops firing, the pending change must survive
    second = h.run(dispatcher=rollout, maintenance=windows, advance=1770)  # 01:30:30
    assert rollout.calls == []
    assert second.summary.endswith("still pending: --max-num-seqs 8→16 (outside the maintenance window; "
                                   "next opens 2026-06-06 02:00Z)")
    assert views.status(second)["pending"]["plan"]["recommendations"][0]["to"] == "16"

    third = h.run(dispatcher=rollout, maintenance=windows)  # 02:00:00: the window opens
    ((_, change),) = rollout.calls
    assert change is not None and change.new_args["engine-0"].argv() == ["--max-num-seqs", "16"]
    assert "deferred --max-num-seqs 8→16 handed to the rollout (maintenance window open)" in third.summary
    assert third.pending is None
    assert h.run(dispatcher=rollout, maintenance=windows).pending is None
    assert len(rollout.calls) == 1  # handed over exactly once
    v = h.metrics.registry.get_sample_value
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "deferred",
                                       "reason": "fired"}) == 1


def test_a_newer_change_supersedes_the_pending_one() -> None:
    h = Harness("apply")
    windows = MaintenanceWindows([WINDOW])
    rollout = FakeRollout()
    h.run(dispatcher=rollout, maintenance=windows)
    h.run(dispatcher=rollout, maintenance=windows)  # deferred: 8 → 16
    h.state.args["engine-0"] = h.state.args["engine-0"].with_value("--max-num-seqs", "12")  # as if a human did
    h.run(dispatcher=rollout, maintenance=windows, advance=3600)  # deferred again: 12 → 24 replaces 8 → 16
    assert h.state.pending is not None and h.state.pending.plan.changes[0].to_value == 24
    h.run(dispatcher=rollout, maintenance=windows)  # 02:xx: a fresh change goes out, the pending one with it
    ((_, change),) = rollout.calls
    assert change is not None and change.changes[0].to_value == 24 and h.state.pending is None


def test_actions_without_a_restart_are_not_held_by_windows_nor_drop_a_pending_change() -> None:
    h = Harness("apply")
    h.settings = h.settings.model_copy(update={"decisions": h.settings.decisions.model_copy(update={
        "idle": h.settings.decisions.idle.model_copy(update={"keep_warm_after_seconds": 60})})})
    windows = MaintenanceWindows([WINDOW])
    rollout = FakeRollout()
    h.run(dispatcher=rollout, maintenance=windows)
    h.run(dispatcher=rollout, maintenance=windows)  # deferred
    c = h.collectors[0]
    c.waiting = c.running = 0
    c.step = 0  # no request finishes any more: idle
    for _ in range(4):
        result = h.run(dispatcher=rollout, maintenance=windows)
    actions = [a for acts, ch in rollout.calls for _, a in acts if ch is None]
    assert [a.kind for a in actions] == ["keep-warm", "keep-warm"]  # idle from cycle 3: at 1m and 2m
    assert result.summary == ("cycle 6: keep-warm ×10 (idle for 2m (keep-warm after 1m)); still pending: "
                              "--max-num-seqs 8→16 (outside the maintenance window; next opens 2026-06-06 02:00Z); "
                              "rollout: engine-0: keep-warm ×10")
    assert h.state.pending is not None  # the keep-warm did not drop the pending change


def test_apply_without_a_rollout_says_so() -> None:
    h = Harness("apply")
    h.run()
    result = h.run()
    assert result.summary.endswith("(no rollout configured: not applied)")


def test_failures_become_part_of_the_line_not_exceptions(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness("apply", names=("engine-0", "engine-1"))
    h.collectors[1].fail = "cannot connect: [Errno 111] Connection refused"

    class Broken:
        busy = False
        verifying = ()

        def __call__(self, actions: Any, change: Any, **kwargs: Any) -> RolloutOutcome:
            raise RuntimeError("actuator exploded")

    h.run(dispatcher=Broken())
    result = h.run(dispatcher=Broken())
    assert result.summary == (
        "cycle 2: engine-0: --max-num-seqs 8→16 handed to the rollout; "
        "engine-1: scrape failed (cannot connect: [Errno 111] Connection refused); "
        "rollout error (RuntimeError: actuator exploded)")

    from tuner.planning import planner

    def broken_plan(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("bad rule")

    monkeypatch.setattr(planner, "plan", broken_plan)
    result = h.run(dispatcher=Broken())
    assert result.summary == ("cycle 3: engine-0: planner error (ValueError: bad rule); "
                              "engine-1: scrape failed (cannot connect: [Errno 111] Connection refused)")
    assert result.targets["engine-0"].signals["requests_waiting"].value == 112  # still observed
    v = h.metrics.registry.get_sample_value
    assert v("tuner_scrape_errors_total", {"target": "engine-1", "source": "engine"}) == 3
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "failed",
                                       "reason": "fired"}) == 1


def test_a_stop_request_skips_planning_and_acting() -> None:
    h = Harness("apply")
    rollout = FakeRollout()
    h.run(dispatcher=rollout)
    result = h.run(dispatcher=rollout, should_stop=lambda: True)
    assert rollout.calls == []
    assert result.stopped == "stopping: skipped planning and acting"
    assert result.summary == "cycle 2: running 8, waiting 112, kv 1%; stopping: skipped planning and acting"


def test_a_removed_target_is_forgotten() -> None:
    h = Harness(names=("engine-0", "engine-1"))
    h.run()
    h.collectors.pop()
    h.settings = h.settings.model_copy(update={"targets": h.settings.targets[:1]})
    h.run()
    assert set(h.state.targets) == {"engine-0"}
    assert h.metrics.registry.get_sample_value(
        "tuner_signal_requests", {"target": "engine-1", "signal": "requests_waiting"}) is None


def test_records_are_json_and_the_json_formatter_carries_them(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness("recommend")
    h.run()
    with caplog.at_level(logging.INFO, logger="tuner.cycle"):
        result = h.run()
    json.dumps(views.status(result))
    json.dumps(views.recommendations(result))
    record = next(r for r in caplog.records if r.name == "tuner.cycle")
    assert record.getMessage() == result.summary
    line = json.loads(logs.JsonLogFormatter().format(record))
    assert line["msg"] == result.summary
    assert line["cycle"]["cycle"] == 2
    assert line["cycle"]["targets"]["engine-0"]["plan"]["recommendations"][0]["to"] == "16"


def test_maintenance_windows_are_minute_sets() -> None:
    windows = MaintenanceWindows([WINDOW, "30 12 * * 1"])
    assert not windows.is_open(T0)  # 01:00
    assert windows.is_open(T0 + 3600)  # 02:00
    assert windows.is_open(T0 + 3 * 3600 - 1)  # 03:59:59
    assert not windows.is_open(T0 + 3 * 3600)  # 04:00
    assert windows.next_open(T0) == T0 + 3600
    assert windows.next_open(T0 + 3600 + 30) == T0 + 3600  # open now: this minute
    with pytest.raises(ValueError, match=r"'\* 2-4 \* \*'.*e\.g\. '\* 2-4 \* \* 6,0'"):
        MaintenanceWindows(["* 2-4 * *"])
    with pytest.raises(ValueError, match="at least one"):
        MaintenanceWindows([])


def test_maintenance_windows_in_a_time_zone() -> None:
    windows = MaintenanceWindows(["* 4 * * *"], timezone="Europe/Berlin")  # 04:xx CEST = 02:xx UTC
    assert windows.is_open(T0 + 3600)
    assert not windows.is_open(T0)


def test_a_repeated_recommendation_is_logged_once_then_on_change_and_every_ten_minutes(
        caplog: pytest.LogCaptureFixture) -> None:
    h = Harness("recommend")
    with caplog.at_level(logging.DEBUG, logger="tuner.cycle"):
        results = [h.run() for _ in range(6)]  # 30 s apart: the same recommendation from cycle 2 on
        said = [r.getMessage() for r in caplog.records if r.name == "tuner.cycle" and r.levelno == logging.INFO]
        assert said == [results[0].summary, results[1].summary]  # the window filling, then the recommendation
        quiet = [r for r in caplog.records if r.name == "tuner.cycle" and r.levelno == logging.DEBUG]
        assert [r.getMessage() for r in quiet] == [r.summary for r in results[2:]]  # still there, at DEBUG
        assert all("tuner_cycle" in r.__dict__ for r in quiet)  # with the structured record
        caplog.clear()
        later = [h.run() for _ in range(20)]  # cycles 7-26; cycle 22 is 600 s after cycle 2
        again = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert again == [later[15].summary + " (the same since cycle 2)"] and later[15].number == 22
        caplog.clear()
        h.collectors[0].waiting = 0  # the queue drains: a different line, said at once
        changed = h.run()
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [changed.summary]
