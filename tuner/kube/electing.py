"""Leader election on a ``coordination.k8s.io`` Lease, after client-go's ``leaderelection`` (about as small).

One leader per pool decides; the others wait. Every ``retry_period_seconds`` each agent reads the Lease:

- the holder is this agent: renew (``renewTime`` = now), a PUT with the Lease's resourceVersion;
- another holder whose record (holder, renewTime) has not changed for ``lease_duration_seconds`` *as this
  agent observed it* (its own monotonic clock, never the holder's timestamps: clocks of two nodes need not
  agree), or no holder: take it, ``leaseTransitions`` + 1, again a compare-and-swap PUT (two contenders:
  one gets 409 and stays a follower);
- otherwise: follow.

The **epoch** is the ``leaseTransitions`` this agent's acquisition wrote: every acquisition by another
holder raises it, so it orders leaders. The pool's ConfigMap keeps the highest epoch that wrote to it and
refuses older ones (``store``): a deposed leader that wakes up cannot write.

A Lease deleted and created again (a Helm reinstall, an Argo CD replace) starts its ``leaseTransitions``
at 0 again, while the ConfigMap keeps its epoch: so an acquisition writes ``max(leaseTransitions, the
ConfigMap's epoch) + 1``, read just before. Where that read was behind (or two agents got one epoch from
two Leases), the leader's first write is refused though the Lease is its own; ``advance`` then raises
the Lease's ``leaseTransitions`` above the ConfigMap's epoch — a compare-and-swap that only the holder of
the Lease as it is now can make, so a leader deposed for real never gets a new epoch this way.

A leader that could not renew for ``renew_deadline_seconds`` (< the lease duration) stops acting
(``is_leader`` turns false) before anybody else can take over. On a clean stop the leader releases the
Lease (no holder) so the next one takes it at its next try instead of after the lease duration.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from tuner.kube import store
from tuner.kube.api import ApiError, KubeApi
from tuner.runtime import selfmetrics

log = logging.getLogger("tuner.kube.lease")


@dataclass(frozen=True)
class Leadership:
    epoch: int
    since: float  # monotonic


class Elector:
    def __init__(self, api: KubeApi, identity: str, *, lease_seconds: float, renew_deadline_seconds: float,
                 retry_seconds: float, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
                 on_change: Callable[[Leadership | None], None] | None = None,
                 metrics: selfmetrics.TunerMetrics | None = None) -> None:
        self.api, self.identity = api, identity
        self.lease_seconds, self.renew_deadline, self.retry = lease_seconds, renew_deadline_seconds, retry_seconds
        self._mono, self._wall, self._on_change, self.metrics = monotonic, wall, on_change, metrics
        self._failing: str | None = None  # the election's failure last said (said once, until it ends)
        self._observed: tuple[str | None, dt.datetime | None] | None = None
        self._observed_at = 0.0
        self._leadership: Leadership | None = None
        self._renewed_at = 0.0
        self._lock = threading.Lock()
        self.holder: str | None = None  # the holder last seen

    @property
    def leadership(self) -> Leadership | None:
        """This agent's leadership, if it renewed within the renew deadline."""
        with self._lock:
            if self._leadership is not None and self._mono() - self._renewed_at > self.renew_deadline:
                return None
            return self._leadership

    def is_leader(self) -> bool:
        return self.leadership is not None

    def try_once(self) -> Leadership | None:
        """One read and, where due, one renewal or acquisition. Never raises for the API's failures."""
        before = self.leadership
        try:
            lease = self.api.get_lease()
            now = self._mono()
            seen = (lease.holder, lease.renewed_at)
            if seen != self._observed:
                self._observed, self._observed_at = seen, now
            self.holder = lease.holder
            if lease.holder == self.identity and self._leadership is not None:
                self.api.update_lease(replace(lease, renewed_at=self._wall(),
                                              duration_seconds=round(self.lease_seconds)))
                with self._lock:
                    self._renewed_at = now
            elif lease.holder is None or now - self._observed_at > self.lease_seconds or lease.holder == self.identity:
                # free, expired, or ours from before this process (a restarted agent): take it, a new epoch
                # above the Lease's and the ConfigMap's (a re-created Lease starts again at 0)
                floor = store.epoch_floor(self.api.get_configmap().data)
                wall = self._wall()
                taken = self.api.update_lease(replace(lease, holder=self.identity,
                                                      duration_seconds=round(self.lease_seconds), acquired_at=wall,
                                                      renewed_at=wall, transitions=max(lease.transitions, floor) + 1))
                with self._lock:
                    self._leadership, self._renewed_at = Leadership(taken.transitions, now), now
                self.holder = self.identity
                log.info("leader of the pool (epoch %d), after %s", taken.transitions, lease.holder or "no holder")
                if floor > lease.transitions:
                    self._raised(floor, lease.transitions, taken.transitions)
            elif self._leadership is not None:
                with self._lock:
                    self._leadership = None
            if self._failing is not None:
                log.info("leader election: the Lease answers again")
                self._failing = None
        except ApiError as exc:
            if not exc.conflict:
                self._fail(exc)
        after = self.leadership
        if after != before and self._on_change is not None:
            self._on_change(after)
        return after

    def advance(self, past: int) -> Leadership | None:
        """A new epoch above ``past`` (the ConfigMap's) for this agent's leadership: the Lease's
        ``leaseTransitions`` raised to ``max(it, past) + 1``, a compare-and-swap made only while this agent
        holds the Lease as it is now. None when it does not: it was deposed for real."""
        for _attempt in range(3):
            held = self.leadership
            if held is None:
                return None
            try:
                lease = self.api.get_lease()
                if lease.holder != self.identity:
                    return None
                epoch = max(lease.transitions, past) + 1
                self.api.update_lease(replace(lease, transitions=epoch, renewed_at=self._wall(),
                                              duration_seconds=round(self.lease_seconds)))
            except ApiError as exc:
                if exc.conflict:  # a renewal of ours in between: read it again
                    continue
                log.warning("leader election: raising the epoch: %s", exc)
                return None
            with self._lock:
                if self._leadership is None:
                    return None
                self._leadership, self._renewed_at = Leadership(epoch, held.since), self._mono()
                raised = self._leadership
            self._raised(past, lease.transitions, epoch)
            return raised
        return None

    def _raised(self, floor: int, transitions: int, epoch: int) -> None:
        log.warning("the pool's ConfigMap is at epoch %d, the Lease's leaseTransitions at %d (the Lease was "
                    "re-created, or the epoch edited): this leader's epoch is %d", floor, transitions, epoch)
        if self.metrics is not None:
            self.metrics.epoch_raised.inc()

    def _fail(self, exc: ApiError) -> None:
        """One line while the same failure lasts (a deleted Lease would say it every retry period)."""
        text = str(exc)
        if text == self._failing:
            return
        self._failing = text
        hint = ""
        if exc.code == 404:  # deleted: the chart creates both (helm upgrade --install); the agents may not
            hint = "; no agent leads until it exists again (the chart creates it: helm upgrade --install)"
        log.warning("leader election: %s%s", exc, hint)

    def release(self) -> None:
        """Give the Lease up (a clean stop): no holder, so the next agent takes it at its next try."""
        with self._lock:
            was, self._leadership = self._leadership, None
        if was is None:
            return
        try:
            lease = self.api.get_lease()
            if lease.holder == self.identity:
                self.api.update_lease(replace(lease, holder=None, duration_seconds=1, renewed_at=self._wall()))
                log.info("released the Lease (epoch %d)", was.epoch)
        except ApiError as exc:
            log.warning("releasing the Lease: %s", exc)

    def run(self, stop: threading.Event) -> None:
        """Try every ``retry_seconds`` until ``stop``; then release."""
        while not stop.is_set():
            try:
                self.try_once()
            except Exception:  # the election must outlive any surprise; a leader that cannot renew steps down
                log.exception("leader election failed")
            stop.wait(self.retry)
        self.release()
