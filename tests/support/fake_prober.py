"""A prober over the in-memory fake actuator: a replica is healthy while the fake says it runs, it holds no
requests, and warming it always works. The rollout driver's tests drive the branches real engines rarely take
with it (tests/processes/test_rolling.py, tests/faults/test_step_exceptions.py)."""

from __future__ import annotations

from tuner.actuators import base, fake


class FakeProber:
    def __init__(self, actuator: fake.FakeActuator) -> None:
        self.actuator = actuator

    def is_healthy(self, replica: base.Replica) -> bool:
        return self.actuator.status(replica.name).state is base.State.RUNNING

    def load(self, replica: base.Replica) -> int | None:
        return 0

    def warm(self, replica: base.Replica, *, requests: int) -> str | None:
        return None
