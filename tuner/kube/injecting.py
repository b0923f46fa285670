"""Adoption: the agent and the launcher added to the user's own workloads (``vllm-tuner inject``).

Pure: Kubernetes documents in, documents out, no I/O. It runs as a Helm post-renderer (the plugin in
deploy/helm/plugins/vllm-tuner-inject), after ``kubectl kustomize`` in a pipeline, or by hand, and it is
the only code that changes a pod template (docs/kubernetes.md, "Adoption"). Every refusal is an
``AdoptionError`` that names the object, says what is wrong and shows what would be accepted: a
workload the tuner cannot really tune fails the render, it is never "adopted" into a silent no-op.

What it does to each workload annotated ``vllm-tuner.io/inject: "true"`` (a Deployment or a StatefulSet):

- finds the engine container **by name** (``vllm-tuner.io/engine-container``, default ``vllm``), at any
  position; refuses a shell-wrapped command line (``sh -c "vllm serve …"``: every override would land
  after the shell string, where the shell ignores it) and one given in ``args`` only (the image's
  ENTRYPOINT, which the pod spec does not show, would be left out of the launcher's command line);
- wraps the command line in ``WRAPPER``: a fixed Python program (the engine's arguments reach it as
  argv, never through a shell) that waits up to ``wait_seconds`` for the agent's launcher.pyz and
  desired.json, then runs the launcher, or, when the agent never wrote them, the engine's own command
  line unchanged (fail open);
- readiness and liveness become ``PROBE``, an exec probe that asks the launcher on the pod's loopback,
  or the engine's own ``/health`` when the engine runs without the launcher: the probes hold in both
  cases, and no probe port is open on the pod's network;
- derives the launcher's ``--stop-timeout`` and the pod's ``terminationGracePeriodSeconds`` from the
  engine's ``--shutdown-timeout`` (``stop_timeout_seconds``, ``grace_period_seconds``), never lowering a
  longer grace period the user set;
- adds the agent as a native sidecar **without a startupProbe** (nothing the tuner reads can hold the
  engine back), its configuration volume ``optional: true``, the service-account token projected into
  the agent only, a ``restricted``-level security context without a fixed UID;
- keeps the pod's ServiceAccount (the chart binds its Role to it) and names every object it refers to
  after the pool (``vllm-tuner.io/pool``), so several pools share a namespace.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tuner.errors import TunerError

INJECT = "vllm-tuner.io/inject"
POOL = "vllm-tuner.io/pool"
ENGINE_CONTAINER = "vllm-tuner.io/engine-container"
ENGINE_PORT = "vllm-tuner.io/engine-port"  # written on the pod: where monitoring finds the engine's /metrics
AGENT_LABEL = "vllm-tuner.io/agent"
AGENT = "vllm-tuner-agent"
STATE_DIR = "/var/run/vllm-tuner"
CONFIG_DIR = "/etc/vllm-tuner"
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PROBE_PORT = 8081  # the launcher's default --probe-port
METRICS_PORT = 9180
PRE_STOP_SECONDS = 10
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})

# The engine container's command: python3 -c WRAPPER STATE_DIR WAIT [launcher options] -- ENGINE ARGV.
# Fixed text; the engine's argv is data (sys.argv), exec'd as is: no shell ever parses it. A "plain"
# file tells PROBE that the engine runs without the launcher.
WRAPPER = """\
import os, sys, time
a = sys.argv[1:]
i = a.index("--")
d, wait, opts, cmd = a[0], float(a[1]), a[2:i], a[i + 1:]
z, plain = os.path.join(d, "launcher.pyz"), os.path.join(d, "plain")
end = time.monotonic() + wait
while time.monotonic() < end and not (os.path.isfile(z) and os.path.isfile(os.path.join(d, "desired.json"))):
    time.sleep(0.25)
try:
    if os.path.isfile(z):
        os.path.exists(plain) and os.unlink(plain)
    else:
        open(plain, "w").close()
        print("vllm-tuner: no launcher in %s after %gs: the engine runs on its own" % (d, wait), file=sys.stderr)
except OSError:
    pass
if os.path.isfile(z):
    os.execv(sys.executable, [sys.executable, z, "--state-dir", d, *opts, "--", *cmd])
os.execvp(cmd[0], cmd)
"""

# The exec probe: python3 -c PROBE STATE_DIR readyz|livez PROBE_PORT ENGINE_PORT. Exit 0: healthy.
PROBE = """\
import os, socket, sys
d, what, probe_port, engine_port = sys.argv[1:5]
plain = os.path.exists(os.path.join(d, "plain"))
port, path = (int(engine_port), "/health") if plain else (int(probe_port), "/" + what)
try:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        s.sendall(b"GET " + path.encode() + b" HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n")
        head = s.recv(64).split(None, 2)
except OSError as e:
    sys.exit("%s: %s" % (path, e))
sys.exit(0 if head[1:2] == [b"200"] else "%s: %s" % (path, b" ".join(head[1:]).decode(errors="replace")))
"""


class AdoptionError(TunerError):
    """A workload asked for the tuner (``vllm-tuner.io/inject``) but cannot be adopted as it is written.

    ``where`` names the object (``Deployment/ns/name``), ``what`` says what is wrong, ``fix`` what would
    be accepted instead."""

    def __init__(self, where: str, what: str, fix: str) -> None:
        self.where, self.what, self.fix = where, what, fix
        super().__init__(f"{where}: {what}; {fix}")


@dataclasses.dataclass(frozen=True)
class Settings:
    image: str
    """The agent's image (``vllm-tuner --image``), by tag or digest."""
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
    agent_resources: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {
        "requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}})


@dataclasses.dataclass(frozen=True)
class Adopted:
    """What was done to one workload (``vllm-tuner inject`` prints these on stderr)."""

    where: str
    pool: str
    container: str
    shutdown_timeout_seconds: float
    stop_timeout_seconds: float
    grace_period_seconds: int

    def line(self) -> str:
        return (f"{self.where}: adopted into pool {self.pool} (container {self.container}, --shutdown-timeout "
                f"{self.shutdown_timeout_seconds:g}s → launcher --stop-timeout {self.stop_timeout_seconds:g}s, "
                f"terminationGracePeriodSeconds {self.grace_period_seconds})")


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


def where_of(doc: Mapping[str, Any]) -> str:
    meta = doc.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{doc.get('kind')}/{ns + '/' if ns else ''}{meta.get('name')}"


def is_asked(doc: Mapping[str, Any]) -> bool:
    if not isinstance(doc, Mapping):
        return False
    annotations = (doc.get("metadata") or {}).get("annotations") or {}
    template = ((doc.get("spec") or {}).get("template") or {}).get("metadata") or {}
    return str(annotations.get(INJECT, (template.get("annotations") or {}).get(INJECT, ""))).lower() == "true"


def inject(docs: Iterable[Any], settings: Settings) -> tuple[list[Any], list[Adopted]]:
    """Every document, the asked-for workloads adopted; the others unchanged. Raises ``AdoptionError``
    at the first workload that cannot be adopted."""
    out, adopted = [], []
    for doc in docs:
        if not is_asked(doc):
            out.append(doc)
            continue
        kind = doc.get("kind")
        if (doc.get("apiVersion"), kind) not in WORKLOADS:
            reason = REFUSED_KINDS.get(str(kind), f"a {kind} is not a workload the tuner adopts")
            raise AdoptionError(where_of(doc), reason, f"adopt a Deployment or a StatefulSet, or remove the {INJECT} "
                                                       "annotation")
        new, done = adopt(doc, settings)
        out.append(new)
        adopted.append(done)
    return out, adopted


def is_injected(container: Mapping[str, Any]) -> bool:
    command = container.get("command") or []
    return len(command) > 3 and command[1:3] == ["-c", WRAPPER]


def engine_argv(where: str, container: Mapping[str, Any]) -> list[str]:
    command, args = list(container.get("command") or []), list(container.get("args") or [])
    name = container.get("name")
    if not command:
        raise AdoptionError(where, f"container {name} gives its command line in args only, after the image's "
                                   "ENTRYPOINT, which the pod spec does not show (the launcher must run the whole "
                                   "command line)",
                            "give all of it in command, e.g. command: [vllm, serve, MODEL, --port, \"8000\"]")
    argv = [str(a) for a in command + args]
    if posixpath.basename(argv[0]) in SHELLS and any(a.startswith("-") and "c" in a[1:] and not a.startswith("--")
                                                     for a in argv[1:3]):
        raise AdoptionError(where, f"container {name} runs its engine through a shell ({argv[0]} -c \"…\"): the "
                                   "tuner's flags would be appended after the shell string, where the shell "
                                   "ignores them, and every change would be a no-op",
                            "write the command line as a list, e.g. command: [vllm, serve, MODEL, --port, "
                            "\"8000\", --shutdown-timeout, \"30\"] (the kubelet expands $(VAR) in it itself)")
    return argv


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def number(where: str, argv: Sequence[str], flag: str, default: float) -> float:
    text = flag_value(argv, flag)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise AdoptionError(where, f"{flag} {text!r} is not a number of seconds the timeouts can be derived from",
                            f"give it literally, e.g. {flag} 30") from None
    if not math.isfinite(value) or value < 0:
        raise AdoptionError(where, f"{flag} {text!r} is out of range", f"give a number >= 0, e.g. {flag} 30")
    return value


def adopt(original: Mapping[str, Any], settings: Settings) -> tuple[dict[str, Any], Adopted]:
    where = where_of(original)
    doc: dict[str, Any] = copy.deepcopy(dict(original))
    meta = doc.setdefault("metadata", {})
    template = doc.setdefault("spec", {}).setdefault("template", {})
    tmeta = template.setdefault("metadata", {})
    spec = template.setdefault("spec", {})
    annotations = {**(tmeta.get("annotations") or {}), **(meta.get("annotations") or {})}
    pool = str(annotations.get(POOL) or (tmeta.get("labels") or {}).get(POOL) or "")
    if not pool:
        raise AdoptionError(where, "it does not say which pool it belongs to",
                            f"annotate it {POOL}: <the chart's pool.name>, e.g. {POOL}: llama")
    name = str(annotations.get(ENGINE_CONTAINER) or "vllm")
    containers = spec.get("containers") or []
    engine = next((c for c in containers if c.get("name") == name), None)
    if engine is None:
        names = ", ".join(str(c.get("name")) for c in containers) or "none"
        raise AdoptionError(where, f"it has no container named {name} (its containers: {names})",
                            f"name the engine's container with the annotation {ENGINE_CONTAINER}: <name>")
    if is_injected(engine):  # rendered through twice: wrap the engine's own command line again
        engine["command"] = engine["command"][engine["command"].index("--") + 1:]
    argv = engine_argv(where, engine)
    shutdown = number(where, argv, "--shutdown-timeout", 0.0)
    engine_port = int(number(where, argv, "--port", 8000))
    stop = shutdown + settings.stop_margin_seconds
    grace = max(int(spec.get("terminationGracePeriodSeconds") or 0),
                math.ceil(PRE_STOP_SECONDS + stop + settings.grace_margin_seconds))

    engine["command"] = ["python3", "-c", WRAPPER, STATE_DIR, f"{settings.wait_seconds:g}",
                         "--stop-timeout", f"{stop:g}", "--", *engine["command"]]
    engine["readinessProbe"] = probe("readyz", engine_port, period=2, timeout=3, failures=1)
    engine["livenessProbe"] = probe("livez", engine_port, period=10, timeout=5, failures=6)
    engine.setdefault("lifecycle", {})["preStop"] = {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}
    merge_by_key(engine.setdefault("volumeMounts", []), [{"name": "vllm-tuner-state", "mountPath": STATE_DIR}],
                 "name")

    spec["terminationGracePeriodSeconds"] = grace
    spec.setdefault("automountServiceAccountToken", False)  # only the agent gets a token (projected below)
    init = [c for c in spec.get("initContainers") or [] if c.get("name") != AGENT]
    spec["initContainers"] = [agent_container(settings, engine=name), *init]
    merge_by_key(spec.setdefault("volumes", []), pod_volumes(pool), "name")
    tmeta.setdefault("labels", {}).update({POOL: pool, AGENT_LABEL: "true"})
    tmeta.setdefault("annotations", {})["kubectl.kubernetes.io/default-container"] = name
    # The engine's /metrics port, whatever its port is named (production-stack: container-port) or if it is
    # not declared at all: deploy/kubernetes/monitoring/podmonitor.yaml scrapes the address this names.
    tmeta["annotations"][ENGINE_PORT] = str(engine_port)
    return doc, Adopted(where, pool, name, shutdown, stop, grace)


def probe(what: str, engine_port: int, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"exec": {"command": ["python3", "-I", "-S", "-c", PROBE, STATE_DIR, what, str(PROBE_PORT),
                                 str(engine_port)]},
            "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": failures, "successThreshold": 1}


def merge_by_key(items: list[dict[str, Any]], new: Sequence[dict[str, Any]], key: str) -> None:
    for item in new:
        items[:] = [i for i in items if i.get(key) != item[key]] + [item]


def agent_container(settings: Settings, *, engine: str) -> dict[str, Any]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {
        "name": AGENT, "image": settings.image, "imagePullPolicy": settings.image_pull_policy,
        "restartPolicy": "Always",  # a native sidecar (Kubernetes >= 1.29); no startupProbe: it gates nothing
        "args": ["agent", "--config", f"{CONFIG_DIR}/config.yaml", "--state-dir", STATE_DIR,
                 "--startup-timeout", f"{settings.agent_startup_seconds:g}"],
        "env": [{"name": "POD_NAME", **field("metadata.name")}, {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                {"name": "POD_UID", **field("metadata.uid")}, {"name": "VLLM_TUNER_ENGINE_CONTAINER", "value": engine}],
        "ports": [{"name": "tuner-metrics", "containerPort": METRICS_PORT}],
        "resources": copy.deepcopy(dict(settings.agent_resources)),
        # The restricted Pod Security level, and no runAsUser: the image's numeric USER, or the UID
        # OpenShift's restricted-v2 assigns.
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "vllm-tuner-state", "mountPath": STATE_DIR},
                         {"name": "vllm-tuner-config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "vllm-tuner-token", "mountPath": TOKEN_DIR, "readOnly": True}],
    }


def pod_volumes(pool: str) -> list[dict[str, Any]]:
    return [
        {"name": "vllm-tuner-state", "emptyDir": {"sizeLimit": "64Mi"}},
        # optional: a missing ConfigMap must not keep the pod from starting
        {"name": "vllm-tuner-config", "configMap": {"name": config_map_name(pool), "optional": True}},
        {"name": "vllm-tuner-token", "projected": {"defaultMode": 0o444, "sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}},
    ]
