"""run_cycle with fake collectors, a fake planner and a fake rollout: windows, modes, the one-line
summary, maintenance windows (deferred, not dropped), metrics and the structured log record."""

from __future__ import annotations

import calendar
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tuner import config
from tuner.daemon import cycle, selfmetrics
from tuner.daemon.collecting import GpuInputs
from tuner.model import snapshots
from tuner.model.engines import EngineInfo

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
        self.fail: str | None = None

    def scrape_engine(self) -> snapshots.Snapshot:
        self.done += 5
        if self.fail:
            return snapshots.Snapshot.failed(self.clock(), self.fail)
        body = BODY % {"running": self.running, "waiting": self.waiting, "done": self.done}
        return snapshots.parse(body, self.clock(), keep_prefixes=("vllm:",))

    def engine_info(self) -> EngineInfo:
        return EngineInfo(model="m", max_model_len=4096, version="0.32.0")

    def read_gpus(self) -> GpuInputs:
        return GpuInputs(unavailable="no GPU source configured for this target")


@dataclass(frozen=True)
class Change:
    rule: str
    flag: str
    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class Held:
    rule: str
    guard: str
    reason: str


@dataclass(frozen=True)
class FakePlan:
    changes: tuple[Change, ...] = ()
    held: tuple[Held, ...] = ()
    actions: tuple[str, ...] = ()
    restart_needed: bool = False
    text: str = "no action"

    def summary(self) -> str:
        return self.text


RAISE = FakePlan(changes=(Change("queue-pressure", "--max-num-seqs", "8", "16", "queueing while slot-bound"),),
                 restart_needed=True, text="--max-num-seqs 8→16 (queue-pressure)")
COOLDOWN = FakePlan(held=(Held("kv-pressure", "cooldown", "cooldown 4m12s left"),),
                    text="cycle 7: no action (kv-pressure: cooldown 4m12s left)")  # the planner's own count


class FakePlanner:
    def __init__(self, *plans: FakePlan | Exception) -> None:
        self.plans = list(plans)
        self.seen: list[cycle.Observation] = []

    def __call__(self, observation: cycle.Observation, *, now: float) -> FakePlan | None:
        self.seen.append(observation)
        plan = self.plans.pop(0) if len(self.plans) > 1 else self.plans[0]
        if isinstance(plan, Exception):
            raise plan
        return plan


@dataclass
class FakeRollout:
    result: str = "ok"
    calls: list[tuple[dict[str, Any], bool | None]] = field(default_factory=list)

    def __call__(self, plans: Mapping[str, cycle.PlanLike], *, now: float, maintenance_open: bool | None,
                 should_stop: Callable[[], bool], signals: Mapping[str, Any]) -> cycle.RolloutOutcome:
        self.calls.append((dict(plans), maintenance_open))
        self.signals = signals
        return cycle.RolloutOutcome(summary=f"{', '.join(plans)} restarted ({self.result})",
                                    results=dict.fromkeys(plans, self.result),
                                    state={"phase": "idle"})


class Harness:
    def __init__(self, mode: str = "observe", *, names: Sequence[str] = ("engine-0",), interval: float = 30,
                 window: float = 90) -> None:
        self.now = T0
        self.settings = config.parse({
            "mode": mode,
            "targets": [{"name": n, "metrics_url": f"http://127.0.0.1:1/{n}/metrics"} for n in names],
            "scrape": {"interval_seconds": interval, "window_seconds": window, "min_snapshots": 2},
        })
        self.collectors = [FakeCollector(n, lambda: self.now) for n in names]
        self.state = cycle.CycleState(started_at=T0)
        self.metrics = selfmetrics.TunerMetrics()

    def run(self, *, advance: float = 30, **kwargs: Any) -> cycle.CycleResult:
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
    assert v("tuner_signal", {"target": "engine-0", "signal": "requests_waiting"}) == 112
    assert v("tuner_cycle_duration_seconds_count") == 2
    for step in cycle.STEPS:
        assert v("tuner_cycle_step_duration_seconds_count", {"step": step}) == 2


def test_the_window_keeps_window_seconds_of_snapshots() -> None:
    h = Harness(window=90)
    for _ in range(6):
        result = h.run()
    # snapshots at 0, 30, …, 150 s; the window at 150 s reaches back to 60 s
    assert result.targets["engine-0"].snapshots == 4
    assert [s.scraped_at - T0 for s in h.state.windows["engine-0"]] == [60, 90, 120, 150]


def test_recommend_mode_passes_the_window_to_the_planner_and_says_what_it_said() -> None:
    h = Harness("recommend")
    planner = FakePlanner(COOLDOWN)
    h.run(planner=planner)
    result = h.run(planner=planner)
    assert result.summary == "cycle 2: no action (kv-pressure: cooldown 4m12s left)"
    obs = planner.seen[-1]
    assert obs.target.name == "engine-0" and len(obs.window) == 2
    assert obs.signals["requests_running"].value == 8
    v = h.metrics.registry.get_sample_value
    assert v("tuner_decisions_total", {"rule": "kv-pressure", "outcome": "held", "reason": "cooldown"}) == 2


def test_recommend_never_calls_the_rollout() -> None:
    h = Harness("recommend")
    rollout = FakeRollout()
    result = h.run(planner=FakePlanner(RAISE), rollout=rollout)
    assert rollout.calls == []
    assert result.summary == "cycle 1: --max-num-seqs 8→16 (queue-pressure)"
    assert result.recommendations()["recommendations"] == [{
        "target": "engine-0", "flag": "--max-num-seqs", "from": "8", "to": "16", "rule": "queue-pressure",
        "reason": "queueing while slot-bound"}]
    v = h.metrics.registry.get_sample_value
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "recommended",
                                       "reason": "queueing while slot-bound"}) == 1
    assert v("tuner_engine_arg_info", {"target": "engine-0", "flag": "--max-num-seqs", "value": "16",
                                       "kind": "recommended"}) == 1
    assert v("tuner_engine_arg_info", {"target": "engine-0", "flag": "--max-model-len", "value": "4096",
                                       "kind": "current"}) == 1


def test_apply_without_windows_hands_the_plan_to_the_rollout() -> None:
    h = Harness("apply")
    rollout = FakeRollout()
    result = h.run(planner=FakePlanner(RAISE), rollout=rollout)
    assert rollout.calls == [({"engine-0": RAISE}, None)]
    assert result.summary == ("cycle 1: --max-num-seqs 8→16 handed to the rollout; "
                              "rollout: engine-0 restarted (ok)")
    assert result.status()["rollout"] == {"summary": "engine-0 restarted (ok)", "results": {"engine-0": "ok"},
                                          "phase": "idle"}
    v = h.metrics.registry.get_sample_value
    assert v("tuner_restarts_total", {"target": "engine-0", "result": "ok"}) == 1
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "applied",
                                       "reason": "queueing while slot-bound"}) == 1


def test_restarts_outside_the_maintenance_window_are_deferred_not_dropped() -> None:
    h = Harness("apply")
    windows = cycle.MaintenanceWindows([WINDOW])
    rollout = FakeRollout()
    # the rule fires once, then its cooldown holds it: the deferred plan must survive on its own
    planner = FakePlanner(RAISE, COOLDOWN)

    first = h.run(planner=planner, rollout=rollout, maintenance=windows, advance=1800)
    assert rollout.calls == []
    assert first.summary == ("cycle 1: --max-num-seqs 8→16 deferred (outside the maintenance window; "
                             "next opens 2026-06-06 02:00Z)")
    assert set(first.deferred) == {"engine-0"}

    second = h.run(planner=planner, rollout=rollout, maintenance=windows, advance=1800)  # 01:30
    assert rollout.calls == []
    assert second.summary == "cycle 2: no action (kv-pressure: cooldown 4m12s left); still pending: engine-0"
    assert second.status()["pending"]["engine-0"]["plan"]["changes"][0]["to"] == "16"

    third = h.run(planner=planner, rollout=rollout, maintenance=windows)  # 02:00: the window opens
    assert rollout.calls == [({"engine-0": RAISE}, True)]
    assert "engine-0: deferred --max-num-seqs 8→16 handed to the rollout (maintenance window open)" in third.summary
    assert third.deferred == {}
    assert h.run(planner=planner, rollout=rollout, maintenance=windows).deferred == {}
    assert len(rollout.calls) == 1  # handed over exactly once
    v = h.metrics.registry.get_sample_value
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "deferred",
                                       "reason": "queueing while slot-bound"}) == 1


def test_a_newer_restart_plan_supersedes_the_deferred_one() -> None:
    h = Harness("apply")
    windows = cycle.MaintenanceWindows([WINDOW])
    bigger = FakePlan(changes=(Change("queue-pressure", "--max-num-seqs", "8", "32", "still queueing"),),
                      restart_needed=True, text="--max-num-seqs 8→32")
    rollout = FakeRollout()
    h.run(planner=FakePlanner(RAISE), rollout=rollout, maintenance=windows)
    h.run(planner=FakePlanner(bigger), rollout=rollout, maintenance=windows, advance=3600)
    h.run(planner=FakePlanner(COOLDOWN), rollout=rollout, maintenance=windows)
    assert rollout.calls == [({"engine-0": bigger}, True)]


def test_actions_without_a_restart_are_not_held_by_windows_nor_drop_a_deferred_restart() -> None:
    h = Harness("apply")
    warm = FakePlan(actions=("keep-warm",), text="cycle 3: keep-warm ×10 (idle 20m)")
    rollout = FakeRollout()
    windows = cycle.MaintenanceWindows([WINDOW])
    h.run(planner=FakePlanner(RAISE), rollout=rollout, maintenance=windows)
    result = h.run(planner=FakePlanner(warm), rollout=rollout, maintenance=windows)
    assert rollout.calls == [({"engine-0": warm}, False)]
    assert "engine-0: keep-warm ×10 (idle 20m) handed to the rollout" not in result.summary
    assert result.summary.startswith("cycle 2: keep-warm ×10 (idle 20m) handed to the rollout; still pending")
    assert set(result.deferred) == {"engine-0"}


def test_apply_without_a_rollout_says_so() -> None:
    h = Harness("apply")
    result = h.run(planner=FakePlanner(RAISE))
    assert result.summary.endswith("(no rollout configured: not applied)")


def test_failures_become_part_of_the_line_not_exceptions() -> None:
    h = Harness("apply", names=("engine-0", "engine-1"))
    h.collectors[1].fail = "cannot connect: [Errno 111] Connection refused"

    class Broken:
        def __call__(self, plans: Any, **kwargs: Any) -> cycle.RolloutOutcome:
            raise RuntimeError("actuator exploded")

    result = h.run(planner=FakePlanner(RAISE), rollout=Broken())
    assert result.summary == (
        "cycle 1: engine-0: --max-num-seqs 8→16 handed to the rollout; "
        "engine-1: scrape failed (cannot connect: [Errno 111] Connection refused); "
        "rollout error (RuntimeError: actuator exploded)")
    h.collectors[1].fail = "cannot connect: [Errno 111] Connection refused"
    result = h.run(planner=FakePlanner(ValueError("bad rule")))
    assert result.summary == ("cycle 2: engine-0: planner error (ValueError: bad rule); "
                              "engine-1: scrape failed (cannot connect: [Errno 111] Connection refused)")
    v = h.metrics.registry.get_sample_value
    assert v("tuner_scrape_errors_total", {"target": "engine-1", "source": "engine"}) == 2
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "failed",
                                       "reason": "queueing while slot-bound"}) == 1


def test_a_stop_request_skips_planning_and_keeps_plans() -> None:
    h = Harness("apply")
    rollout = FakeRollout()
    result = h.run(planner=FakePlanner(RAISE), rollout=rollout, should_stop=lambda: True)
    assert rollout.calls == []
    assert result.stopped == "stopping: skipped plan and act"
    assert result.summary == "cycle 1: running 8, waiting 112, kv 1%; stopping: skipped plan and act"


def test_a_removed_target_is_forgotten() -> None:
    h = Harness(names=("engine-0", "engine-1"))
    h.run()
    h.collectors.pop()
    h.settings = h.settings.model_copy(update={"targets": h.settings.targets[:1]})
    h.run()
    assert set(h.state.windows) == {"engine-0"}
    assert h.metrics.registry.get_sample_value(
        "tuner_signal", {"target": "engine-1", "signal": "requests_waiting"}) is None


def test_records_are_json_and_the_json_formatter_carries_them(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness("recommend")
    with caplog.at_level(logging.INFO, logger="tuner.cycle"):
        result = h.run(planner=FakePlanner(RAISE))
    json.dumps(result.status())
    json.dumps(result.recommendations())
    record = next(r for r in caplog.records if r.name == "tuner.cycle")
    assert record.getMessage() == result.summary
    line = json.loads(cycle.JsonLogFormatter().format(record))
    assert line["msg"] == result.summary
    assert line["cycle"]["cycle"] == 1
    assert line["cycle"]["targets"]["engine-0"]["plan"]["changes"][0]["to"] == "16"


def test_maintenance_windows_are_minute_sets() -> None:
    windows = cycle.MaintenanceWindows([WINDOW, "30 12 * * 1"])
    assert not windows.is_open(T0)  # 01:00
    assert windows.is_open(T0 + 3600)  # 02:00
    assert windows.is_open(T0 + 3 * 3600 - 1)  # 03:59:59
    assert not windows.is_open(T0 + 3 * 3600)  # 04:00
    assert windows.next_open(T0) == T0 + 3600
    assert windows.next_open(T0 + 3600 + 30) == T0 + 3600  # open now: this minute
    with pytest.raises(ValueError, match=r"'\* 2-4 \* \*'.*e\.g\. '\* 2-4 \* \* 6,0'"):
        cycle.MaintenanceWindows(["* 2-4 * *"])
    with pytest.raises(ValueError, match="at least one"):
        cycle.MaintenanceWindows([])


def test_maintenance_windows_in_a_time_zone() -> None:
    windows = cycle.MaintenanceWindows(["* 4 * * *"], timezone="Europe/Berlin")  # 04:xx CEST = 02:xx UTC
    assert windows.is_open(T0 + 3600)
    assert not windows.is_open(T0)


def test_plan_items_with_their_own_as_dict_are_shown_as_they_say() -> None:
    @dataclass(frozen=True)
    class OwnChange:
        from_value: int
        to_value: int

        def as_dict(self) -> dict[str, Any]:
            return {"flag": "--max-num-seqs", "from": "8", "to": "16", "rule": "r", "reason": "why"}

    plan = FakePlan(changes=(OwnChange(8, 16),))  # type: ignore[arg-type]
    assert cycle.change_json(plan.changes[0])["to"] == "16"
    assert cycle.plan_json(plan)["changes"] == [{"flag": "--max-num-seqs", "from": "8", "to": "16", "rule": "r",
                                                 "reason": "why"}]
    assert cycle.plan_summary(COOLDOWN) == "no action (kv-pressure: cooldown 4m12s left)"
