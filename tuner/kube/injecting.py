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

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tuner.kube.adoption import (
    AGENT,
    AGENT_LABEL,
    AGENT_SPEC,
    CONFIG_DIR,
    DNS_LABEL,
    ENGINE_CONTAINER,
    ENGINE_PORT,
    INJECT,
    INT32_MAX,
    INT64_MAX,
    MAX_SHUTDOWN_SECONDS,
    METRICS_PORT,
    POOL,
    PRE_STOP_SECONDS,
    PROBE_PORT,
    REFUSED_KINDS,
    STATE_DIR,
    TOKEN_DIR,
    VOLUMES,
    WORKLOADS,
    Adopted,
    AdoptionError,
    Refused,
    Settings,
    config_map_name,
    where_of,
)
from tuner.kube.adoption import dict_of as _dict
from tuner.kube.enginecommand import (
    KNOWN_ENTRYPOINTS,
    engine_command,
    flag_value,
    image_problem,
    image_warning,
    known_entrypoint,
    number,
    script_problem,
)
from tuner.kube.podparts import (
    AGENT_PROBE,
    PROBE,
    TIMINGS,
    WRAPPER,
    _is_ours,
    _timings,
    agent_container,
    is_injected,
    merge_by_key,
    output_problems,
    pod_volumes,
    probe,
)

__all__ = ["AGENT", "AGENT_LABEL", "AGENT_PROBE", "AGENT_SPEC", "CONFIG_DIR", "ENGINE_CONTAINER", "ENGINE_PORT",
           "INJECT", "INT32_MAX", "INT64_MAX", "KNOWN_ENTRYPOINTS", "METRICS_PORT", "POOL", "PROBE", "PROBE_PORT",
           "REFUSED_KINDS", "STATE_DIR", "TOKEN_DIR", "VOLUMES", "WORKLOADS", "WRAPPER", "Adopted", "AdoptionError",
           "Refused", "Settings", "adopt", "agent_container", "agent_specs", "collide", "config_map_name",
           "engine_command", "flatten", "image_problem", "image_warning", "inject", "is_asked", "is_injected",
           "known_entrypoint", "output_problems", "pod_volumes", "script_problem", "where_of"]

def is_asked(doc: Any) -> bool:
    if not isinstance(doc, Mapping):
        return False
    annotations = _dict(_dict(doc.get("metadata")).get("annotations"))
    template = _dict(_dict(_dict(doc.get("spec")).get("template")).get("metadata"))
    return str(annotations.get(INJECT, _dict(template.get("annotations")).get(INJECT, ""))).lower() == "true"


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
                                      "ghcr.io/example/vllm-tuner:0.4.0, or the chart's image.repository"))
    elif (why := image_problem(image)) is not None:
        problems.append(AdoptionError(where, f"the agent image: {why}", "e.g. ghcr.io/example/vllm-tuner:0.4.0"))
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
