"""The rollout machine, driven by events the way h11's tests drive its connection state: no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.rollout import machine
from tuner.rollout.machine import Event, Leg, Outcome, State, Step

E = Event
OLD = ("--model", "m", "--max-num-seqs", "8")
NEW = ("--model", "m", "--max-num-seqs", "32")
FORWARD_EVENTS = (E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.HEALTHY, E.CONFIRMED, E.WARMED, E.UNDRAINED)
BACK_EVENTS = (E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.HEALTHY, E.CONFIRMED, E.WARMED, E.UNDRAINED)


def make(names: tuple[str, ...] = ("a", "b"), **limits: object) -> machine.Rollout:
    return machine.new(
        "r1",
        replicas=names,
        changes=dict.fromkeys(names, (OLD, NEW)),
        limits=machine.Limits(**limits),  # type: ignore[arg-type]
        now=0.0,
    )


def drive(r: machine.Rollout, name: str, events: tuple[Event, ...], *, now: float = 1.0) -> machine.Rollout:
    for i, event in enumerate(events):
        r = machine.handle(r, name, event, now=now + i)
    return r


def steps(r: machine.Rollout, healthy: set[str], now: float = 100.0) -> list[tuple[Step, str | None]]:
    return [(a.step, a.replica) for a in machine.next_actions(r, now=now, healthy=frozenset(healthy))]


def test_two_replicas_one_at_a_time_to_done() -> None:
    r = make()
    assert steps(r, {"a", "b"}) == [(Step.ADMIT, "a")]
    r = machine.handle(r, "a", E.GO, now=1)
    # a is out of the pool: admitting b as well would make two unavailable.
    acts = machine.next_actions(r, now=1, healthy=frozenset({"a", "b"}))
    assert [(x.step, x.replica) for x in acts] == [(Step.DRAIN, "a"), (Step.HOLD, "b")]
    assert "max_unavailable=1" in acts[1].reason
    r = drive(r, "a", (*FORWARD_EVENTS, E.VERIFIED), now=2)
    assert r.of("a").state is State.DONE
    assert steps(r, {"a", "b"}) == [(Step.ADMIT, "b")]
    r = drive(r, "b", (E.GO, *FORWARD_EVENTS, E.VERIFIED), now=20)
    assert machine.outcome(r) is Outcome.DONE
    assert machine.next_actions(r, now=50, healthy=frozenset({"a", "b"})) == ()
    assert machine.describe(r) == "rollout r1 done: a=done b=done"


def test_each_state_asks_for_its_step_with_this_legs_argv_and_deadlines() -> None:
    r = make(idle_timeout_seconds=10, stop_timeout_seconds=7, start_timeout_seconds=300, verify_seconds=30,
             warmup_requests=4)
    seen = {}
    r = machine.handle(r, "a", E.GO, now=1)
    for event in (*FORWARD_EVENTS, None):
        (action, _hold) = machine.next_actions(r, now=0, healthy=frozenset({"a", "b"}))
        seen[action.step] = action
        if event is not None:
            r = machine.handle(r, "a", event, now=100)
    assert seen[Step.WAIT_IDLE].deadline == 100 + 10
    assert seen[Step.STOP].timeout_seconds == 7
    assert seen[Step.START].argv == NEW
    assert seen[Step.WAIT_HEALTHY].deadline == 100 + 300
    assert seen[Step.CONFIRM_ARGS].argv == NEW
    assert seen[Step.WARM].count == 4
    assert seen[Step.VERIFY].deadline == 100 + 30


def test_health_wait_stretches_to_the_slowest_measured_start_plus_margin() -> None:
    # The trial: 45 s idle, 170 s under load; a fixed 120 s wait was too short.
    limits = machine.Limits(start_timeout_seconds=120, start_margin_seconds=60)
    assert limits.health_wait_seconds(None) == 120
    assert limits.health_wait_seconds(45) == 120
    assert limits.health_wait_seconds(170) == 230
    r = make(start_timeout_seconds=120, start_margin_seconds=60)
    r = drive(r, "a", (E.GO, E.DRAINED, E.IDLE, E.STOPPED), now=0)
    r = machine.handle(r, "a", E.STARTED, now=1000)
    r = machine.handle(r, "a", E.HEALTHY, now=1170)
    assert r.measured_start_seconds == 170
    r = drive(r, "a", (E.CONFIRMED, E.WARMED, E.UNDRAINED, E.VERIFIED, ), now=1200)
    r = drive(r, "b", (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED), now=2000)
    (action,) = machine.next_actions(r, now=2004, healthy=frozenset({"a"}))
    assert action.step is Step.WAIT_HEALTHY
    assert action.deadline == 2004 + 230


def test_unknown_transition_is_an_error_naming_what_is_allowed() -> None:
    r = make()
    with pytest.raises(machine.RolloutError, match=r"'a' is pending \(forward leg\).*'healthy'.*allowed here: go"):
        machine.handle(r, "a", E.HEALTHY, now=1)
    r = drive(r, "a", (E.GO, *FORWARD_EVENTS, E.VERIFIED))
    with pytest.raises(machine.RolloutError, match="none \\(terminal\\)"):
        machine.handle(r, "a", E.FAILED, now=99)
    with pytest.raises(KeyError, match="'zz' is not part of it"):
        machine.handle(r, "zz", E.GO, now=99)


@pytest.mark.parametrize("kind", list(machine.Kind))
@pytest.mark.parametrize(("state", "event"), [(s, e) for s in State for e in Event])
def test_the_table_is_the_only_way_states_change(state: State, event: Event, kind: machine.Kind) -> None:
    r = make() if kind is machine.Kind.RESTART else make_live()
    r = r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__},
                       "progress": (machine.Progress("a", state=state), r.of("b"))})
    target = machine.TABLES[kind, machine.Leg.FORWARD].get((state, event))
    if target is None:
        with pytest.raises(machine.RolloutError):
            machine.handle(r, "a", event, now=5)
    else:
        assert machine.handle(r, "a", event, now=5).of("a").state is target


def test_a_start_that_never_gets_healthy_rolls_back_to_the_old_argv_and_halts() -> None:
    r = make()
    r = drive(r, "a", (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED))
    r = machine.handle(r, "a", E.FAILED, now=50, reason="not healthy after 300 s")
    a = r.of("a")
    # rolled back, but not remembered as bad for good: a slow start on a loaded host is not a refusal
    assert (a.state, a.leg, a.bad_args, a.reason) == (State.ROLLING_BACK, Leg.BACK, False, "not healthy after 300 s")
    assert r.is_halted
    # b is never admitted; a drains again (idempotent) and walks the path with the old arguments.
    assert steps(r, {"b"}) == [(Step.DRAIN, "a")]
    r = drive(r, "a", (E.DRAINED, E.IDLE, E.STOPPED), now=60)
    (start,) = machine.next_actions(r, now=70, healthy=frozenset({"b"}))
    assert (start.step, start.argv) == (Step.START, OLD)
    r = drive(r, "a", (E.STARTED, E.HEALTHY, E.CONFIRMED, E.WARMED, E.UNDRAINED), now=70)
    assert r.of("a").state is State.ROLLED_BACK
    assert r.of("b").state is State.PENDING
    assert machine.next_actions(r, now=90, healthy=frozenset({"a", "b"})) == ()
    assert machine.outcome(r) is Outcome.ROLLED_BACK


@pytest.mark.parametrize(
    ("at", "event", "bad"),
    [
        ((E.GO, E.DRAINED), E.FAILED, False),  # the drain hook failed: old args still live
        ((E.GO, E.DRAINED), E.CRASHED, False),  # the old engine died while draining
        ((E.GO, E.DRAINED, E.IDLE, E.STOPPED), E.FAILED, False),  # the actuator could not launch
        ((E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED), E.CRASHED, True),  # exited at start
        ((E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED), E.FAILED, False),  # alive, past the deadline
        ((E.GO, *FORWARD_EVENTS[:5]), E.FAILED, False),  # argv mismatch: not the engine's fault
        ((E.GO, *FORWARD_EVENTS[:6]), E.CRASHED, True),  # died at its first (warm-up) requests
        ((E.GO, *FORWARD_EVENTS), E.FAILED, False),  # worse than the baseline
        ((E.GO, *FORWARD_EVENTS), E.CRASHED, True),  # died at its first live requests
    ],
)
def test_which_failures_mark_the_new_arguments_bad(at: tuple[Event, ...], event: Event, bad: bool) -> None:
    r = machine.handle(drive(make(), "a", at), "a", event, now=99)
    assert r.of("a").state is State.ROLLING_BACK
    assert r.of("a").bad_args is bad


def test_a_step_failing_before_the_stop_goes_back_by_undraining_only() -> None:
    """The engine still runs the old arguments at DRAINING and WAITING_IDLE: the back leg begins at the
    undrain. Past the stop, and on the back leg, a failure is FAILED as before."""
    for at in ((E.GO,), (E.GO, E.DRAINED)):
        r = drive(make(), "a", at)
        assert machine.failure_event(r, "a") is E.FAILED_BEFORE_STOP
        r = machine.handle(r, "a", E.FAILED_BEFORE_STOP, now=50, reason="nginx -t rejected the config")
        a = r.of("a")
        assert (a.state, a.leg, a.bad_args, a.reason) == (
            State.UNDRAINING, Leg.BACK, False, "nginx -t rejected the config")
        assert steps(r, {"a", "b"}) == [(Step.UNDRAIN, "a")]  # halted: b is not admitted
        assert machine.handle(r, "a", E.UNDRAINED, now=51).of("a").state is State.ROLLED_BACK
        assert machine.handle(r, "a", E.FAILED, now=51).of("a").state is State.FAILED
        again = machine.handle(r, "a", E.INTERRUPTED, now=51)  # resumed: the old arguments are confirmed
        assert (again.of("a").state, again.of("a").leg) == (State.WAITING_HEALTHY, Leg.BACK)
    past = drive(make(), "a", (E.GO, E.DRAINED, E.IDLE))
    assert machine.failure_event(past, "a") is E.FAILED
    with pytest.raises(machine.RolloutError):
        machine.handle(past, "a", E.FAILED_BEFORE_STOP, now=60)
    back = machine.handle(drive(make(), "a", (E.GO, E.DRAINED, E.IDLE)), "a", E.FAILED, now=60)
    back = machine.handle(back, "a", E.DRAINED, now=61)  # back leg, waiting for idle
    assert back.of("a").state is State.WAITING_IDLE and machine.failure_event(back, "a") is E.FAILED
    with pytest.raises(machine.RolloutError):
        machine.handle(back, "a", E.FAILED_BEFORE_STOP, now=62)


def test_a_failure_on_the_back_leg_leaves_the_replica_failed_and_out_of_the_pool() -> None:
    r = drive(make(("a", "b", "c"), max_unavailable=2), "a", (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED))
    r = machine.handle(r, "a", E.CRASHED, now=10)
    r = drive(r, "a", (E.DRAINED, E.IDLE, E.STOPPED, E.STARTED), now=11)
    r = machine.handle(r, "a", E.FAILED, now=20, reason="old arguments do not start either")
    assert r.of("a").state is State.FAILED
    assert machine.outcome(r) is Outcome.FAILED
    with pytest.raises(machine.RolloutError):
        machine.handle(r, "a", E.INTERRUPTED, now=21)


def test_rule2_never_takes_down_the_last_serving_replica() -> None:
    single = make(("a",))
    (hold,) = machine.next_actions(single, now=0, healthy=frozenset({"a"}))
    assert hold.step is Step.HOLD
    assert "last serving replica" in hold.reason and "allow_downtime" in hold.reason
    assert steps(make(("a",), allow_downtime=True), {"a"}) == [(Step.ADMIT, "a")]
    # b is not healthy (still starting, or broken): a must wait, whatever b's role in the rollout.
    assert steps(make(), {"a"})[0][0] is Step.HOLD
    assert steps(make(("a", "b", "c"), max_unavailable=2), {"a", "c"}) == [(Step.ADMIT, "a")]


def test_max_unavailable_two_admits_two_and_counts_broken_replicas() -> None:
    r = make(("a", "b", "c"), max_unavailable=2)
    r = machine.handle(r, "a", E.GO, now=1)
    assert steps(r, {"a", "b", "c"}) == [(Step.DRAIN, "a"), (Step.ADMIT, "b")]
    r = machine.handle(r, "b", E.GO, now=1)
    assert [s for s, _ in steps(r, {"a", "b", "c"})] == [Step.DRAIN, Step.DRAIN, Step.HOLD]


def test_rule3_interrupted_replicas_resume_at_a_step_safe_to_repeat() -> None:
    expected = {
        (E.GO,): State.DRAINING,
        (E.GO, E.DRAINED): State.DRAINING,
        (E.GO, E.DRAINED, E.IDLE): State.STOPPING,
        (E.GO, E.DRAINED, E.IDLE, E.STOPPED): State.STOPPING,
        (E.GO, *FORWARD_EVENTS[:4]): State.WAITING_HEALTHY,
        (E.GO, *FORWARD_EVENTS[:5]): State.WAITING_HEALTHY,
        (E.GO, *FORWARD_EVENTS[:6]): State.WAITING_HEALTHY,
        (E.GO, *FORWARD_EVENTS[:7]): State.WAITING_HEALTHY,
        (E.GO, *FORWARD_EVENTS): State.WAITING_HEALTHY,
    }
    for events, resume_at in expected.items():
        r = machine.handle(drive(make(), "a", events), "a", E.INTERRUPTED, now=50)
        a = r.of("a")
        assert (a.state, a.leg, a.resumes) == (resume_at, Leg.FORWARD, 1), events


def test_rule3_a_second_interruption_rolls_back_and_the_back_leg_resumes_by_draining() -> None:
    r = drive(make(), "a", (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.INTERRUPTED))
    r = machine.handle(r, "a", E.INTERRUPTED, now=60)
    a = r.of("a")
    assert (a.state, a.leg, a.bad_args) == (State.ROLLING_BACK, Leg.BACK, False)
    assert "interrupted 2 times" in a.reason
    r = drive(r, "a", (E.DRAINED, E.IDLE, E.STOPPED, E.INTERRUPTED), now=70)
    assert (r.of("a").state, r.of("a").leg) == (State.STOPPING, Leg.BACK)
    r = machine.handle(drive(r, "a", (E.STOPPED, E.STARTED, E.HEALTHY)), "a", E.INTERRUPTED, now=90)
    assert (r.of("a").state, r.of("a").leg) == (State.WAITING_HEALTHY, Leg.BACK)


def test_rule3_an_engine_found_down_is_stopped_and_started_again_not_judged() -> None:
    """After a host reboot the tuner finds the engine down: wherever the replica was, it re-enters at the
    (idempotent) stop and is started again with its leg's arguments — never marked bad for it."""
    for n in range(len(FORWARD_EVENTS)):
        r = machine.handle(drive(make(), "a", (E.GO, *FORWARD_EVENTS[:n])), "a", E.FOUND_DOWN, now=50)
        a = r.of("a")
        assert (a.state, a.leg, a.resumes, a.bad_args) == (State.STOPPING, Leg.FORWARD, 1, False), n
    back = drive(make(), "a", (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.CRASHED))
    assert back.of("a").leg is Leg.BACK
    r = machine.handle(back, "a", E.FOUND_DOWN, now=60)
    assert (r.of("a").state, r.of("a").leg) == (State.STOPPING, Leg.BACK)
    again = machine.handle(drive(make(), "a", (E.GO, E.DRAINED, E.FOUND_DOWN)), "a", E.FOUND_DOWN, now=70)
    assert (again.of("a").state, again.of("a").leg) == (State.ROLLING_BACK, Leg.BACK)  # max_resumes: back


def test_abort_admits_nothing_more_but_lets_in_flight_replicas_finish() -> None:
    r = machine.handle(make(), "a", E.GO, now=1)
    r = machine.abort(r, "operator asked")
    assert steps(r, {"a", "b"}) == [(Step.DRAIN, "a")]
    assert machine.outcome(r) is Outcome.RUNNING
    r = drive(r, "a", (*FORWARD_EVENTS, E.VERIFIED))
    assert machine.outcome(r) is Outcome.ABORTED


def test_new_rejects_what_cannot_be_rolled_out() -> None:
    with pytest.raises(ValueError, match="not replicas of this actuator: x"):
        machine.new("r", replicas=["a"], changes={"x": (OLD, NEW)}, limits=machine.Limits(), now=0)
    with pytest.raises(ValueError, match="nothing to change"):
        machine.new("r", replicas=["a"], changes={}, limits=machine.Limits(), now=0)
    with pytest.raises(ValueError, match="order leaves out a"):
        machine.new("r", replicas=["a", "b"], changes={"a": (OLD, NEW)}, order=["b"],
                    limits=machine.Limits(), now=0)
    with pytest.raises(ValueError, match="max_unavailable must be >= 1"):
        machine.new("r", replicas=["a"], changes={"a": (OLD, NEW)}, limits=machine.Limits(max_unavailable=0), now=0)
    r = machine.new("r", replicas=["a", "b"], changes={"a": (OLD, NEW), "b": (OLD, NEW)}, order=["b", "a"],
                    limits=machine.Limits(), now=0)
    assert r.order == ("b", "a")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from([e for e in Event if e is not E.GO])), max_size=80),
       st.integers(1, 2), st.sets(st.sampled_from(["a", "b", "c"])))
def test_whatever_happens_no_more_than_max_unavailable_are_out_of_the_pool(
    moves: list[tuple[int, Event]], max_unavailable: int, unhealthy: set[str]
) -> None:
    names = ("a", "b", "c")
    r = make(names, max_unavailable=max_unavailable)
    healthy = frozenset(set(names) - unhealthy)
    # GO only ever comes from an ADMIT action (the driver's contract); every other event may come any time.
    for t, (i, event) in enumerate(moves):
        for action in machine.next_actions(r, now=t, healthy=healthy):
            if action.step is Step.ADMIT:
                assert action.replica is not None
                r = machine.handle(r, action.replica, E.GO, now=t)
        name = names[i]
        try:
            r = machine.handle(r, name, event, now=t)
        except machine.RolloutError:
            continue
        out = {p.name for p in r.progress if p.state in machine.IN_FLIGHT or p.state is State.FAILED}
        assert len(out) <= max_unavailable
        # Out-of-pool replicas that were unhealthy before admission still count against the budget; one
        # that left for good (Rule 4: its pod deleted) is no longer in the pool and counts for nothing.
        present = set(names) - {p.name for p in r.progress if p.state is State.LEFT}
        down = present - healthy
        assert len(out | down) <= max(max_unavailable, len(down))


def test_a_replica_that_left_counts_no_more_for_availability() -> None:
    """The case Hypothesis found once the pool could lose a pod (Rule 4): b, unhealthy, leaves; a may go
    (c serves) — b's unavailability no longer holds the rollout up."""
    r = make(("a", "b", "c"), max_unavailable=1)
    healthy = frozenset({"a", "c"})
    assert [a.step for a in machine.next_actions(r, now=0, healthy=healthy)] == [Step.HOLD]
    r = machine.handle(r, "b", E.LEFT, now=1)
    assert [(a.step, a.replica) for a in machine.next_actions(r, now=1, healthy=healthy)] == [(Step.ADMIT, "a")]


# --- Rule 5: the live path ---------------------------------------------------------------------------


def make_live(names: tuple[str, ...] = ("a", "b"), **limits: object) -> machine.Rollout:
    return machine.new("l1", replicas=names, changes=dict.fromkeys(names, (OLD, NEW)),
                       live=dict.fromkeys(names, ({"max_num_seqs": 8}, {"max_num_seqs": 32})),
                       limits=machine.Limits(**limits), now=0.0)  # type: ignore[arg-type]


def test_a_live_change_asks_every_replica_at_once_and_verifies_without_a_restart() -> None:
    r = make_live(ack_timeout_seconds=20, verify_seconds=30)
    assert r.kind is machine.Kind.LIVE
    assert steps(r, set()) == [(Step.ADMIT, "a")]  # nothing leaves the pool: no availability rule
    r = machine.handle(r, "a", E.GO, now=1.5)
    assert steps(r, set()) == [(Step.REQUEST, "a"), (Step.ADMIT, "b")]
    (request, _) = machine.next_actions(r, now=2, healthy=frozenset())
    assert (request.values, request.deadline, request.seq) == ({"max_num_seqs": 32}, 21.5, 1500)
    r = machine.handle(r, "b", E.GO, now=2)
    for name in ("a", "b"):
        r = drive(r, name, (E.ACKNOWLEDGED,), now=3)
    assert steps(r, set()) == [(Step.VERIFY, "a"), (Step.VERIFY, "b")]
    r = drive(r, "a", (E.VERIFIED,), now=40)
    r = drive(r, "b", (E.VERIFIED,), now=40)
    assert machine.outcome(r) is Outcome.DONE
    assert machine.describe(r) == "rollout l1 done: a=done b=done"


def test_a_live_replica_that_goes_back_takes_the_pool_with_it() -> None:
    r = make_live(("a", "b", "c"))
    r = drive(r, "a", (E.GO, E.ACKNOWLEDGED, E.VERIFIED))
    r = drive(r, "b", (E.GO, E.ACKNOWLEDGED))
    r = machine.handle(r, "b", E.FAILED, now=9, reason="worse than before: p99")
    assert [(p.name, p.state, p.leg) for p in r.progress] == [
        ("a", State.PUTTING_BACK, Leg.BACK), ("b", State.PUTTING_BACK, Leg.BACK), ("c", State.PENDING, Leg.FORWARD)]
    assert r.of("a").reason == "put back with the pool: b: worse than before: p99"
    assert steps(r, {"a", "b", "c"}) == [(Step.REQUEST, "a"), (Step.REQUEST, "b")]  # halted: c stays
    assert r.values_for("a") == {"max_num_seqs": 8}
    r = drive(r, "a", (E.ACKNOWLEDGED,), now=10)
    r = machine.handle(r, "b", E.FAILED, now=11, reason="not acknowledged")
    assert machine.outcome(r) is Outcome.FAILED
    assert not any(p.bad_args for p in r.progress)  # live values never mark the command line bad


@pytest.mark.parametrize(("at", "event", "state"), [
    ((E.GO,), E.INTERRUPTED, State.REQUESTING),  # ask again: idempotent
    ((E.GO, E.ACKNOWLEDGED), E.INTERRUPTED, State.REQUESTING),  # ask again and verify anew
    ((E.GO, E.ACKNOWLEDGED), E.FOUND_DOWN, State.ROLLED_BACK),  # the engine lost its values with its process
    ((E.GO, E.ACKNOWLEDGED), E.CRASHED, State.ROLLED_BACK),
    ((E.GO, E.FAILED), E.INTERRUPTED, State.PUTTING_BACK),
    ((E.GO, E.FAILED), E.FOUND_DOWN, State.ROLLED_BACK),
])
def test_rule3_on_the_live_path(at: tuple[Event, ...], event: Event, state: State) -> None:
    r = machine.handle(drive(make_live(("a",)), "a", at), "a", event, now=50)
    assert r.of("a").state is state


def test_rule3_a_second_interruption_of_a_live_change_puts_it_back() -> None:
    r = drive(make_live(("a",)), "a", (E.GO, E.INTERRUPTED, E.ACKNOWLEDGED, E.INTERRUPTED))
    assert (r.of("a").state, r.of("a").leg) == (State.PUTTING_BACK, Leg.BACK)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from([e for e in Event if e is not E.GO])), max_size=60))
def test_whatever_happens_a_live_pool_never_keeps_values_one_replica_put_back(moves: list[tuple[int, Event]]) -> None:
    names = ("a", "b", "c")
    r = make_live(names)
    # GO only ever comes from an ADMIT action (the driver's contract); every other event may come any time.
    for t, (i, event) in enumerate(moves):
        for action in machine.next_actions(r, now=t, healthy=frozenset()):
            if action.step is Step.ADMIT:
                assert action.replica is not None
                r = machine.handle(r, action.replica, E.GO, now=t)
        try:
            r = machine.handle(r, names[i], event, now=t)
        except machine.RolloutError:
            continue
        back = [p for p in r.progress if p.leg is Leg.BACK or p.state is State.ROLLED_BACK]
        if back:
            kept = [p.name for p in r.progress if p.leg is Leg.FORWARD and
                    (p.state in machine.IN_FLIGHT or p.state is State.DONE)]
            assert not kept, machine.describe(r)
    assert machine.outcome(r) is not Outcome.DONE or all(p.state in (State.DONE, State.LEFT) for p in r.progress)


# --- issue 31: an unconfirmable back leg on the old arguments goes back in the pool --------------------------


def _to_back_confirm(rollout: machine.Rollout, name: str) -> machine.Rollout:
    """Forward to CONFIRMING_ARGS, failed there, and the back leg up to its own CONFIRMING_ARGS."""
    E = machine.Event
    for event in (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.HEALTHY, E.FAILED,
                  E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.HEALTHY):
        rollout = machine.handle(rollout, name, event, now=1.0, reason="x" if event is E.FAILED else "")
    assert rollout.of(name).state is machine.State.CONFIRMING_ARGS and rollout.of(name).leg is machine.Leg.BACK
    return rollout


def test_unconfirmed_on_the_back_leg_is_undrained_and_the_rollout_failed() -> None:
    r = _to_back_confirm(machine.new("r", replicas=["a", "b"], limits=machine.Limits(), now=0.0,
                                     changes={"a": (["--x", "1"], ["--x", "2"]), "b": (["--x", "1"], ["--x", "2"])}),
                         "a")
    r = machine.handle(r, "a", machine.Event.UNCONFIRMED, now=2.0, reason="self-report unreadable")
    assert r.of("a").state is machine.State.RELEASING
    assert machine.next_actions(r, now=2.0, healthy=frozenset({"a", "b"}))[0].step is machine.Step.UNDRAIN
    assert machine.State.RELEASING in machine.MAY_SERVE[machine.Leg.BACK]
    resumed = machine.handle(r, "a", machine.Event.INTERRUPTED, now=3.0)  # Rule 3: health and argv checked again
    assert resumed.of("a").state is machine.State.WAITING_HEALTHY
    failed = machine.handle(r, "a", machine.Event.FAILED, now=3.0, reason="undrain refused")
    assert failed.of("a").state is machine.State.FAILED  # the undrain failed: drained, a person is asked
    r = machine.handle(r, "a", machine.Event.UNDRAINED, now=3.0)
    assert r.of("a").state is machine.State.FAILED_SERVING and r.of("a").reason == "self-report unreadable"
    assert machine.outcome(r) is machine.Outcome.FAILED
    assert r.of("b").state is machine.State.PENDING and machine.next_actions(r, now=4.0, healthy=frozenset()) == ()


def test_unconfirmed_is_not_an_event_of_the_forward_leg() -> None:
    r = machine.new("r", replicas=["a"], changes={"a": (["--x", "1"], ["--x", "2"])}, limits=machine.Limits(), now=0.0)
    for event in (machine.Event.GO, machine.Event.DRAINED, machine.Event.IDLE, machine.Event.STOPPED,
                  machine.Event.STARTED, machine.Event.HEALTHY):
        r = machine.handle(r, "a", event, now=1.0)
    with pytest.raises(machine.RolloutError):
        machine.handle(r, "a", machine.Event.UNCONFIRMED, now=2.0)
