"""What the agent says about itself: its own series on ``/metrics``, Kubernetes Events on its pod, its log.

==================================  =====================================================================
``tuner_agent_degraded{reason}``    1 while a start-up problem holds (``config``: missing or invalid,
                                    its rules too; ``identity``: no pod name or namespace; ``api-config``:
                                    no API server to talk to; ``state-dir``: the shared directory is not
                                    writable; ``api``: the pool's ConfigMap was not readable at start-up);
                                    absent otherwise
``tuner_agent_leader``              1 while this agent leads the pool, else 0
``tuner_agent_leader_epoch``        its leadership's epoch (the Lease's ``leaseTransitions``); absent
                                    while it does not lead
``tuner_agent_pool_epoch``          the highest epoch that wrote the pool's ConfigMap, as last seen
``tuner_agent_refused_writes``      the leader's writes the ConfigMap's epoch refused (a deposed leader's)
``tuner_agent_configmap_conflicts`` compare-and-swap writes that lost to another writer (and were retried)
==================================  =====================================================================

The leadership and ConfigMap series are read when ``/metrics`` is scraped (``watch``): the elector and the
store keep their own counts, nothing is mirrored.

A problem (``Reporter.problem``) is logged, raises its gauge and becomes one Event (type Warning, reason
``TunerDegraded``) on the agent's pod — sent when the API server answers, retried a few times (an
unreachable API server is one of the problems), and given up on for good at a 403 (the chart's
``rbac.events: false``). The Event is all the agent asks for: ``create`` on ``events``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tuner.kube.api import ApiError, KubeApi

log = logging.getLogger("tuner.kube")

EVENT_REASON = "TunerDegraded"
MAX_PENDING = 8  # Events not sent yet (an unreachable API server): the oldest go first
MAX_ATTEMPTS = 30  # tries per Event (one per flush: every few seconds)


@dataclass(frozen=True)
class Pool:
    """Where the leadership and ConfigMap series are read from, at scrape time."""

    is_leader: Callable[[], bool]
    leader_epoch: Callable[[], int | None]
    pool_epoch: Callable[[], int]
    refused_writes: Callable[[], int]
    conflicts: Callable[[], int]


class _PoolCollector(Collector):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        p = self.pool
        yield GaugeMetricFamily("tuner_agent_leader", "1 while this agent leads the pool, else 0.",
                                value=1 if p.is_leader() else 0)
        epoch = p.leader_epoch()
        leader_epoch = GaugeMetricFamily("tuner_agent_leader_epoch", "The epoch this agent leads with (the "
                                         "Lease's leaseTransitions); absent while it does not lead.")
        if epoch is not None:
            leader_epoch.add_metric([], epoch)
        yield leader_epoch
        yield GaugeMetricFamily("tuner_agent_pool_epoch", "The highest leader epoch that wrote the pool's "
                                "ConfigMap, as this agent last saw it.", value=p.pool_epoch())
        yield CounterMetricFamily("tuner_agent_refused_writes", "Writes to the pool's ConfigMap refused because a "
                                  "newer leader's epoch is there (this agent was deposed).", value=p.refused_writes())
        yield CounterMetricFamily("tuner_agent_configmap_conflicts", "Compare-and-swap writes to the pool's "
                                  "ConfigMap that lost to another writer (then retried).", value=p.conflicts())


class AgentMetrics:
    """The agent's series, in the registry the agent's ``/metrics`` serves (``TunerMetrics.registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.degraded = Gauge("tuner_agent_degraded", "1 while a start-up problem of the agent holds, by reason "
                              "(the engine started on its own command line); absent otherwise.", ["reason"],
                              registry=registry)
        self._pool: _PoolCollector | None = None

    def watch(self, pool: Pool) -> None:
        """Read the leadership and ConfigMap series from ``pool`` at every scrape."""
        if self._pool is None:
            self._pool = _PoolCollector(pool)
            self.registry.register(self._pool)


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
