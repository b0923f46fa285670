"""Fuzzing the two loaders a user feeds by hand: ``tuner.config.parse`` and ``tuner.rules.loading.parse``.
Generated YAML-ish data (random trees, YAML text, and valid files with their leaves mutated, keys
dropped or added) is either accepted or refused with a ``ConfigError`` naming where: never any other
exception. Accepted configurations also answer ``apply_problems`` and accepted rules evaluate."""

from __future__ import annotations

import copy
import math

import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.support import REPO, fuzz, tried
from tuner import config
from tuner.errors import ConfigError
from tuner.model import knobs
from tuner.rules import evaluation, loading
from tuner.signals import VOCABULARY, Signal

CONFIG_KEYS = ["mode", "targets", "name", "kind", "metrics_url", "base_url", "gpu", "args", "scrape", "decisions",
               "daemon", "actuator", "drain", "rollout", "gpu_control", "rule_files", "interval_seconds", "tls",
               "devices", "url", "command", "upstream_file", "thermal", "idle", "safety", "engine", "platform",
               "defaults", "maintenance_windows", "state_file", "journal_file", "max_unavailable"]
RULE_KEYS = ["id", "when", "then", "all", "any", "for", "signal", "flag", "op", "value", "times", "factor",
             "values", "direction", "min", "max", "min_from", "max_from", "value_from", "plus", "verify", "expect",
             "cooldown", "priority", "enabled", "engines", "experimental", "adds_load", "max_resolution",
             "tolerance", "min_change", "rules", "version"]
TEXT = st.sampled_from(["", "yes", "no", "on", "~", "null", ".inf", "-.inf", ".nan", "1e3", "0x10", "15m", "90s",
                        "2h", "P1D", "--max-num-seqs", "--block-size", "queue_time_mean_s", "kv_cache_usage", ">",
                        "<=", "==", "scale", "set", "step", "toggle", "up", "down", "vllm", "sglang", "apply",
                        "observe", "recommend", "systemd", "process", "nginx", "nvml", "dcgm", "none", "cuda",
                        "http://127.0.0.1:8000/metrics", "* 2-4 * * *", "é", "a" * 300, "\x00", "decrease",
                        "no-increase"]) | st.text(max_size=12)
LEAF = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT
        | st.sampled_from([0, 1, -1, 2**63, 2**64, 10**400, 1e308, math.inf, -math.inf, math.nan, 0.5]))


def tree(keys: list[str]):
    key = st.sampled_from(keys) | st.text(max_size=6)
    return st.recursive(LEAF, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(key, kids, max_size=5),
                        max_leaves=20)


def paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*prefix, i))


@st.composite
def mutated(draw, base, keys):
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(list(paths(data))))
        if not where:
            continue
        *head, last = where
        parent = data
        for part in head:
            parent = parent[part]
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "wrap", "tree"]))
        if op == "replace":
            parent[last] = draw(LEAF)
        elif op == "delete":
            del parent[last]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(keys))] = draw(LEAF)
        elif op == "wrap":
            parent[last] = [parent[last]]
        elif op == "tree":
            parent[last] = draw(tree(keys))
    return data


VALID_CONFIG = config.parse({
    "mode": "apply",
    "targets": [{"name": "a", "metrics_url": "http://127.0.0.1:8001/metrics", "args": ["--max-num-seqs", "8"],
                 "gpu": {"kind": "nvml", "devices": [0]}},
                {"name": "b", "metrics_url": "http://127.0.0.1:8002/metrics", "args": ["--max-num-seqs", "8"],
                 "gpu": {"kind": "dcgm", "url": "http://127.0.0.1:9400/metrics", "gpus": [1]}}],
    "actuator": {"kind": "systemd"},
    "drain": {"kind": "nginx", "upstream_file": "/tmp/upstreams.conf"},
    "daemon": {"maintenance_windows": ["* 2-4 * * *"]},
}).model_dump(mode="json", exclude_none=True)
VALID_RULES = yaml.safe_load((REPO / "rules" / "default.yaml").read_text())


def refused(exc: ConfigError) -> None:
    """A refusal names where and what, as strings (the CLI prints them one per line)."""
    assert exc.problems and all(isinstance(w, str) and isinstance(m, str) for w, m in exc.problems)


def load_config(data) -> None:
    try:
        settings = config.parse(data, file="fuzz.yaml")
    except ConfigError as exc:
        refused(exc)
        return
    settings.apply_problems()


SIGNALS = {name: Signal(v) for name, v in zip(VOCABULARY, [0.5, 1.0, 100.0, 0.0, 2048.0, 16.0] * 20, strict=False)}


def load_rules(data) -> None:
    try:
        rules = loading.parse(data, file="fuzz.yaml")
    except ConfigError as exc:
        refused(exc)
        return
    ctx = evaluation.Context(signals=SIGNALS, args=knobs.EngineArgs.from_string("--max-num-seqs 8 --block-size 16"))
    for outcome in evaluation.evaluate(rules, ctx):
        assert outcome.reason or outcome.status == "fired"


@fuzz(1)
@given(tree(CONFIG_KEYS))
def test_config_from_random_trees(data):
    tried("config tree")
    load_config(data)


@fuzz(2)
@given(mutated(VALID_CONFIG, CONFIG_KEYS))
def test_config_from_a_valid_file_mutated(data):
    tried("config mutated")
    load_config(data)


@fuzz(1)
@given(st.text(max_size=200))
def test_config_from_yaml_text(text):
    tried("config yaml")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return  # read_yaml turns this into a ConfigError before parse sees it
    load_config(data)


@fuzz(1)
@given(tree(RULE_KEYS))
def test_rules_from_random_trees(data):
    tried("rules tree")
    load_rules(data)


@fuzz(2)
@given(mutated(VALID_RULES, RULE_KEYS))
def test_rules_from_the_default_file_mutated(data):
    tried("rules mutated")
    load_rules(data)
