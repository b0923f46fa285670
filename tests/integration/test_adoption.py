"""Adoption of real charts (docs/kubernetes.md, "Adoption"): production-stack's own chart (vendored,
tests/fixtures/charts/vllm-stack) rendered by Helm 4's renderer and run through `vllm-tuner inject` the
way Helm 4 runs the post-renderer plugin (deploy/helm/plugins/vllm-tuner-inject) and the way kustomize's
helmCharts recipe (deploy/kubernetes/production-stack) does; the result validated strictly. And the two
programs adoption puts in the pod, run for real: the engine's wrapper (the launcher when the agent
wrote it, else the engine on its own: fail open) and the exec probe (the launcher's, else the engine's
/health)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import ports, waiting
from tests.integration.test_deploy import CHART, VERSIONS, by_kind, kubectl, validate
from tests.support import helm_shim
from tuner.actuators import children
from tuner.kube import injecting as inj
from tuner.launcher import packaging
from tuner.portable import pod_protocol as protocol

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "tests" / "fixtures" / "charts" / "vllm-stack"
PLUGIN = REPO / "deploy" / "helm" / "plugins" / "vllm-tuner-inject"
RECIPE = REPO / "deploy" / "kubernetes" / "production-stack"
IMAGE = "ghcr.io/example/vllm-tuner:0.1.0"
helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")


def render(chart: Path, values: dict[str, Any], *, name: str, namespace: str = "llm") -> str:
    with helm.Chart.load(str(chart)) as c:
        rendered = c.render(values, name=name, namespace=namespace, is_install=True)
    return "".join(f"---\n# Source: {p}\n{t}\n" for p, t in sorted(rendered.items()) if p.endswith(".yaml"))


def post_render(manifests: str, *extra_args: str) -> subprocess.CompletedProcess[str]:
    """What Helm 4 does with `--post-renderer vllm-tuner-inject --post-renderer-args …`: the plugin's
    platformCommand (its command and args, environment variables expanded), the extra args after them,
    the rendered manifests on stdin, the new manifests from stdout; a non-zero exit fails the release."""
    plugin = yaml.safe_load((PLUGIN / "plugin.yaml").read_text())
    (command,) = plugin["runtimeConfig"]["platformCommand"]
    env = {**os.environ, "HELM_PLUGIN_NAME": plugin["name"], "HELM_PLUGIN_DIR": str(PLUGIN),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    argv = [os.path.expandvars(command["command"]), *(os.path.expandvars(a) for a in command["args"]), *extra_args]
    return subprocess.run(argv, input=manifests, capture_output=True, text=True, timeout=120, env=env, check=False)


STACK_VALUES = yaml.safe_load((RECIPE / "values.yaml").read_text())


def test_the_plugin_is_a_helm_4_post_renderer():
    plugin = yaml.safe_load((PLUGIN / "plugin.yaml").read_text())
    assert plugin["apiVersion"] == "v1" and plugin["type"] == "postrenderer/v1" and plugin["runtime"] == "subprocess"
    assert plugin["name"] == PLUGIN.name and "config" not in plugin  # postrenderer/v1 takes no config
    assert set(plugin["runtimeConfig"]) == {"platformCommand"}


def test_production_stack_through_the_helm_4_post_renderer_plugin():
    out = post_render(render(STACK, STACK_VALUES, name="vllm"), f"--image={IMAGE}")
    assert out.returncode == 0, out.stderr
    assert "Deployment/llm/vllm-opt125m-deployment-vllm: adopted into pool opt125m" in out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    engine_deployment = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-vllm"))
    spec = engine_deployment["spec"]["template"]["spec"]
    (engine,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    command = engine["command"]
    assert command[command.index("--") + 1:][:3] == ["vllm", "serve", "facebook/opt-125m"]
    assert command[command.index("--stop-timeout") + 1] == "45"  # --shutdown-timeout 30 (extraArgs) + 15
    assert spec["serviceAccountName"] == "vllm-opt125m" and spec["terminationGracePeriodSeconds"] == 65
    assert engine["startupProbe"]["httpGet"]["path"] == "/health", "the chart's own startupProbe is kept"
    router = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-router"))
    assert "initContainers" not in router["spec"]["template"]["spec"], "only the annotated workload is adopted"
    tuner = yaml.safe_load_all(render(CHART, {"pool": {"name": "opt125m"}, "serviceAccount": {"create": True,
                                              "name": "vllm-opt125m"}}, name="opt125m"))
    for version in VERSIONS:
        validate([*docs, *(d for d in tuner if d)], version)


def test_the_post_renderer_fails_the_release_it_cannot_adopt():
    values = yaml.safe_load(yaml.safe_dump(STACK_VALUES))
    del values["servingEngineSpec"]["modelSpec"][0]["annotations"]
    out = post_render(render(STACK, values, name="vllm"), f"--image={IMAGE}")
    assert out.returncode == 2 and "no workload asks for the tuner" in out.stderr, "adopting nothing is a mistake"
    values["servingEngineSpec"]["modelSpec"][0]["annotations"] = {"vllm-tuner.io/inject": "true"}
    out = post_render(render(STACK, values, name="vllm"), f"--image={IMAGE}")
    assert out.returncode == 2 and "annotate it vllm-tuner.io/pool" in out.stderr


def test_production_stack_through_the_kustomize_helm_charts_recipe(tmp_path):
    """deploy/kubernetes/production-stack as a user lays it out: production-stack where kustomize pulls
    it (charts/vllm-stack-0.1.12/vllm-stack), vllm-tuner's chart untarred into charts/vllm-tuner."""
    recipe = tmp_path / "recipe"
    shutil.copytree(RECIPE, recipe)
    shutil.copytree(STACK, recipe / "charts" / "vllm-stack-0.1.12" / "vllm-stack")
    shutil.copytree(CHART, recipe / "charts" / "vllm-tuner")
    shim = helm_shim.install(tmp_path)
    env = {**os.environ, "HELM_SHIM_LOG": str(tmp_path / "helm.log")}
    built = subprocess.run([kubectl(), "kustomize", "--enable-helm", "--helm-command", str(shim), str(recipe)],
                           capture_output=True, text=True, timeout=180, env=env, check=False)
    assert built.returncode == 0, built.stderr
    assert [line.split()[0] for line in (tmp_path / "helm.log").read_text().splitlines()] == \
        ["version", "template", "version", "template"], "kustomize pulled nothing: both charts were local"
    out = subprocess.run([sys.executable, "-m", "tuner", "inject", "--require", "--image", IMAGE], input=built.stdout,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("RoleBinding", "vllm-tuner-opt125m"), ("ServiceAccount", "vllm-opt125m"),
            ("ConfigMap", "vllm-tuner-config-opt125m"), ("Deployment", "vllm-opt125m-deployment-vllm")} <= names
    for version in VERSIONS:
        validate(docs, version)


# --- the programs in the pod, for real -----------------------------------------------------------------


def run_wrapper(state: Path, engine: list[str], *, wait: float, opts: tuple[str, ...] = ("--stop-timeout", "20")
                ) -> subprocess.Popen[bytes]:
    """The engine container's command, as injected; its output in state/../wrapper.log."""
    argv = ["python3", "-c", inj.WRAPPER, str(state), f"{wait:g}", *opts, "--", *engine]
    with open(state.parent / "wrapper.log", "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def probe(state: Path, what: str, probe_port: int, engine_port: int) -> int:
    return subprocess.run(["python3", "-I", "-S", "-c", inj.PROBE, str(state), what, str(probe_port),
                           str(engine_port)], capture_output=True, timeout=30, check=False).returncode


def stub(port: int) -> list[str]:
    return ["python3", str(REPO / "tests" / "support" / "stub_engine.py"), "--port", str(port)]


def stop(proc: subprocess.Popen[bytes]) -> None:
    children.stop(proc, timeout_seconds=20)  # SIGTERM, SIGKILL after 20 s, reaped


def test_without_the_agent_the_engine_starts_on_its_own_and_the_probes_hold(tmp_path):
    state, port = tmp_path / "state", ports.free_port()
    state.mkdir()
    started = time.monotonic()
    proc = run_wrapper(state, stub(port), wait=1.0)
    try:
        waiting.wait_for(lambda: probe(state, "readyz", ports.free_port(), port) == 0, 30, "the engine's /health")
        assert time.monotonic() - started < 15
        assert (state / "plain").exists() and not (state / "launcher.pyz").exists()
        assert probe(state, "livez", 1, port) == 0, "liveness holds on the engine's own /health"
    finally:
        stop(proc)
    assert "no launcher in" in (tmp_path / "wrapper.log").read_text()
    assert probe(state, "readyz", 1, port) != 0, "an engine that is gone is not ready"


def test_with_the_agents_launcher_the_engine_runs_under_it_and_the_probes_ask_it(tmp_path):
    state, port, probe_port = tmp_path / "state", ports.free_port(), ports.free_port()
    state.mkdir()
    (state / "plain").write_text("")  # left by an earlier start without the agent
    packaging.build_zipapp(state / "launcher.pyz")
    (state / "desired.json").write_text('{"v": 1, "generation": 1, "overrides": [], "drain": false}')
    proc = run_wrapper(state, stub(port), wait=30.0, opts=("--probe-port", str(probe_port)))
    try:
        waiting.wait_for(lambda: probe(state, "readyz", probe_port, port) == 0, 60, "the launcher's /readyz",
                         detail=lambda: (tmp_path / "wrapper.log").read_text()[-2000:])
        assert not (state / "plain").exists()
        status = waiting.wait_for(lambda: protocol.read_status(state), 30, "status.json")
        assert status["launcher_pid"] == proc.pid, "the wrapper exec'd the launcher: same process"
        assert probe(state, "livez", probe_port, port) == 0
        (state / "desired.json").write_text('{"v": 1, "generation": 2, "overrides": [], "drain": true}')
        waiting.wait_for(lambda: probe(state, "readyz", probe_port, port) != 0, 30, "drained: not ready")
        assert probe(state, "livez", probe_port, port) == 0
    finally:
        stop(proc)


# --- what people run: vLLM's documented Deployment, args only, kind: List, AIBrix, llm-d ----------------

MANIFESTS = REPO / "tests" / "fixtures" / "manifests"


def kustomize_with_annotations(tmp_path: Path, manifest: Path, *, pool: str, container: str) -> str:
    """The user's manifest as they have it, the tuner's annotations added by a kustomize patch (the
    way one adopts a manifest one does not own), built by real `kubectl kustomize`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(manifest, tmp_path / manifest.name)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [manifest.name],
        "patches": [{"target": {"kind": "Deployment"}, "patch": yaml.safe_dump({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "not-important", "annotations": {
                "vllm-tuner.io/inject": "true", "vllm-tuner.io/pool": pool,
                "vllm-tuner.io/engine-container": container}}})}]}))
    built = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120,
                           check=False)
    assert built.returncode == 0, built.stderr
    return built.stdout


def inject_cli(text: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tuner", "inject", "--require", "--image", IMAGE, *args],
                          input=text, capture_output=True, text=True, timeout=120, check=False)


def engine_after_wrapper(doc: dict[str, Any], name: str) -> tuple[dict[str, Any], list[str]]:
    (engine,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    command = engine["command"]
    return engine, command[command.index("--") + 1:] + list(engine.get("args") or [])


VLLM_DOCS_SCRIPT = ("vllm serve mistralai/Mistral-7B-Instruct-v0.3 --trust-remote-code --enable-chunked-prefill "
                    "--max_num_batched_tokens 1024")


def test_vllms_documented_deployment_is_adopted_as_the_scripts_argv(tmp_path):
    built = kustomize_with_annotations(tmp_path, MANIFESTS / "vllm-docs" / "deployment-gpu.yaml", pool="mistral",
                                       container="mistral-7b")
    out = inject_cli(built)
    assert out.returncode == 0, out.stderr
    assert "Deployment/default/mistral-7b: container mistral-7b's script /bin/sh -c" in out.stderr
    assert "warning: Deployment/default/mistral-7b: the engine has no --shutdown-timeout" in out.stderr
    assert "vllm/vllm-openai:latest is :latest" in out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (deployment,) = by_kind(docs, "Deployment")
    engine, argv = engine_after_wrapper(deployment, "mistral-7b")
    assert argv == shlex.split(VLLM_DOCS_SCRIPT) and "args" not in engine
    assert engine["livenessProbe"]["initialDelaySeconds"] == 60 and engine["readinessProbe"]["initialDelaySeconds"] == 60
    assert "exec" in engine["startupProbe"], "a load longer than liveness allows is covered on the fallback path"
    assert by_kind(docs, "Service") == by_kind([d for d in yaml.safe_load_all(built) if d], "Service")
    for version in VERSIONS:
        validate(docs, version)


def args_only_deployment() -> dict[str, Any]:
    """vLLM's documented Deployment written the other common way: args only, after the image's ENTRYPOINT."""
    (doc, _) = [d for d in yaml.safe_load_all((MANIFESTS / "vllm-docs" / "deployment-gpu.yaml").read_text()) if d]
    doc["metadata"].update(name="qwen", annotations={"vllm-tuner.io/inject": "true", "vllm-tuner.io/pool": "qwen",
                                                     "vllm-tuner.io/engine-container": "mistral-7b"})
    (engine,) = doc["spec"]["template"]["spec"]["containers"]
    del engine["command"]
    engine.update(image="vllm/vllm-openai:v0.32.0", args=["Qwen/Qwen3-8B", "--port", "8000", "--shutdown-timeout", "30"])
    return doc


def test_an_args_only_vllm_openai_deployment_and_a_kind_list_of_both_are_adopted():
    sh = next(d for d in yaml.safe_load_all((MANIFESTS / "vllm-docs" / "deployment-gpu.yaml").read_text()) if d)
    sh["metadata"]["annotations"] = {"vllm-tuner.io/inject": "true", "vllm-tuner.io/pool": "mistral",
                                     "vllm-tuner.io/engine-container": "mistral-7b"}
    listed = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
              "items": [sh, args_only_deployment()]}  # what `kubectl get deploy -o yaml` prints
    out = inject_cli(yaml.safe_dump(listed))
    assert out.returncode == 0, out.stderr
    assert "Deployment/default/qwen: container mistral-7b gives args only: adopted after the ENTRYPOINT of " \
           "vllm/vllm-openai:v0.32.0, command [\"vllm\", \"serve\"]" in out.stderr
    (result,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert result["kind"] == "List" and len(result["items"]) == 2
    first, second = result["items"]
    assert engine_after_wrapper(first, "mistral-7b")[1] == shlex.split(VLLM_DOCS_SCRIPT)
    engine, argv = engine_after_wrapper(second, "mistral-7b")
    assert argv == ["vllm", "serve", "Qwen/Qwen3-8B", "--port", "8000", "--shutdown-timeout", "30"]
    assert engine["args"] == ["Qwen/Qwen3-8B", "--port", "8000", "--shutdown-timeout", "30"]
    for version in VERSIONS:
        validate(result["items"], version)


def test_a_script_with_and_and_is_refused_with_the_list_form():
    sh = next(d for d in yaml.safe_load_all((MANIFESTS / "vllm-docs" / "deployment-gpu.yaml").read_text()) if d)
    sh["metadata"]["annotations"] = {"vllm-tuner.io/inject": "true", "vllm-tuner.io/pool": "mistral",
                                     "vllm-tuner.io/engine-container": "mistral-7b"}
    sh["spec"]["template"]["spec"]["containers"][0]["args"] = [f"pip install -U hf_transfer && {VLLM_DOCS_SCRIPT}"]
    out = inject_cli(yaml.safe_dump(sh))
    assert out.returncode == 2 and out.stdout == ""
    assert f"command: {json.dumps(shlex.split(VLLM_DOCS_SCRIPT))}" in out.stderr and "more than one command" in out.stderr


@pytest.mark.parametrize(("manifest", "container", "engine_argv0"), [
    (MANIFESTS / "aibrix" / "model.yaml", "vllm-openai", ["vllm", "serve", "--host", "0.0.0.0"]),
    (MANIFESTS / "llm-d" / "vllm-deployment.yaml", "modelserver", ["vllm", "serve", "Qwen/Qwen3-32B"]),
], ids=["aibrix", "llm-d"])
def test_aibrix_and_llm_d_manifests_are_adopted(tmp_path, manifest, container, engine_argv0):
    original = next(d for d in yaml.safe_load_all(manifest.read_text()) if d)
    (theirs,) = [c for c in original["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    built = kustomize_with_annotations(tmp_path, manifest, pool="pool", container=container)
    out = inject_cli(built)
    assert out.returncode == 0, out.stderr
    assert "no --shutdown-timeout" in out.stderr  # neither sets one: vLLM's default 0 s
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (deployment,) = by_kind(docs, "Deployment")
    engine, argv = engine_after_wrapper(deployment, container)
    assert argv == [*theirs["command"], *theirs.get("args", [])] and argv[:len(engine_argv0)] == engine_argv0
    assert engine["startupProbe"] == theirs["startupProbe"], "their own startupProbe is kept"
    assert engine["livenessProbe"]["periodSeconds"] == theirs["livenessProbe"]["periodSeconds"]
    assert engine["livenessProbe"]["timeoutSeconds"] >= 5, "an exec probe needs more than their 1 s"
    assert deployment["spec"]["selector"] == original["spec"]["selector"]
    for version in VERSIONS:
        validate(docs, version)
