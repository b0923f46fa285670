"""The idle wait of a restart (tuner/runtime/driving.py): a drained replica's backlog is waited for while it can
finish by the deadline, and cut short only when the rate it finishes at says it cannot."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fake_prober import FakeProber
from tuner.actuators import base, fake
from tuner.rollout import journal, machine
from tuner.rollout.machine import Event, Step
from tuner.runtime import driving


class Draining(FakeProber):
    """``load0`` requests in flight at the drain, ``rate`` of them finishing per second (none arriving)."""

    def __init__(self, actuator: fake.FakeActuator, load0: int, rate: float) -> None:
        super().__init__(actuator)
        self.load0, self.rate, self.now = load0, rate, 0.0

    def load(self, replica: base.Replica) -> int | None:
        return max(0, math.ceil(self.load0 - self.rate * self.now - 1e-9))


def wait(load0: int, rate: float, timeout: float, prober_type: type[Draining] = Draining
         ) -> tuple[float, Event, str]:
    """Poll the idle wait once a second from the drain until it answers: when, what and why."""
    replica = base.Replica("a", "http://127.0.0.1:9000")
    actuator = fake.FakeActuator([replica], running={"a": ("--max-num-seqs", "8")})
    prober = prober_type(actuator, load0, rate)
    with tempfile.TemporaryDirectory() as tmp:
        driver = driving.RolloutDriver(actuator=actuator, drainer=fake.FakeDrainer(), prober=prober,
                                       journal=journal.Journal(Path(tmp) / "j.jsonl"), idle_settle_seconds=0)
        action = machine.Instruction(Step.WAIT_IDLE, "a", deadline=timeout)
        status = actuator.status("a")
        for t in range(int(timeout) + 2):
            prober.now = float(t)
            answer = driver._wait_idle(replica, status, action, float(t))
            if answer is not None:
                return float(t), *answer
    raise AssertionError("the idle wait never answered")


@settings(max_examples=300, deadline=None)
@given(load0=st.integers(1, 50_000), rate=st.floats(0.01, 500), timeout=st.sampled_from([30.0, 60.0, 120.0, 600.0]))
def test_a_backlog_is_cut_short_only_when_it_cannot_finish_by_the_deadline(load0: int, rate: float,
                                                                         timeout: float) -> None:
    finish = load0 / rate
    at, event, why = wait(load0, rate, timeout)
    if event is Event.IDLE_TIMEOUT and at < timeout:  # cut short: only on evidence, and rightly
        assert at >= driving.BACKLOG_OBSERVE_SECONDS and load0 - math.ceil(load0 - rate * at - 1e-9) >= 10
        assert finish > timeout / 2, why
        assert "stopped now rather than at the deadline" in why
    if finish <= timeout / 2:  # a backlog that finishes in time is waited for to the end
        assert event is Event.IDLE
    if finish > 3 * timeout and rate * driving.BACKLOG_OBSERVE_SECONDS >= driving.BACKLOG_MIN_FINISHED + 1:
        # one that cannot is stopped once the watch has seen enough of it finish, not at the deadline
        assert event is Event.IDLE_TIMEOUT and at <= driving.BACKLOG_OBSERVE_SECONDS + 1, (at, why)


def test_long_requests_that_have_not_finished_yet_are_waited_for() -> None:
    """Eight long generations finish together 40 s after the drain: nothing finished in the first ten seconds
    is no evidence of a backlog that cannot finish."""

    class Together(Draining):
        def load(self, replica: base.Replica) -> int | None:
            return 8 if self.now < 40 else 0

    at, event, _ = wait(8, 0.0, 120.0, Together)
    assert (at, event) == (40.0, Event.IDLE)  # no answer before the last of them finished


def test_a_cut_backlog_names_the_rate_and_the_time_it_needed() -> None:
    """The restart mode's restart-003 in small: 19,000 queued at a cap of 8, about 25 finishing a second."""
    at, event, why = wait(19_000, 25.0, 120.0)
    assert (at, event) == (driving.BACKLOG_OBSERVE_SECONDS, Event.IDLE_TIMEOUT)
    assert why == ("18750 requests in flight would not finish by the deadline: 750 s at the 25/s they finished in "
                   "the last 10 s, 110 s left; stopped now rather than at the deadline")
