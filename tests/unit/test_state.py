"""runtime/state.py: the tuner's state file holds no secret — masked command lines, the configuration's
arguments only as a hash, crash memory masked — and a restarted tuner gets the real values back from
``targets[].args``. A file it cannot trust is one ConfigError naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner import config
from tuner.errors import ConfigError
from tuner.model import knobs
from tuner.planning import history as history_mod
from tuner.runtime.state import TunerState

KEY = "sk-state-7f3a9c"


def settings(key: str = KEY, seqs: str = "4") -> config.TunerSettings:
    return config.parse({"targets": [{"name": "a", "metrics_url": "http://127.0.0.1:8001/metrics",
                                      "args": ["--model", "m", "--api-key", key, "--max-num-seqs", seqs]}]})


def saved_state(tmp_path: Path) -> tuple[config.TunerSettings, Path]:
    s = settings()
    state = TunerState.fresh(s.targets, path=tmp_path / "state.json", redactor=s.redactor())
    tuned = state.args["a"].with_value("--max-num-seqs", 8)
    bad = tuned.with_value("--max-model-len", 8192)
    state.book({"a": history_mod.failed_to_start(state.history("a"), bad, reason=f"runs {bad}")}, {"a": tuned})
    return s, tmp_path / "state.json"


def test_the_state_file_holds_no_secret_and_a_restarted_tuner_gets_them_back(tmp_path: Path) -> None:
    s, path = saved_state(tmp_path)
    text = path.read_text()
    assert KEY not in text
    saved = json.loads(text)["targets"]["a"]
    assert saved["args"] == ["--model", "m", "--api-key", "***", "--max-num-seqs", "8"]
    assert "config_args" not in saved and len(saved["config_sha256"]) == 64
    again = TunerState.load(path, s.targets, redactor=s.redactor())
    assert again.args["a"].argv() == ["--model", "m", "--api-key", KEY, "--max-num-seqs", "8"]
    # crash memory still recognises the refused command line, secret and all
    bad = again.args["a"].with_value("--max-model-len", 8192)
    assert again.history("a").is_bad(bad) is not None
    assert again.current_args("a")["--api-key"] == "***" and again.current_args("a")["--max-num-seqs"] == "8"


def test_a_rotated_key_keeps_the_tuners_changes_an_edited_flag_does_not(tmp_path: Path) -> None:
    _, path = saved_state(tmp_path)
    rotated = settings(key="sk-rotated-000111")
    again = TunerState.load(path, rotated.targets, redactor=rotated.redactor())
    assert again.args["a"].argv() == ["--model", "m", "--api-key", "sk-rotated-000111", "--max-num-seqs", "8"]
    edited = settings(seqs="6")
    assert TunerState.load(path, edited.targets).args["a"].argv() == edited.targets[0].args


def test_a_state_file_written_before_secrets_were_masked_is_read_then_rewritten_masked(tmp_path: Path) -> None:
    s = settings()
    path = tmp_path / "state.json"
    tuned = [*s.targets[0].args[:-1], "8"]  # type: ignore[index]
    path.write_text(json.dumps({"targets": {"a": {"args": tuned, "config_args": s.targets[0].args, "history": {}}}}))
    state = TunerState.load(path, s.targets, redactor=s.redactor())
    assert state.args["a"].argv() == tuned
    state.save()
    assert KEY not in path.read_text()


@pytest.mark.parametrize("garbage", ["{", "null", "[]", '{"targets": 3}', '{"targets": {"a": {"history": 5}}}'])
def test_a_state_file_that_cannot_be_trusted_is_one_config_error_naming_it(tmp_path: Path, garbage: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(garbage)
    with pytest.raises(ConfigError) as err:
        TunerState.load(path, settings().targets)
    assert err.value.file == str(path) and "move it aside" in str(err.value)


def test_the_owned_arguments_are_unchanged_by_a_round_trip_without_secrets(tmp_path: Path) -> None:
    s = config.parse({"targets": [{"name": "a", "metrics_url": "http://127.0.0.1:8001/metrics",
                                   "args": ["--model", "m", "--max-num-seqs", "4"]}]})
    state = TunerState.fresh(s.targets, path=tmp_path / "state.json")
    state.book({}, {"a": knobs.EngineArgs.parse(["--model", "m", "--max-num-seqs", "16"])})
    assert TunerState.load(tmp_path / "state.json", s.targets).args["a"].argv() == ["--model", "m", "--max-num-seqs", "16"]
