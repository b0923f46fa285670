"""What the agent says about itself: its own series on ``/metrics``, Kubernetes Events on its pod, its log.

==================================  =====================================================================
``tuner_agent_degraded{reason}``    1 while a start-up problem holds (``config``: missing or invalid,
                                    its rules too; ``identity``: no pod name or namespace; ``api-config``:
                                    no API server to talk to; ``state-dir``: the shared directory is not
                                    writable; ``api``: the pool's ConfigMap was not readable at start-up);
                                    absent otherwise
==================================  =====================================================================

A problem (``Reporter.problem``) is logged, raises its gauge and becomes one Event (type Warning, reason
``TunerDegraded``) on the agent's pod — sent when the API server answers, retried a few times (an
unreachable API server is one of the problems), and given up on for good at a 403 (the chart's
``rbac.events: false``). The Event is all the agent asks for: ``create`` on ``events``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from tuner.kube.api import ApiError, KubeApi

log = logging.getLogger("tuner.kube")

EVENT_REASON = "TunerDegraded"
MAX_PENDING = 8  # Events not sent yet (an unreachable API server): the oldest go first
MAX_ATTEMPTS = 30  # tries per Event (one per flush: every few seconds)


class AgentMetrics:
    """The agent's series, in the registry the agent's ``/metrics`` serves (``TunerMetrics.registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.degraded = Gauge("tuner_agent_degraded", "1 while a start-up problem of the agent holds, by reason "
                              "(the engine started on its own command line); absent otherwise.", ["reason"],
                              registry=registry)


@dataclass
class _Pending:
    message: str
    attempts: int = 0


class Reporter:
    """Problems: said in the log, on ``/metrics`` and as Events on the agent's pod (module docstring)."""

    def __init__(self, metrics: AgentMetrics, *, pod: str | None, api: KubeApi | None = None,
                 pod_uid: str | None = None) -> None:
        self.metrics, self.pod, self.api, self.pod_uid = metrics, pod, api, pod_uid
        self.active: dict[str, str] = {}  # reason → message
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._events_off: str | None = None  # why Events are not sent (no API, or RBAC says no)
        self.sent = 0

    def problem(self, reason: str, message: str) -> None:
        """A start-up problem: logged once, its gauge raised, an Event queued."""
        with self._lock:
            if self.active.get(reason) == message:
                return
            self.active[reason] = message
            if self.api is not None and self.pod and self._events_off is None:
                self._pending = [*self._pending[-(MAX_PENDING - 1):], _Pending(message)]
        self.metrics.degraded.labels(reason=reason).set(1)
        log.error("degraded (%s): %s", reason, message)

    def resolved(self, reason: str) -> None:
        with self._lock:
            if self.active.pop(reason, None) is None:
                return
        self.metrics.degraded.remove(reason)
        log.warning("no longer degraded (%s)", reason)

    def flush(self) -> None:
        """Send the Events not sent yet (from the loop that runs anyway; one request each at most)."""
        with self._lock:
            pending = list(self._pending)
        for item in pending:
            if self.api is None or self.pod is None or self._events_off is not None:
                return
            try:
                self.api.create_event(pod=self.pod, pod_uid=self.pod_uid, reason=EVENT_REASON, message=item.message,
                                      type="Warning", component="vllm-tuner-agent")
            except ApiError as exc:
                item.attempts += 1
                if exc.code in (401, 403):
                    self._events_off = str(exc)
                    log.warning("no Events on the pod (%s): the problems are in this log and on /metrics", exc)
                elif item.attempts < MAX_ATTEMPTS:
                    continue
            else:
                self.sent += 1
            with self._lock:
                if item in self._pending:
                    self._pending.remove(item)
