"""Rollouts end to end: two stub engines (real processes) behind a REAL nginx, under a real load loop
through nginx, driven by ``RolloutDriver`` with the process actuator and the nginx drainer.

The lead's e2e tier runs the same driver over real vLLM; here the engine is
``tests/support/stub_engine.py`` (starts in 1.5 s instead of 45-170 s). Every wait is bounded and all
traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import nginx as nginx_support
from harness import required
from tests.support.fake_prober import FakeProber
from tuner.actuators import base, fake, process
from tuner.errors import PermanentActuatorError
from tuner.planning import verification
from tuner.rollout import journal, machine
from tuner.rollout.machine import Outcome
from tuner.runtime import driving, engineside
from tuner.sources.engines import EngineClient

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 4

STUB = Path(__file__).resolve().parents[1] / "support" / "stub_engine.py"
LIMITS = machine.Limits(idle_timeout_seconds=10, stop_timeout_seconds=10, start_timeout_seconds=20,
                        start_margin_seconds=10, verify_seconds=2, warmup_requests=2)
pytestmark = pytest.mark.usefixtures("real_nginx")


@pytest.fixture(scope="module")
def real_nginx() -> None:
    required.need(nginx_support.skip_reason(), "real nginx")


class Load:
    """Clients posting completions through nginx until stopped; counts every outcome."""

    def __init__(self, url: str, *, workers: int = 4) -> None:
        self.url = url
        self.outcomes: Counter[str] = Counter()
        self.errors: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(workers)]

    def _loop(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(self.url + "/v1/completions", json={"model": "stub", "prompt": "hi",
                                                                        "max_tokens": 4})
                    self.outcomes["ok" if r.status_code == 200 else f"http {r.status_code}"] += 1
                except httpx.HTTPError as exc:
                    self.outcomes[type(exc).__name__] += 1
                    self.errors.append((time.time(), repr(exc)))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=35)

    @property
    def failed(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k != "ok")


class Crash(BaseException):
    """The tuner dies right after this record reached the disk (as SIGKILL would leave it)."""


class CrashingJournal(journal.Journal):
    def __init__(self, path: Path, when: Callable[[journal.Record], bool], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._when = when

    def append(self, kind: str, *, at: float, **fields: Any) -> journal.Record:
        record = super().append(kind, at=at, **fields)
        if self._when(record):
            raise Crash(record)
        return record


@dataclass
class Stack:
    tmp: Path
    ports: dict[str, int]
    lb: nginx_support.NginxBalancer
    actuators: list[process.ProcessActuator] = field(default_factory=list)
    probers: list[EngineClient] = field(default_factory=list)
    bad: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)

    @property
    def replicas(self) -> list[base.Replica]:
        return [base.Replica(n, f"http://127.0.0.1:{p}") for n, p in self.ports.items()]

    def argv(self, name: str, max_num_seqs: int | str = 8, *extra: str) -> tuple[str, ...]:
        return ("--host", "127.0.0.1", "--port", str(self.ports[name]), "--model", "stub",
                "--max-num-seqs", str(max_num_seqs), "--stub-latency", "0.1", "--stub-start-seconds", "1.5",
                "--shutdown-timeout", "5", *extra)

    def actuator(self) -> process.ProcessActuator:
        """A fresh instance over the same state directory: what a restarted tuner builds."""
        a = process.ProcessActuator(self.replicas, command=[sys.executable, str(STUB)], state_dir=self.tmp / "state")
        self.actuators.append(a)
        return a

    def driver(self, j: journal.Journal) -> driving.RolloutDriver:
        client = EngineClient()
        self.probers.append(client)
        prober = engineside.EngineProber(client, kind="vllm")
        return driving.RolloutDriver(
            actuator=self.actuator(), drainer=self.lb.drainer(settle_seconds=0.3), prober=prober,
            journal=j, poll_seconds=0.2, idle_settle_seconds=0.5, hold_timeout_seconds=60,
            on_bad_args=lambda *bad: self.bad.append(bad),
        )

    def live_argv(self, name: str) -> tuple[str, ...]:
        return tuple(httpx.get(f"http://127.0.0.1:{self.ports[name]}/stub/argv", timeout=2).json()["argv"])

    def pid(self, name: str) -> int:
        return int(httpx.get(f"http://127.0.0.1:{self.ports[name]}/stub/argv", timeout=2).json()["pid"])


_run = itertools.count()

# The engines of a stack are started by an earlier tuner: a process of its own that exits, as a tuner restarted
# mid-rollout does. Every actuator of the test then adopts them from their pid files, as the next tuner does.
# Started from the test's own process, the first actuator's Popen and the adopting actuator's waitpid were two
# waiters on one child: the adopting one reaped it, the Popen's status stayed unread, and its pid could name
# another child by the time the teardown polled it (pid_max 32,768; `make test` spends pids fast). The garbage
# collector then freed it "still running" in whatever test ran next.
EARLIER_TUNER = """
import json, sys
from pathlib import Path
from tuner.actuators import base, process
doc = json.loads(sys.argv[1])
replicas = [base.Replica(name, url) for name, url in doc["replicas"]]
actuator = process.ProcessActuator(replicas, command=doc["command"], state_dir=Path(doc["state_dir"]))
for name, argv in doc["argv"].items():
    actuator.start(name, argv)
"""


def _start_by_an_earlier_tuner(s: Stack) -> None:
    import json
    import os
    import subprocess

    from tuner.actuators import children

    doc = {"replicas": [(r.name, r.base_url) for r in s.replicas], "command": [sys.executable, str(STUB)],
           "state_dir": str(s.tmp / "state"), "argv": {name: list(s.argv(name)) for name in s.ports}}
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    tuner = subprocess.Popen([sys.executable, "-c", EARLIER_TUNER, json.dumps(doc)], env=env)
    code = children.stop(tuner, timeout_seconds=60, signal_first=None)
    assert code == 0, f"the earlier tuner exited {code}"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    n = next(_run)
    ports = {f"a{n}": nginx_support.free_port(), f"b{n}": nginx_support.free_port()}
    with nginx_support.NginxBalancer({name: f"127.0.0.1:{p}" for name, p in ports.items()}) as lb:
        s = Stack(tmp_path, ports, lb)
        _start_by_an_earlier_tuner(s)
        client = EngineClient()
        deadline = time.monotonic() + 20
        while not all(client.is_healthy(r.base_url, "vllm") for r in s.replicas):
            assert time.monotonic() < deadline, "stub engines did not become healthy"
            time.sleep(0.1)
        client.close()
        try:
            yield s
        finally:
            last = s.actuators[-1] if s.actuators else s.actuator()
            for name in ports:
                last.stop(name, timeout_seconds=5)
            for a in s.actuators:  # in-process only: let older instances reap what they had started
                for name in ports:
                    a.status(name)
            for p in s.probers:
                p.close()


def events_at(records: Any) -> list[tuple[float, str, str, str]]:
    return [(r["at"], r["replica"], r["event"], r["to"]) for r in records if r["kind"] == "event"]


def events(records: Any) -> list[tuple[str, str, str]]:
    return [(r["replica"], r["event"], r["to"]) for r in records if r["kind"] == "event"]


def test_rollout_under_load_through_nginx_drops_no_request(stack: Stack) -> None:
    a, b = stack.ports
    with journal.Journal(stack.tmp / "journal.jsonl") as j, Load(stack.lb.url) as load:
        time.sleep(1)
        driver = stack.driver(j)
        rollout = driver.begin("r1", {n: stack.argv(n, 32) for n in (a, b)}, limits=LIMITS)
        began = time.monotonic()
        rollout = driver.run(rollout)
        took = time.monotonic() - began
        time.sleep(1)
    assert machine.outcome(rollout) is Outcome.DONE, machine.describe(rollout)
    assert load.failed == 0, load.outcomes
    assert load.outcomes["ok"] > 50
    assert stack.live_argv(a) == stack.argv(a, 32) and stack.live_argv(b) == stack.argv(b, 32)
    seq = events(j.records)
    # One at a time: b is admitted only after a is verified, and each walks the whole path.
    assert seq.index((b, "go", "draining")) > seq.index((a, "verified", "done"))
    path = ["draining", "waiting_idle", "stopping", "starting", "waiting_healthy", "confirming_args", "warming",
            "undraining", "verifying", "done"]
    assert [to for name, _, to in seq if name == a] == path
    assert [to for name, _, to in seq if name == b] == path
    assert stack.lb.drainer().drained == set()
    assert took < 60, took


@pytest.mark.parametrize(
    ("bad_extra", "why"),
    [
        (("--max-num-seqs", "0"), "exits at start"),
        (("--stub-crash-after-requests", "1"), "dies at its first request"),
    ],
)
def test_arguments_the_engine_cannot_run_are_rolled_back_while_the_other_replica_serves(
    stack: Stack, bad_extra: tuple[str, ...], why: str
) -> None:
    a, b = stack.ports
    pid_b = stack.pid(b)
    bad = (*stack.argv(a, 32), *bad_extra)
    with journal.Journal(stack.tmp / "journal.jsonl") as j, Load(stack.lb.url) as load:
        driver = stack.driver(j)
        rollout = driver.begin("r-bad", {a: bad, b: stack.argv(b, 32)}, limits=LIMITS)
        rollout = driver.run(rollout)
        time.sleep(0.5)
    assert machine.outcome(rollout) is Outcome.ROLLED_BACK, machine.describe(rollout)
    assert load.failed == 0, (why, load.outcomes, load.errors, events_at(j.records),
                              (stack.lb.dir / "error.log").read_text()[-3000:])
    assert stack.live_argv(a) == stack.argv(a)  # back on the old arguments, serving
    assert stack.pid(b) == pid_b  # never touched
    assert rollout.of(b).state is machine.State.PENDING
    assert [(n, argv) for n, argv, _ in stack.bad] == [(a, bad)]
    assert journal.bad_argv(j.records)[0][:2] == (a, bad)
    seq = [r for r in j.records if r["kind"] == "event" and r["replica"] == a]
    started = next(r["at"] for r in seq if r["to"] == "waiting_healthy")
    done = next(r["at"] for r in seq if r["to"] == "rolled_back")
    assert done - started < LIMITS.start_timeout_seconds + 60  # the bound: restart time + 60 s


@pytest.mark.parametrize("crash_at", ["starting", "waiting_healthy", "verifying"])
def test_a_tuner_killed_mid_rollout_resumes_from_the_journal_to_a_consistent_state(
    stack: Stack, crash_at: str
) -> None:
    a, b = stack.ports
    path = stack.tmp / "journal.jsonl"
    with Load(stack.lb.url) as load:
        with CrashingJournal(path, lambda r: r.get("replica") == a and r.get("to") == crash_at) as j:
            driver = stack.driver(j)
            rollout = driver.begin("r-crash", {n: stack.argv(n, 32) for n in (a, b)}, limits=LIMITS)
            with pytest.raises(Crash):
                driver.run(rollout)
        # A new tuner: new actuator (re-adopts the engines from pid files), new drainer (reads nginx's
        # upstream file), the journal read back from disk.
        with journal.Journal(path) as j2:
            assert journal.unfinished(j2.records) is not None
            driver2 = stack.driver(j2)
            recovered = driver2.recover()
            assert recovered is not None
            assert recovered.of(a).resumes == 1
            final = driver2.run(recovered)
            records = j2.records
        time.sleep(0.5)
    assert machine.outcome(final) is Outcome.DONE, machine.describe(final)
    assert stack.live_argv(a) == stack.argv(a, 32) and stack.live_argv(b) == stack.argv(b, 32)
    assert load.failed == 0, load.outcomes
    # killed before its start ran, a's engine is found down and started again; later, it runs and is resumed
    expected = (a, "found_down", "stopping") if crash_at == "starting" else (a, "interrupted", "waiting_healthy")
    assert expected in events(records)
    assert journal.unfinished(records) is None
    assert stack.lb.drainer().drained == set()


@pytest.mark.parametrize("crash_at", ["starting", "waiting_healthy"])
def test_a_tuner_killed_mid_rollout_restarts_engines_with_their_real_secret(tmp_path: Path, crash_at: str) -> None:
    """Token-protected engines (``--api-key``: the stub, like vLLM, answers /v1/* only with it). The journal
    and the pid files hold the key masked; the tuner is killed mid-rollout; the next one replays the
    journal, puts the key back from the configuration (``restore``) and re-adopts the running engine from
    /proc — so every engine it starts, or rolls back to, gets the real key (a masked one would never turn
    healthy: the probe sends the real token)."""
    from tuner.model import secrets
    from tuner.sources.scraping import HttpSettings

    key = "sk-rolling-6d0e4b2a"
    n = next(_run)
    ports = {f"a{n}": nginx_support.free_port(), f"b{n}": nginx_support.free_port()}
    a = next(iter(ports))
    with nginx_support.NginxBalancer({name: f"127.0.0.1:{p}" for name, p in ports.items()}) as lb:
        s = Stack(tmp_path, ports, lb)
        configured = {name: [*s.argv(name, 8), "--api-key", key] for name in ports}
        redactor = secrets.DEFAULT.learn(argvs=configured.values())
        client = EngineClient(HttpSettings(bearer_token=key))

        def actuator() -> process.ProcessActuator:
            act = process.ProcessActuator(s.replicas, command=[sys.executable, str(STUB)],
                                          state_dir=tmp_path / "state", redactor=redactor)
            s.actuators.append(act)
            return act

        def driver(j: journal.Journal) -> driving.RolloutDriver:
            return driving.RolloutDriver(
                actuator=actuator(), drainer=lb.drainer(settle_seconds=0.3),
                prober=engineside.EngineProber(client, kind="vllm"), journal=j, poll_seconds=0.2,
                idle_settle_seconds=0.5, hold_timeout_seconds=60,
                restore=lambda r: journal.restored(r, lambda name, argv: redactor.restore(argv, configured[name])))

        try:
            first = actuator()
            for name in ports:
                first.start(name, configured[name])
            deadline = time.monotonic() + 20
            while not all(client.is_healthy(r.base_url, "vllm") for r in s.replicas):
                assert time.monotonic() < deadline, "the stub engines did not serve with the key"
                time.sleep(0.1)
            new = {name: [*s.argv(name, 32), "--api-key", key] for name in ports}
            path = tmp_path / "journal.jsonl"
            with CrashingJournal(path, lambda r: r.get("replica") == a and r.get("to") == crash_at,
                                 redactor=redactor) as j:
                d = driver(j)
                with pytest.raises(Crash):
                    d.run(d.begin("r-secret", new, limits=LIMITS))
            with journal.Journal(path, redactor=redactor) as j2:
                d2 = driver(j2)
                final = d2.run(d2.recover() or pytest.fail("nothing to recover"))
            live = {name: s.live_argv(name) for name in ports}
        finally:
            for act in reversed(s.actuators):  # whichever instance started an engine stops it
                for name in ports:
                    act.stop(name, timeout_seconds=5)
            client.close()
    assert machine.outcome(final) is Outcome.DONE, machine.describe(final)
    assert tuple(new[a]) == final.new_argv[a]  # the replayed rollout carries the real key again
    assert live == {name: tuple(argv) for name, argv in new.items()}  # the new flags, with the real key
    for stored in [path, *(tmp_path / "state").glob("*.json")]:
        assert key not in stored.read_text(), stored
    assert "--api-key" in path.read_text()  # masked, not dropped


# --- the same driver over the in-memory fakes: the branches real engines rarely take ---------------


def fake_driver(tmp_path: Path, names: tuple[str, ...] = ("a", "b"), **kwargs: Any) -> driving.RolloutDriver:
    actuator = fake.FakeActuator([base.Replica(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names)],
                                 running=dict.fromkeys(names, ("--max-num-seqs", "8")))
    options: dict[str, Any] = dict(drainer=fake.FakeDrainer(), poll_seconds=0.01, idle_settle_seconds=0)
    options.update(kwargs)
    return driving.RolloutDriver(actuator=actuator, prober=FakeProber(actuator),
                                 journal=journal.Journal(tmp_path / "j.jsonl"), **options)


FAST = machine.Limits(verify_seconds=0, warmup_requests=1)
NEW = ("--max-num-seqs", "32")


@dataclass
class ScriptedVerifier:
    """Says ``verdict`` at the deadline; counts the polls inside the window."""

    verdict: verification.Verdict
    observed: list[str] = field(default_factory=list)
    judged: list[str] = field(default_factory=list)

    def observe(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> None:
        self.observed.append(replica.name)

    def judge(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> verification.Verdict:
        self.judged.append(replica.name)
        if isinstance(self.verdict, Exception):
            raise self.verdict
        return self.verdict


def test_a_worse_verdict_rolls_back_without_marking_the_arguments_bad(tmp_path: Path) -> None:
    bad: list[object] = []
    v = ScriptedVerifier(verification.Verdict(False, "ttft_p95_s 1 → 1.4 (+40%)"))
    d = fake_driver(tmp_path, verifier=v, on_bad_args=bad.append)
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert machine.outcome(r) is Outcome.ROLLED_BACK
    assert v.judged == ["a"]  # b is never admitted
    assert r.of("a").reason == "worse than before: ttft_p95_s 1 → 1.4 (+40%)"
    assert bad == [] and not r.of("a").bad_args
    assert d.actuator.status("a").argv == ("--max-num-seqs", "8")
    d.journal.close()


def test_a_good_verdict_is_journaled_with_its_reason_after_observing_the_window(tmp_path: Path) -> None:
    v = ScriptedVerifier(verification.Verdict(True, "queue_time_mean_s 2 → 0.5 (-75%): ok"))
    d = fake_driver(tmp_path, verifier=v, poll_seconds=0.01)
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=machine.Limits(verify_seconds=0.1, warmup_requests=1)))
    assert machine.outcome(r) is Outcome.DONE
    assert v.judged == ["a", "b"] and {"a", "b"} <= set(v.observed)  # polled inside each window
    verified = [x for x in d.journal.records if x.get("event") == "verified"]
    assert [x["reason"] for x in verified] == ["queue_time_mean_s 2 → 0.5 (-75%): ok"] * 2
    d.journal.close()


def test_a_verifier_that_raises_rolls_the_replica_back(tmp_path: Path) -> None:
    v = ScriptedVerifier(RuntimeError("boom"))  # type: ignore[arg-type]
    d = fake_driver(tmp_path, verifier=v)
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert machine.outcome(r) is Outcome.ROLLED_BACK
    assert "the verification itself failed: RuntimeError: boom" in r.of("a").reason
    d.journal.close()


def test_the_last_serving_replica_is_held_then_the_rollout_aborted(tmp_path: Path) -> None:
    d = fake_driver(tmp_path, names=("solo",), hold_timeout_seconds=0.2)
    r = d.run(d.begin("r", {"solo": NEW}, limits=FAST))
    assert machine.outcome(r) is Outcome.ABORTED
    assert "last serving replica" in (r.aborted or "")
    assert d.actuator.status("solo").argv == ("--max-num-seqs", "8")
    assert [x["kind"] for x in d.journal.records] == ["rollout", "abort"]
    d.journal.close()
    d2 = fake_driver(tmp_path / "2", names=("solo",))
    r2 = d2.run(d2.begin("r", {"solo": NEW}, limits=machine.Limits(verify_seconds=0, allow_downtime=True)))
    assert machine.outcome(r2) is Outcome.DONE
    d2.journal.close()


def test_a_drain_that_fails_is_undone_by_the_undrain_alone_and_a_failed_undrain_stops_everything(
        tmp_path: Path) -> None:
    """The engine still runs the old arguments when its drain fails: the way back is the undrain, not a
    restart onto what already runs nor a second drain through the hook that just failed (it used to
    end failed, "a human must look", with the engine untouched and serving)."""

    class DrainFails(fake.FakeDrainer):
        def drain(self, name: str) -> None:
            self.calls.append(("drain", name))
            raise PermanentActuatorError(f"fake drainer: cannot drain {name}")

    drainer = DrainFails()
    d = fake_driver(tmp_path, drainer=drainer)
    pid = d.actuator.status("a").pid
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert machine.outcome(r) is Outcome.ROLLED_BACK, machine.describe(r)
    assert "cannot drain a" in r.of("a").reason and not r.of("a").bad_args
    assert [(x["event"], x["to"]) for x in d.journal.records if x["kind"] == "event"] == [
        ("go", "draining"), ("failed_before_stop", "undraining"), ("undrained", "rolled_back")]
    assert d.actuator.status("a").pid == pid and d.actuator.status("a").argv == ("--max-num-seqs", "8")
    assert drainer.calls == [("drain", "a"), ("undrain", "a")] and r.of("b").state is machine.State.PENDING
    d.journal.close()
    # …and where the undrain fails too, the replica is left failed: a human must look.
    d = fake_driver(tmp_path / "2", drainer=fake.FakeDrainer(failing=frozenset({"a"})))
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert machine.outcome(r) is Outcome.FAILED
    assert "cannot undrain a" in r.of("a").reason
    assert r.of("b").state is machine.State.PENDING
    d.journal.close()


def test_a_stop_request_leaves_a_journaled_rollout_that_resumes(tmp_path: Path) -> None:
    stop = threading.Event()
    d = fake_driver(tmp_path, stop_event=stop, on_tick=lambda: None)
    d._on_tick = lambda: stop.set() if d.journal.records[-1].get("to") == "waiting_healthy" else None
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert machine.outcome(r) is Outcome.RUNNING
    assert r.of("a").state is machine.State.WAITING_HEALTHY
    with pytest.raises(PermanentActuatorError, match="still unfinished"):
        d.begin("r2", {"a": NEW}, limits=FAST)
    d.journal.close()
    again = fake_driver(tmp_path)
    again.actuator = d.actuator  # the engines outlived the tuner
    again.prober = FakeProber(d.actuator)  # type: ignore[arg-type]
    recovered = again.recover()
    assert recovered is not None
    r = again.run(recovered)
    assert machine.outcome(r) is Outcome.DONE
    assert again.recover() is None
    again.journal.close()


def test_engines_down_at_tuner_start_are_restarted_on_their_leg_not_condemned(tmp_path: Path) -> None:
    """A host reboot mid-rollout: the tuner comes back with a journal whose last record (a's verdict) was
    lost, and both engines down. a was verified on the new arguments: it must be started on them again,
    not judged "crashed" (which marked them bad for good, tried to drain the dead replica, ended failed,
    and then the start-up adopted it with the "bad" arguments anyway)."""
    stop = threading.Event()
    bad: list[object] = []
    d = fake_driver(tmp_path, stop_event=stop)
    d._on_tick = lambda: stop.set() if d.journal.records[-1].get("to") == "verifying" else None
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert r.of("a").state is machine.State.VERIFYING  # the next record (verified) never reached the disk
    d.journal.close()
    for name in ("a", "b"):  # the reboot
        d.actuator.stop(name, timeout_seconds=1)
    again = fake_driver(tmp_path, on_bad_args=lambda *x: bad.append(x))
    again.actuator = d.actuator
    again.prober = FakeProber(d.actuator)  # type: ignore[arg-type]
    recovered = again.recover()
    assert recovered is not None and recovered.of("a").state is machine.State.STOPPING
    found = [x for x in again.journal.records if x.get("event") == "found_down"]
    assert [x["replica"] for x in found] == ["a"] and "found the engine stopped" in found[0]["reason"]
    r = again.run(recovered)
    assert machine.outcome(r) is Outcome.DONE, machine.describe(r)
    assert bad == [] and not any(p.bad_args for p in r.progress)
    assert again.actuator.status("a").argv == NEW and again.actuator.status("b").argv == NEW
    again.journal.close()


def test_a_tuner_stopping_mid_rollout_puts_a_healthy_drained_replica_back(tmp_path: Path) -> None:
    """SIGTERM while a is drained and verifying on confirmed new arguments: a goes back in the pool
    before the tuner exits (it used to stay drained until the tuner came back)."""
    stop = threading.Event()
    drainer = fake.FakeDrainer()
    d = fake_driver(tmp_path, stop_event=stop, drainer=drainer)
    d._on_tick = lambda: stop.set() if d.journal.records[-1].get("to") == "waiting_idle" else None
    r = d.run(d.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert r.of("a").state is machine.State.WAITING_IDLE and "a" not in drainer.drained
    notes = [x for x in d.journal.records if x["kind"] == "note"]
    assert [(x["replica"], "waiting_idle" in x["note"]) for x in notes] == [("a", True)]
    d.journal.close()
    # …and not a replica whose engine is down or starting: there, nginx would route to nothing
    stop2, drainer2 = threading.Event(), fake.FakeDrainer()
    d2 = fake_driver(tmp_path / "2", stop_event=stop2, drainer=drainer2)
    d2._on_tick = lambda: stop2.set() if d2.journal.records[-1].get("to") == "starting" else None
    r2 = d2.run(d2.begin("r", {"a": NEW, "b": NEW}, limits=FAST))
    assert r2.of("a").state is machine.State.STARTING and "a" in drainer2.drained
    d2.journal.close()


def test_without_a_drain_the_idle_wait_is_skipped_not_run_to_its_deadline(tmp_path: Path) -> None:
    """With nothing taking the replica out of the load balancer, requests keep arriving: the old driver
    waited the whole idle_timeout while the queue grew (1,200-2,450 requests in flight at the deadline on
    the H200), then cut them anyway."""

    class Busy(FakeProber):
        def load(self, replica: base.Replica) -> int | None:
            return 40

    d = fake_driver(tmp_path, drains=False, names=("solo",))
    d.prober = Busy(d.actuator)  # type: ignore[arg-type]
    r = d.run(d.begin("r", {"solo": NEW}, limits=machine.Limits(verify_seconds=0, warmup_requests=0,
                                                                 allow_downtime=True, idle_timeout_seconds=3600)))
    assert machine.outcome(r) is Outcome.DONE
    idle = next(x for x in d.journal.records if x.get("event") in ("idle", "idle_timeout"))
    assert (idle["event"], idle["reason"]) == ("idle", "not waited for: nothing drains this replica")
    d.journal.close()
