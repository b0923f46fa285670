"""The Kubernetes API, as the agent uses it: one ``lightkube`` client (sync, on httpx), every call bounded
by ``request_timeout_seconds``, and the few requests the chart's Role allows (docs/kubernetes.md, RBAC):

=================================  ==========================================================
request                            Role rule
=================================  ==========================================================
get, update the pool's Lease       leases, by name: get, update
get, update (CAS), patch, watch    configmaps, by name: get, update, patch, watch (the watch
the pool's ConfigMap               carries ``fieldSelector=metadata.name=<name>``)
list the pool's pods, get one      pods: get, list (read only)
get the pool's PDB                 poddisruptionbudgets, by name: get
create an Event on the agent's     events (core v1): create (``reporting``: a start-up problem)
own pod
=================================  ==========================================================

Errors become ``ApiError`` (the status code kept: 409 is a lost compare-and-swap, 403 a request the
Role does not allow, 0 no answer at all), with one line saying which request failed.

An update (PUT) replaces the whole object, its labels and annotations too: the Lease and the ConfigMap are
read with theirs and written back with them (Helm's labels and ``helm.sh/resource-policy: keep``, and the
operator's switches on the ConfigMap, ``tuner.kube.switches``), and a compare-and-swap that lost to a
``kubectl annotate`` re-reads them like any other change.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import lightkube
from lightkube import operators
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap, Event, Pod
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import PatchType

from tuner import config
from tuner.errors import TunerError


class ApiError(TunerError):
    """A request to the API server failed. ``code``: the HTTP status (409 conflict, 403 forbidden, 404 not
    found), 0 when there was no answer."""

    def __init__(self, what: str, code: int, reason: str) -> None:
        self.what, self.code, self.reason = what, code, reason
        super().__init__(f"{what}: {reason}" + (f" (HTTP {code})" if code else ""))

    @property
    def conflict(self) -> bool:
        return self.code == 409


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec, as the elector reads and writes it."""

    resource_version: str | None
    holder: str | None
    duration_seconds: int | None
    acquired_at: dt.datetime | None
    renewed_at: dt.datetime | None
    transitions: int
    labels: Mapping[str, str] = field(default_factory=dict)  # kept as read: an update replaces them
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ConfigMapRecord:
    resource_version: str
    data: Mapping[str, str]
    labels: Mapping[str, str] = field(default_factory=dict)  # kept as read: an update replaces them
    annotations: Mapping[str, str] = field(default_factory=dict)  # the operator's switches among them


def _configmap_record(cm: Any) -> ConfigMapRecord:
    meta = cm.metadata
    return ConfigMapRecord(str(meta.resourceVersion), dict(cm.data or {}), dict(meta.labels or {}),
                           dict(meta.annotations or {}))


@dataclass(frozen=True)
class PodView:
    """What the leader needs of a pod."""

    name: str
    uid: str
    ip: str | None
    phase: str | None
    ready: bool  # the pod's Ready condition (the kubelet's view of its containers' readiness)
    deleting: bool  # metadata.deletionTimestamp is set
    labels: Mapping[str, str]


def label_selector(selector: config.LabelSelector) -> dict[str, Any]:
    """The config's selector in lightkube's form."""
    out: dict[str, Any] = dict(selector.match_labels)
    for req in selector.match_expressions:
        if req.operator == "In":
            out[req.key] = operators.in_(req.values)
        elif req.operator == "NotIn":
            out[req.key] = operators.not_in(req.values)
        elif req.operator == "Exists":
            out[req.key] = operators.exists()
        else:
            out[req.key] = operators.not_exists()
    return out


class KubeApi:
    def __init__(self, settings: config.KubernetesSettings, *, namespace: str,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.settings, self.namespace = settings, namespace
        if settings.api_server:
            cluster = Cluster(server=settings.api_server,
                              certificate_auth=settings.ca_file if settings.api_server.startswith("https") else None)
        else:
            import os

            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise config_error("kubernetes.api_server", "not in a cluster ($KUBERNETES_SERVICE_HOST is not set) "
                                   "and no kubernetes.api_server given, e.g. https://10.0.0.1:443")
            host = f"[{host}]" if ":" in host else host
            cluster = Cluster(server=f"https://{host}:{port}", certificate_auth=settings.ca_file)
        kubeconfig = KubeConfig.from_one(cluster=cluster, user=User(token_file=settings.token_file), namespace=namespace)
        self._client = lightkube.Client(kubeconfig, namespace=namespace, trust_env=False, transport=transport,
                                        timeout=httpx.Timeout(settings.request_timeout_seconds),
                                        field_manager="vllm-tuner")

    def close(self) -> None:
        self._client.close()

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except lightkube.ApiError as exc:
            raise ApiError(what, int(exc.status.code or 0), str(exc.status.message or exc)) from exc
        except (httpx.HTTPError, OSError, ValueError) as exc:  # no answer, or not JSON
            raise ApiError(what, 0, f"{type(exc).__name__}: {exc}") from exc

    # --- the Lease -----------------------------------------------------------------------------------

    def get_lease(self) -> LeaseRecord:
        name = self.settings.lease
        lease = self._call(f"get Lease {name}", self._client.get, Lease, name, namespace=self.namespace)
        spec = lease.spec or LeaseSpec()
        return LeaseRecord(lease.metadata.resourceVersion, spec.holderIdentity or None, spec.leaseDurationSeconds,
                           spec.acquireTime, spec.renewTime, spec.leaseTransitions or 0,
                           dict(lease.metadata.labels or {}), dict(lease.metadata.annotations or {}))

    def update_lease(self, record: LeaseRecord) -> LeaseRecord:
        """PUT with the record's resourceVersion (and its labels and annotations, as read): ``ApiError`` 409
        when someone else wrote it first."""
        name = self.settings.lease
        lease = Lease(metadata=ObjectMeta(name=name, namespace=self.namespace, resourceVersion=record.resource_version,
                                          labels=dict(record.labels) or None,
                                          annotations=dict(record.annotations) or None),
                      spec=LeaseSpec(holderIdentity=record.holder, leaseDurationSeconds=record.duration_seconds,
                                     acquireTime=record.acquired_at, renewTime=record.renewed_at,
                                     leaseTransitions=record.transitions))
        out = self._call(f"update Lease {name}", self._client.replace, lease)
        return replace(record, resource_version=out.metadata.resourceVersion,
                       labels=dict(out.metadata.labels or {}), annotations=dict(out.metadata.annotations or {}))

    # --- the pool's ConfigMap ------------------------------------------------------------------------

    def get_configmap(self) -> ConfigMapRecord:
        name = self.settings.journal_configmap
        cm = self._call(f"get ConfigMap {name}", self._client.get, ConfigMap, name, namespace=self.namespace)
        return _configmap_record(cm)

    def replace_configmap(self, resource_version: str, data: Mapping[str, str], *,
                          labels: Mapping[str, str] | None = None,
                          annotations: Mapping[str, str] | None = None) -> ConfigMapRecord:
        """Compare-and-swap: PUT with ``resource_version``; ``ApiError`` 409 when it changed meanwhile.
        ``labels`` and ``annotations``: those of the version read (a PUT without them removes them)."""
        name = self.settings.journal_configmap
        cm = ConfigMap(metadata=ObjectMeta(name=name, namespace=self.namespace, resourceVersion=resource_version,
                                           labels=dict(labels or {}) or None,
                                           annotations=dict(annotations or {}) or None),
                       data=dict(data))
        out = self._call(f"update ConfigMap {name}", self._client.replace, cm)
        return _configmap_record(out)

    def patch_configmap_key(self, key: str, value: str | None) -> ConfigMapRecord:
        """One key, set (or removed with None) by a JSON merge patch: atomic on the server, no CAS needed
        (an agent's report of its own pod touches nothing else)."""
        name = self.settings.journal_configmap
        out = self._call(f"patch ConfigMap {name}", self._client.patch, ConfigMap, name, {"data": {key: value}},
                         namespace=self.namespace, patch_type=PatchType.MERGE)
        return _configmap_record(out)

    def watch_configmap(self, resource_version: str | None, *, server_timeout: int = 30
                        ) -> Iterator[tuple[str, ConfigMapRecord]]:
        """(event type, the ConfigMap) for every change after ``resource_version``; reconnects on its own
        after each ``server_timeout``. Raises ``ApiError`` when the watch cannot go on."""
        name = self.settings.journal_configmap
        stream = self._client.watch(ConfigMap, namespace=self.namespace, fields={"metadata.name": name},
                                    resource_version=resource_version, server_timeout=server_timeout)
        while True:
            event = self._call(f"watch ConfigMap {name}", next, stream)
            kind, cm = event
            yield kind, _configmap_record(cm)

    # --- pods and the PDB ----------------------------------------------------------------------------

    def list_pods(self) -> list[PodView]:
        selector = label_selector(self.settings.selector)
        pods = self._call("list pods", lambda: list(self._client.list(Pod, namespace=self.namespace, labels=selector)))
        return [pod_view(p) for p in pods]

    def get_pod(self, name: str) -> PodView:
        return pod_view(self._call(f"get pod {name}", self._client.get, Pod, name, namespace=self.namespace))

    # --- Events ---------------------------------------------------------------------------------------

    def create_event(self, *, pod: str, pod_uid: str | None, reason: str, message: str, type: str,
                     component: str) -> None:
        """One Event about the agent's own pod (``kubectl describe pod`` shows it)."""
        now = dt.datetime.now(dt.UTC)
        event = Event(
            metadata=ObjectMeta(name=f"{pod}.{uuid.uuid4().hex[:16]}", namespace=self.namespace),
            involvedObject=ObjectReference(apiVersion="v1", kind="Pod", name=pod, namespace=self.namespace,
                                           uid=pod_uid or None),
            reason=reason, message=message[:1024], type=type, count=1, firstTimestamp=now, lastTimestamp=now,
            source=EventSource(component=component), reportingComponent=f"vllm-tuner.io/{component}",
            reportingInstance=pod)
        self._call(f"create Event on pod {pod}", self._client.create, event)

    def disruptions_allowed(self) -> int | None:
        """The PDB's status.disruptionsAllowed; None when none is configured."""
        name = self.settings.pod_disruption_budget
        if name is None:
            return None
        pdb = self._call(f"get PodDisruptionBudget {name}", self._client.get, PodDisruptionBudget, name,
                         namespace=self.namespace)
        return int(pdb.status.disruptionsAllowed) if pdb.status is not None else 0


def pod_view(pod: Any) -> PodView:
    status = pod.status
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or [])) if status else False
    return PodView(name=pod.metadata.name, uid=pod.metadata.uid or "", ip=status.podIP if status else None,
                   phase=status.phase if status else None, ready=ready,
                   deleting=pod.metadata.deletionTimestamp is not None, labels=dict(pod.metadata.labels or {}))


def config_error(where: str, what: str) -> TunerError:
    from tuner.errors import ConfigError

    return ConfigError("<kubernetes>", [(where, what)])


def dumps(doc: Any) -> str:
    """Compact, sorted JSON: the ConfigMap's values (a stable text, so unchanged documents compare equal)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
