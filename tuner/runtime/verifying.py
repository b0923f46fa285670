"""The rollout's verification step, against the engine: scrape the replica through its verification
window, then judge its signals there against the signals before the change
(``tuner.planning.verification``, pure).

The baseline is what the cycle that decided the change saw for each replica (its signal window, e.g.
the last five minutes before the rollout); the window after is the replica's own ``/metrics`` scraped
at every driver poll from the moment it was undrained until the deadline (``rollout.verify_seconds``).
Both come from the engine's counters and histograms, so the comparison measures the engine, not the
load balancer. The checks and baselines are journaled with the decision, so a tuner restarted
mid-rollout judges the resumed replica by the same standard.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tuner.actuators import base
from tuner.model import dialects, snapshots
from tuner.planning import verification
from tuner.rollout import machine
from tuner.signals import Signal
from tuner.signals import engine as engine_signals
from tuner.sources import engines

log = logging.getLogger("tuner.rollout")


def values_of(signals: Mapping[str, Signal]) -> dict[str, float | None]:
    return {name: s.value for name, s in signals.items()}


def error_count(snap: snapshots.Snapshot, dialect: dialects.Dialect) -> float | None:
    """Requests the engine finished with an error or abort, plus completion requests it answered 4xx/5xx."""
    if not snap.ok:
        return None
    bad = engine_signals.counter(snap, dialect, "request_success",
                                 lambda lb: lb.get("finished_reason") in ("error", "abort"))
    rejected = engine_signals.counter(snap, dialect, "http_requests",
                                      lambda lb: lb.get("status") in ("4xx", "5xx")
                                      and lb.get("handler") in dialect.completion_handlers)
    if bad is None and rejected is None:
        return None
    return (bad or 0.0) + (rejected or 0.0)


@dataclass
class _Expectation:
    checks: tuple[verification.Check, ...]
    baselines: Mapping[str, Mapping[str, float | None]]  # replica → signal → value before the change


class SignalVerifier:
    """``driving.Verifier`` over real ``/metrics``: ``observe`` at every poll, ``judge`` at the deadline."""

    def __init__(self, client: engines.EngineClient, *, kind: str = "vllm") -> None:
        self._client = client
        self._kind = kind
        self._dialect = dialects.DIALECTS[kind]
        self._expect: dict[str, _Expectation] = {}
        self._windows: dict[tuple[str, str, float | None], list[snapshots.Snapshot]] = {}

    def expect(self, rollout_id: str, *, checks: Sequence[verification.Check],
               baselines: Mapping[str, Mapping[str, float | None]]) -> None:
        """What the rollout ``rollout_id`` must show, and the signals before it."""
        self._expect[rollout_id] = _Expectation(tuple(checks), {k: dict(v) for k, v in baselines.items()})

    def _window(self, key: tuple[str, str, float | None]) -> list[snapshots.Snapshot]:
        """The scrapes of one replica's (current) verification window: (change id, replica, since)."""
        for stale in [k for k in self._windows if k[:2] == key[:2] and k != key]:
            del self._windows[stale]  # a re-entered verification starts a fresh window
        return self._windows.setdefault(key, [])

    def observe(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> None:
        self.observe_window(rollout.id, replica, since=rollout.of(replica.name).since)

    def judge(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> verification.Verdict:
        return self.judge_window(rollout.id, replica, since=rollout.of(replica.name).since)

    def observe_window(self, change_id: str, replica: base.Replica, *, since: float | None) -> None:
        """One scrape into the window of ``change_id`` on ``replica`` (a rollout's or a live change's)."""
        self._window((change_id, replica.name, since)).append(self._client.metrics(replica.base_url, self._kind))

    def judge_window(self, change_id: str, replica: base.Replica, *, since: float | None) -> verification.Verdict:
        """The verdict on ``replica`` over its window, against the baseline expected for ``change_id``."""
        self.observe_window(change_id, replica, since=since)
        key = (change_id, replica.name, since)
        good = [s for s in self._window(key) if s.ok]
        errors: float | None = None
        if len(good) >= 2:
            first, last = error_count(good[0], self._dialect), error_count(good[-1], self._dialect)
            if first is not None and last is not None and last >= first:
                errors = last - first
        elif good:
            errors = error_count(good[-1], self._dialect)  # one scrape: everything since start counts
        signals = engine_signals.compute(good, dialect=self._dialect, min_snapshots=2)
        expectation = self._expect.get(change_id)
        if expectation is None:
            verdict = verification.judge((), {}, {}, errors=errors)
            verdict = verification.Verdict(verdict.ok, verdict.reason + "; no baseline known for this change")
        else:
            before = expectation.baselines.get(replica.name, {})
            why = {name: s.reason for name, s in signals.items() if s.value is None and s.reason}
            verdict = verification.judge(expectation.checks, before, values_of(signals), errors=errors,
                                         why_missing=why)
        log.info("change %s: %s verification over %d scrapes: %s", change_id, replica.name, len(good),
                 verdict.reason)
        self._windows.pop(key, None)
        return verdict
