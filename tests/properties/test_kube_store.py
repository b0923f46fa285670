"""Class 7 of issue 17: the Kubernetes store survives the lifecycles users put it through.

Against the fake API server (tests/support/fake_kube.py, in this process, the chart's Role enforced), with
the agent's real pieces: the elector, the pool's ConfigMap store and journal, the leader.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from tests.support import fake_kube as fk
from tests.support.kube_harness import (  # the pool's helpers (its fixtures: this folder's conftest.py)
    CM,
    LEASE,
    a_term,
    cycle_ready_pool,
    data,
    engine_client,
    lead_in_thread,
    save,
    until,
)
from tuner import config
from tuner.kube import acting, electing, leading, store
from tuner.kube import api as kapi
from tuner.model import knobs
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.runtime import selfmetrics

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart's Role")

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def elector(api: kapi.KubeApi, who: str, clock: Clock,
            metrics: selfmetrics.TunerMetrics | None = None) -> electing.Elector:
    wall = {"t": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}

    def now() -> dt.datetime:
        wall["t"] += dt.timedelta(seconds=1)
        return wall["t"]

    return electing.Elector(api, who, lease_seconds=15, renew_deadline_seconds=10, retry_seconds=2, monotonic=clock,
                            wall=now, metrics=metrics)


def edit(kube: fk.FakeKube, **keys: str | None) -> None:
    """A human's ``kubectl edit`` of the pool's ConfigMap (None removes the key)."""
    def change(cm: dict[str, Any]) -> None:
        d = cm.setdefault("data", {})
        for key, value in keys.items():
            name = key.replace("__", ".")
            if value is None:
                d.pop(name, None)
            else:
                d[name] = value
    kube.modify("ConfigMap", CM, change)


def recreate_lease(kube: fk.FakeKube, chart: list[dict[str, Any]]) -> None:
    """``helm uninstall`` + ``helm install`` (or an Argo CD replace): the Lease comes back with ``spec: {}``."""
    kube.delete("Lease", LEASE)
    fk.load_objects(kube, [d for d in chart if d["kind"] == "Lease"])


# --- the reproductions: each failed on main before issue 17's class 7 ------------------------------------


def test_a_recreated_lease_does_not_lock_every_new_leader_out(kube: fk.FakeKube, api: kapi.KubeApi,
                                                              chart: list[dict[str, Any]],
                                                              tuner_settings: config.TunerSettings) -> None:
    clock = Clock()
    s = store.PoolStore(api)
    for i in range(5):  # five leaders before the reinstall: the ConfigMap is at epoch 5
        e = elector(api, f"pod-{i}_0", clock)
        taken = e.try_once()
        assert taken is not None and taken.epoch == i + 1
        s.update(lambda d: d, epoch=taken.epoch, leader=f"pod-{i}_0")
        e.release()
    assert store.loads(data(kube), "epoch", None) == 5
    recreate_lease(kube, chart)
    assert kube.get("Lease", LEASE)["spec"] == {}  # type: ignore[index]

    b = elector(api, "pod-b_1", clock)
    leadership = b.try_once()
    assert leadership is not None
    leader = leading.Leader(tuner_settings, api=api, store=store.PoolStore(api), identity="pod-b_1", rules=(),
                            client=engine_client())
    with lead_in_thread(leader, leadership):
        until(lambda: store.loads(data(kube), "leader", None) == "pod-b_1")
    assert store.loads(data(kube), "epoch", None) > 5
    with pytest.raises(store.Deposed):  # the last leader before the reinstall is refused
        store.PoolStore(api).update(lambda d: {**d, "x": "1"}, epoch=5, leader="pod-4_0")


@pytest.mark.parametrize("epoch", ["7.0", "-1", "1e400", "", "null", "[7]", '"7"', str(2**64), "true", "{"])
def test_a_hand_edited_epoch_does_not_switch_fencing_off(kube: fk.FakeKube, api: kapi.KubeApi, epoch: str) -> None:
    store.ConfigMapJournal(store.PoolStore(api), epoch=7, leader="pod-a_1").append("note", at=1.0, note="a")
    edit(kube, epoch=epoch)
    before = data(kube)
    deposed = store.ConfigMapJournal(store.PoolStore(api), epoch=3, leader="pod-old_1")  # a leader long gone
    with contextlib.suppress(Exception):
        deposed.append("note", at=2.0, note="from a deposed leader")
    assert data(kube) == before
    with pytest.raises(store.PoolUnreadableError) as info:
        deposed.append("note", at=2.0, note="from a deposed leader")
    assert f"ConfigMap {CM}" in str(info.value) and "'epoch'" in str(info.value)
    assert "above every epoch used so far" in str(info.value)


@pytest.mark.parametrize("state", ['{"histories": {"vllm-a": ', "[]", '{"histories": []}', "17",
                                   '{"histories": {"vllm-a": {"changes": 3}}}'])
def test_a_garbled_state_is_not_replaced_by_an_empty_history(kube: fk.FakeKube, api: kapi.KubeApi,
                                                             tuner_settings: config.TunerSettings, state: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    cycle_ready_pool(kube, api)
    edit(kube, state=state)
    metrics = selfmetrics.TunerMetrics()
    leader = leading.Leader(tuner_settings, api=api, store=store.PoolStore(api), identity="pod-a_1", rules=(),
                            client=engine_client(), metrics=metrics)
    with lead_in_thread(leader, electing.Leadership(1, 0.0)):
        until(lambda: data(kube).get("state") != state
              or metrics.registry.get_sample_value("tuner_pool_unreadable", {"key": "state"}) == 1)
    assert data(kube).get("state") == state
    lines = [r.getMessage() for r in caplog.records if "'state'" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"ConfigMap {CM}" in lines[0] and "delete the key" in lines[0]


def test_one_bad_journal_line_is_set_aside_once_not_raised_at_every_cycle(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings,
        caplog: pytest.LogCaptureFixture) -> None:
    cycle_ready_pool(kube, api)
    journal = store.ConfigMapJournal(store.PoolStore(api), epoch=1, leader="pod-a_1")
    journal.append("note", at=1.0, note="first")
    journal.append("note", at=3.0, note="third")
    first, third = data(kube)["journal"].splitlines()
    bad = '{"v":1,"seq":2,"kind":"note","note":"cut off by a bad ed'  # not the tail: no torn write
    edit(kube, journal="\n".join([first, bad, third]) + "\n")
    metrics = selfmetrics.TunerMetrics()
    leader = leading.Leader(tuner_settings, api=api, store=store.PoolStore(api), identity="pod-a_1", rules=(),
                            client=engine_client(), metrics=metrics)
    with lead_in_thread(leader, electing.Leadership(2, 0.0)):
        until(lambda: leader.cycles >= 3)
    after = data(kube)
    assert bad not in after["journal"].splitlines()
    assert after["journal.quarantine"].splitlines() == [bad]  # kept verbatim, for a human
    assert [r["note"] for r in store.parse_journal(after["journal"]).records] == ["first", "third"]
    assert metrics.registry.get_sample_value("tuner_pool_journal_set_aside_total") == 1
    assert not [r for r in caplog.records if r.exc_info], "a traceback"
    lines = [r.getMessage() for r in caplog.records if "'journal'" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"ConfigMap {CM}" in lines[0] and "line 2" in lines[0] and "journal.quarantine" in lines[0]


def test_two_leaders_with_one_epoch_from_two_leases_the_first_to_write_keeps_it(
        kube: fk.FakeKube, api: kapi.KubeApi, chart: list[dict[str, Any]]) -> None:
    clock = Clock()
    store.PoolStore(api).update(lambda d: d, epoch=4, leader="pod-0_0")  # the ConfigMap at epoch 4
    edit(kube, epoch="4")
    a, b = elector(api, "pod-a_1", clock), elector(api, "pod-b_2", clock)
    got_a = a.try_once()  # epoch 5 from this Lease; a stalls before its first write
    assert got_a is not None and got_a.epoch == 5
    recreate_lease(kube, chart)
    got_b = b.try_once()  # the new Lease starts at 0 and the ConfigMap still says 4: epoch 5 again
    assert got_b is not None and got_b.epoch == 5
    store_a, store_b = store.PoolStore(api), store.PoolStore(api)
    assert leading.claim(store_a, 5, identity="pod-a_1", advance=a.advance) == 5  # a wakes and writes first
    assert leading.claim(store_b, 5, identity="pod-b_2", advance=b.advance) == 6  # b holds the Lease: above a
    assert kube.get("Lease", LEASE)["spec"]["leaseTransitions"] == 6  # type: ignore[index]
    with pytest.raises(store.Deposed):  # a does not hold the Lease: no new epoch for it
        leading.claim(store_a, 5, identity="pod-a_1", advance=a.advance)
    with pytest.raises(store.Deposed):
        store_a.update(lambda d: {**d, "late": "1"}, epoch=5, leader="pod-a_1")
    assert "late" not in data(kube)


def test_a_desired_key_deleted_by_hand_does_not_make_requests_look_carried_out(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings) -> None:
    assert tuner_settings.kubernetes is not None
    s = store.PoolStore(api)
    s.report("vllm-a", {"state": "serving", "serial": 5, "generation": 5, "launcher_generation": 5,
                        "overrides": [], "base_sha256": "b" * 64})
    edit(kube, desired=None)  # the fix the message gives for a garbled one
    pool = acting.PoolActions(s, api, tuner_settings.kubernetes, epoch=1, leader="pod-a_1", replicas=[])
    serial = pool.request("vllm-a", drain=True)
    assert serial == 6  # above what the pod's agent carried out already: it acts on it
    assert not acting.carried_out(pool.report("vllm-a") or {}, serial)


# --- generated: lifecycles, epochs, states and journal lines of many shapes -------------------------------

AGENTS = 3


def epoch_value(text: str) -> int | None:
    """The oracle: the integer an edited epoch holds, None when it holds none a Lease could."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if type(value) is int and 0 <= value < 2**31 else None


EPOCH_SHAPES = st.one_of(
    st.integers(min_value=0, max_value=60).map(str),  # readable: below, at or above the leaders' epochs
    st.sampled_from(["7.0", "7e0", "-1", "1e400", "", " ", "null", "[7]", '"7"', "true", "{", "[]", "{}", "0x10",
                     "NaN", "Infinity", str(2**31), str(2**64), "9" * 400, " 5 ", "05"]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=8),
)
WHO = st.integers(0, AGENTS - 1)
OPS = st.sampled_from([  # weighted by repetition: mostly agents taking over, claiming and writing
    *["lead"] * 3, "takeover", "tick", *["claim"] * 2, *["write"] * 4, "release", *["recreate_lease"] * 2,
    "delete_lease",
    "edit_epoch", "fix_epoch", "delete_epoch", "edit_leader"]).flatmap(lambda kind: {
        "lead": WHO.map(lambda who: (kind, who)),
        "takeover": WHO.map(lambda who: (kind, who)),
        "tick": st.tuples(st.just(kind), WHO, st.sampled_from([0.0, 3.0, 8.0, 16.0])),
        "claim": WHO.map(lambda who: (kind, who)),
        "write": WHO.map(lambda who: (kind, who)),
        "release": WHO.map(lambda who: (kind, who)),
        "edit_epoch": EPOCH_SHAPES.map(lambda text: (kind, text)),
        "edit_leader": st.sampled_from(['"pod-0_x"', '"someone"', "7", "{", ""]).map(lambda text: (kind, text)),
    }.get(kind, st.just((kind,))))


class Lifecycle:
    """Agents (an elector, a store, the term each last got and claimed) and a log of the writes the
    ConfigMap took, checked after every step: a term followed by another one's write never writes again
    (unless a human lowered the epoch in between), and nothing is written while the epoch does not read."""

    def __init__(self, kube: fk.FakeKube, api: kapi.KubeApi, chart: list[dict[str, Any]]) -> None:
        self.kube, self.api, self.chart = kube, api, chart
        self.clock = Clock()
        self.names = [f"pod-{i}_x" for i in range(AGENTS)]
        self.electors = [elector(api, n, self.clock, metrics=selfmetrics.TunerMetrics()) for n in self.names]
        self.stores = [store.PoolStore(api) for _ in self.names]
        self.got: list[electing.Leadership | None] = [None] * AGENTS  # the last leadership its elector gave it
        self.terms: list[int | None] = [None] * AGENTS  # the epoch it claimed the ConfigMap with
        self.used: set[int] = set()
        self.seen: set[tuple[str, int]] = set()
        self.last: tuple[str, int] | None = None
        self.writes = 0
        self.refusals = 0
        self.deposed = 0
        self.ever_lowered = False
        self.wrote: set[tuple[str, int]] = set()  # every term that wrote

    def epoch_text(self) -> str | None:
        return data(self.kube).get("epoch")

    def garbled(self) -> bool:
        text = self.epoch_text()
        return text is not None and epoch_value(text) is None

    def took(self, who: int, epoch: int) -> None:
        term = (self.names[who], epoch)
        garbled = self.garbled()
        assert not garbled, "a write while the epoch does not read"
        if term != self.last:
            assert term not in self.seen, f"{term} wrote again after {self.last}: a deposed leader wrote"
            if self.last is not None:
                self.seen.add(self.last)
            self.last = term
        self.writes += 1
        self.wrote.add(term)
        assert epoch_value(self.epoch_text() or "") == epoch

    def lowered(self) -> None:
        """A human lowered or removed the fence (against the fix's advice): fencing starts again from what
        they set, and a term above it that wrote before may write again until a newer one passes it."""
        self.seen, self.last, self.ever_lowered = set(), None, True

    def step(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "lead":  # a takeover, then the new leader's claim
            self.step(("takeover", op[1]))
            self.step(("claim", op[1]))
        elif kind in ("tick", "takeover"):  # a takeover: the others silent for two lease durations (paused)
            for dt_seconds in ([op[2]] if kind == "tick" else [16.0, 16.0]):
                self.clock.t += dt_seconds
                got = self.electors[op[1]].try_once()
                if got is not None:
                    self.got[op[1]] = got
                    self.used.add(got.epoch)
        elif kind == "claim" and self.got[op[1]] is not None:
            who, garbled = op[1], self.garbled()
            got = self.got[who]
            assert got is not None
            try:
                epoch = leading.claim(self.stores[who], got.epoch, identity=self.names[who],
                                      advance=self.electors[who].advance)
            except store.PoolUnreadableError:
                self.refusals += 1
                if not garbled:
                    raise
                return
            except store.Deposed:
                self.deposed += 1
                return
            except kapi.ApiError:
                return
            assert not garbled
            self.used.add(epoch)
            self.terms[who] = epoch
            self.took(who, epoch)
        elif kind == "write" and self.terms[op[1]] is not None:
            who, epoch = op[1], self.terms[op[1]]
            assert epoch is not None
            try:
                self.stores[who].update(lambda d: {**d, "n": str(self.writes)}, epoch=epoch, leader=self.names[who])
            except store.Deposed:
                self.deposed += 1
                return
            except (store.PoolUnreadableError, kapi.ApiError):
                return
            self.took(who, epoch)
        elif kind == "release":
            self.electors[op[1]].release()
        elif kind in ("recreate_lease", "delete_lease"):
            if self.kube.get("Lease", LEASE) is not None:
                self.kube.delete("Lease", LEASE)
            if kind == "recreate_lease":
                fk.load_objects(self.kube, [d for d in self.chart if d["kind"] == "Lease"])
        elif kind == "edit_epoch":
            before = epoch_value(self.epoch_text() or "0")
            edit(self.kube, epoch=op[1])
            value = epoch_value(op[1])
            if value is not None and (before is None or value <= before):
                self.lowered()
        elif kind == "fix_epoch" and self.garbled():  # the fix the message gives
            edit(self.kube, epoch=str(max(self.used, default=0) + 1))
        elif kind == "delete_epoch":
            edit(self.kube, epoch=None)
            self.lowered()
        elif kind == "edit_leader":
            edit(self.kube, leader=op[1])

    def settle(self) -> None:
        """The end of the story: the Lease exists and the epoch reads (the documented fix where it does
        not), one agent takes over; it must lead, and nobody else may write any more."""
        if self.kube.get("Lease", LEASE) is None:
            fk.load_objects(self.kube, [d for d in self.chart if d["kind"] == "Lease"])
        if self.garbled():
            with pytest.raises(store.PoolUnreadableError, match="'epoch'"):
                self.stores[0].update(lambda d: d, epoch=2**31 - 1, leader=self.names[0])
            edit(self.kube, epoch=str(max(self.used, default=0) + 1))  # above every epoch used so far
        got = None
        for _ in range(3):
            self.clock.t += 16
            got = self.electors[0].try_once()
            if got is not None:
                break
        assert got is not None, "no leader after the Lease expired"
        epoch = leading.claim(self.stores[0], got.epoch, identity=self.names[0], advance=self.electors[0].advance)
        self.took(0, epoch)
        assert store.loads(data(self.kube), "leader", None) == self.names[0]
        for who in range(1, AGENTS):
            term = self.terms[who]
            if term is not None and (term <= epoch or not self.ever_lowered):
                with pytest.raises(store.Deposed):
                    self.stores[who].update(lambda d: {**d, "late": "1"}, epoch=term, leader=self.names[who])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=6, max_size=24))
def test_fencing_holds_through_generated_lifecycles(server: fk.FakeKube, api: kapi.KubeApi,
                                                    chart: list[dict[str, Any]], ops: list[tuple[Any, ...]]) -> None:
    with server.cond:
        server.objects.clear()
    fk.load_objects(server, [d for d in chart if d["kind"] in ("Lease", "ConfigMap")])
    note(f"ops: {ops}")
    life = Lifecycle(server, api, chart)
    for op in ops:
        life.step(op)
    life.settle()
    raised = sum(e.metrics.registry.get_sample_value("tuner_pool_epoch_raised_total") or 0
                 for e in life.electors if e.metrics is not None)
    event(f"epochs raised above the Lease's: {min(raised, 3):g}{'+' if raised > 3 else ''}")
    event(f"writes refused for a garbled epoch: {'some' if life.refusals else 'none'}")
    event(f"terms that wrote: {min(len(life.wrote), 4)}{'+' if len(life.wrote) >= 4 else ''}")
    event(f"writes refused for an older term: {'some' if life.deposed else 'none'}")


@settings(max_examples=400, deadline=None)
@given(text=EPOCH_SHAPES)
def test_an_epoch_of_any_shape_reads_as_an_integer_or_as_a_problem(text: str) -> None:
    found = store.inspect({"epoch": text})
    value = epoch_value(text)
    if value is None:
        (problem,) = found.problems
        assert problem.key == "epoch" and problem.reason.startswith("key 'epoch'")
        try:
            shown = isinstance(json.loads(text), (int, float, bool, type(None)))  # short numbers are shown
        except ValueError:
            shown = False
        if not shown and len(text.strip()) >= 4:
            # described, never quoted: the text is not in the line but where the line's own words hold it
            # (a generated "them" is in "the epoch well above them is safe")
            words = store.inspect({"epoch": "\x00" * 8}).problems[0].line(CM)
            if text.strip() not in words:
                assert text.strip() not in problem.line(CM)[len(CM):]
    else:
        assert found.problems == () and found.epoch == value


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children,
                                                                                      max_size=3), max_leaves=12)
HISTORY = {"cycle": 3, "streaks": {"kv": 2}, "changes": {"--max-num-seqs": {"at": 1.0, "direction": 1, "rule": "r",
                                                                              "from": "8", "to": "16"}},
           "restarts": [1.0], "bad_args": [], "rejected_args": []}


@settings(max_examples=400, deadline=None)
@given(doc=st.one_of(JSON.map(lambda v: json.dumps(v)), st.text(max_size=40),
                     st.dictionaries(st.sampled_from(["vllm-a", "vllm-b"]), JSON, max_size=2).map(
                         lambda h: json.dumps({"histories": h})),
                     st.sampled_from(["cycle", "streaks", "changes", "restarts", "bad_args"]).flatmap(
                         lambda key: JSON.map(lambda v: json.dumps({"histories": {"vllm-a": {**HISTORY, key: v}}})))))
def test_a_state_of_any_shape_is_read_whole_or_refused_never_emptied(doc: str) -> None:
    found = store.inspect({"state": doc})
    if found.problems:
        (problem,) = found.problems
        assert problem.key == "state" and "delete the key" in problem.fix
        return
    parsed = json.loads(doc)  # read: a JSON object whose every history reads
    assert isinstance(parsed, dict)
    assert set(found.histories) == set(parsed.get("histories", {}))


def test_a_saved_state_reads_back() -> None:
    found = store.inspect({"state": json.dumps({"histories": {"vllm-a": HISTORY}})})
    assert found.problems == () and found.histories["vllm-a"].cycle == 3


def rollout_records(rid: str, *, events: int, at: float) -> list[dict[str, Any]]:
    """A decision, its rollout over replicas a and b, and its first ``events`` transitions (20: done)."""
    path = ("go", "drained", "idle", "stopped", "started", "healthy", "confirmed", "warmed", "undrained", "verified")
    r = machine.new(rid, replicas=["a", "b"], changes={n: (["--x", "1"], ["--x", "2"]) for n in "ab"},
                    limits=machine.Limits(max_unavailable=1), now=at)
    out: list[dict[str, Any]] = [{"kind": "decision", "rollout": rid, "at": at},
                                 {"kind": "rollout", "at": at, **journaling.rollout_fields(r)}]
    for name, step in [(n, e) for n in "ab" for e in path][:events]:
        after = machine.handle(r, name, machine.Event(step), now=at)
        out.append({"kind": "event", "at": at, **journaling.event_fields(r, after, name, machine.Event(step))})
        r = after
    return out


BAD_LINES = st.one_of(
    st.sampled_from(['{"v":1,"seq":7,"kind":"note","note":"cut off', "}", "[]", "null", "7", '"text"', "{}",
                     '{"kind":7}', '{"kind":"note","seq":"7"}', '{"kind":"note","seq":true}', '{"kind":"note","at":"x"}',
                     '{"kind":"note","at":1e400}', '{"kind":"note","at":NaN}', "[" * 40 + "]" * 40, "\x00",
                     '{"kind":"event","rollout_id":"zz","replica":"a","event":"go","at":1}',
                     '{"kind":"event","rollout_id":"r0","replica":"a","event":"bogus","at":1}',
                     '{"kind":"abort","rollout_id":"zz"}', '{"kind":"rollout","rollout":{"id":"r9"}}',
                     '{"kind":"rollout","rollout":[]}']),
    st.text(min_size=1, max_size=30).filter(lambda t: "\n" not in t and t.strip() != "" and t[0] != "{"),
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=6),
              st.lists(JSON, max_size=3)).map(json.dumps),
)


def shape(r: machine.Rollout | None) -> Any:
    return None if r is None else (r.id, tuple((p.name, p.state) for p in r.progress))


@settings(max_examples=800, deadline=None)
@example(finished=1, unfinished=1, garbling=[("replace", 1.0, '{"v":1,"seq":7,"kind":"note","note":"cut off'),
                                             ("replace", 0.90625, "null")])  # a rollout's record and its one event
@given(finished=st.integers(0, 3), unfinished=st.one_of(st.none(), st.integers(0, 19)),
       garbling=st.lists(st.tuples(st.sampled_from(["replace", "insert"]), st.floats(0, 1), BAD_LINES),
                         min_size=1, max_size=3))
def test_journal_lines_of_any_bad_shape_are_set_aside_or_refused_never_lost(
        finished: int, unfinished: int | None, garbling: list[tuple[str, float, str]]) -> None:
    records: list[dict[str, Any]] = []
    for i in range(finished):
        records += rollout_records(f"r{i}", events=20, at=float(i))
        records.append({"kind": "note", "at": float(i), "note": f"after r{i}"})
    if unfinished is not None:
        records += rollout_records(f"r{finished}", events=unfinished, at=99.0)
    records = [{"v": 1, "seq": n, "epoch": 1, **r} for n, r in enumerate(records, 1)]
    original = journaling.unfinished(records)
    lines = store.journal_text(records).split("\n")[:-1]
    for how, where, bad in garbling:
        at = min(int(where * (len(lines) + 1)), len(lines) - (how == "replace"))
        if how == "replace" and lines:
            lines[at] = bad
        else:
            lines.insert(max(at, 0), bad)
    text = "".join(line + "\n" for line in lines)
    present = sorted(ln for ln in lines if ln.strip())
    parsed = store.parse_journal(text)  # never raises
    # every line is a record (written as it was) or a bad line kept verbatim: nothing is lost
    assert sorted([*store.journal_text(parsed.records).split("\n")[:-1], *(b.text for b in parsed.bad)]) == present
    if parsed.refusal is not None:
        event("refused: " + re.sub(r"\d[\d, ]*", "N ", parsed.refusal.split(":")[0])[:70])
        assert any(str(b.number) in parsed.refusal for b in parsed.bad)
        (problem,) = store.inspect({"journal": text}).problems
        assert problem.key == "journal" and "'journal'" in problem.reason
        return
    after = journaling.unfinished(parsed.records)
    event(f"set aside {len(parsed.bad)} line(s), " + ("no rollout unfinished" if original is None else
                                                       "the unfinished rollout kept" if after is not None else
                                                       "an untouched rollout's record set aside"))
    untouched = original is not None and all(p.state is machine.State.PENDING for p in original.progress)
    assert shape(after) == shape(original) or (untouched and after is None), (shape(original), shape(after))
    moved = store.set_aside({"journal": text}, parsed)  # what the leader writes
    assert sorted([*moved["journal"].split("\n")[:-1], *moved[store.QUARANTINE].split("\n")[:-1]]) == present


def test_a_pod_left_drained_is_reported_on_the_pod_with_a_warning_event(kube: fk.FakeKube, api: kapi.KubeApi,
                                                                         tuner_settings: config.TunerSettings) -> None:
    """Issue 31: past rollout.left_drained_ask_after_seconds the leader asks a person with a Warning Event on the
    pod a failed rollout left drained — through the chart's Role (the fake API enforces it), once."""
    old, new = ("--max-num-seqs", "8"), ("--max-num-seqs", "16")
    r = machine.new("r9", replicas=["pod-x"], changes={"pod-x": (old, new)}, limits=machine.Limits(), now=0.0)
    records: list[dict[str, Any]] = [{"kind": "rollout", "at": 0.0, **journaling.rollout_fields(r)}]
    E = machine.Event
    for i, e in enumerate((E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED, E.CRASHED, E.DRAINED, E.IDLE, E.STOPPED,
                           E.STARTED, E.HEALTHY, E.FAILED), start=1):
        after = machine.handle(r, "pod-x", e, now=float(i), reason="runs other arguments")
        records.append({"kind": "event", "at": float(i), **journaling.event_fields(r, after, "pod-x", e, "why")})
        r = after
    assert r.of("pod-x").state is machine.State.FAILED
    metrics = selfmetrics.TunerMetrics()
    leader = leading.Leader(tuner_settings, api=api, store=store.PoolStore(api), identity="pod-a_1", rules=(),
                            client=engine_client(), metrics=metrics)
    ask_after = tuner_settings.rollout.left_drained_ask_after_seconds
    shown = leader.left_drained.check(records, now=12.0 + ask_after - 1)
    assert shown["pod-x"]["rollout"] == "r9" and not shown["pod-x"]["person_asked"]
    for now in (12.0 + ask_after, 12.0 + ask_after + 60):
        leader.left_drained.check(records, now=now)
    events = [o for (_, res, _, _), o in kube.objects.items() if res == "events" and o.get("reason") == "ReplicaLeftDrained"]
    assert not kube.denied()
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    assert events[0]["involvedObject"]["name"] == "pod-x" and "a person must look" in events[0]["message"].lower()
    assert metrics.registry.get_sample_value("tuner_replica_left_drained_seconds", {"replica": "pod-x"}) == ask_after + 60


# --- one booking: a rollout a leader finished is booked, whichever leader books it (issue 29) -----------------

OLD_ARGS, NEW_ARGS = ["--max-num-seqs", "8"], ["--max-num-seqs", "16"]
ROLLED_BACK_AT_START = (machine.Event.GO, machine.Event.DRAINED, machine.Event.IDLE, machine.Event.STOPPED,
                        machine.Event.STARTED, machine.Event.CRASHED, machine.Event.DRAINED, machine.Event.IDLE,
                        machine.Event.STOPPED, machine.Event.STARTED, machine.Event.HEALTHY,
                        machine.Event.CONFIRMED, machine.Event.WARMED, machine.Event.UNDRAINED)


def finish_a_rolled_back_rollout(journal: store.ConfigMapJournal, rid: str = "r1") -> machine.Rollout:
    """A rollout of ``NEW_ARGS`` on pod-x whose candidate crashed (rolled back), journaled as the driver does."""
    journal.append("decision", at=10.0, rollout=rid, target="pod-x", changes=[{
        "flag": "--max-num-seqs", "knob": "max_num_seqs", "from": "8", "to": "16", "rule": "more-seqs",
        "reason": "why", "direction": 1}])
    r = machine.new(rid, replicas=["pod-x"], changes={"pod-x": (OLD_ARGS, NEW_ARGS)}, limits=machine.Limits(),
                    now=10.0)
    journal.append("rollout", at=10.0, **journaling.rollout_fields(r))
    for e in ROLLED_BACK_AT_START:
        why = "engine exited: status 1" if e is machine.Event.CRASHED else ""
        after = machine.handle(r, "pod-x", e, now=11.0, reason=why)
        journal.append("event", at=11.0, **journaling.event_fields(r, after, "pod-x", e))
        r = after
    assert machine.outcome(r) is machine.Outcome.ROLLED_BACK
    return r


def test_a_rollout_is_booked_in_the_write_that_finishes_it(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings) -> None:
    """The kill point between a rollout's last journal record and the leader's next save of the pool's
    history: there is none. The write of the record that finishes the rollout carries its booking (the value
    that rolled back is held bad, its cooldown runs), so a leader killed right after loses nothing and the
    next leader has nothing to book — and does not propose the value again."""
    a, journal_a = a_term(api, tuner_settings, "pod-a_1", 1)
    a.book_unbooked(journal_a)  # a fresh pool: nothing to book, and the state says so from now on
    save(a, journal_a)
    assert json.loads(data(kube)["state"])["booked_rollout"] == ""
    writes = a.store.writes
    finish_a_rolled_back_rollout(journal_a)
    assert a.store.writes - writes == 2 + len(ROLLED_BACK_AT_START)  # one write a record, the booking in the last
    saved = json.loads(data(kube)["state"])
    assert saved["booked_rollout"] == "r1" and "pod-x" in saved["histories"]
    # ... leader a is killed here: its cycle never booked the rollout in memory, nor saved

    b, journal_b = a_term(api, tuner_settings, "pod-b_2", 2)
    assert b.book_unbooked(journal_b) is None  # booked already
    assert b.state.history("pod-x").is_bad(knobs.EngineArgs.parse(NEW_ARGS))  # never proposed again


def test_a_finished_rollout_an_older_leader_did_not_book_is_booked_by_the_next_leader(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings) -> None:
    """A rollout finished by a leader that did not book it with its last record (an older version's, or one
    whose booking failed): the next leader books it at the start of its term, as a restarted daemon does
    (``Dispatcher.book_unbooked``), and saves what it booked with the history, so no later leader books it
    again — and the value is not proposed again."""
    a, journal_a = a_term(api, tuner_settings, "pod-a_1", 1)
    a.book_unbooked(journal_a)
    save(a, journal_a)
    journal_a.booking = None  # an older leader's journal
    finish_a_rolled_back_rollout(journal_a)
    assert json.loads(data(kube)["state"])["booked_rollout"] == ""

    b, journal_b = a_term(api, tuner_settings, "pod-b_2", 2)
    assert b.book_unbooked(journal_b) is not None  # what the term's first cycle does first
    assert b.state.history("pod-x").is_bad(knobs.EngineArgs.parse(NEW_ARGS))  # never proposed again
    save(b, journal_b)
    saved = json.loads(data(kube)["state"])
    assert saved["booked_rollout"] == "r1" and "pod-x" in saved["histories"]

    c, journal_c = a_term(api, tuner_settings, "pod-c_3", 3)
    assert c.book_unbooked(journal_c) is None  # once
    assert c.state.history("pod-x").is_bad(knobs.EngineArgs.parse(NEW_ARGS))


def test_a_cycle_writes_the_pool_once_with_every_change(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings) -> None:
    """Issue 29: a cycle with a journal line to set aside, a gone pod's report and desired state, the user's
    win (the pods run another base than the pool's overrides) and a history to save makes one ConfigMap
    write (main made five: the quarantine, the gone pod, the pool, its note, the history)."""
    cycle_ready_pool(kube, api)
    journal = store.ConfigMapJournal(store.PoolStore(api), epoch=1, leader="pod-a_1")
    journal.append("note", at=1.0, note="first")
    journal.append("note", at=3.0, note="third")
    first, third = data(kube)["journal"].splitlines()
    bad = '{"v":1,"seq":2,"kind":"note","note":"cut off by a bad ed'
    store.PoolStore(api).report("vllm-gone", {"state": "serving", "argv": ["vllm"], "base_sha256": "b" * 64})
    edit(kube, journal="\n".join([first, bad, third]) + "\n",
         pool=json.dumps({"overrides": [["--max-num-seqs", "16"]], "base_sha256": "a" * 64, "rollout": "r0"}),
         desired=json.dumps({"vllm-gone": {"serial": 3, "overrides": [], "drain": False}}))
    leader, journal = a_term(api, tuner_settings, "pod-a_2", 2)
    before = leader.store.writes
    leader.cycle(journal, threading.Event(), recover=True)
    assert leader.store.writes - before == 1
    after = data(kube)
    assert "report.vllm-gone" not in after and json.loads(after["desired"]) == {}
    assert after["journal.quarantine"].splitlines() == [bad]
    pool = json.loads(after["pool"])
    assert pool["overrides"] == [] and pool["base_sha256"] == "b" * 64 and "the user wins" in pool["reason"]
    notes = [r["note"] for r in store.parse_journal(after["journal"]).records]
    assert notes[:2] == ["first", "third"] and "the user wins" in notes[2]
    assert json.loads(after["state"])["booked_rollout"] == "" and "vllm-a" in json.loads(after["state"])["histories"]
    was = data(kube)
    leader.cycle(journal, threading.Event())
    assert leader.store.writes - before == 2  # the next cycle: its history (the cycle count), once
    now = data(kube)
    assert {k for k in set(was) | set(now) if was.get(k) != now.get(k)} == {"state"}


def test_a_cycle_with_no_pod_reporting_keeps_the_pool_s_history(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings) -> None:
    """Every pod restarting at once (none reports): the cycle's write forgets the gone pods' keys but keeps the
    pool's decision history for the pods to come (the state follows no pod then)."""
    cycle_ready_pool(kube, api)
    leader, journal = a_term(api, tuner_settings, "pod-a_1", 1)
    leader.cycle(journal, threading.Event(), recover=True)
    saved = data(kube)["state"]
    assert "vllm-a" in json.loads(saved)["histories"]
    kube.delete("Pod", "vllm-a")
    leader.cycle(journal, threading.Event())
    after = data(kube)
    assert after["state"] == saved and "report.vllm-a" not in after
