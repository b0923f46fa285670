"""Issue 31, class 1: a failed rollout never leaves a replica that can serve out of the pool without a bound.

Generated: the confirmation of a replica's arguments fails on each leg — its self-report readable and
different, or unreadable; the engine healthy or not at that moment — and the forward leg fails by its
confirmation or by its verification. The oracle is the machine's table (``tuner/rollout/machine.py``):

- back leg confirmed → ``rolled_back``, undrained;
- back leg, the self-report unreadable, the engine healthy on exactly the old arguments → ``failed_serving``:
  undrained, the rollout ``failed`` with that reason;
- back leg, the self-report readable and different, or unreadable with the engine unhealthy → ``failed``:
  drained, journaled; ``journal.left_drained`` names it, ``/status``'s document and the metric show it at
  once, and a person is asked exactly once after ``left_drained_ask_after_seconds``.

Plus the held-out shape end to end: a real HTTP engine answering ``max_model_len: Infinity`` (valid for
Python's json, refused by the bounded reader) through the daemon's own confirmer and engine client.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fake_prober import FakeProber
from tuner.actuators import base, fake
from tuner.planning import verification
from tuner.rollout import journal, machine
from tuner.runtime import dispatching, drained, driving, selfmetrics
from tuner.sources.engines import EngineClient

OLD = ("--max-model-len", "4096", "--max-num-seqs", "8")
NEW = ("--max-model-len", "4096", "--max-num-seqs", "32")
NAMES = ("a", "b", "c")
LIMITS = machine.Limits(verify_seconds=0, warmup_requests=1, allow_downtime=True)


class Prober(FakeProber):
    """Healthy while the fake runs it, except replicas made ``sick`` (they stop answering /health)."""

    def __init__(self, actuator: fake.FakeActuator) -> None:
        super().__init__(actuator)
        self.sick: set[str] = set()

    def is_healthy(self, replica: base.Replica) -> bool:
        return replica.name not in self.sick and super().is_healthy(replica)


class Verifier:
    def __init__(self, worse: set[str]) -> None:
        self.worse = worse

    def observe(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> None:
        return None

    def judge(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> verification.Verdict:
        return verification.Verdict(replica.name not in self.worse, "p99 TTFT 40% worse")


class Confirmer:
    """What each leg's confirmation of the failing replica finds: "ok", "differs" or "unreadable"; at the
    back leg's confirmation the engine stops answering /health where ``back_healthy`` is False."""

    def __init__(self, victim: str, forward: str, back: str, back_healthy: bool, prober: Prober) -> None:
        self.victim, self.forward, self.back, self.back_healthy, self.prober = victim, forward, back, back_healthy, prober
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __call__(self, replica: base.Replica, argv: Sequence[str]) -> str | None:
        self.calls.append((replica.name, tuple(argv)))
        if replica.name != self.victim:
            return None
        leg = self.forward if tuple(argv) == NEW else self.back
        if tuple(argv) == OLD and not self.back_healthy:
            self.prober.sick.add(replica.name)
        if leg == "differs":
            return "the engine serves max_model_len 2048, expected 4096"
        if leg == "unreadable":
            return driving.Unreadable("the served max_model_len is unreadable: max_model_len is not a finite number")
        return None


def expected(forward: str, back: str, back_healthy: bool) -> machine.State:
    """The table in machine.py's docstring: where the failing replica ends."""
    if back == "ok":
        return machine.State.ROLLED_BACK
    if back == "unreadable" and back_healthy:
        return machine.State.FAILED_SERVING
    return machine.State.FAILED


@settings(max_examples=120, deadline=None)
@given(forward=st.sampled_from(["differs", "unreadable", "worse"]), back=st.sampled_from(["ok", "differs", "unreadable"]),
       back_healthy=st.booleans(), replicas=st.integers(1, 3), victim=st.integers(0, 2))
def test_a_failed_confirmation_leaves_drained_only_what_cannot_serve(
        tmp_path_factory: Any, forward: str, back: str, back_healthy: bool, replicas: int, victim: int) -> None:
    names = NAMES[:replicas]
    victim_name = names[victim % replicas]
    actuator = fake.FakeActuator([base.Replica(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names)],
                                 running=dict.fromkeys(names, OLD))
    prober = Prober(actuator)
    drainer = fake.FakeDrainer()
    confirm = Confirmer(victim_name, "ok" if forward == "worse" else forward, back, back_healthy, prober)
    path = Path(tmp_path_factory.mktemp("j")) / "journal.jsonl"
    j = journal.Journal(path)
    clock = iter(range(10_000))
    driver = driving.RolloutDriver(actuator=actuator, drainer=drainer, prober=prober, journal=j,
                                   verifier=Verifier({victim_name} if forward == "worse" else set()),
                                   confirm=confirm, poll_seconds=0.001, idle_settle_seconds=0,
                                   hold_timeout_seconds=5.0, clock=lambda: float(next(clock)))
    order = (victim_name, *(n for n in names if n != victim_name))
    rollout = driver.run(driver.begin("r", dict.fromkeys(names, NEW), limits=LIMITS, order=order))
    j.close()

    want = expected(forward, back, back_healthy)
    p = rollout.of(victim_name)
    assert p.state is want, (machine.describe(rollout), p.reason)
    assert machine.outcome(rollout) is (machine.Outcome.ROLLED_BACK if want is machine.State.ROLLED_BACK
                                        else machine.Outcome.FAILED)
    # in the pool unless the table says drained; the others were never admitted after the failure
    assert drainer.drained == ({victim_name} if want is machine.State.FAILED else set()), drainer.calls
    assert all(rollout.of(n).state is machine.State.PENDING for n in names if n != victim_name)
    assert actuator.status(victim_name).argv == OLD  # the engine runs exactly its pre-rollout arguments
    if want is machine.State.FAILED_SERVING:
        assert "unreadable" in p.reason and "unconfirmed" in p.reason
    # what a restarted tuner reads from the journal: nothing to resume, and the same replica left drained
    records = journal.read_records(path)
    assert journal.unfinished(records) is None
    left = journal.left_drained(records)
    assert set(left) == ({victim_name} if want is machine.State.FAILED else set())

    # shown at once, a person asked exactly once after the bound, never before
    metrics = selfmetrics.TunerMetrics()
    asked: list[tuple[str, str]] = []
    watch = drained.LeftDrainedWatch(ask_after_seconds=900, metrics=metrics, ask=lambda n, m: asked.append((n, m)))
    since = left[victim_name].since if left else 0.0
    shown = watch.check(records, now=since + 10)
    assert set(shown) == set(left) and not asked
    for name in left:
        assert shown[name]["reason"] == p.reason and not shown[name]["person_asked"]
        assert metrics.registry.get_sample_value("tuner_replica_left_drained_seconds", {"replica": name}) == 10
    for now in (since + 900, since + 901, since + 5000):
        shown = watch.check(records, now=now)
    assert [n for n, _ in asked] == list(left)
    assert all(s["person_asked"] for s in shown.values())


def test_a_later_rollout_that_drains_the_replica_again_clears_it(tmp_path: Path) -> None:
    actuator = fake.FakeActuator([base.Replica("a", "http://127.0.0.1:9000")], running={"a": OLD})
    prober = Prober(actuator)
    j = journal.Journal(tmp_path / "journal.jsonl")
    confirm = Confirmer("a", "differs", "differs", True, prober)
    driver = driving.RolloutDriver(actuator=actuator, drainer=fake.FakeDrainer(), prober=prober, journal=j,
                                   confirm=confirm, poll_seconds=0.001, idle_settle_seconds=0)
    driver.run(driver.begin("r1", {"a": NEW}, limits=LIMITS))
    assert set(journal.left_drained(j.records)) == {"a"}
    metrics = selfmetrics.TunerMetrics()
    watch = drained.LeftDrainedWatch(ask_after_seconds=900, metrics=metrics)
    watch.check(j.records, now=1e10)
    confirm.victim = "nobody"
    driver.run(driver.begin("r2", {"a": NEW}, limits=LIMITS))
    assert journal.left_drained(j.records) == {}
    assert watch.check(j.records, now=1e10) == {}
    assert metrics.registry.get_sample_value("tuner_replica_left_drained_seconds", {"replica": "a"}) is None
    j.close()


# --- the held-out shape: a real HTTP engine whose /v1/models answers max_model_len: Infinity ---------------


class _Engine(http.server.BaseHTTPRequestHandler):
    infinity = False

    def do_GET(self) -> None:
        if self.path.startswith("/v1/models"):
            mml = "Infinity" if type(self).infinity else "4096"
            body = f'{{"object": "list", "data": [{{"id": "m", "max_model_len": {mml}}}]}}'.encode()
        elif self.path.startswith("/version"):
            body = json.dumps({"version": "0.32.0"}).encode()
        elif self.path.startswith("/health"):
            body = b""
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[tuple[str, type[_Engine]]]:
    handler = type("Engine", (_Engine,), {"infinity": True})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_an_engine_whose_self_report_never_reads_is_put_back_after_a_failed_rollout(
        tmp_path: Path, engine: tuple[str, type[_Engine]]) -> None:
    url, _ = engine
    actuator = fake.FakeActuator([base.Replica("a", url)], running={"a": OLD})
    drainer = fake.FakeDrainer()
    client = EngineClient()
    j = journal.Journal(tmp_path / "journal.jsonl")
    # health from the actuator (this engine serves no completions to warm with); the self-report over HTTP
    driver = driving.RolloutDriver(actuator=actuator, drainer=drainer, prober=FakeProber(actuator), journal=j,
                                   confirm=dispatching.confirm_for(client, actuator, kind="vllm"),
                                   poll_seconds=0.01, idle_settle_seconds=0)
    rollout = driver.run(driver.begin("r", {"a": NEW}, limits=LIMITS))
    j.close()
    p = rollout.of("a")
    assert (p.state, machine.outcome(rollout)) == (machine.State.FAILED_SERVING, machine.Outcome.FAILED), p.reason
    assert "max_model_len is unreadable" in p.reason
    assert drainer.drained == set() and actuator.status("a").argv == OLD
    assert journal.left_drained(j.records) == {}
    state = dispatching.rollout_state(rollout)
    assert state["outcome"] == "failed" and state["replicas"] == {"a": "failed_serving"}
    assert "unreadable" in state["reasons"]["a"]


def test_a_readable_self_report_that_differs_on_the_way_back_stays_drained(
        tmp_path: Path, engine: tuple[str, type[_Engine]]) -> None:
    url, handler = engine
    handler.infinity = False  # it serves 4096; the old arguments say 2048
    old = ("--max-model-len", "2048", "--max-num-seqs", "8")
    actuator = fake.FakeActuator([base.Replica("a", url)], running={"a": old})
    drainer = fake.FakeDrainer()
    client = EngineClient()
    j = journal.Journal(tmp_path / "journal.jsonl")
    driver = driving.RolloutDriver(actuator=actuator, drainer=drainer, prober=FakeProber(actuator), journal=j,
                                   confirm=dispatching.confirm_for(client, actuator, kind="vllm"),
                                   poll_seconds=0.01, idle_settle_seconds=0)
    rollout = driver.run(driver.begin("r", {"a": ("--max-model-len", "1024", "--max-num-seqs", "8")},
                                      limits=LIMITS))
    j.close()
    assert rollout.of("a").state is machine.State.FAILED and drainer.drained == {"a"}
    assert set(journal.left_drained(j.records)) == {"a"}


def test_a_failed_live_rollout_leaves_nothing_drained() -> None:
    """A live rollout drains nothing: its FAILED (values not put back) is not a replica out of the pool."""
    r = machine.new("live", replicas=["a"], changes={"a": (OLD, OLD)}, limits=LIMITS, now=0.0,
                    live={"a": ({"max_num_seqs": None}, {"max_num_seqs": 4})})
    records: list[dict[str, Any]] = [{"kind": "rollout", "at": 0.0, **journal.rollout_fields(r)}]
    for i, event in enumerate((machine.Event.GO, machine.Event.FAILED, machine.Event.FAILED), start=1):
        after = machine.handle(r, "a", event, now=float(i), reason="refused")
        records.append({"kind": "event", "at": float(i), **journal.event_fields(r, after, "a", event, "refused")})
        r = after
    assert r.of("a").state is machine.State.FAILED
    assert journal.left_drained(records) == {}


def test_a_replica_left_drained_by_an_earlier_rollout_is_not_counted_as_serving(tmp_path: Path) -> None:
    """Rule 2: b, left drained by r1, answers /health but serves nobody; r2 must not drain a, the one replica
    that serves, while b is still out (b first: drained again, restarted, put back; then a)."""
    actuator = fake.FakeActuator([base.Replica(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("ab")],
                                 running=dict.fromkeys("ab", OLD))
    prober = Prober(actuator)
    drainer = fake.FakeDrainer()
    j = journal.Journal(tmp_path / "journal.jsonl")
    confirm = Confirmer("b", "differs", "differs", True, prober)
    limits = machine.Limits(verify_seconds=0, warmup_requests=1)  # no allow_downtime
    driver = driving.RolloutDriver(actuator=actuator, drainer=drainer, prober=prober, journal=j, confirm=confirm,
                                   poll_seconds=0.001, idle_settle_seconds=0, hold_timeout_seconds=0.2)
    driver.run(driver.begin("r1", {"b": NEW}, limits=limits))
    assert drainer.drained == {"b"}
    confirm.victim = "nobody"
    r2 = driver.run(driver.begin("r2", dict.fromkeys("ab", NEW), limits=limits, order=["a", "b"]))
    # a was held (b out of the pool, a the last serving replica) and the rollout aborted: a never drained
    assert ("drain", "a") not in drainer.calls and r2.of("a").state is machine.State.PENDING, machine.describe(r2)
    r3 = driver.run(driver.begin("r3", dict.fromkeys("ab", NEW), limits=limits, order=["b", "a"]))
    assert machine.outcome(r3) is machine.Outcome.DONE and drainer.drained == set(), machine.describe(r3)
    j.close()
