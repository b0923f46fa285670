"""What adoption is (``vllm-tuner inject``, ``tuner.kube.injecting``): the names it writes on a workload
and its pod (annotations, labels, paths, ports), its settings, its refusals and what it reports for a
workload it adopted."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.errors import TunerError

INJECT = "vllm-tuner.io/inject"
POOL = "vllm-tuner.io/pool"
ENGINE_CONTAINER = "vllm-tuner.io/engine-container"
ENGINE_PORT = "vllm-tuner.io/engine-port"  # written on the pod: where monitoring finds the engine's /metrics
AGENT_LABEL = "vllm-tuner.io/agent"
AGENT_SPEC = "vllm-tuner.io/agent"
"""The annotation on the chart's configuration ConfigMap (JSON: image, imagePullPolicy, resources,
livenessProbe) that the chart's values ``image.*`` and ``agent.*`` write and ``inject`` reads when the
chart is rendered in the same stream (kustomize's helmCharts, one ``helm template`` of both)."""
AGENT = "vllm-tuner-agent"
STATE_DIR = "/var/run/vllm-tuner"
CONFIG_DIR = "/etc/vllm-tuner"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PROBE_PORT = 8081  # the launcher's default --probe-port
METRICS_PORT = 9180
PRE_STOP_SECONDS = 10
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_SHUTDOWN_SECONDS = 86_400.0
VOLUMES = ("vllm-tuner-state", "vllm-tuner-config", "vllm-tuner-token")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class AdoptionError(TunerError):
    """A workload asked for the tuner (``vllm-tuner.io/inject``) but cannot be adopted as it is written.

    ``where`` names the object (``Deployment/ns/name``), ``what`` says what is wrong, ``fix`` what would
    be accepted instead."""

    def __init__(self, where: str, what: str, fix: str) -> None:
        self.where, self.what, self.fix = where, what, fix
        super().__init__(f"{where}: {what}; {fix}")


class Refused(AdoptionError):
    """Every problem of one run (``problems``), one line each; the first is this error's own."""

    def __init__(self, problems: Sequence[AdoptionError]) -> None:
        self.problems = tuple(problems)
        first = self.problems[0]
        super().__init__(first.where, first.what, first.fix)
        self.args = ("\n".join(str(p) for p in self.problems),)

    def __str__(self) -> str:
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class Settings:
    image: str | None = None
    """The agent's image (``vllm-tuner inject --image``), by tag or digest. None: the chart's
    (``AGENT_SPEC``) when it is in the stream; a workload adopted without either is refused."""
    image_pull_policy: str = "IfNotPresent"
    wait_seconds: float = 30.0
    """How long the engine container waits for the agent's launcher and desired.json before it starts
    the engine on its own (fail open). The agent gives up on the API server before that
    (``agent_startup_seconds``), so a slow API still starts the engine under the launcher."""
    agent_startup_seconds: float = 20.0
    stop_margin_seconds: float = 15.0
    """Launcher ``--stop-timeout`` = the engine's ``--shutdown-timeout`` + this: vLLM's own teardown after
    its HTTP drain took 3.5-8.3 s here (docs/kubernetes.md, "What was measured"), so 15 s is about twice
    the slowest one before SIGKILL."""
    grace_margin_seconds: float = 10.0
    """terminationGracePeriodSeconds = preStop sleep + the launcher's stop timeout + this: the launcher's
    SIGKILL and reaping, then the agent sidecar's own stop (it releases the Lease) within the same
    grace period."""
    startup_seconds: int = 1800
    """The startupProbe added when the engine has none: how long a model may load (download, weights,
    compilation, CUDA graphs) before liveness applies. 30 minutes: a large model from a cold cache."""
    entrypoint: tuple[str, ...] | None = None
    """The ENTRYPOINT of the engine's image, for a container that gives args only (``--entrypoint
    vllm,serve``); None: only ``KNOWN_ENTRYPOINTS``."""
    agent_resources: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {
        "requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}})
    agent_liveness: Mapping[str, int] = dataclasses.field(default_factory=lambda: {
        "periodSeconds": 30, "timeoutSeconds": 5, "failureThreshold": 4})
    """The agent's liveness probe timings (its own /healthz): a wedged agent restarted after about two
    minutes (a native sidecar restarts alone; the engine is not touched)."""


@dataclasses.dataclass(frozen=True)
class Adopted:
    """What was done to one workload (``vllm-tuner inject`` prints these on stderr)."""

    where: str
    pool: str
    container: str
    shutdown_timeout_seconds: float
    stop_timeout_seconds: float
    grace_period_seconds: int
    notes: tuple[str, ...] = ()
    """Rewrites made (a shell script as its argv, the ENTRYPOINT of args only), said in the output."""
    warnings: tuple[str, ...] = ()

    def line(self) -> str:
        return (f"{self.where}: adopted into pool {self.pool} (container {self.container}, --shutdown-timeout "
                f"{self.shutdown_timeout_seconds:g}s → launcher --stop-timeout {self.stop_timeout_seconds:g}s, "
                f"terminationGracePeriodSeconds {self.grace_period_seconds})")

    def lines(self) -> list[str]:
        return ([self.line()] + [f"{self.where}: {n}" for n in self.notes]
                + [f"warning: {self.where}: {w}" for w in self.warnings])


# Kinds refused by name, and why (a workload of any other kind asking for the tuner is refused too).
REFUSED_KINDS = {
    "LeaderWorkerSet": "a multi-node engine (one leader and its workers) is one replica of the pool, and the "
                       "launcher relaunches one container: it cannot restart a group together. Not supported",
    "InferenceService": "KServe renders the engine's Deployment itself, from its ServingRuntime, inside the "
                        "cluster: the rendered manifests never contain it. Not supported",
    "LLMInferenceService": "KServe renders the engine's Deployment itself, inside the cluster: the rendered "
                           "manifests never contain it. Not supported",
    "RayCluster": "a Ray cluster's engine spans several pods; the launcher relaunches one container. Not supported",
    "DaemonSet": "one engine per node is not a pool the tuner rolls one replica at a time. Not supported",
    "Pod": "a bare Pod has no controller to replace it; adopt its Deployment or StatefulSet",
    "ReplicaSet": "adopt the Deployment that owns it",
    "Job": "a Job's engine finishes; there is nothing to tune over time",
    "CronJob": "a CronJob's engine finishes; there is nothing to tune over time",
}
WORKLOADS = {("apps/v1", "Deployment"), ("apps/v1", "StatefulSet")}


def config_map_name(pool: str) -> str:
    """The chart's configuration ConfigMap of ``pool`` (deploy/helm/vllm-tuner, ``vllm-tuner.config``)."""
    return f"vllm-tuner-config-{pool}"


def dict_of(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def where_of(doc: Mapping[str, Any]) -> str:
    """``Kind/namespace/name``, one line of at most a few hundred characters whatever the document says."""
    meta = dict_of(doc.get("metadata"))
    ns = meta.get("namespace")
    text = f"{doc.get('kind')}/{ns + '/' if isinstance(ns, str) and ns else ''}{meta.get('name')}"
    return " ".join(text.split())[:300]
