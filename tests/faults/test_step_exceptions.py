"""Class 3 of issue 17: a step's exception is that step's failure.

Generated faults make any of the rollout driver's collaborators — the actuator's ``stop``, ``start`` and
``status``, the drainer's ``drain`` and ``undrain``, the prober's ``is_healthy`` and ``warm``, the
verifier — raise an exception of any class (not only the actuators' own errors: a ``KeyError`` from a
bug, an ``OSError`` from a full disk, an ``AssertionError``) at its n-th call, once or a few times.
The promise: ``run`` returns; the rollout is finished (done, rolled back or failed: never running with
the journal unfinished, which would fail every later cycle); no replica is left drained but one whose
way back failed too (the machine's ``FAILED``, journaled for a human); and every engine that runs,
runs its old or its new command line.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fake_prober import FakeProber
from tuner.actuators import base, fake
from tuner.planning import verification
from tuner.rollout import journal, machine
from tuner.runtime import driving

OLD = ("--max-num-seqs", "8")
NEW = ("--max-num-seqs", "32")
NAMES = ("a", "b", "c")
EXCEPTIONS = [KeyError, ValueError, TypeError, RuntimeError, OSError, AssertionError, ZeroDivisionError,
              AttributeError, IndexError]
POINTS = ["actuator.stop", "actuator.start", "actuator.status", "drainer.drain", "drainer.undrain",
          "prober.is_healthy", "prober.warm", "prober.load", "verifier.observe", "verifier.judge"]


class Faults:
    """Raises ``plan[(point, n)]`` at the n-th call of ``point``."""

    def __init__(self, plan: dict[tuple[str, int], type[Exception]]) -> None:
        self.plan = plan
        self.calls: Counter[str] = Counter()
        self.raised: list[str] = []

    def hit(self, point: str) -> None:
        self.calls[point] += 1
        exc = self.plan.get((point, self.calls[point]))
        if exc is not None:
            self.raised.append(point)
            raise exc(f"injected at {point} #{self.calls[point]}")


def _wrap(obj: Any, prefix: str, faults: Faults, methods: tuple[str, ...]) -> Any:
    class Wrapped:
        def __getattr__(self, name: str) -> Any:
            inner = getattr(obj, name)
            if name not in methods:
                return inner

            def call(*args: Any, **kwargs: Any) -> Any:
                faults.hit(f"{prefix}.{name}")
                return inner(*args, **kwargs)

            return call

    return Wrapped()


class Verifier:
    def observe(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> None:
        return None

    def judge(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> verification.Verdict:
        return verification.Verdict(True, "ok")


faults_plans = st.dictionaries(
    st.tuples(st.sampled_from(POINTS), st.integers(1, 12)), st.sampled_from(EXCEPTIONS), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(plan=faults_plans, replicas=st.integers(2, 3))
def test_any_exception_of_any_step_is_that_steps_failure(tmp_path_factory: Any, plan: dict[tuple[str, int], type],
                                                         replicas: int) -> None:
    names = NAMES[:replicas]
    faults = Faults(plan)
    actuator = fake.FakeActuator([base.Replica(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names)],
                                 running=dict.fromkeys(names, OLD))
    drainer = fake.FakeDrainer()
    j = journal.Journal(Path(tmp_path_factory.mktemp("j")) / "j.jsonl")
    driver = driving.RolloutDriver(
        actuator=_wrap(actuator, "actuator", faults, ("stop", "start", "status")),
        prober=_wrap(FakeProber(actuator), "prober", faults, ("is_healthy", "warm", "load")),
        drainer=_wrap(drainer, "drainer", faults, ("drain", "undrain")),
        verifier=_wrap(Verifier(), "verifier", faults, ("observe", "judge")),
        journal=j, poll_seconds=0.001, idle_settle_seconds=0, hold_timeout_seconds=5.0)
    # begin reads each replica's status; a fault there refuses the rollout before anything is touched
    try:
        rollout = driver.begin("r", dict.fromkeys(names, NEW), limits=machine.Limits(verify_seconds=0,
                                                                                     warmup_requests=1))
    except Exception:  # nothing was journaled or touched
        assert journal.unfinished(j.records) is None and not drainer.drained
        return
    rollout = driver.run(rollout)
    assert machine.outcome(rollout) is not machine.Outcome.RUNNING, machine.describe(rollout)
    assert journal.unfinished(journal.read_records(j.path)) is None  # what a restarted tuner would see
    # drained only where the way back failed too (the machine's FAILED: a human must look, journaled)
    failed = {p.name for p in rollout.progress if p.state is machine.State.FAILED}
    assert drainer.drained <= failed, (drainer.drained, faults.raised)
    for name in names:
        status = actuator.status(name)
        assert status.state is not base.State.RUNNING or status.argv in (OLD, NEW), (name, status)
    j.close()
