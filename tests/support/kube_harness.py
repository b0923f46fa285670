"""The Kubernetes leader's in-process harness: the fake API server (tests/support/fake_kube.py, the chart's
Role enforced on the agents) with the chart's Lease and journal ConfigMap, the agent's settings and API
client, and the helpers the store's, the switches' and the kill points' tests share.

The fixtures are taken by the conftest.py of each folder whose modules use them (tests/properties/,
tests/integration/). A module that sets ``ANONYMOUS = "admin"`` gets a server whose requests without a
token act as the cluster's admin (``kubectl`` over plain HTTP sends none: an operator).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import fake_kube as fk
from tuner import config
from tuner.kube import api as kapi
from tuner.kube import documents, electing, leading, poolview, store
from tuner.sources import engines

NS = "llm"
LEASE = "vllm-tuner-vllm"
CM = "vllm-tuner-journal-vllm"
LABELS = {"vllm-tuner.io/pool": "vllm"}
POD = "vllm-a"
ARGV = ["vllm", "serve", "m", "--port", "8000"]


@pytest.fixture(scope="module")
def chart() -> list[dict[str, Any]]:
    pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart's Role")
    return fk.chart_objects(namespace=NS)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, chart: list[dict[str, Any]]) -> Iterator[fk.FakeKube]:
    (role,) = [d for d in chart if d["kind"] == "Role"]
    k = fk.FakeKube(role_rules=role["rules"], namespace=NS,
                    anonymous=getattr(request.module, "ANONYMOUS", None)).start()
    try:
        yield k
    finally:
        k.stop()


def installed(server: fk.FakeKube, chart: list[dict[str, Any]]) -> fk.FakeKube:
    """The server with the chart freshly installed: its Lease and ConfigMaps as Helm creates them."""
    with server.cond:
        server.objects.clear()
        server.requests.clear()
    fk.load_objects(server, [d for d in chart if d["kind"] in ("Lease", "ConfigMap")])
    return server


@pytest.fixture
def kube(server: fk.FakeKube, chart: list[dict[str, Any]]) -> fk.FakeKube:
    """The server with the chart freshly installed: its Lease and ConfigMaps as Helm creates them."""
    return installed(server, chart)


def settings_of(kube: fk.FakeKube, tmp_path: Path) -> config.TunerSettings:
    (tmp_path / "token").write_text(fk.AGENT_TOKEN)
    return config.parse({"mode": "apply", "scrape": {"interval_seconds": 0.1},
                         "kubernetes": {"pool": "vllm", "selector": {"matchLabels": LABELS}, "lease": LEASE,
                                        "journal_configmap": CM, "api_server": kube.url,
                                        "token_file": str(tmp_path / "token"), "ca_file": None,
                                        "lease_duration_seconds": 15, "renew_deadline_seconds": 10,
                                        "retry_period_seconds": 2}})


@pytest.fixture
def tuner_settings(kube: fk.FakeKube, tmp_path: Path) -> config.TunerSettings:
    return settings_of(kube, tmp_path)


@pytest.fixture
def api(tuner_settings: config.TunerSettings) -> Iterator[kapi.KubeApi]:
    assert tuner_settings.kubernetes is not None
    a = kapi.KubeApi(tuner_settings.kubernetes, namespace=NS)
    try:
        yield a
    finally:
        a.close()


def engine_client() -> engines.EngineClient:
    body = 'vllm:num_requests_running{model_name="m",engine="0"} 0\n'
    return engines.EngineClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, text=body)))


def data(kube: fk.FakeKube) -> dict[str, str]:
    cm = kube.get("ConfigMap", CM)
    assert cm is not None
    return dict(cm.get("data") or {})


def cycle_ready_pool(kube: fk.FakeKube, api: kapi.KubeApi) -> None:
    """One pod that runs and has reported: the leader's cycle reaches the end (the history saved)."""
    kube.add_pod(POD, ip="127.0.0.1", labels=LABELS, ready=True)
    store.PoolStore(api).report(POD, {"state": "serving", "ready": True, "argv": ARGV, "base_argv": ARGV,
                                      "base_sha256": "b" * 64, "overrides": [], "serial": 0, "generation": 1,
                                      "launcher_generation": 1})


@contextlib.contextmanager
def lead_in_thread(leader: leading.Leader, leadership: electing.Leadership, **kwargs: Any) -> Iterator[None]:
    """While inside: ``leader`` leads its term in a thread of its own; on the way out it is told to stop and
    joined (10 s at most)."""
    stop = threading.Event()
    thread = threading.Thread(target=leader.lead, args=(leadership, stop), kwargs=kwargs, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Until ``condition()`` holds: a wait on something happening, not on time passing."""
    done = threading.Event()
    deadline = 0.0
    while not condition():
        if deadline > timeout:
            raise AssertionError(f"not within {timeout}s")
        done.wait(0.02)
        deadline += 0.02


def a_term(api: kapi.KubeApi, tuner_settings: config.TunerSettings, who: str,
           epoch: int) -> tuple[leading.Leader, store.ConfigMapJournal]:
    """A leadership term's start, as ``Leader.lead`` makes it: the claim, the pool's history, the dispatcher."""
    pool = store.PoolStore(api)
    leader = leading.Leader(tuner_settings, api=api, store=pool, identity=who, rules=(), client=engine_client())
    epoch = leading.claim(pool, epoch, identity=who, advance=None)
    leader._load_history()
    journal = store.ConfigMapJournal(pool, epoch=epoch, leader=who)
    leader._build(journal, threading.Event())
    return leader, journal


def save(leader: leading.Leader, journal: store.ConfigMapJournal, *, now: float = 20.0) -> None:
    """The end of a leader's cycle: its one write (the history saved with the rest)."""
    pool = poolview.view(documents.inspect(leader.store.refresh()), leader.api.list_pods(), now=now)
    leader.settle(journal, pool)
