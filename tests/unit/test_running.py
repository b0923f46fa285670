"""The rollout adapter's booking (tuner.daemon.running.Applying.book, through planning.pooling.book): what a
finished rollout changes in the tuner's owned arguments and histories — and that an interrupted one
changes nothing."""

from __future__ import annotations

from pathlib import Path

from tuner import config
from tuner.daemon import running
from tuner.daemon.state import TunerState
from tuner.model import knobs
from tuner.planning.history import Change
from tuner.rollout import journal, machine
from tuner.rollout.machine import Event

OLD, NEW = ("--max-num-seqs", "4"), ("--max-num-seqs", "8")
CHANGE = Change(flag="--max-num-seqs", knob="max_num_seqs", from_value=4, to_value=8, rule="r", reason="why",
                direction=1)
FORWARD = (Event.GO, Event.DRAINED, Event.IDLE, Event.STOPPED, Event.STARTED, Event.HEALTHY, Event.CONFIRMED,
           Event.WARMED, Event.UNDRAINED, Event.VERIFIED)


def applying(tmp_path: Path) -> running.Applying:
    settings = config.parse({"mode": "apply", "targets": [
        {"name": n, "metrics_url": f"http://127.0.0.1:{p}/metrics", "args": list(OLD)}
        for n, p in (("a", 8001), ("b", 8002))]})
    state = TunerState.fresh(settings.targets, path=tmp_path / "state.json")
    return running.Applying(settings, state, driver=None, client=None, replicas={},  # type: ignore[arg-type]
                            journal=journal.Journal(tmp_path / "j.jsonl"), clock=lambda: 1000.0)


def rollout_with_a_done() -> machine.Rollout:
    r = machine.new("r1", replicas=["a", "b"], changes={"a": (OLD, NEW), "b": (OLD, NEW)},
                    limits=machine.Limits(), now=0)
    for e in FORWARD:
        r = machine.handle(r, "a", e, now=1)
    return r


def test_an_interrupted_rollout_is_not_booked_twice_the_journal_resumes_it(tmp_path: Path) -> None:
    ap = applying(tmp_path)
    r = rollout_with_a_done()  # a done, b still pending: the tuner was stopping
    out = ap.book(r, [CHANGE])
    assert "interrupted" in out.summary and out.state["outcome"] == "running"
    assert ap.state.args["a"].argv() == list(OLD) and ap.state.history("a").restarts == ()
    assert not (tmp_path / "state.json").exists()
    # the resumed rollout, once finished, is booked once
    for e in FORWARD:
        r = machine.handle(r, "b", e, now=2)
    ap.book(r, [CHANGE])
    assert ap.state.args["a"].argv() == list(NEW) and ap.state.history("a").restarts == (1000.0,)
    assert ap.state.history("b").changes["max_num_seqs"].to_value == "8"
    # the tuner's own restart: warmed by the rollout, not to be warmed again when the next step sees it
    assert ap.state.history("b").own_restarts_until == 1000.0
    saved = TunerState.load(tmp_path / "state.json", ap.settings.targets)
    assert saved.args["b"].argv() == list(NEW) and saved.history("b").restarts == (1000.0,)


def test_a_rolled_back_pool_rejects_the_arguments_on_every_replica(tmp_path: Path) -> None:
    ap = applying(tmp_path)
    r = rollout_with_a_done()
    for e in (Event.GO, Event.DRAINED, Event.IDLE, Event.STOPPED, Event.STARTED):
        r = machine.handle(r, "b", e, now=2)
    r = machine.handle(r, "b", Event.CRASHED, now=3, reason="engine exited: status 1")
    for e in (Event.DRAINED, Event.IDLE, Event.STOPPED, Event.STARTED, Event.HEALTHY, Event.CONFIRMED,
              Event.WARMED, Event.UNDRAINED):
        r = machine.handle(r, "b", e, now=4)
    out = ap.book(r, [CHANGE])
    assert out.results == {"a": "ok", "b": "rolled_back"}
    new = knobs.EngineArgs.parse(NEW)
    assert ap.state.history("b").is_bad(new) == "engine exited: status 1"  # crashed: bad for good
    assert ap.state.args["a"].argv() == list(NEW)  # a stays on what it runs; the pool rolled back at b
