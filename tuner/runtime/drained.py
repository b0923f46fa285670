"""Replicas a failed rollout left out of the pool: shown at once, measured, and after a bound a person is asked.

A rollout whose way back fails leaves its replica drained (the machine's ``FAILED``): the engine did not come
back on arguments anyone confirmed, so the tuner never puts it back itself. It does not leave it there
silently either. From the journal (``journal.left_drained``, so a restarted tuner finds the same), at every
cycle:

- ``/status`` shows it under ``left_drained`` with the rollout, since when and why;
- ``tuner_replica_left_drained_seconds{replica}`` says how long (``deploy/prometheus/alerts.yaml`` alerts on it);
- once it has been out ``rollout.left_drained_ask_after_seconds``, one ERROR line asks a person, and
  ``ask`` (on Kubernetes, a Warning Event on the pod) carries the same message — once per rollout and
  replica in one tuner's life.

It is out of the pool until a person puts it back or a later rollout that drains it again ends (which
undrains it); a replica whose back leg could only not read the engine's self-report is not here: it was
put back (``FAILED_SERVING``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from tuner.rollout import journal as journaling
from tuner.runtime import selfmetrics

log = logging.getLogger("tuner.rollout")

Ask = Callable[[str, str], None]
"""(replica, message): tell a person (a Kubernetes Event); the log line is written anyway."""


class LeftDrainedWatch:
    def __init__(self, *, ask_after_seconds: float, metrics: selfmetrics.TunerMetrics | None = None,
                 ask: Ask | None = None) -> None:
        self._ask_after = ask_after_seconds
        self._metrics = metrics
        self._ask = ask
        self._asked: set[tuple[str, str]] = set()  # (replica, rollout id)

    def check(self, records: Iterable[journaling.Record], *, now: float) -> dict[str, dict[str, Any]]:
        """The replicas left drained, as ``/status`` shows them; asks a person where the bound has passed."""
        found = journaling.left_drained(records)
        if self._metrics is not None:
            self._metrics.set_left_drained({n: max(0.0, now - d.since) for n, d in found.items()})
        shown: dict[str, dict[str, Any]] = {}
        for name, d in found.items():
            out_for = max(0.0, now - d.since)
            due = out_for >= self._ask_after
            key = (name, d.rollout_id)
            if due and key not in self._asked:
                self._asked.add(key)
                message = (f"{name} has been out of the pool for {out_for:.0f}s: rollout {d.rollout_id} could not "
                           f"bring it back ({d.reason or 'no reason journaled'}). A person must look: check its "
                           "engine, then put it back in the load balancer (the next rollout that includes it "
                           "does so as well)")
                log.error("%s", message)
                if self._ask is not None:
                    try:
                        self._ask(name, message)
                    except Exception:  # telling a person must not stop the tuner: the log line stands
                        log.exception("could not report %s left drained", name)
            shown[name] = {"rollout": d.rollout_id, "since": d.since, "seconds": round(out_for, 1),
                           "reason": d.reason, "person_asked": key in self._asked,
                           "ask_after_seconds": self._ask_after}
        return shown
