"""Adoption: the agent and the launcher added to the user's own workloads (``vllm-tuner inject``).

Pure: Kubernetes documents in, documents out, no I/O. It runs as a Helm post-renderer (the plugin in
deploy/helm/plugins/vllm-tuner-inject), after ``kubectl kustomize`` in a pipeline, or by hand, and it is
the only code that changes a pod template (docs/kubernetes.md, "Adoption"). Every refusal is an
``AdoptionError`` that names the object, says what is wrong and shows what would be accepted; every
workload's problems are gathered and refused together (``Refused``): a workload the tuner cannot really
tune fails the render, it is never "adopted" into a silent no-op.

What it does to each workload annotated ``vllm-tuner.io/inject: "true"`` (a Deployment or a StatefulSet,
alone, in a multi-document stream or inside a ``kind: List``):

- finds the engine container **by name** (``vllm-tuner.io/engine-container``, default ``vllm``), at any
  position, and its whole command line (``engine_command``): a list as written; a shell's ``-c`` script
  that is one simple command (no operators, expansions or redirections; ``exec`` allowed) as its
  ``shlex`` split, the rewrite said in the output; args only, after an ENTRYPOINT that is known
  (``KNOWN_ENTRYPOINTS``, ``vllm/vllm-openai`` by version) or given (``--entrypoint vllm,serve``). Any
  other script is refused with the list form to paste: the tuner's flags would land after the script,
  where the shell ignores them;
- wraps the command line in ``WRAPPER``: a fixed Python program (the engine's arguments reach it as
  argv, never through a shell) that waits up to ``wait_seconds`` for the agent's launcher.pyz and
  desired.json, then runs the launcher, or, when the agent never wrote them, the engine's own command
  line unchanged (fail open);
- readiness and liveness become ``PROBE``, an exec probe that asks the launcher on the pod's loopback,
  or the engine's own ``/health`` when the engine runs without the launcher, keeping the user's own
  timings (``initialDelaySeconds`` and the rest); a startupProbe (the same program) covers a model's
  load when the user gave none, so a slow load is not killed by liveness on the fallback path; no
  probe port is open on the pod's network;
- derives the launcher's ``--stop-timeout`` and the pod's ``terminationGracePeriodSeconds`` from the
  engine's ``--shutdown-timeout`` (``stop_timeout_seconds``, ``grace_period_seconds``), never lowering a
  longer grace period the user set; warns when there is none (vLLM's default 0 s: in-flight requests
  fail at every relaunch) and when an image is not pinned;
- adds the agent as a native sidecar **without a startupProbe** (nothing the tuner reads can hold the
  engine back) and with a liveness probe on its own ``/healthz`` (loopback), its configuration volume
  ``optional: true``, the service-account token projected into the agent only, a ``restricted``-level
  security context without a fixed UID; its image, pull policy, resources and probe timings from
  ``Settings``, or from the chart's ConfigMap of the pool when it is in the same stream (``AGENT_SPEC``);
- keeps the pod's ServiceAccount (the chart binds its Role to it) and names every object it refers to
  after the pool (``vllm-tuner.io/pool``), so several pools share a namespace;
- refuses what would collide (a volume, mount or container of the user's named like one it adds, two
  containers of one name) naming both sides, and checks its own output against what the API server
  would check offline (``output_problems``: names, int64 ranges, unique names and mount paths).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import posixpath
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
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
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh", "busybox"})
VOLUMES = ("vllm-tuner-state", "vllm-tuner-config", "vllm-tuner-token")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

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

# Images whose ENTRYPOINT is known, so a container that gives its command line in args only can be
# adopted: (repository, lowest version, highest version or None) → the ENTRYPOINT. vLLM's own
# docker/Dockerfile (target vllm-openai) ends in ENTRYPOINT ["python3", "-m",
# "vllm.entrypoints.openai.api_server"] in the v0.9 line (commit 0000977e) and in ENTRYPOINT ["vllm",
# "serve"] at commit dead20ba (about October 2025, the v0.11 line), so in every release from v0.12 on;
# v0.10 and v0.11 are not guessed (docs/kubernetes.md, "Args only, and the image's ENTRYPOINT").
VLLM_REPOSITORIES = frozenset({"vllm/vllm-openai", "docker.io/vllm/vllm-openai", "index.docker.io/vllm/vllm-openai"})
KNOWN_ENTRYPOINTS: tuple[tuple[frozenset[str], tuple[int, int], tuple[int, int] | None, tuple[str, ...]], ...] = (
    (VLLM_REPOSITORIES, (0, 0), (0, 9), ("python3", "-m", "vllm.entrypoints.openai.api_server")),
    (VLLM_REPOSITORIES, (0, 12), None, ("vllm", "serve")),
)

# An image reference (the distribution/reference grammar, simplified): [domain[:port]/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"  # a domain's (a registry has a dot, a port or is localhost)
IMAGE_REFERENCE = re.compile(
    rf"^(?P<name>(?:(?P<domain>localhost(?::[0-9]+)?|{_LABEL}(?:\.{_LABEL})+(?::[0-9]+)?|{_LABEL}:[0-9]+)/)?"
    rf"{_COMPONENT}(?:/{_COMPONENT})*)(?::(?P<tag>[\w][\w.-]{{0,127}}))?"
    rf"(?:@(?P<digest>sha256:[0-9a-f]{{64}}))?$")


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


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def where_of(doc: Mapping[str, Any]) -> str:
    """``Kind/namespace/name``, one line of at most a few hundred characters whatever the document says."""
    meta = _dict(doc.get("metadata"))
    ns = meta.get("namespace")
    text = f"{doc.get('kind')}/{ns + '/' if isinstance(ns, str) and ns else ''}{meta.get('name')}"
    return " ".join(text.split())[:300]


def is_asked(doc: Any) -> bool:
    if not isinstance(doc, Mapping):
        return False
    annotations = _dict(_dict(doc.get("metadata")).get("annotations"))
    template = _dict(_dict(_dict(doc.get("spec")).get("template")).get("metadata"))
    return str(annotations.get(INJECT, _dict(template.get("annotations")).get(INJECT, ""))).lower() == "true"


def image_problem(image: Any) -> str | None:
    """Why ``image`` is not an image reference (None: it is one)."""
    if not isinstance(image, str) or not image:
        return "no image"
    if len(image) > 4096 or not IMAGE_REFERENCE.match(image):
        return f"{image[:200]!r} is not an image reference ([REGISTRY/]REPOSITORY[:TAG][@sha256:DIGEST], lower-case)"
    return None


def image_warning(image: str) -> str | None:
    """Why ``image`` is not pinned (None: a version tag or a digest)."""
    m = IMAGE_REFERENCE.match(image)
    if m is None or m.group("digest"):
        return None
    if m.group("tag") is None:
        return f"image {image} has no tag (it means :latest): pods started on different days may run different images"
    if m.group("tag") == "latest":
        return f"image {image} is :latest: pods started on different days may run different images"
    return None


def known_entrypoint(image: Any) -> tuple[str, ...] | None:
    m = IMAGE_REFERENCE.match(image) if isinstance(image, str) else None
    if m is None or m.group("tag") is None:
        return None
    version = re.match(r"^v?(\d+)\.(\d+)(?:\.\d+)?(?:[.-]?post\d+)?$", m.group("tag"))
    if version is None:
        return None
    v = (int(version.group(1)), int(version.group(2)))
    for repositories, lo, hi, entrypoint in KNOWN_ENTRYPOINTS:
        if m.group("name") in repositories and lo <= v and (hi is None or v <= hi):
            return entrypoint
    return None


def agent_specs(docs: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """pool → the chart's agent settings (``AGENT_SPEC``) from its configuration ConfigMaps in the stream."""
    out: dict[str, dict[str, Any]] = {}
    for doc in docs:
        if not (isinstance(doc, Mapping) and doc.get("kind") == "ConfigMap" and doc.get("apiVersion") == "v1"):
            continue
        meta = _dict(doc.get("metadata"))
        name, raw = meta.get("name"), _dict(meta.get("annotations")).get(AGENT_SPEC)
        if isinstance(name, str) and name.startswith("vllm-tuner-config-") and isinstance(raw, str):
            try:
                spec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(spec, dict):
                out[name.removeprefix("vllm-tuner-config-")] = spec
    return out


def flatten(docs: Iterable[Any]) -> list[Any]:
    """The documents, a ``kind: List``'s items among them."""
    out: list[Any] = []
    for doc in docs:
        if isinstance(doc, Mapping) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            out.extend(doc["items"])
        else:
            out.append(doc)
    return out


def inject(docs: Iterable[Any], settings: Settings) -> tuple[list[Any], list[Adopted]]:
    """Every document, the asked-for workloads adopted (inside a ``kind: List`` too); the others
    unchanged. Raises ``Refused`` with every problem of every workload that cannot be adopted."""
    docs = list(docs)
    specs = agent_specs(flatten(docs))
    problems: list[AdoptionError] = []
    adopted: list[Adopted] = []

    def one(doc: Any) -> Any:
        if isinstance(doc, Mapping) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            return {**doc, "items": [one(item) for item in doc["items"]]}
        if not is_asked(doc):
            return doc
        kind = doc.get("kind")
        if (str(doc.get("apiVersion")), str(kind)) not in WORKLOADS:
            reason = REFUSED_KINDS.get(str(kind), f"a {kind} is not a workload the tuner adopts")
            problems.append(AdoptionError(where_of(doc), reason, "adopt a Deployment or a StatefulSet, or remove "
                                                                 f"the {INJECT} annotation"))
            return doc
        try:
            new, done = adopt(doc, settings, specs=specs)
        except Refused as exc:
            problems.extend(exc.problems)
            return doc
        adopted.append(done)
        return new

    out = [one(doc) for doc in docs]
    if problems:
        raise Refused(problems)
    return out, adopted


def is_injected(container: Mapping[str, Any]) -> bool:
    command = container.get("command")
    return isinstance(command, list) and len(command) > 3 and command[1:3] == ["-c", WRAPPER] and "--" in command


def _strings(where: str, name: str, key: str, value: Any, problems: list[AdoptionError]) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        problems.append(AdoptionError(where, f"container {name}'s {key} is a string, not a list (Kubernetes "
                                             "refuses it; split into one argument per character it would run "
                                             "nothing)", f"write it as a list, e.g. {key}: {_flow(value.split()[:4])}"))
        return []
    if not isinstance(value, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                              for a in value):
        problems.append(AdoptionError(where, f"container {name}'s {key} is not a list of strings",
                                      f"write it as a list of strings, e.g. {key}: [vllm, serve, MODEL]"))
        return []
    return [str(a) for a in value]


def _flow(argv: Sequence[str]) -> str:
    """A list as YAML/JSON flow text the user can paste."""
    return json.dumps(list(argv), ensure_ascii=False)


_SIMPLE_OPERATORS = re.compile(r"&&|\|\||[;&|\n]")
_KUBE_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def script_problem(script: str, env: Iterable[str]) -> str | None:
    """Why a ``sh -c`` script is not one simple command (None: it is one). Quotes are fine; operators,
    redirections, expansions, globs, comments, assignments and several lines are not. ``$(VAR)`` of a
    variable in the container's env is the kubelet's own expansion (done before the shell runs), so it
    stays allowed."""
    names = set(env)
    text = _KUBE_VAR.sub(lambda m: "_" if m.group(1) in names else m.group(0), script.replace("\\\n", " "))
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif quote == '"':
            if c in '$`':
                return "it expands variables or commands inside double quotes"
            if c == "\\":
                i += 1
            elif c == '"':
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c in ";&|":
            return "it runs more than one command (;, &&, || or |)"
        elif c in "<>":
            return "it redirects input or output"
        elif c in "$`":
            return "it expands variables or commands ($, `)"
        elif c in "()":
            return "it uses a subshell or a function"
        elif c in "*?[{~":
            return "it uses globbing or brace/tilde expansion"
        elif c == "#" and (i == 0 or text[i - 1] in " \t"):
            return "it has a comment"
        elif c == "\n" and text[i + 1:].strip():
            return "it has more than one line"
        i += 1
    if quote:
        return "a quote is not closed"
    try:
        words = shlex.split(text)
    except ValueError:
        return "it cannot be split into words"
    if not words or (words[0] == "exec" and len(words) == 1):
        return "it is empty"
    first = words[1] if words[0] == "exec" else words[0]
    if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", first):
        return "it sets a variable before the command (use the container's env instead)"
    return None


def _suggested_argv(script: str) -> list[str] | None:
    """The engine's own command out of a script that is more than one command: the last command that
    runs vLLM (``vllm …`` or ``python… -m vllm…``), as a list."""
    try:
        lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        lexer.whitespace = " \t\r"
        tokens = list(lexer)
    except ValueError:
        return None
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token and (set(token) <= set(";&|<>()") or token == "\n"):
            commands.append([])
        else:
            commands[-1].extend(token.split("\n"))
    for words in reversed(commands):
        words = [w for w in words if w]
        while words and (words[0] == "exec" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            words = words[1:]
        if words and (posixpath.basename(words[0]) == "vllm" or any(w.startswith("vllm.") for w in words[:3])):
            return words
    return None


@dataclasses.dataclass(frozen=True)
class Command:
    argv: list[str]
    """The engine's whole command line."""
    command: list[str]
    """What the container's ``command`` runs after the wrapper (``args`` follow it, unless ``drop_args``)."""
    drop_args: bool = False
    note: str | None = None
    """What was rewritten to get it (None: taken as written)."""


def engine_command(where: str, container: Mapping[str, Any], settings: Settings, problems: list[AdoptionError]
                   ) -> Command | None:
    """The engine's whole command line; None (and a problem said) when it cannot be had."""
    name = container.get("name")
    command = _strings(where, str(name), "command", container.get("command"), problems)
    args = _strings(where, str(name), "args", container.get("args"), problems)
    if problems:
        return None
    if not command:
        image = container.get("image")
        entrypoint = settings.entrypoint or known_entrypoint(image)
        if not entrypoint:
            problems.append(AdoptionError(
                where, f"container {name} gives its command line in args only, after the ENTRYPOINT of image "
                       f"{image}, which is not known here (the launcher must run the whole command line)",
                "say the image's ENTRYPOINT with --entrypoint (e.g. --entrypoint vllm,serve for vllm/vllm-openai "
                f"v0.12 and later), or give all of it in command, e.g. command: {_flow(['vllm', 'serve', *args[:3]])}"))
            return None
        how = "--entrypoint" if settings.entrypoint else f"the ENTRYPOINT of {image}"
        return Command([*entrypoint, *args], list(entrypoint),
                       note=f"container {name} gives args only: adopted after {how}, command {_flow(entrypoint)}")
    argv = command + args
    flags = next((i for i, a in enumerate(argv[1:3], 1) if a.startswith("-") and not a.startswith("--")
                  and "c" in a[1:]), None)
    if posixpath.basename(argv[0]) not in SHELLS or flags is None:
        return Command(argv, command)
    if flags + 1 >= len(argv):
        problems.append(AdoptionError(where, f"container {name} runs {argv[0]} -c without a script",
                                      "write the engine's command line as a list, e.g. command: "
                                      "[vllm, serve, MODEL, --port, \"8000\"]"))
        return None
    script, rest = argv[flags + 1], argv[flags + 2:]
    env = [str(e.get("name")) for e in container.get("env") or [] if isinstance(e, Mapping)]
    why = "it is followed by more arguments ($0, $1, … of the script)" if rest else script_problem(script, env)
    if why is None:
        words = shlex.split(_KUBE_VAR.sub(lambda m: m.group(0), script.replace("\\\n", " ")))
        words = words[1:] if words[0] == "exec" else words
        return Command(words, words, drop_args=True,
                       note=f"container {name}'s script {argv[0]} -c {script!r} adopted as its argv: command "
                            f"{_flow(words)}")
    suggested = _suggested_argv(script)
    fix = (f"write the engine's command line as a list: command: {_flow(suggested)} (and args: [] ); anything "
           "else the script did belongs in an init container or the image" if suggested else
           "write the engine's command line as a list, e.g. command: [vllm, serve, MODEL, --port, \"8000\"] (the "
           "kubelet expands $(VAR) in it itself)")
    problems.append(AdoptionError(
        where, f"container {name} runs its engine through a shell script that is not one simple command ({why}): "
               "the tuner's flags would be appended after the script, where the shell ignores them, and every "
               "change would be a no-op", fix))
    return None


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


def number(where: str, argv: Sequence[str], flag: str, default: float, *, hi: float,
           problems: list[AdoptionError]) -> float:
    text = flag_value(argv, flag)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        problems.append(AdoptionError(where, f"{flag} {text[:80]!r} is not a number of seconds the timeouts can be "
                                             "derived from", f"give it literally, e.g. {flag} 30"))
        return default
    if not math.isfinite(value) or not 0 <= value <= hi:
        problems.append(AdoptionError(where, f"{flag} {text[:80]!r} is out of range", f"give a number from 0 to "
                                                                                       f"{hi:g}, e.g. {flag} 30"))
        return default
    return value


def _mapping_at(where: str, parent: dict[str, Any], key: str, path: str, problems: list[AdoptionError]
                ) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        parent[key] = value = {}
    if not isinstance(value, dict):
        problems.append(AdoptionError(where, f"{path} is a {type(value).__name__}, not a mapping",
                                      f"write {path} as a mapping (key: value)"))
        return {}
    return value


def _list_at(where: str, parent: Mapping[str, Any], key: str, path: str, problems: list[AdoptionError]
             ) -> list[dict[str, Any]]:
    value = parent.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, dict) for i in value):
        problems.append(AdoptionError(where, f"{path} is not a list of mappings", f"write {path} as a list, "
                                                                                   "e.g. - name: vllm"))
        return []
    return value


def _unshared(value: Any) -> Any:
    """A copy that shares nothing (a YAML alias is one object in two places: a change to one, e.g. the
    pod labels aliased to the selector's, must not change the other)."""
    if isinstance(value, Mapping):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return value


def _timings(user: Any, keys: Iterable[str]) -> dict[str, Any]:
    user = _dict(user)
    return {k: user[k] for k in keys if isinstance(user.get(k), int) and not isinstance(user.get(k), bool)}


TIMINGS = ("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold", "terminationGracePeriodSeconds")


def adopt(original: Mapping[str, Any], settings: Settings, *, specs: Mapping[str, Mapping[str, Any]] | None = None
          ) -> tuple[dict[str, Any], Adopted]:
    """One workload adopted; ``Refused`` with its every problem when it cannot be."""
    where = where_of(original)
    problems: list[AdoptionError] = []
    doc: dict[str, Any] = _unshared(original)
    meta = _mapping_at(where, doc, "metadata", "metadata", problems)
    spec0 = _mapping_at(where, doc, "spec", "spec", problems)
    template = _mapping_at(where, spec0, "template", "spec.template", problems)
    tmeta = _mapping_at(where, template, "metadata", "spec.template.metadata", problems)
    spec = _mapping_at(where, template, "spec", "spec.template.spec", problems)
    if problems:
        raise Refused(problems)
    annotations = {**_dict(tmeta.get("annotations")), **_dict(meta.get("annotations"))}
    pool = str(annotations.get(POOL) or _dict(tmeta.get("labels")).get(POOL) or "")
    if not pool:
        problems.append(AdoptionError(where, "it does not say which pool it belongs to",
                                      f"annotate it {POOL}: <the chart's pool.name>, e.g. {POOL}: llama"))
    elif not DNS_LABEL.match(pool) or len(pool) > 40:
        problems.append(AdoptionError(where, f"its pool {pool[:80]!r} is not the chart's pool.name (a DNS label of "
                                             "at most 40 characters)", f"annotate it {POOL}: llama-8b"))
    chart = dict(_dict((specs or {}).get(pool)))
    image = settings.image or chart.get("image")
    if not image:
        where_chart = ("its image.repository is empty" if chart else
                       f"the chart's ConfigMap of the pool ({config_map_name(pool)}) is not in the input")
        problems.append(AdoptionError(where, f"no agent image was given (no --image, no $VLLM_TUNER_IMAGE, and "
                                             f"{where_chart})",
                                      "give --image REGISTRY/vllm-tuner:TAG, e.g. --image "
                                      "ghcr.io/example/vllm-tuner:0.3.1, or the chart's image.repository"))
    elif (why := image_problem(image)) is not None:
        problems.append(AdoptionError(where, f"the agent image: {why}", "e.g. ghcr.io/example/vllm-tuner:0.3.1"))
    name = str(annotations.get(ENGINE_CONTAINER) or "vllm")
    containers = _list_at(where, spec, "containers", "spec.template.spec.containers", problems)
    inits = _list_at(where, spec, "initContainers", "spec.template.spec.initContainers", problems)
    volumes = _list_at(where, spec, "volumes", "spec.template.spec.volumes", problems)
    if problems:
        raise Refused(problems)
    index = next((i for i, c in enumerate(containers) if c.get("name") == name), None)
    if index is None:
        names = ", ".join(str(c.get("name")) for c in containers) or "none"
        raise Refused([AdoptionError(where, f"it has no container named {name} (its containers: {names})",
                                     f"name the engine's container with the annotation {ENGINE_CONTAINER}: <name>")])
    engine = containers[index]
    mounts = _list_at(where, engine, "volumeMounts", f"container {name}'s volumeMounts", problems)
    if not isinstance(engine.get("lifecycle"), (dict, type(None))):
        problems.append(AdoptionError(where, f"container {name}'s lifecycle is not a mapping",
                                      "write it as a mapping, e.g. lifecycle: {preStop: …}"))
    if problems:
        raise Refused(problems)
    engine["volumeMounts"] = mounts
    was_injected = is_injected(engine)
    if was_injected:  # rendered through twice: wrap the engine's own command line again
        engine["command"] = engine["command"][engine["command"].index("--") + 1:]
    got = engine_command(where, engine, settings, problems)
    if got is None:
        raise Refused(problems)
    argv = got.argv
    notes = [got.note] if got.note else []
    warnings: list[str] = []
    if flag_value(argv, "--shutdown-timeout") is None:
        warnings.append("the engine has no --shutdown-timeout: vLLM's default is 0 s, so requests in flight fail at "
                        "every relaunch; add e.g. --shutdown-timeout 30 (and the chart's shutdownTimeoutSeconds: 30)")
    shutdown = number(where, argv, "--shutdown-timeout", 0.0, hi=MAX_SHUTDOWN_SECONDS, problems=problems)
    engine_port = int(number(where, argv, "--port", 8000, hi=65535, problems=problems))
    user_grace = spec.get("terminationGracePeriodSeconds")
    if user_grace is not None and (not isinstance(user_grace, int) or isinstance(user_grace, bool)
                                   or not 0 <= user_grace <= INT64_MAX):
        problems.append(AdoptionError(where, f"terminationGracePeriodSeconds {str(user_grace)[:40]} is not an integer "
                                             f"from 0 to {INT64_MAX}", "e.g. terminationGracePeriodSeconds: 60"))
        user_grace = 0
    if isinstance(engine.get("image"), str) and (w := image_warning(engine["image"])):
        warnings.append(f"container {name}'s {w}")
    if isinstance(image, str) and image_problem(image) is None and (w := image_warning(image)):
        warnings.append(f"the agent's {w}")
    collide(where, name, pool, engine, containers, inits, volumes, problems)
    if problems:
        raise Refused(problems)

    stop = shutdown + settings.stop_margin_seconds
    grace = max(int(user_grace or 0), math.ceil(PRE_STOP_SECONDS + stop + settings.grace_margin_seconds))
    probes = {k: engine.get(k) for k in ("readinessProbe", "livenessProbe", "startupProbe")}
    engine["command"] = ["python3", "-c", WRAPPER, STATE_DIR, f"{settings.wait_seconds:g}",
                         "--stop-timeout", f"{stop:g}", "--", *got.command]
    if got.drop_args:
        engine.pop("args", None)  # the script's words are the whole command line now
    if was_injected:  # our own probes from the first pass: the user's timings are in them already
        probes = {k: None if k == "startupProbe" and _is_ours(v) else v for k, v in probes.items()}
    # The user's timings, but never a shorter timeout than the exec probe needs (a Python start and a
    # loopback request: an httpGet's timeoutSeconds: 1 is too short on a loaded node).
    ready = _timings(probes["readinessProbe"], ("initialDelaySeconds", "timeoutSeconds"))
    engine["readinessProbe"] = probe("readyz", engine_port, **{"periodSeconds": 2, "failureThreshold": 1, **ready,
                                                                "timeoutSeconds": max(3, ready.get("timeoutSeconds", 0))})
    live = _timings(probes["livenessProbe"], TIMINGS)
    engine["livenessProbe"] = probe("livez", engine_port, **{"periodSeconds": 10, "failureThreshold": 6, **live,
                                                              "timeoutSeconds": max(5, live.get("timeoutSeconds", 0))})
    if probes["startupProbe"] is None:
        period = 10
        engine["startupProbe"] = probe("livez", engine_port, periodSeconds=period, timeoutSeconds=5,
                                       failureThreshold=max(1, math.ceil(settings.startup_seconds / period)))
    engine["lifecycle"] = {**(engine.get("lifecycle") or {}),
                           "preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}}
    merge_by_key(engine["volumeMounts"], [{"name": "vllm-tuner-state", "mountPath": STATE_DIR}], "name")

    spec["terminationGracePeriodSeconds"] = grace
    spec.setdefault("automountServiceAccountToken", False)  # only the agent gets a token (projected below)
    agent = agent_container(settings, engine=name, chart=chart, image=str(image))
    spec["initContainers"] = [agent, *(c for c in inits if c.get("name") != AGENT)]
    spec["volumes"] = volumes
    merge_by_key(spec["volumes"], pod_volumes(pool), "name")
    tmeta["labels"] = {**_dict(tmeta.get("labels")), POOL: pool, AGENT_LABEL: "true"}
    tmeta["annotations"] = {**_dict(tmeta.get("annotations")), "kubectl.kubernetes.io/default-container": name}
    # The engine's /metrics port, whatever its port is named (production-stack: container-port) or if it is
    # not declared at all: deploy/kubernetes/monitoring/podmonitor.yaml scrapes the address this names.
    tmeta["annotations"][ENGINE_PORT] = str(engine_port)
    problems.extend(AdoptionError(where, p, "this is a bug of vllm-tuner inject's if the input was valid; report it")
                    for p in output_problems(doc))
    if problems:
        raise Refused(problems)
    return doc, Adopted(where, pool, name, shutdown, stop, grace, tuple(notes), tuple(warnings))


def _is_ours(probe_: Any) -> bool:
    command = _dict(_dict(probe_).get("exec")).get("command")
    return isinstance(command, list) and PROBE in command


def collide(where: str, name: str, pool: str, engine: Mapping[str, Any], containers: Sequence[Mapping[str, Any]],
            inits: Sequence[Mapping[str, Any]], volumes: Sequence[Mapping[str, Any]],
            problems: list[AdoptionError]) -> None:
    """Refuse what the adoption would silently replace or duplicate: the user's volume, mount or
    container named like one it adds, two containers of one name."""
    ours = {v["name"]: v for v in pod_volumes(pool)}
    for v in volumes:
        mine = ours.get(str(v.get("name")))
        if mine is not None and v != mine:  # an earlier adoption's is equal to it
            kinds = ", ".join(sorted(str(k) for k in set(v) - {"name"})) or "nothing"
            theirs = next(iter(set(mine) - {"name"}))
            problems.append(AdoptionError(where, f"the pod's volume {v['name']} ({kinds}) has the name of the "
                                                 f"volume adoption adds ({theirs}); it would be replaced",
                                          f"rename your volume: the names {', '.join(VOLUMES)} are the tuner's"))
    for c in inits:
        if c.get("name") == AGENT and not (c.get("restartPolicy") == "Always" and any(
                a == "agent" for a in (c.get("args") or []))):
            problems.append(AdoptionError(where, f"the pod's init container {AGENT} is not the tuner's agent",
                                          f"rename it: the name {AGENT} is the tuner's"))
    seen: dict[str, str] = {}
    for kind, group in (("container", containers), ("init container", inits)):
        for c in group:
            cname = str(c.get("name"))
            if cname in seen and not (kind == "init container" and cname == AGENT):
                problems.append(AdoptionError(where, f"two containers are named {cname} (a {seen[cname]} and a {kind})",
                                              "give every container its own name"))
            seen.setdefault(cname, kind)
    if AGENT in {str(c.get("name")) for c in containers}:
        problems.append(AdoptionError(where, f"the pod's container {AGENT} has the name of the agent adoption adds",
                                      f"rename it: the name {AGENT} is the tuner's"))
    for m in engine.get("volumeMounts") or []:
        if not isinstance(m, Mapping):
            continue
        if m.get("mountPath") == STATE_DIR and m.get("name") != "vllm-tuner-state":
            problems.append(AdoptionError(where, f"container {name} mounts its volume {m.get('name')} at {STATE_DIR}, "
                                                 "where adoption mounts the tuner's state (vllm-tuner-state)",
                                          f"mount it elsewhere: {STATE_DIR} is the tuner's"))


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
