"""The Helm chart's ``values.schema.json`` (deploy/helm/vllm-tuner), generated from the same pydantic
models ``check-config`` validates with: one source, so ``helm template``/``install`` refuses what the
agent would refuse (a misspelt mode, a malformed rule, an unknown key) before anything reaches a pod.

Each value the chart writes into the agent's configuration takes its field's schema from the models
(``FROM_CONFIG``: ``mode`` from ``TunerSettings.mode``, ``rules`` from ``RuleFile.rules``, …, their
descriptions the models' attribute docstrings); the chart's own values (image, RBAC, NetworkPolicy,
the agent container) are written here. Every object is closed (``additionalProperties: false``): an
unknown key such as ``mdoe:`` fails the render.

``python -m tuner.kube.chartvalues`` prints it; ``make chart-schema`` writes it;
tests/integration/test_deploy.py holds the committed file equal to this output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tuner.config import TunerSettings
from tuner.rules.schema import RuleFile

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "vllm-tuner" / "values.schema.json"

# chart value → (pydantic model in TunerSettings' $defs, or "TunerSettings"; its field)
FROM_CONFIG: dict[str, tuple[str, str]] = {
    "mode": ("TunerSettings", "mode"),
    "maintenanceWindows": ("DaemonSettings", "maintenance_windows"),
    "maintenanceTimezone": ("DaemonSettings", "maintenance_timezone"),
    "statusFromNetwork": ("DaemonSettings", "status_from_network"),
    "engineContainer": ("KubernetesSettings", "engine_container"),
    "enginePort": ("KubernetesSettings", "engine_port"),
    "shutdownTimeoutSeconds": ("KubernetesSettings", "shutdown_timeout_seconds"),
    "maxUnavailable": ("KubernetesSettings", "max_unavailable"),
    "drainGraceSeconds": ("KubernetesSettings", "drain_grace_seconds"),
}
RULE_PREFIX = "Rule_"  # the rule file's $defs, renamed so they cannot meet the configuration's


def _closed(properties: dict[str, Any], description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "description": description, "additionalProperties": False, "properties": properties,
            **extra}


def _renamed_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        return {k: (v.replace("#/$defs/", f"#/$defs/{prefix}") if k == "$ref" and isinstance(v, str)
                    else _renamed_refs(v, prefix)) for k, v in node.items()}
    if isinstance(node, list):
        return [_renamed_refs(v, prefix) for v in node]
    return node


def _field(config: dict[str, Any], model: str, name: str) -> dict[str, Any]:
    holder = config if model == "TunerSettings" else config["$defs"][model]
    field = dict(holder["properties"][name])
    field.pop("title", None)
    return field


def schema() -> dict[str, Any]:
    config = TunerSettings.model_json_schema()
    rules = _renamed_refs(RuleFile.model_json_schema(), RULE_PREFIX)
    defs = {"LabelSelector": config["$defs"]["LabelSelector"],
            "SelectorRequirement": config["$defs"]["SelectorRequirement"],
            **{f"{RULE_PREFIX}{k}": v for k, v in rules["$defs"].items()}}
    integer = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
    probe = _closed(dict.fromkeys(("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold"), integer), "The agent's liveness probe timings (its /healthz).")
    pool = _field(config, "KubernetesSettings", "pool")
    properties: dict[str, Any] = {
        "global": {"type": "object", "description": "Helm's values shared with subcharts (unused here)."},
        "image": _closed({
            "repository": {"type": "string", "pattern": r"^([a-z0-9][a-z0-9._/:-]*)?$",
                           "description": "The tuner's image, without tag (REGISTRY/PATH). Empty: none here "
                                          "(`vllm-tuner inject --image` gives it)."},
            "tag": {"type": "string", "pattern": r"^([\w][\w.-]{0,127})?$",
                    "description": "Its tag. Empty: the chart's appVersion."},
            "digest": {"type": "string", "pattern": r"^(sha256:[0-9a-f]{64})?$",
                       "description": "Its digest (sha256:…): pins the image; wins over the tag."},
            "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        }, "The agent's image: `vllm-tuner inject` uses it when this chart is rendered in the same stream "
           "(kustomize helmCharts) and no --image is given."),
        **{value: _field(config, model, name) for value, (model, name) in FROM_CONFIG.items()},
        "pool": _closed({
            "name": {"anyOf": [{"const": ""}, {**pool, "maxLength": 40}],
                     "description": "The pool's name (a DNS label, at most 40 characters). Empty: the release name."},
            "selector": {"anyOf": [{"type": "object", "maxProperties": 0}, {"$ref": "#/$defs/LabelSelector"}],
                         "description": "The pool's pods. Empty: matchLabels {vllm-tuner.io/pool: <pool>}."},
        }, "The pool: one release per pool."),
        "rules": rules["properties"]["rules"],
        "serviceAccount": _closed({"name": {"type": "string"}, "create": {"type": "boolean"}},
                                  "The ServiceAccount the pool's pods run as (the Role is bound to it)."),
        "rbac": _closed({k: {"type": "boolean"} for k in ("create", "createLeases", "readPodDisruptionBudget")},
                        "The Role and RoleBinding."),
        "journal": _closed({"create": {"type": "boolean"}}, "The pool's journal ConfigMap."),
        "pdb": _closed({"enabled": {"type": "boolean"}, "name": {"type": "string"}},
                       "A PodDisruptionBudget for the pool's pods."),
        "networkPolicy": _closed({
            "enabled": {"type": "boolean"},
            "enginePorts": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 65535}},
            "engineFrom": {"type": "array", "items": {"type": "object"}},
            "monitoringNamespace": {"type": "string", "minLength": 1},
            "extraIngress": {"type": "array", "items": {"type": "object"}},
        }, "A NetworkPolicy for the pool's pods."),
        "agent": _closed({
            "resources": _closed({"requests": {"type": "object"}, "limits": {"type": "object"},
                                  "claims": {"type": "array"}}, "The agent container's resources."),
            "livenessProbe": probe,
        }, "The agent sidecar `vllm-tuner inject` adds (read from this chart's ConfigMap in the same stream)."),
    }
    properties["rules"] = {**properties["rules"], "description": "The rules file's `rules:` list (docs/rules.md). "
                                                                 "Empty: the tuner's built-in default rules."}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "vllm-tuner chart values",
            "description": "Generated by `python -m tuner.kube.chartvalues` from the configuration's pydantic "
                           "models (tuner/config.py, tuner/rules/schema.py); do not edit by hand.",
            "type": "object", "additionalProperties": False, "properties": properties, "$defs": defs}


def text() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"]:
        SCHEMA_PATH.write_text(text(), encoding="utf-8")
        print(SCHEMA_PATH)
    else:
        sys.stdout.write(text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
