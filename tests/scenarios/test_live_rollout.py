"""A live change through the rollout driver (machine Rule 5), on in-memory engines and a clock the test
moves: the driver never waits for the verification window (``advance`` returns while replicas verify),
a refusal or a missing acknowledgement on one replica puts the whole pool back, and a tuner restarted
mid-verification asks again and judges anew (Rule 3). The same driver over real processes is
tests/processes/test_live_apply.py and tests/faults/test_live_kill_points.py."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tuner.actuators import base, fake
from tuner.planning import verification
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rollout.machine import Outcome, State
from tuner.runtime import driving

ARGV = ("--model", "m", "--max-num-seqs", "16")
CANDIDATE = ("--model", "m", "--max-num-seqs", "16")  # a live change leaves the command line as it is
NAMES = ("a", "b")
LIMITS = machine.Limits(verify_seconds=30, ack_timeout_seconds=10)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeLive:
    """Engines whose cores acknowledge a request at the next poll, unless told to refuse the new values
    (``refuses``) or to stay silent."""

    refuses: dict[str, str] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)
    asked: list[tuple[str, int, dict[str, int | None]]] = field(default_factory=list)
    values: dict[str, dict[str, int | None]] = field(default_factory=lambda: {n: {"max_num_seqs": 8} for n in NAMES})
    pokes: list[str] = field(default_factory=list)

    def ask(self, replica: base.Replica, *, seq: int, values: machine.LiveValues) -> str | None:
        self.asked.append((replica.name, seq, dict(values)))
        if not self._refused(replica.name, values) and replica.name not in self.silent:
            self.values[replica.name] = dict(values)
        return None

    def _refused(self, name: str, values: machine.LiveValues) -> bool:
        return name in self.refuses and dict(values) == {"max_num_seqs": 32}

    def answer(self, replica: base.Replica, *, seq: int, values: machine.LiveValues) -> tuple[bool, str | None]:
        if self._refused(replica.name, values):
            return False, self.refuses[replica.name]
        return self.values[replica.name] == dict(values), None

    def poke(self, replica: base.Replica) -> None:
        self.pokes.append(replica.name)


class Healthy:
    def is_healthy(self, replica: base.Replica) -> bool:
        return True

    def load(self, replica: base.Replica) -> int | None:
        return 0

    def warm(self, replica: base.Replica, *, requests: int) -> str | None:
        return None


@dataclass
class Judge:
    """``driving.Verifier``: counts the scrapes of each window, says ``bad`` replicas got worse."""

    bad: set[str] = field(default_factory=set)
    observed: dict[str, int] = field(default_factory=dict)

    def observe(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> None:
        self.observed[replica.name] = self.observed.get(replica.name, 0) + 1

    def judge(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> verification.Verdict:
        return verification.Verdict(replica.name not in self.bad, "p99 +40%" if replica.name in self.bad else "held")


def driver(path: Path, clock: Clock, live: FakeLive, judge: Judge,
           actuator: fake.FakeActuator | None = None) -> driving.RolloutDriver:
    actuator = actuator or fake.FakeActuator([base.Replica(n, f"http://{n}") for n in NAMES],
                                             running=dict.fromkeys(NAMES, ARGV))
    return driving.RolloutDriver(actuator=actuator, drainer=fake.FakeDrainer(), prober=Healthy(),
                                 journal=journaling.Journal(path, fsync=False, lock=False), verifier=judge,
                                 clock=clock, live_control=live, stop_event=threading.Event(), poll_seconds=0)


def begin(d: driving.RolloutDriver) -> machine.Rollout:
    return d.begin("l1", dict.fromkeys(NAMES, CANDIDATE), limits=LIMITS,
                   live=dict.fromkeys(NAMES, ({"max_num_seqs": 8}, {"max_num_seqs": 32})))


def test_advance_returns_while_the_pool_verifies_and_keeps_the_values_once_they_held(tmp_path: Path) -> None:
    clock, live, judge = Clock(), FakeLive(), Judge()
    d = driver(tmp_path / "j.jsonl", clock, live, judge)
    r = d.advance(begin(d))
    assert [p.state for p in r.progress] == [State.VERIFYING, State.VERIFYING]  # returned: nothing to do now
    assert machine.outcome(r) is Outcome.RUNNING
    seen = dict(judge.observed)
    for _ in range(3):  # the cycles and the job between them go on; each advance scrapes the window once
        clock.now += 5
        r = d.advance(r)
    assert {n: judge.observed[n] - seen[n] for n in NAMES} == {"a": 3, "b": 3}
    assert machine.outcome(r) is Outcome.RUNNING
    clock.now += 30
    r = d.advance(r)
    assert machine.outcome(r) is Outcome.DONE, machine.describe(r)
    assert live.values == {n: {"max_num_seqs": 32} for n in NAMES}
    assert [a for a in live.asked if a[0] == "a"] == [("a", 1000000 % 2 ** 31, {"max_num_seqs": 32})]  # asked once
    assert not any(c[0] in ("stop", "start") for c in d.actuator.calls)  # type: ignore[attr-defined]
    assert journaling.replay(d.journal.records)["l1"] == r  # the journal holds the same rollout


def test_one_replica_worse_than_before_puts_the_whole_pool_back(tmp_path: Path) -> None:
    clock, live, judge = Clock(), FakeLive(), Judge(bad={"b"})
    d = driver(tmp_path / "j.jsonl", clock, live, judge)
    r = d.advance(begin(d))
    clock.now += 31
    r = d.advance(r)
    assert machine.outcome(r) is Outcome.ROLLED_BACK, machine.describe(r)
    assert live.values == {n: {"max_num_seqs": 8} for n in NAMES}
    assert r.of("a").reason == "put back with the pool: b: worse than before: p99 +40%"


def test_a_refusal_or_a_missing_acknowledgement_goes_back_at_the_deadline(tmp_path: Path) -> None:
    clock, live, judge = Clock(), FakeLive(refuses={"a": "max_num_active_seqs above the envelope"}), Judge()
    d = driver(tmp_path / "r.jsonl", clock, live, judge)
    r = d.advance(begin(d))
    assert machine.outcome(r) is Outcome.ROLLED_BACK, machine.describe(r)
    assert r.of("a").reason == "the engine refused it: max_num_active_seqs above the envelope"
    assert live.values == {n: {"max_num_seqs": 8} for n in NAMES}

    clock, live = Clock(), FakeLive(silent={"b"})
    d = driver(tmp_path / "s.jsonl", clock, live, judge)
    r = d.advance(begin(d))
    assert r.of("b").state is State.REQUESTING
    clock.now += 3
    r = d.advance(r)
    assert live.pokes == ["b"]  # an idle engine applies a request at its next step: one small request
    clock.now += 10
    live.silent.clear()  # the put-back request is acknowledged
    r = d.advance(r)
    assert machine.outcome(r) is Outcome.ROLLED_BACK, machine.describe(r)
    assert r.of("b").reason == "not acknowledged within 10s"


def test_a_tuner_restarted_mid_verification_asks_again_and_judges_anew(tmp_path: Path) -> None:
    clock, live, judge = Clock(), FakeLive(), Judge()
    path = tmp_path / "j.jsonl"
    d = driver(path, clock, live, judge)
    d.advance(begin(d))
    clock.now += 12  # killed here: nothing of the driver's memory survives
    again = driver(path, clock, live, Judge())
    r = again.recover()
    assert r is not None and [p.state for p in r.progress] == [State.REQUESTING, State.REQUESTING]
    r = again.advance(r)
    assert [a[1] for a in live.asked if a[0] == "a"] == [1000000, 1012000]  # a new request number
    clock.now += 31
    assert machine.outcome(again.advance(r)) is Outcome.DONE


def test_an_engine_that_died_lost_its_live_values_and_takes_the_pool_back(tmp_path: Path) -> None:
    clock, live, judge = Clock(), FakeLive(), Judge()
    actuator = fake.FakeActuator([base.Replica(n, f"http://{n}") for n in NAMES], running=dict.fromkeys(NAMES, ARGV))
    d = driver(tmp_path / "j.jsonl", clock, live, judge, actuator)
    r = d.advance(begin(d))
    actuator.crash("a")
    clock.now += 1
    r = d.advance(r)
    assert r.of("a").state is State.ROLLED_BACK and not r.of("a").bad_args  # not judged: its values are gone
    assert r.of("b").state is State.ROLLED_BACK and live.values["b"] == {"max_num_seqs": 8}


def test_a_live_step_the_same_way_supersedes_the_verification_in_flight(tmp_path: Path) -> None:
    """Machine Rule 6 (issue 25): once every replica runs the new values, the next live step the same way
    ends this rollout kept — VERIFIED with the reason, journaled — and its verification judges the newest
    value; the journal replays to the same rollout. A replica still asking cannot be superseded."""
    clock, live, judge = Clock(), FakeLive(), Judge()
    d = driver(tmp_path / "j.jsonl", clock, live, judge)
    r = d.advance(begin(d))
    assert machine.supersedable(r)
    clock.now += 2
    r = d.supersede(r, "superseded by l2 (--max-num-seqs 32→64)")
    assert machine.outcome(r) is Outcome.DONE, machine.describe(r)
    verified = [e for e in d.journal.records if e["kind"] == "event" and e.get("event") == "verified"]
    assert [(e["replica"], e["reason"]) for e in verified] == [(n, "superseded by l2 (--max-num-seqs 32→64)")
                                                               for n in NAMES]
    assert journaling.replay(d.journal.records)["l1"] == r
    assert journaling.unfinished(d.journal.records) is None  # the next rollout may begin

    clock, live = Clock(), FakeLive(silent={"b"})
    d = driver(tmp_path / "s.jsonl", clock, live, Judge())
    r = d.advance(begin(d))
    assert r.of("b").state is State.REQUESTING and not machine.supersedable(r)
    with pytest.raises(machine.RolloutError):
        d.supersede(r, "too early")
