"""The operator's switches: pause and pins, as guards the planner asks first, and as the runtime file
(``runtime.control``) the CLI writes and the daemon reads every cycle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.unit.test_planner import QUEUE_BOUND, SETTINGS, run, sig
from tuner.model import knobs
from tuner.model.knobs import EngineArgs
from tuner.planning import guards, planner, pooling
from tuner.runtime import control
from tuner.signals import Signal

TARGETS = {"targets": [{"name": "a", "metrics_url": "http://127.0.0.1:8000/metrics"}]}
PAUSED = SETTINGS.model_copy(update={"paused": "holiday freeze"})


def test_a_paused_tuner_says_what_it_would_do_and_holds_it() -> None:
    p = run(QUEUE_BOUND, "--max-num-seqs 8", settings=PAUSED)
    assert not p.changes and not p.actions
    assert ("*", "paused", "paused: holiday freeze") in [(h.rule, h.guard, h.reason) for h in p.held]
    assert ("queue-slot-bound", "paused", "paused: holiday freeze") in [(h.rule, h.guard, h.reason) for h in p.held]
    assert p.summary() == "cycle 3: no action (paused: holiday freeze)"
    assert run(QUEUE_BOUND, "--max-num-seqs 8").changes  # the same traffic, not paused: the change goes out


def test_a_paused_tuner_sends_no_keep_warm_either() -> None:
    idle = dict(window_seconds=300, request_rate=0, idle_seconds=Signal(300, "no activity in the whole window"))
    p = run(idle, "", cycles=11, start=10_000, settings=SETTINGS.model_copy(update={"paused": True}))
    assert not p.actions and p.history.last_keep_warm is None
    assert any(h.guard == "paused" and "not done: keep-warm" in h.reason for h in p.held)
    assert p.summary().startswith("cycle 11: no action (paused (decisions.paused))")


def test_a_pinned_flag_is_held_with_its_reason() -> None:
    pinned = SETTINGS.model_copy(update={"pins": {"--max-num-seqs": "the clients' SLO was agreed at 8"}})
    p = run(QUEUE_BOUND, "--max-num-seqs 8", settings=pinned)
    assert not p.changes
    (h,) = [h for h in p.held if h.rule == "queue-slot-bound"]
    assert (h.guard, h.reason) == ("pinned", "--max-num-seqs is pinned: the clients' SLO was agreed at 8")


@given(st.sampled_from(sorted(knobs.KNOBS)), st.sampled_from(["vllm", "sglang", "name"]))
def test_a_pin_holds_the_knob_its_flag_names_in_every_spelling_and_no_other(name: str, spelling: str) -> None:
    knob = knobs.KNOBS[name]
    pin = name if spelling == "name" else knob.flag(spelling)  # type: ignore[arg-type]
    if pin is None:
        return  # the engine has no such flag
    found = knobs.knob_for(pin)
    assert found is not None  # (SGLang's --chunked-prefill-size is first of all the batched-token budget)
    held = knobs.KNOBS[found.name]
    for flag in filter(None, (held.flag("vllm"), held.flag("sglang"), *held.aliases)):
        assert not guards.pinned(held.name, flag, {pin: "why"}).allowed
    assert all(guards.pinned(k, "--x", {pin: "why"}).allowed for k in knobs.KNOBS if k != held.name)


def test_pins_must_name_flags_the_tuner_changes() -> None:
    with pytest.raises(ValidationError, match="--no-such-flag: not a flag the tuner changes; expected one of"):
        planner.DecisionSettings(pins={"--no-such-flag": "x"})


def test_a_pending_change_waits_while_paused_and_is_dropped_once_pinned() -> None:
    p = run(QUEUE_BOUND, "--max-num-seqs 8")
    pending = pooling.Pending(p, 0.0, "outside the maintenance window")
    args = {"engine-0": EngineArgs.from_string("--max-num-seqs 8")}
    common = dict(window_open=True, stopping=False, closed_reason="", now=2000.0, args=args, kind="vllm",
                  signals={"engine-0": sig(**QUEUE_BOUND)})
    held = pooling.admit(pooling.PoolPlan(), pending, settings=PAUSED, **common)
    assert held.hand_over is None and held.pending is pending
    dropped = pooling.admit(pooling.PoolPlan(), pending,
                            settings=SETTINGS.model_copy(update={"pins": {"--max-num-seqs": "agreed"}}), **common)
    assert dropped.hand_over is None and dropped.pending is None
    assert dropped.dropped == "--max-num-seqs is pinned: agreed"
    released = pooling.admit(pooling.PoolPlan(), pending, settings=SETTINGS, **common)
    assert released.hand_over is not None and released.released


# --- the runtime file ------------------------------------------------------------------------------------


def test_switches_round_trip_and_add_up_with_the_configuration(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    assert control.load(path) == control.Control()
    c = control.Control(paused="freeze", paused_at=1.0, paused_by="ops",
                        pins={"--max-model-len": control.Pin("32k", 2.0, "ops")})
    control.save(path, c)
    assert control.load(path) == c
    assert path.stat().st_mode & 0o777 == 0o644  # the daemon's user reads what root wrote
    config_pins = SETTINGS.model_copy(update={"pins": {"--max-num-seqs": "config"}})
    eff = control.effective(config_pins, c)
    assert eff.paused == "vllm-tuner pause: freeze"
    assert eff.pins == {"--max-num-seqs": "config", "--max-model-len": "32k"}
    report = control.report(config_pins, c)
    assert report["paused"] and report["paused_from"] == "runtime"
    assert report["pins"]["--max-num-seqs"]["from"] == "config" and report["pins"]["--max-model-len"]["from"] == "runtime"
    assert control.effective(SETTINGS, control.Control()) is SETTINGS


@given(st.binary(max_size=300) | st.builds(lambda v: json.dumps(v).encode(), st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=10)))
def test_a_file_that_does_not_read_pauses_the_tuner_and_never_raises(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "control.json"
        path.write_bytes(data)
        c = control.load(path)
    if c.error is not None:
        assert c.paused is not None and "does not read" in c.paused
        assert control.report(SETTINGS, c)["paused"]
    else:
        control.report(SETTINGS, c)  # a file that reads is reported, whatever it holds


def test_the_file_lives_beside_the_state_file(tmp_path: Path) -> None:
    from tuner import config

    settings = config.TunerSettings.model_validate({"daemon": {"state_file": "state/state.json"}, **TARGETS})
    assert control.path_for(settings, tmp_path / "c.yaml") == tmp_path / "state" / "control.json"
    assert control.path_for(config.TunerSettings.model_validate(TARGETS), "/x/c.yaml") == Path("/var/lib/vllm-tuner/control.json")


@pytest.mark.parametrize(("argv", "expected"), [
    (["pin", "--max-num-seqs", "--reason", "x"], ["pin", "--reason", "x", "--", "--max-num-seqs"]),
    (["pin", "--config", "c.yaml", "--max-model-len"], ["pin", "--config", "c.yaml", "--", "--max-model-len"]),
    (["unpin", "--config=c.yaml", "--max-model-len"], ["unpin", "--config=c.yaml", "--", "--max-model-len"]),
    (["pin", "--reason", "--weird-reason", "max-num-seqs"], ["pin", "--reason", "--weird-reason", "max-num-seqs"]),
    (["pin", "--", "--max-num-seqs"], ["pin", "--", "--max-num-seqs"]),
    (["status", "--max-num-seqs"], ["status", "--max-num-seqs"]),
])
def test_pin_takes_the_engine_flag_as_written(argv: list[str], expected: list[str]) -> None:
    from tuner.cli import operating

    assert operating.flag_as_positional(argv) == expected


def test_a_flag_is_pinned_in_its_own_spelling_or_without_dashes() -> None:
    assert control.pin_name("max-num-seqs") == "--max-num-seqs"
    assert control.pin_name("--max_num_seqs") == "--max-num-seqs"
    with pytest.raises(control.ControlFileError, match="--bogus: not a flag the tuner changes"):
        control.pin_name("bogus")
