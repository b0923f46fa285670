"""The leader's pool view and its one write per cycle (tuner/kube/poolview.py), pure: the pool's ConfigMap
as typed documents in (``documents.inspect``), the view and the write out."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.kube import documents, poolview
from tuner.kube.api import PodView, dumps
from tuner.rollout import journal as journaling
from tuner.rollout import machine

BASES = ("a" * 64, "b" * 64)
STATES = ("starting", "serving", "draining", "stopping", "exited", "candidate-failed", None)


def pod(name: str, *, phase: str = "Running", ip: str | None = "10.0.0.1", deleting: bool = False) -> PodView:
    return PodView(name=name, uid=name, ip=ip, phase=phase, ready=True, deleting=deleting, labels={})


def report(state: str | None, base: str | None, *, argv: object = ("vllm", "serve", "m")) -> str:
    return dumps({"state": state, "base_sha256": base, "argv": list(argv) if isinstance(argv, tuple) else argv,
                  "overrides": []})


PODS = st.lists(st.tuples(st.sampled_from(STATES), st.sampled_from((*BASES, None)),
                          st.sampled_from(["Running", "Pending"]), st.booleans(), st.booleans()),
                min_size=0, max_size=5)


@settings(max_examples=300)
@given(pods=PODS, pool_base=st.sampled_from((*BASES, None)), overrides=st.booleans())
def test_the_view_is_the_members_their_hold_and_the_users_win(pods: list[tuple[str | None, str | None, str, bool,
                                                                                bool]],
                                                               pool_base: str | None, overrides: bool) -> None:
    data = {"pool": dumps({"overrides": [["--max-num-seqs", "16"]] if overrides else [], "base_sha256": pool_base,
                           "rollout": None})}
    listed = []
    for i, (state, base, phase, deleting, reports) in enumerate(pods):
        listed.append(pod(f"p{i}", phase=phase, deleting=deleting))
        if reports:
            data[f"report.p{i}"] = report(state, base)
    found = documents.inspect(data)
    assert not found.problems
    view = poolview.view(found, listed, now=5.0)
    members = {f"p{i}" for i, (state, _, phase, deleting, reports) in enumerate(pods)
               if reports and phase == "Running" and not deleting and state in documents.RUNNING_STATES}
    assert set(view.members) == members
    bases = {pods[int(n[1:])][1] for n in members}
    assert (view.hold is not None) == (len(bases) > 1)
    wins = len(bases) == 1 and None not in bases and overrides and pool_base is not None and pool_base not in bases
    assert (view.user_wins is not None) == wins
    assert view.known == {p.name for p in listed}
    if view.user_wins is not None:
        settled = poolview.settle(data, view, state=documents.state_text({}, ""), epoch=1)
        assert settled.data is not None
        again = documents.inspect(settled.data)
        assert again.pool is not None and again.pool.overrides == () and again.pool.base_sha256 in bases
        assert [r["kind"] for r in again.journal.records] == ["note"]
        # the write applied again to what it wrote changes nothing (a compare-and-swap retried)
        assert poolview.settle(settled.data, view, state=documents.state_text({}, ""), epoch=1).data is None


def test_a_report_that_is_no_list_of_strings_is_no_member() -> None:
    data = {"report.p0": report("serving", BASES[0], argv="vllm serve m"),
            "report.p1": report("serving", BASES[0], argv=["vllm", 3]),
            "report.p2": "not json", "report.p3": report("serving", BASES[0])}
    view = poolview.view(documents.inspect(data), [pod(f"p{i}") for i in range(4)], now=0.0)
    assert list(view.members) == ["p3"]


def done_rollout(rid: str, name: str) -> list[journaling.Record]:
    r = machine.new(rid, replicas=[name], changes={name: (["--a", "1"], ["--a", "2"])}, limits=machine.Limits(),
                    now=1.0)
    records: list[journaling.Record] = [{"v": 1, "seq": 1, "at": 1.0, "kind": "rollout",
                                         **journaling.rollout_fields(r)}]
    for seq, e in enumerate((machine.Event.GO, machine.Event.DRAINED, machine.Event.IDLE, machine.Event.STOPPED,
                             machine.Event.STARTED, machine.Event.HEALTHY, machine.Event.CONFIRMED,
                             machine.Event.WARMED, machine.Event.UNDRAINED, machine.Event.VERIFIED), 2):
        after = machine.handle(r, name, e, now=2.0)
        records.append({"v": 1, "seq": seq, "at": 2.0, "kind": "event", **journaling.event_fields(r, after, name, e)})
        r = after
    assert machine.outcome(r) is machine.Outcome.DONE
    return records


def test_a_done_rollout_makes_the_pool_s_verified_arguments_once_in_the_cycle_s_one_write() -> None:
    records = done_rollout("r1", "p0")
    data = {"journal": documents.journal_text(records),
            "report.p0": dumps({"state": "serving", "argv": ["vllm", "--a", "2"], "base_sha256": BASES[0],
                                "overrides": [["--a", "2"]]}),
            "report.gone": report("serving", BASES[0]), "desired": dumps({"gone": {"serial": 1}, "p0": {"serial": 2}})}
    view = poolview.view(documents.inspect(data), [pod("p0")], now=3.0)
    settled = poolview.settle(data, view, state=documents.state_text({}, "r1"), epoch=4)
    assert settled.data is not None and settled.verified is not None
    assert json.loads(settled.data["pool"]) == {"overrides": [["--a", "2"]], "base_sha256": BASES[0], "rollout": "r1"}
    assert "report.gone" not in settled.data and json.loads(settled.data["desired"]) == {"p0": {"serial": 2}}
    assert json.loads(settled.data["state"])["booked_rollout"] == "r1"
    assert settled.data["journal"] == data["journal"]  # every record kept
    assert poolview.settle(settled.data, view, state=documents.state_text({}, "r1"), epoch=4).data is None
