"""Kill points at every boundary of a Kubernetes leader's term (issue 29): no acknowledged record lost, no
rolled-back value proposed again.

In this process, against the fake API server (tests/support/kube_harness.py, the chart's Role enforced), with
the agent's real pieces: the claim, the pool's store and journal, the leader's start (``book_unbooked``), its
dispatcher's booking and its one write per cycle (``Leader.settle``). A term runs what a leader's term runs —
its claim, its first cycle (the unfinished rollout resumed and finished, as the driver does after machine Rule
3; booked), and then rollouts, each journaled record by record as the driver journals them, booked, and the
cycle's write — and ends at a generated ConfigMap write: killed before it reaches the API server, killed after
the server applied it (written, never acknowledged), or deposed (the next leader claims the pool first, so the
write is refused). The next term takes over from what the API server holds.

After every term's end, and at the end:

- every record a leader's journal acknowledged (``append`` returned) is in the journal;
- the pool's saved history includes the journal's last finished rollout (the booking rode with the write
  that finished it: no leader's end between the two loses its cooldowns and rejected values);
- every rollout of the plan began once and finished; and the value of every one that rolled back is held
  bad by the leader that comes next (never proposed again).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from tests.support import fake_kube as fk
from tests.support.kube_harness import (
    ARGV,
    NS,
    POD,
    a_term,
    cycle_ready_pool,
    data,
    installed,
    save,
    settings_of,
)
from tuner import config
from tuner.kube import api as kapi
from tuner.kube import documents, leading, store
from tuner.model import knobs
from tuner.planning import history as history_mod
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.runtime import dispatching

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart's Role")

E = machine.Event
DONE = (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.HEALTHY, E.CONFIRMED, E.WARMED, E.UNDRAINED, E.VERIFIED)
ROLLED_BACK = (E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.CRASHED, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED,
               E.HEALTHY, E.CONFIRMED, E.WARMED, E.UNDRAINED)
EVENTS = {"done": DONE, "rolled_back": ROLLED_BACK}
OLD = ["--max-num-seqs", "8"]


class Killed(BaseException):
    """The leader's process is gone: nothing it does after this reaches the API server."""


class Ending:
    """The agent's API client, its term ended at its ``at``-th ConfigMap write (counted from 0): ``before``
    the request is sent, ``applied`` by the server but never acknowledged, or ``deposed``: the next leader
    (``successor``, epoch ``next_epoch``) claims the pool first, so the write is refused (``Deposed``)."""

    def __init__(self, api: kapi.KubeApi, *, at: int | None, how: str, successor: str, next_epoch: int) -> None:
        self.api, self.at, self.how = api, at, how
        self.successor, self.next_epoch = successor, next_epoch
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def replace_configmap(self, *args: Any, **kwargs: Any) -> Any:
        if self.at is not None and self.writes == self.at:
            self.at = None  # once
            if self.how == "before":
                raise Killed
            if self.how == "applied":
                self.api.replace_configmap(*args, **kwargs)
                raise Killed
            leading.claim(store.PoolStore(self.api), self.next_epoch, identity=self.successor, advance=None)
        self.writes += 1
        return self.api.replace_configmap(*args, **kwargs)


def change(i: int) -> dict[str, Any]:
    return {"flag": "--max-num-seqs", "knob": "max_num_seqs", "from": "8", "to": str(16 + i), "rule": "more-seqs",
            "reason": "why", "direction": 1}


def new_args(i: int) -> list[str]:
    return ["--max-num-seqs", str(16 + i)]


class Pool:
    """The plan (each rollout's outcome), the terms run so far, and every record a journal acknowledged."""

    def __init__(self, kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings,
                 plan: Sequence[str]) -> None:
        self.kube, self.api, self.settings, self.plan = kube, api, tuner_settings, list(plan)
        self.acknowledged: list[journaling.Record] = []
        self.terms = 0
        self.ends: list[str] = []

    def identity(self, term: int) -> str:
        return f"pod-{term}_x"

    def term(self, at: int | None, how: str) -> leading.Leader | None:
        """One term, ended at its ``at``-th write (None: it runs to the end of the plan); its leader."""
        self.terms += 1
        n = self.terms
        api = Ending(self.api, at=at, how=how, successor=self.identity(n + 1), next_epoch=n + 1)
        try:
            leader, journal = a_term(api, self.settings, self.identity(n), n)  # type: ignore[arg-type]
            acknowledge = journal.append

            def append(kind: str, **fields: Any) -> journaling.Record:
                record = acknowledge(kind, **fields)
                self.acknowledged.append(record)
                return record

            journal.append = append  # type: ignore[method-assign]
            self.lead(leader, journal)
        except Killed:
            self.ends.append(f"killed {how}")
            return None
        except store.Deposed:
            self.ends.append("deposed")
            return None
        self.ends.append("ran to the end")
        return leader

    def lead(self, leader: leading.Leader, journal: store.ConfigMapJournal) -> None:
        leader._track([config.Target(name=POD, kind="vllm", metrics_url="http://127.0.0.1:8000/metrics",
                                     base_url="http://127.0.0.1:8000", args=ARGV)])
        leader.book_unbooked(journal)  # the term's first cycle: a finished rollout not booked yet
        unfinished = journaling.unfinished(journal.records)
        if unfinished is not None:  # resumed (machine Rule 3) and carried to its end, as the driver does
            i = int(unfinished.id.removeprefix("r"))
            done = sum(1 for r in journal.records if r["kind"] == "event" and r.get("rollout_id") == unfinished.id)
            self.finish(leader, journal, i, unfinished, EVENTS[self.plan[i]][done:])
        save(leader, journal)
        begun = {r["rollout"]["id"] for r in journal.records if r["kind"] == "rollout"}
        for i, outcome in enumerate(self.plan):
            if f"r{i}" in begun:
                continue
            journal.append("decision", at=10.0 + i, rollout=f"r{i}", target=POD, changes=[change(i)])
            r = machine.new(f"r{i}", replicas=[POD], changes={POD: (OLD, new_args(i))}, limits=machine.Limits(),
                            now=10.0 + i)
            journal.append("rollout", at=10.0 + i, **journaling.rollout_fields(r))
            self.finish(leader, journal, i, r, EVENTS[outcome])
            save(leader, journal)

    def finish(self, leader: leading.Leader, journal: store.ConfigMapJournal, i: int, r: machine.Rollout,
               events: Sequence[machine.Event]) -> None:
        """The rest of rollout ``i``'s events journaled, then booked in the leader's memory (``Dispatcher.book``)."""
        for e in events:
            after = machine.handle(r, POD, e, now=11.0 + i, reason="engine exited: status 1" if e is E.CRASHED else "")
            journal.append("event", at=11.0 + i, **journaling.event_fields(r, after, POD, e))
            r = after
        assert machine.outcome(r) is not machine.Outcome.RUNNING
        assert leader.dispatcher is not None
        leader.dispatcher.book(r, dispatching.changes_of(journal.records, r.id))

    # --- what holds ------------------------------------------------------------------------------------

    def check(self) -> None:
        found = documents.inspect(data(self.kube))
        assert not found.problems, found.problems
        records = [dict(r) for r in found.journal.records]
        lost = [r for r in self.acknowledged if dict(r) not in records]
        assert not lost, f"acknowledged records lost: {lost}"
        rollouts = [r["rollout"]["id"] for r in records if r["kind"] == "rollout"]
        assert len(rollouts) == len(set(rollouts)), f"a rollout began twice: {rollouts}"
        finished = [r for r in journaling.replay(found.journal.records).values()
                    if machine.outcome(r) is not machine.Outcome.RUNNING]
        if finished:
            assert found.booked_rollout == finished[-1].id, (
                f"the journal finished {finished[-1].id}, the saved history includes {found.booked_rollout!r}")
            for r in finished:  # booked in that write: the saved history holds its rejected value
                i = int(r.id.removeprefix("r"))
                if machine.outcome(r) is machine.Outcome.ROLLED_BACK:
                    assert history_mod.from_dict(json.loads(data(self.kube)["state"])["histories"][POD]).is_bad(
                        knobs.EngineArgs.parse(new_args(i))), f"{r.id}'s rolled-back value is not held bad"

    def check_next_leader(self) -> None:
        """The leader that comes next, at the start of its term: it holds every rolled-back value bad."""
        leader, journal = a_term(self.api, self.settings, "pod-next_x", self.terms + 1)
        leader.book_unbooked(journal)
        for r in journaling.replay(journal.records).values():
            if machine.outcome(r) is machine.Outcome.ROLLED_BACK:
                i = int(r.id.removeprefix("r"))
                assert leader.state.history(POD).is_bad(knobs.EngineArgs.parse(new_args(i))), (
                    f"{r.id}'s rolled-back value would be proposed again")


END = st.tuples(st.integers(min_value=0, max_value=40), st.sampled_from(["before", "applied", "deposed"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.sampled_from(["done", "rolled_back"]), min_size=1, max_size=3),
       ends=st.lists(END, min_size=1, max_size=3))
def test_no_acknowledged_record_is_lost_and_no_rolled_back_value_comes_back_at_any_kill_point(
        server: fk.FakeKube, chart: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory,
        plan: list[str], ends: list[tuple[int, str]]) -> None:
    kube = installed(server, chart)
    tuner_settings = settings_of(kube, tmp_path_factory.mktemp("kill"))
    assert tuner_settings.kubernetes is not None
    api = kapi.KubeApi(tuner_settings.kubernetes, namespace=NS)
    try:
        cycle_ready_pool(kube, api)
        note(f"plan {plan}, ends {ends}")
        pool = Pool(kube, api, tuner_settings, plan)
        for at, how in ends:
            pool.term(at, how)
            pool.check()
        assert pool.term(None, "never") is not None
        pool.check()
        pool.check_next_leader()
        for end in pool.ends[:-1]:
            event(end)
        assert all(machine.outcome(r) is not machine.Outcome.RUNNING
                   for r in journaling.replay(documents.inspect(data(kube)).journal.records).values())
        assert {r["rollout"]["id"] for r in documents.inspect(data(kube)).journal.records if r["kind"] == "rollout"} \
            == {f"r{i}" for i in range(len(plan))}
    finally:
        api.close()


def test_the_write_that_finishes_a_rollout_is_the_kill_point_that_lost_its_booking(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings) -> None:
    """The reproduction: a leader killed right after the write that finished a rolled-back rollout (before
    its cycle's write). On main before issue 29 the saved history did not include the rollout: its rejected
    value lived in that leader's memory only."""
    cycle_ready_pool(kube, api)
    pool = Pool(kube, api, tuner_settings, ["rolled_back"])
    # the claim, the first cycle's write, then the decision, the rollout and its events: the last is the
    # write that finishes it; the kill comes at the cycle's write after it
    pool.term(2 + 2 + len(ROLLED_BACK), "before")
    assert pool.ends == ["killed before"]
    pool.check()
    assert documents.inspect(data(kube)).booked_rollout == "r0"
    pool.check_next_leader()
