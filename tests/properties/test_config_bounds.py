"""Class 8 of issue 17: ``check-config`` agrees with ``run``, and configuration input is bounded.

Generated YAML alias bombs (any fan-out and depth whose expansion passes the bound, as a list or a
mapping) and recursive aliases are refused by the one YAML reader (config, rule files, ``--decisions``)
before anything is constructed, while documents with a few aliases read as PyYAML reads them. Every
field named ``*_seconds`` in every settings model, found by walking the configuration's models, is
refused at generated values past what a scheduler and a clock can hold (``1e300``, ``.inf``, ``.nan``,
just past ten years); at the bound itself, what ``run`` builds from it (an APScheduler interval, a
thread's wait, a timedelta) holds it.
"""

from __future__ import annotations

import os
import threading
import types
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from apscheduler.triggers.interval import IntervalTrigger
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tuner import config
from tuner.errors import ConfigError
from tuner.model import bounds
from tuner.rules import loading

SETTINGS = settings(max_examples=60, deadline=None)
MINIMAL = {"targets": [{"name": "a", "metrics_url": "http://127.0.0.1:8000/metrics"}]}


def _write(tmp: Path, text: str) -> Path:
    path = tmp / "config.yaml"
    path.write_text(text)
    return path


@st.composite
def alias_bombs(draw: st.DrawFn) -> str:
    fan = draw(st.integers(2, 12))
    levels = draw(st.integers(2, 10))
    while fan**levels <= loading.YAML_MAX_NODES:
        levels += 1
    mapping = draw(st.booleans())
    lines = ['l0: &l0 ["lol"]']
    for i in range(1, levels + 1):
        refs = [f"*l{i - 1}"] * fan
        body = "{" + ", ".join(f"k{j}: {r}" for j, r in enumerate(refs)) + "}" if mapping else "[" + ", ".join(refs) + "]"
        lines.append(f"l{i}: &l{i} {body}")
    return "\n".join(lines) + "\n"


@SETTINGS
@given(text=alias_bombs())
def test_an_alias_bomb_is_refused_before_it_expands(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = _write(tmp_path_factory.mktemp("bomb"), text)
    assert len(text) < 2000
    with pytest.raises(ConfigError, match="alias"):
        loading.read_yaml(path, what="configuration file")
    with pytest.raises(ConfigError):
        config.load(path)  # check-config and run read it so


@SETTINGS
@given(fan=st.integers(1, 4), levels=st.integers(1, 3))
def test_a_few_aliases_read_as_pyyaml_reads_them(tmp_path_factory: pytest.TempPathFactory, fan: int,
                                                 levels: int) -> None:
    lines = ['l0: &l0 ["x"]'] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan)}]" for i in range(1, levels + 1)]
    text = "\n".join(lines) + "\n"
    assert loading.read_yaml(_write(tmp_path_factory.mktemp("ok"), text), what="f") == yaml.safe_load(text)


@pytest.mark.parametrize("text", ["&a [*a]\n", "&a {k: *a}\n", "- &b [1, [2, *b]]\n"])
def test_a_recursive_alias_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="refers to the node that holds it"):
        loading.read_yaml(_write(tmp_path, text), what="f")


@pytest.mark.parametrize("text", ["\x00", "mode: observe\n\x07\n", "a: \x1b"])
def test_a_non_printable_character_is_a_config_error_not_a_traceback(tmp_path: Path, text: str) -> None:
    # PyYAML's reader refuses it in the loader's constructor (found by tests/fuzz/test_fuzz_inject.py)
    with pytest.raises(ConfigError, match="not valid YAML"):
        loading.read_yaml(_write(tmp_path, text), what="f")


def test_a_stream_of_documents_shares_one_budget() -> None:
    one = "a: &a [" + ", ".join(["x"] * 300) + "]\nb: [" + ", ".join(["*a"] * 300) + "]\n"  # 90 000 values
    assert len(loading.parse_yaml(one, what="s")) == 1
    with pytest.raises(ConfigError, match="alias bomb"):
        loading.parse_yaml(one + "---\n" + one, what="s")
    with pytest.raises(ConfigError, match="line 3, column 1: not valid YAML"):
        loading.parse_yaml("a: 1\nb: [\n", what="s")
    with pytest.raises(ConfigError, match="line 2, column 1: not valid YAML: but found another document"):
        loading.parse_yaml("a: 1\n---\nb: 2\n", what="s", single=True)


def test_deep_nesting_and_a_fifo_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="deeper"):
        loading.read_yaml(_write(tmp_path, "[" * 500 + "]" * 500 + "\n"), what="f")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        loading.read_yaml(fifo, what="f")


# -- durations ---------------------------------------------------------------------------------------


def _models(annotation: Any) -> list[type[BaseModel]]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models(a)]
    if origin is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def duration_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every ``*_seconds`` field reachable through single sub-models (a union of models is skipped)."""
    found = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if name.endswith("_seconds"):
            found.append((*prefix, key))
        subs = _models(field.annotation)
        if len(subs) == 1 and subs[0] is not model:
            found += duration_paths(subs[0], (*prefix, key))
    return found


PATHS = duration_paths(config.TunerSettings)


def test_the_walk_finds_the_durations_of_every_section() -> None:
    assert ("scrape", "interval_seconds") in PATHS and ("scrape", "window_seconds") in PATHS
    assert ("scrape", "deadline_seconds") in PATHS and len(PATHS) >= 10


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data: dict[str, Any] = {**MINIMAL}
    node = data
    for key in path[:-1]:
        node[key] = dict(node.get(key, {}))
        node = node[key]
    node[path[-1]] = value
    return data


@settings(max_examples=len(PATHS) * 6, deadline=None)
@given(path=st.sampled_from(PATHS),
       value=st.sampled_from([1e300, float("inf"), float("nan"), bounds.MAX_DURATION_SECONDS * 1.0001, 10**30]))
def test_a_duration_past_what_run_can_hold_is_refused_by_check_config(path: tuple[str, ...], value: float) -> None:
    with pytest.raises(ConfigError) as caught:
        config.parse(_with(path, value))
    assert path[-1] in str(caught.value)


@pytest.mark.parametrize("path", [("scrape", "interval_seconds"), ("scrape", "window_seconds"),
                                  ("scrape", "deadline_seconds"), ("daemon", "health_max_age_seconds")])
def test_at_the_bound_what_run_builds_holds_it(path: tuple[str, ...]) -> None:
    settings_ = config.parse(_with(path, bounds.MAX_DURATION_SECONDS))
    scrape = settings_.scrape
    for seconds in (scrape.interval_seconds, scrape.window_seconds, scrape.collect_deadline_seconds(),
                    scrape.effective_stale_after()):
        assert seconds <= threading.TIMEOUT_MAX
        timedelta(seconds=seconds)
        IntervalTrigger(seconds=seconds)
    scrape.window_settings()
