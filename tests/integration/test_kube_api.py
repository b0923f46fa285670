"""The agent's API pieces against the fake API server (tests/support/fake_kube.py) with the chart installed
and its Role enforced: the Lease elector, the pool's ConfigMap (compare-and-swap, fencing, the journal, the
watch), and the RBAC contract (what the agent asks is allowed; what the Role does not allow is refused)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import fake_kube as fk
from tuner import config
from tuner.kube import api as kapi
from tuner.kube import electing, store

# Scheduling (tests/conftest.py): one of the fast tier's longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 17

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart's Role")

NS = "llm"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def kube() -> Iterator[fk.FakeKube]:
    k = fk.from_chart({"pdb": {"enabled": True}}, namespace=NS).start()
    try:
        yield k
    finally:
        k.stop()


def settings(kube: fk.FakeKube, tmp_path: Path, token: str = fk.AGENT_TOKEN) -> config.KubernetesSettings:
    (tmp_path / "token").write_text(token)
    return config.KubernetesSettings.model_validate({
        "pool": "vllm", "selector": {"matchLabels": {"vllm-tuner.io/pool": "vllm"}}, "lease": "vllm-tuner-vllm",
        "journal_configmap": "vllm-tuner-journal-vllm", "pod_disruption_budget": "vllm", "api_server": kube.url,
        "token_file": str(tmp_path / "token"), "ca_file": None})


@pytest.fixture
def api(kube: fk.FakeKube, tmp_path: Path) -> Iterator[kapi.KubeApi]:
    a = kapi.KubeApi(settings(kube, tmp_path), namespace=NS)
    try:
        yield a
    finally:
        a.close()


def elector(api: kapi.KubeApi, who: str, clock: Clock) -> electing.Elector:
    wall = {"t": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}

    def now() -> dt.datetime:
        wall["t"] += dt.timedelta(seconds=1)
        return wall["t"]

    return electing.Elector(api, who, lease_seconds=15, renew_deadline_seconds=10, retry_seconds=2, monotonic=clock,
                            wall=now)


def test_one_leader_a_new_epoch_at_each_takeover_and_a_quick_release(api: kapi.KubeApi, kube: fk.FakeKube) -> None:
    clock = Clock()
    a, b = elector(api, "pod-a_1", clock), elector(api, "pod-b_2", clock)
    assert a.try_once() == electing.Leadership(1, clock.t)
    assert b.try_once() is None and b.holder == "pod-a_1"
    clock.t += 5
    assert a.try_once() is not None and b.try_once() is None  # renewed: b sees the record change
    clock.t += 14  # b's last observed change is 14 s old: not expired yet
    assert b.try_once() is None
    clock.t += 2  # a stopped renewing 16 s ago (by b's clock): a's own renew deadline (10 s) passed long ago
    assert not a.is_leader()
    taken = b.try_once()
    assert taken is not None and taken.epoch == 2
    assert a.try_once() is None and not a.is_leader()  # a sees b hold it
    lease = kube.get("Lease", "vllm-tuner-vllm")["spec"]  # type: ignore[index]
    assert lease["holderIdentity"] == "pod-b_2" and lease["leaseTransitions"] == 2
    b.release()
    assert kube.get("Lease", "vllm-tuner-vllm")["spec"].get("holderIdentity") is None  # type: ignore[index]
    assert a.try_once() == electing.Leadership(3, clock.t)  # at once, not after the lease duration


def test_two_contenders_one_wins_the_compare_and_swap(api: kapi.KubeApi, kube: fk.FakeKube) -> None:
    clock = Clock()
    a, b = elector(api, "pod-a_1", clock), elector(api, "pod-b_2", clock)
    stale = api.get_lease()
    assert a.try_once() is not None
    with pytest.raises(kapi.ApiError) as info:  # b's write on the version both read
        api.update_lease(kapi.LeaseRecord(stale.resource_version, "pod-b_2", 15, None, None, stale.transitions + 1))
    assert info.value.conflict
    assert b.try_once() is None


def test_a_deposed_leaders_write_is_refused(api: kapi.KubeApi, kube: fk.FakeKube) -> None:
    old, new = store.PoolStore(api), store.PoolStore(api)
    journal = store.ConfigMapJournal(old, epoch=1, leader="pod-a_1")
    journal.append("note", at=1.0, note="from epoch 1")
    # A newer leader takes the ConfigMap (its first write carries epoch 2).
    store.ConfigMapJournal(new, epoch=2, leader="pod-b_2").append("note", at=2.0, note="from epoch 2")
    before = kube.get("ConfigMap", "vllm-tuner-journal-vllm")
    # The old leader's cache is stale: its PUT gets 409, it re-reads, sees epoch 2 and refuses to write.
    with pytest.raises(store.Deposed, match="epoch 1 is deposed"):
        journal.append("event", at=3.0, note="late")
    assert old.conflicts == 1 and old.refused == 1
    # With a fresh cache it refuses before even trying.
    with pytest.raises(store.Deposed):
        old.update(lambda d: {**d, "x": "1"}, epoch=1, leader="pod-a_1")
    after = kube.get("ConfigMap", "vllm-tuner-journal-vllm")
    assert after == before
    assert [r["note"] for r in store.ConfigMapJournal(new, epoch=2, leader="pod-b_2").records] == [
        "from epoch 1", "from epoch 2"]


def test_the_agents_writes_keep_the_objects_labels_and_annotations(api: kapi.KubeApi, kube: fk.FakeKube) -> None:
    """A PUT replaces labels and annotations: the leader's writes to the ConfigMap and the elector's to the
    Lease carry those they read (Helm's, ``helm.sh/resource-policy: keep``), and an annotation a human adds
    between the leader's read and its write survives (the CAS loses, re-reads, writes it back)."""
    cm_before = kube.get("ConfigMap", "vllm-tuner-journal-vllm")["metadata"]  # type: ignore[index]
    lease_before = kube.get("Lease", "vllm-tuner-vllm")["metadata"]  # type: ignore[index]
    assert cm_before["annotations"] == {"helm.sh/resource-policy": "keep"} and cm_before["labels"]
    s = store.PoolStore(api)
    journal = store.ConfigMapJournal(s, epoch=1, leader="pod-a_1")
    journal.append("note", at=1.0, note="a")

    def annotate(cm: dict[str, Any]) -> None:  # kubectl annotate: a merge patch of the metadata
        cm["metadata"]["annotations"]["vllm-tuner.io/paused"] = "true"

    kube.modify("ConfigMap", "vllm-tuner-journal-vllm", annotate)
    journal.append("note", at=2.0, note="b")  # its cached version is stale: 409, re-read, written again
    assert s.conflicts == 1
    after = kube.get("ConfigMap", "vllm-tuner-journal-vllm")["metadata"]  # type: ignore[index]
    assert after["labels"] == cm_before["labels"]
    assert after["annotations"] == {"helm.sh/resource-policy": "keep", "vllm-tuner.io/paused": "true"}
    assert s.annotations == after["annotations"]
    clock = Clock()
    a = elector(api, "pod-a_1", clock)
    assert a.try_once() is not None  # taken
    clock.t += 3
    assert a.try_once() is not None  # renewed
    a.release()
    lease_after = kube.get("Lease", "vllm-tuner-vllm")["metadata"]  # type: ignore[index]
    assert int(lease_after["resourceVersion"]) > int(lease_before["resourceVersion"])
    assert lease_after.get("labels") == lease_before.get("labels") and lease_after.get("labels")


def test_reports_and_leader_writes_interleave_without_loss(api: kapi.KubeApi, kube: fk.FakeKube) -> None:
    leader, agent = store.PoolStore(api), store.PoolStore(api)
    journal = store.ConfigMapJournal(leader, epoch=1, leader="pod-a_1")
    for i in range(5):
        journal.append("note", at=float(i), note=str(i))
        agent.report("pod-b", {"state": "serving", "i": i})  # a merge patch: the leader's next CAS retries
    assert leader.conflicts >= 4
    data = leader.refresh()
    assert [r["seq"] for r in journal.records] == [1, 2, 3, 4, 5]
    assert store.loads(data, "report.pod-b", {})["i"] == 4


def test_the_journal_stays_under_its_budget(api: kapi.KubeApi) -> None:
    s = store.PoolStore(api)
    journal = store.ConfigMapJournal(s, epoch=1, leader="pod-a_1", budget=4000)
    for i in range(100):
        journal.append("decision", at=float(i), target="pod-a", action={"kind": "sleep"}, pad="x" * 40)
    assert journal.compactions > 0
    assert len(s.data["journal"].encode()) <= 4000
    assert journal.records[-1]["seq"] == 100  # seq goes on across compactions


def test_the_watch_keeps_the_cache_current(api: kapi.KubeApi, kube: fk.FakeKube) -> None:
    watching, writer = store.PoolStore(api), store.PoolStore(api)
    stop = threading.Event()
    thread = threading.Thread(target=watching.watch, args=(stop,), kwargs={"server_timeout": 2}, daemon=True)
    thread.start()
    try:
        rv = watching.wait_change(None, 10)
        writer.report("pod-x", {"state": "starting"})
        rv = watching.wait_change(rv, 10)
        assert store.loads(watching.data, "report.pod-x", {}) == {"state": "starting"}
        writer.report("pod-x", {"state": "serving"})
        watching.wait_change(rv, 10)
        assert store.loads(watching.data, "report.pod-x", {}) == {"state": "serving"}
    finally:
        stop.set()
        thread.join(timeout=10)


def test_pods_and_the_pdb_as_the_leader_sees_them(api: kapi.KubeApi, kube: fk.FakeKube) -> None:
    labels = {"vllm-tuner.io/pool": "vllm", "app.kubernetes.io/name": "vllm"}
    kube.add_pod("vllm-a", ip="10.0.0.1", labels=labels, ready=True)
    kube.add_pod("vllm-b", ip="10.0.0.2", labels=labels, ready=True)
    kube.add_pod("other", ip="10.0.0.3", labels={"app": "x"}, ready=True)
    assert sorted(p.name for p in api.list_pods()) == ["vllm-a", "vllm-b"]
    assert api.disruptions_allowed() == 1
    kube.set_ready("vllm-b", False)
    assert api.disruptions_allowed() == 0
    k = settings(kube, Path(api.settings.token_file).parent)
    admission = __import__("tuner.kube.acting", fromlist=["DisruptionCheck"]).DisruptionCheck(api, k)
    assert "not Ready" in admission(None, "vllm-a")  # vllm-b is out already: a second one would be too many
    kube.set_ready("vllm-b", True)
    assert admission(None, "vllm-a") is None


# --- RBAC: the Role the chart renders, enforced ---------------------------------------------------------


def test_the_chart_config_is_the_agents_config() -> None:
    (cm,) = [d for d in fk.chart_objects({"mode": "apply"}) if d["kind"] == "ConfigMap"
             and d["metadata"]["name"] == "vllm-tuner-config-vllm"]
    s = config.parse(yaml.safe_load(cm["data"]["config.yaml"]), file="config.yaml")
    assert s.mode == "apply" and s.kubernetes is not None
    assert s.kubernetes.lease == "vllm-tuner-vllm" and s.kubernetes.journal_configmap == "vllm-tuner-journal-vllm"
    assert s.kubernetes.pod_disruption_budget == "vllm"


REFUSED: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/api/v1/namespaces/llm/configmaps", {"metadata": {"name": "mine"}}),  # no create
    ("PUT", "/api/v1/namespaces/llm/configmaps/vllm-tuner-config-vllm", {"metadata": {"name": "vllm-tuner-config-vllm"}}),
    ("GET", "/api/v1/namespaces/llm/pods?watch=true", None),  # no code watches pods
    ("POST", "/apis/events.k8s.io/v1/namespaces/llm/events", {"metadata": {"name": "e"}}),
    ("GET", "/api/v1/namespaces/llm/configmaps", None),  # list: not by name
    ("GET", "/api/v1/namespaces/llm/configmaps?watch=true", None),  # a watch without the name selector
    ("GET", "/api/v1/namespaces/llm/secrets/anything", None),
    ("PATCH", "/api/v1/namespaces/llm/pods/vllm-a", {"metadata": {"labels": {"x": "y"}}}),
    ("PUT", "/api/v1/namespaces/llm/pods/vllm-a/status", {}),
    ("POST", "/api/v1/namespaces/llm/pods/vllm-a/exec", {}),
    ("DELETE", "/api/v1/namespaces/llm/pods/vllm-a", None),
    ("GET", "/apis/apps/v1/namespaces/llm/deployments/vllm", None),
    ("PATCH", "/apis/apps/v1/namespaces/llm/deployments/vllm", {}),
    ("POST", "/apis/coordination.k8s.io/v1/namespaces/llm/leases", {"metadata": {"name": "x"}}),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/llm/leases/another", {"metadata": {"name": "another"}}),
    ("DELETE", "/apis/coordination.k8s.io/v1/namespaces/llm/leases/vllm-tuner-vllm", None),
    ("GET", "/apis/policy/v1/namespaces/llm/poddisruptionbudgets/other", None),
]


@pytest.mark.parametrize(("method", "path", "body"), REFUSED)
def test_a_request_outside_the_role_is_refused(kube: fk.FakeKube, method: str, path: str,
                                               body: dict[str, Any] | None) -> None:
    import httpx

    r = httpx.request(method, kube.url + path, json=body, headers={"Authorization": f"Bearer {fk.AGENT_TOKEN}"},
                      timeout=5)
    assert r.status_code == 403, (r.status_code, r.text)
    assert r.json()["reason"] == "Forbidden"


def test_no_token_no_answer(kube: fk.FakeKube) -> None:
    import httpx

    r = httpx.get(kube.url + "/apis/coordination.k8s.io/v1/namespaces/llm/leases/vllm-tuner-vllm", timeout=5)
    assert r.status_code == 401
