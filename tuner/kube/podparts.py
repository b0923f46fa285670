"""What adoption adds to a pod: the engine container's wrapper (``WRAPPER``) and exec probe (``PROBE``),
the agent sidecar (``agent_container``) and its probe, the pod's volumes, and the offline check of an
adopted workload against what the API server would refuse (``output_problems``)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tuner.kube.adoption import (
    AGENT,
    CONFIG_DIR,
    DNS_LABEL,
    INT32_MAX,
    INT64_MAX,
    METRICS_PORT,
    PROBE_PORT,
    STATE_DIR,
    TOKEN_DIR,
    Settings,
    config_map_name,
)
from tuner.kube.adoption import dict_of as _dict

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

# The agent's liveness probe: python3 -c AGENT_PROBE PORT. Its own /healthz on the pod's loopback (the
# chart binds the agent's endpoint to 0.0.0.0 for Prometheus; loopback answers either way).
AGENT_PROBE = """\
import socket, sys
try:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3) as s:
        s.sendall(b"GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n")
        head = s.recv(64).split(None, 2)
except OSError as e:
    sys.exit("/healthz: %s" % e)
sys.exit(0 if head[1:2] == [b"200"] else "/healthz: %s" % b" ".join(head[1:]).decode(errors="replace"))
"""


def is_injected(container: Mapping[str, Any]) -> bool:
    command = container.get("command")
    return isinstance(command, list) and len(command) > 3 and command[1:3] == ["-c", WRAPPER] and "--" in command


def _is_ours(probe_: Any) -> bool:
    command = _dict(_dict(probe_).get("exec")).get("command")
    return isinstance(command, list) and PROBE in command


def _timings(user: Any, keys: Iterable[str]) -> dict[str, Any]:
    user = _dict(user)
    return {k: user[k] for k in keys if isinstance(user.get(k), int) and not isinstance(user.get(k), bool)}


TIMINGS = ("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold", "terminationGracePeriodSeconds")


def output_problems(doc: Mapping[str, Any]) -> list[str]:
    """What the API server would refuse in an adopted workload and can be checked offline: container
    and volume names (DNS labels, unique), mount paths unique per container and mounts of existing
    volumes, integers in their ranges (grace period int64, probe fields int32)."""
    spec = doc["spec"]["template"]["spec"]
    out: list[str] = []
    names: list[str] = []
    volumes = [str(v.get("name")) for v in spec.get("volumes") or []]
    for v in volumes:
        if not DNS_LABEL.match(v) or len(v) > 63:
            out.append(f"volume name {v[:80]!r} is not a DNS label")
    for v in sorted({v for v in volumes if volumes.count(v) > 1}):
        out.append(f"two volumes are named {v}")
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        cname = str(c.get("name"))
        names.append(cname)
        if not DNS_LABEL.match(cname) or len(cname) > 63:
            out.append(f"container name {cname[:80]!r} is not a DNS label")
        paths = [str(m.get("mountPath")) for m in c.get("volumeMounts") or [] if isinstance(m, Mapping)]
        for p in sorted({p for p in paths if paths.count(p) > 1}):
            out.append(f"container {cname} mounts two volumes at {p}")
        for m in c.get("volumeMounts") or []:
            if isinstance(m, Mapping) and str(m.get("name")) not in volumes:
                out.append(f"container {cname} mounts {m.get('name')}, which is not a volume of the pod")
        for key in ("readinessProbe", "livenessProbe", "startupProbe"):
            for field, value in _dict(c.get(key)).items():
                if field.endswith(("Seconds", "Threshold")) and field != "terminationGracePeriodSeconds" and (
                        not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT32_MAX):
                    out.append(f"container {cname}'s {key}.{field} {str(value)[:40]} is not an int32 >= 0")
    for n in sorted({n for n in names if names.count(n) > 1}):
        out.append(f"two containers are named {n}")
    grace = spec.get("terminationGracePeriodSeconds")
    if not isinstance(grace, int) or not 0 <= grace <= INT64_MAX:
        out.append(f"terminationGracePeriodSeconds {str(grace)[:40]} is not an int64 >= 0")
    return out


def probe(what: str, engine_port: int, **timings: int) -> dict[str, Any]:
    return {"exec": {"command": ["python3", "-I", "-S", "-c", PROBE, STATE_DIR, what, str(PROBE_PORT),
                                 str(engine_port)]}, **timings, "successThreshold": 1}


def merge_by_key(items: list[dict[str, Any]], new: Sequence[dict[str, Any]], key: str) -> None:
    for item in new:
        items[:] = [i for i in items if i.get(key) != item[key]] + [item]


def agent_container(settings: Settings, *, engine: str, image: str, chart: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The agent sidecar; ``chart``: the chart's agent settings (``AGENT_SPEC``), over ``settings``'
    defaults (an explicit ``--image`` wins over the chart's image)."""
    chart = _dict(chart)

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    resources: Mapping[str, Any] = (chart["resources"] if isinstance(chart.get("resources"), dict)
                                    else settings.agent_resources)
    liveness = {**settings.agent_liveness, **_timings(chart.get("livenessProbe"), TIMINGS)}
    pull = chart.get("imagePullPolicy") if chart.get("imagePullPolicy") in ("Always", "IfNotPresent", "Never") \
        else settings.image_pull_policy
    return {
        "name": AGENT, "image": image, "imagePullPolicy": pull,
        "restartPolicy": "Always",  # a native sidecar (Kubernetes >= 1.29); no startupProbe: it gates nothing
        "args": ["agent", "--config", f"{CONFIG_DIR}/config.yaml", "--state-dir", STATE_DIR,
                 "--startup-timeout", f"{settings.agent_startup_seconds:g}"],
        "env": [{"name": "POD_NAME", **field("metadata.name")}, {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                {"name": "POD_UID", **field("metadata.uid")}, {"name": "VLLM_TUNER_ENGINE_CONTAINER", "value": engine}],
        "ports": [{"name": "tuner-metrics", "containerPort": METRICS_PORT}],
        "resources": copy.deepcopy(dict(resources)),
        # A wedged agent is restarted alone (a native sidecar); its /healthz on loopback.
        "livenessProbe": {"exec": {"command": ["python3", "-I", "-S", "-c", AGENT_PROBE, str(METRICS_PORT)]},
                          **liveness, "successThreshold": 1},
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
