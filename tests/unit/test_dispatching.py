"""The dispatcher's booking (tuner.runtime.dispatching.Dispatcher.book, through planning.pooling.book): what a
finished rollout changes in the tuner's owned arguments and histories — and that an interrupted one
changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tuner import config
from tuner.model import knobs
from tuner.planning.history import Change
from tuner.rollout import journal, machine
from tuner.rollout.machine import Event
from tuner.rules.schema import Verify
from tuner.runtime import dispatching
from tuner.runtime.state import TunerState

OLD, NEW = ("--max-num-seqs", "4"), ("--max-num-seqs", "8")
CHANGE = Change(flag="--max-num-seqs", knob="max_num_seqs", from_value=4, to_value=8, rule="r", reason="why",
                direction=1)
FORWARD = (Event.GO, Event.DRAINED, Event.IDLE, Event.STOPPED, Event.STARTED, Event.HEALTHY, Event.CONFIRMED,
           Event.WARMED, Event.UNDRAINED, Event.VERIFIED)


def dispatcher(tmp_path: Path) -> dispatching.Dispatcher:
    settings = config.parse({"mode": "apply", "targets": [
        {"name": n, "metrics_url": f"http://127.0.0.1:{p}/metrics", "args": list(OLD)}
        for n, p in (("a", 8001), ("b", 8002))]})
    state = TunerState.fresh(settings.targets, path=tmp_path / "state.json")
    driver = SimpleNamespace(restored=lambda rollout: rollout)  # booking reads nothing else of the driver
    return dispatching.Dispatcher(settings, state, driver=driver, client=None,  # type: ignore[arg-type]
                            journal=journal.Journal(tmp_path / "j.jsonl"), kind="vllm", clock=lambda: 1000.0)


def rollout_with_a_done() -> machine.Rollout:
    r = machine.new("r1", replicas=["a", "b"], changes={"a": (OLD, NEW), "b": (OLD, NEW)},
                    limits=machine.Limits(), now=0)
    for e in FORWARD:
        r = machine.handle(r, "a", e, now=1)
    return r


def test_an_interrupted_rollout_is_not_booked_twice_the_journal_resumes_it(tmp_path: Path) -> None:
    ap = dispatcher(tmp_path)
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
    ap = dispatcher(tmp_path)
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


def journal_a_finished_rollout(ap: dispatching.Dispatcher) -> machine.Rollout:
    """The journal of a rollout that finished (both replicas done), with its decision, as the driver writes it."""
    ap.journal.append("decision", at=0, rollout="r1", changes=[{**CHANGE.as_dict(), "knob": CHANGE.knob,
                                                               "direction": CHANGE.direction}])
    r = machine.new("r1", replicas=["a", "b"], changes={"a": (OLD, NEW), "b": (OLD, NEW)},
                    limits=machine.Limits(), now=0)
    ap.journal.append("rollout", at=0, **journal.rollout_fields(r))
    for name in ("a", "b"):
        for e in FORWARD:
            after = machine.handle(r, name, e, now=1)
            ap.journal.append("event", at=1, **journal.event_fields(r, after, name, e))
            r = after
    return r


def test_a_rollout_finished_but_not_booked_when_the_tuner_died_is_booked_at_the_next_start_once(
        tmp_path: Path) -> None:
    """SIGKILL between the rollout's last journal record and the state file's write: the restarted tuner
    found nothing unfinished, kept the old arguments as its own while both engines ran the new ones, and
    rolled both replicas out again (tests/faults/test_kill_points.py, k = N)."""
    ap = dispatcher(tmp_path)
    ap.state.booked_rollout = ""  # what a first start saves: nothing booked yet
    ap.state.save()
    journal_a_finished_rollout(ap)
    ap.journal.close()  # …killed here
    again = dispatcher(tmp_path)
    again.state = TunerState.load(tmp_path / "state.json", again.settings.targets)
    out = again.book_unbooked()
    assert out is not None and out.results == {"a": "ok", "b": "ok"}
    saved = TunerState.load(tmp_path / "state.json", again.settings.targets)
    assert saved.booked_rollout == "r1"
    assert saved.args["a"].argv() == list(NEW) and saved.history("a").restarts == (1000.0,)
    assert again.book_unbooked() is None  # once
    again.journal.close()
    third = dispatcher(tmp_path)
    third.state = TunerState.load(tmp_path / "state.json", third.settings.targets)
    assert third.book_unbooked() is None and third.state.history("b").restarts == (1000.0,)
    third.journal.close()


def test_a_state_that_does_not_say_what_it_booked_takes_the_journal_as_booked(tmp_path: Path) -> None:
    """A state file from an older tuner (or none at all) with a journal of finished rollouts: nothing is
    booked twice; the last finished rollout is taken as booked."""
    ap = dispatcher(tmp_path)
    journal_a_finished_rollout(ap)
    assert ap.state.booked_rollout is None
    assert ap.book_unbooked() is None
    assert ap.state.booked_rollout == "r1" and ap.state.args["a"].argv() == list(OLD)
    assert ap.state.history("a").restarts == ()
    ap.journal.close()


@settings(max_examples=200, deadline=None)
@given(st.builds(
    Change, flag=st.just("--max-num-seqs"), knob=st.just("max_num_seqs"), from_value=st.integers(1, 4096),
    to_value=st.integers(1, 4096), rule=st.text(min_size=1, max_size=8), reason=st.text(max_size=20),
    direction=st.sampled_from([-1, 1]), adds_load=st.booleans(), experimental=st.booleans(), live=st.booleans(),
    verify=st.lists(st.one_of(
        st.builds(Verify, signal=st.sampled_from(["itl_mean_s", "ttft_p95_s"]), expect=st.just("no-increase"),
                  tolerance=st.floats(0, 1)),
        st.builds(Verify, signal=st.just("itl_mean_s"), expect=st.just("decrease"),
                  min_change=st.floats(0, 1))), max_size=2).map(tuple)))
def test_a_journaled_change_reads_back_as_the_change_that_was_decided(change: Change) -> None:
    """What a resumed rollout books is the change that was decided, every field of it: a live change
    taken up after a restart was booked as a restart once (the fault test caught it)."""
    assert dispatching._change_from(json.loads(json.dumps(dispatching.change_record(change)))) == change
