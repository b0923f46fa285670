"""The launcher's pod states (tuner.launcher.states), driven by observations the way the rollout machine's
tests drive events: no process, no clock. The same table over real processes: tests/processes/test_launcher.py."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.launcher import states
from tuner.launcher.states import Do, Observation, Pod

LIMITS = states.Limits(start_timeout_seconds=100, stop_timeout_seconds=30, kill_timeout_seconds=5,
                       force_after_seconds=10, desired_wait_seconds=30, unready_after=3, ready_after=2,
                       liveness_engine_seconds=60)
See = Observation
OK, FAIL = (True,), (False,)


def does(effects: tuple[states.Effect, ...]) -> list[Do]:
    return [e.do for e in effects]


def started(candidate: bool = True, now: float = 0.0) -> Pod:
    return states.spawned(Pod(), now=now, candidate=candidate)


def test_a_start_becomes_serving_or_draining_when_healthy() -> None:
    pod, fx = states.step(started(), See(health=OK), 5, LIMITS)
    assert (pod.state, does(fx)) == (states.SERVING, [Do.HEALTHY])
    pod, fx = states.step(started(), See(health=OK, drained=True), 5, LIMITS)
    assert pod.state == states.DRAINING
    pod, fx = states.step(pod, See(health=OK), 6, LIMITS)
    assert (pod.state, does(fx)) == (states.SERVING, [Do.TAKEN])  # the drain is lifted


@pytest.mark.parametrize(("candidate", "then"), [(True, "failed"), (False, "exit")])
@pytest.mark.parametrize(("obs", "now", "code"), [(See(exit_code=3), 1, 3), (See(), 101, 1)])
def test_a_start_that_exits_or_times_out_fails_a_candidate_or_ends_a_first_start(
        candidate: bool, then: str, obs: Observation, now: float, code: int) -> None:
    pod, fx = states.step(started(candidate), obs, now, LIMITS)
    assert pod.state == states.STOPPING and pod.stop is not None and pod.stop.then == then
    assert does(fx) == [Do.STOPPING, Do.TERM_GROUP if obs.exit_code is not None else Do.TERM_LEADER]
    pod, fx = states.step(pod, See(exit_code=code), now + 1, LIMITS)  # nothing is left of the group
    if candidate:
        assert (pod.state, does(fx)) == (states.CANDIDATE_FAILED, [Do.STOPPED, Do.CANDIDATE_FAILED])
        pod, fx = states.step(pod, See(), now + 2, LIMITS)
        assert does(fx) == []  # waits for the next generation
        assert does(states.step(pod, See(fresh_request=True), now + 3, LIMITS)[1]) == [Do.START]
    else:
        assert does(fx) == [Do.STOPPED, Do.EXIT] and fx[-1].code == code


def test_a_relaunch_stops_every_process_then_starts_the_desired_command_line() -> None:
    pod, _ = states.step(started(), See(health=OK), 1, LIMITS)
    pod, fx = states.step(pod, See(other_argv=True, fresh_request=True, generation=4), 2, LIMITS)
    assert does(fx) == [Do.TAKEN, Do.RELAUNCH, Do.STOPPING, Do.TERM_LEADER]
    assert fx[2].reason == "relaunch for desired generation 4"
    pod, fx = states.step(pod, See(left=(10, 11)), 13, LIMITS)  # 11 s after the SIGTERM: SIGINT, once
    assert does(fx) == [Do.INT_LEADER]
    pod, fx = states.step(pod, See(exit_code=0, left=(11,)), 14, LIMITS)  # the leader went; its child did not
    assert does(fx) == [Do.TERM_GROUP] and pod.state == states.STOPPING
    pod, fx = states.step(pod, See(exit_code=0, left=(11,)), 33, LIMITS)
    assert does(fx) == [Do.KILL_GROUP] and pod.stop is not None and pod.stop.killed
    pod, fx = states.step(pod, See(exit_code=0, left=(11,)), 39, LIMITS)
    assert fx == () and pod.stop is not None and pod.stop.survivors == (11,)  # liveness says so
    pod, fx = states.step(pod, See(exit_code=-9), 40, LIMITS)
    assert does(fx) == [Do.STOPPED, Do.START] and fx[0].stop is not None and fx[0].stop.killed


def test_an_unplanned_exit_of_a_serving_engine_ends_the_launcher_with_its_code() -> None:
    pod, _ = states.step(started(), See(health=OK), 1, LIMITS)
    pod, fx = states.step(pod, See(exit_code=7), 2, LIMITS)
    assert does(fx) == [Do.UNPLANNED_EXIT, Do.STOPPING, Do.TERM_GROUP]
    pod, fx = states.step(pod, See(exit_code=7), 3, LIMITS)
    assert does(fx) == [Do.STOPPED, Do.EXIT] and fx[-1].code == 7


def test_the_kubelets_sigterm_stops_the_engine_and_exits_with_its_code_never_forced() -> None:
    pod, _ = states.step(started(), See(health=OK), 1, LIMITS)
    pod, fx = states.step(pod, See(term=True), 2, LIMITS)
    assert pod.state == states.TERMINATING and does(fx) == [Do.STOPPING, Do.TERM_LEADER]
    pod, fx = states.step(pod, See(term=True, left=(10,)), 20, LIMITS)
    assert Do.INT_LEADER not in does(fx)  # the kubelet's SIGTERM drains as the engine decides
    pod, fx = states.step(pod, See(term=True, exit_code=0), 21, LIMITS)
    assert does(fx) == [Do.STOPPED, Do.EXIT] and fx[-1].code == 0
    # a SIGTERM during a relaunch's stop: no start after it
    pod, _ = states.step(started(), See(health=OK), 1, LIMITS)
    pod, _ = states.step(pod, See(other_argv=True), 2, LIMITS)
    pod, fx = states.step(pod, See(term=True, exit_code=0), 3, LIMITS)
    assert does(fx) == [Do.STOPPED, Do.EXIT] and pod.state == states.TERMINATING
    # with nothing running it exits at once
    pod, fx = states.spawn_failed(started(), candidate=True, reason="no such file", code=127)
    assert pod.state == states.CANDIDATE_FAILED and does(fx) == [Do.CANDIDATE_FAILED]
    assert does(states.step(pod, See(term=True), 5, LIMITS)[1]) == [Do.EXIT]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.builds(Observation, exit_code=st.none() | st.integers(-9, 3),
                                    health=st.lists(st.booleans(), max_size=4).map(tuple),
                                    left=st.lists(st.integers(1, 3), max_size=2).map(tuple),
                                    other_argv=st.booleans(), fresh_request=st.booleans(), drained=st.booleans(),
                                    term=st.booleans()),
                          st.floats(0, 200)), max_size=30))
def test_whatever_happens_a_stop_ends_in_one_start_failure_or_exit_and_sigterm_is_never_forced(
        moves: list[tuple[Observation, float]]) -> None:
    pod, now, exited = started(), 0.0, False
    for obs, dt in moves:
        now += dt
        before = pod
        pod, fx = states.step(pod, obs, now, LIMITS)
        kinds = does(fx)
        assert not exited or fx == () or kinds == [Do.EXIT]  # nothing after the end but the end again
        if Do.STOPPED in kinds:
            rest = kinds[kinds.index(Do.STOPPED) + 1:]
            assert len(rest) == 1 and rest[0] in (Do.START, Do.CANDIDATE_FAILED, Do.EXIT), kinds
        if Do.INT_LEADER in kinds:
            assert not pod.terminating and before.stop is not None and before.stop.then == "start"
        if Do.START in kinds:  # the effect would spawn: the launcher reports it so
            pod = states.spawned(pod, now=now, candidate=True)
        if Do.EXIT in kinds:
            exited = True
            pod = dataclasses.replace(pod, engine=False)


def health_fx(effects: tuple[states.Effect, ...]) -> list[Do]:
    return [d for d in does(effects) if d in (Do.UNREADY, Do.READY_AGAIN)]


def serving(now: float = 1.0) -> Pod:
    pod, _ = states.step(started(), See(health=OK), now, LIMITS)
    assert pod.state == states.SERVING and pod.healthy
    return pod


def test_without_desired_json_the_base_starts_after_the_wait_and_at_once_when_it_appears() -> None:
    pod = states.waiting(0.0)
    pod, fx = states.step(pod, See(), 29, LIMITS)
    assert fx == () and pod.state == states.WAITING
    pod, fx = states.step(pod, See(), 30, LIMITS)
    assert does(fx) == [Do.START] and "no desired.json after 30s" in fx[0].reason
    pod, fx = states.step(states.waiting(0.0), See(desired_seen=True), 0.2, LIMITS)
    assert does(fx) == [Do.START]
    pod, fx = states.step(states.waiting(0.0), See(term=True), 1, LIMITS)  # the kubelet's SIGTERM first
    assert does(fx) == [Do.EXIT] and fx[0].code == 0
    no_wait = dataclasses.replace(LIMITS, desired_wait_seconds=0)
    assert does(states.step(states.waiting(5.0), See(), 5.0, no_wait)[1]) == [Do.START]


@pytest.mark.parametrize("answers", [
    [FAIL, OK, FAIL, FAIL, OK, FAIL, FAIL],  # a loaded engine's slow answers: never 3 failures in a row
    [(False, True), (False, False, True)],  # several answers in one tick count one by one
    [FAIL, FAIL],
])
def test_readiness_outlives_failed_answers_fewer_than_unready_after(answers: list[tuple[bool, ...]]) -> None:
    pod = serving()
    for i, health in enumerate(answers):
        pod, fx = states.step(pod, See(health=health), 2 + i, LIMITS)
        assert pod.healthy and health_fx(fx) == []


def test_readiness_goes_after_unready_after_failures_and_comes_back_after_ready_after_successes() -> None:
    pod = serving()
    pod, fx = states.step(pod, See(health=(False, False)), 2, LIMITS)
    assert pod.healthy and health_fx(fx) == []
    pod, fx = states.step(pod, See(health=FAIL), 3, LIMITS)
    assert not pod.healthy and health_fx(fx) == [Do.UNREADY] and "3 failed" in fx[0].reason
    pod, fx = states.step(pod, See(health=OK), 4, LIMITS)
    assert not pod.healthy and health_fx(fx) == []  # one good answer is not enough
    pod, fx = states.step(pod, See(health=(False, True)), 5, LIMITS)
    assert not pod.healthy
    pod, fx = states.step(pod, See(health=OK), 6, LIMITS)
    assert pod.healthy and health_fx(fx) == [Do.READY_AGAIN]
    # a burst inside one tick: lost and back again, both said
    pod, fx = states.step(pod, See(health=(False, False, False, True, True)), 7, LIMITS)
    assert pod.healthy and health_fx(fx) == [Do.UNREADY, Do.READY_AGAIN]


def test_liveness_fails_for_a_wedged_serving_engine_only() -> None:
    pod = serving()
    pod, _ = states.step(pod, See(health=FAIL), 10, LIMITS)
    pod, _ = states.step(pod, See(health=(False, False)), 69, LIMITS)
    assert states.liveness(pod, 69.9, LIMITS) is None  # 59.9 s of failures
    why = states.liveness(pod, 70, LIMITS)
    assert why is not None and "failed for 60s without a break (3 answers)" in why
    drained = dataclasses.replace(pod, state=states.DRAINING)
    assert states.liveness(drained, 70, LIMITS) is not None  # drained but wedged is still wedged
    assert states.liveness(pod, 70, dataclasses.replace(LIMITS, liveness_engine_seconds=None)) is None  # off
    # one good answer breaks the run
    back, _ = states.step(pod, See(health=OK), 70, LIMITS)
    assert states.liveness(back, 200, LIMITS) is None and back.failing_since is None


def test_liveness_never_fails_while_starting_relaunching_or_after_a_failed_candidate() -> None:
    pod, _ = states.step(started(now=0), See(health=(False,) * 50), 90, LIMITS)  # a slow start
    assert pod.state == states.STARTING and states.liveness(pod, 99, LIMITS) is None
    pod = serving()
    pod, _ = states.step(pod, See(health=FAIL), 2, LIMITS)
    pod, _ = states.step(pod, See(other_argv=True, fresh_request=True, health=FAIL), 3, LIMITS)  # a relaunch
    assert pod.state == states.STOPPING
    pod, _ = states.step(pod, See(health=FAIL, left=(10,)), 200, LIMITS)
    assert states.liveness(pod, 200, LIMITS) is None
    pod, fx = states.step(pod, See(exit_code=0), 201, LIMITS)
    assert does(fx) == [Do.STOPPED, Do.START]
    pod = states.spawned(pod, now=201, candidate=True)  # a new engine: its /health record starts afresh
    assert pod.failing_since is None and pod.fail_streak == 0 and not pod.healthy
    failed = dataclasses.replace(pod, state=states.CANDIDATE_FAILED, engine=False, failing_since=0.0)
    assert states.liveness(failed, 500, LIMITS) is None
