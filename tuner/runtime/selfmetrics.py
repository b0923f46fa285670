"""The tuner's own Prometheus series (``tuner_*``), in a registry of their own.

Never the global ``REGISTRY``: tests create a fresh ``TunerMetrics()`` each, and a process embedding
the tuner keeps its own metrics apart. Label values that are free text (reasons) are kept short by the
caller: a reason label is a guard name or a rule's short reason, never a sentence with numbers in it.

Each name means one thing in one unit: ``tuner_decisions_total`` counts decisions (a recommendation
repeated every cycle is one decision, counted when it is first made or changes), ``tuner_restarts_total``
engine restarts and ``tuner_live_changes_total`` changes the running engines took without one; the
signals are split by unit (``tuner_signal_seconds``, ``tuner_signal_ratio``, … ``SIGNAL_METRICS``). No
``_created`` series (``disable_created_metrics``): they doubled the output and nothing reads them.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from tuner import __version__
from tuner.signals import VOCABULARY, Signal

disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide in prometheus_client: the tuner's own registry is the only one it serves

# A signal's unit (signals.VOCABULARY) → the gauge that holds it: one unit per metric name.
SIGNAL_METRICS = {
    "requests": "tuner_signal_requests",
    "level": "tuner_signal_level",
    "ratio 0..1": "tuner_signal_ratio",
    "requests/s (signed)": "tuner_signal_requests_per_second",
    "requests/s": "tuner_signal_requests_per_second",
    "tokens/s": "tuner_signal_tokens_per_second",
    "preemptions/s": "tuner_signal_preemptions_per_second",
    "s": "tuner_signal_seconds",
    "tokens": "tuner_signal_tokens",
    "blocks": "tuner_signal_blocks",
    "°C": "tuner_signal_celsius",
    "bool 0/1": "tuner_signal_bool",
    "W": "tuner_signal_watts",
}
OTHER_SIGNALS = "tuner_signal_other"  # a signal outside the vocabulary (none today)


def signal_metric(signal: str) -> str:
    """The metric name a signal is exported under."""
    d = VOCABULARY.get(signal)
    return SIGNAL_METRICS.get(d.unit, OTHER_SIGNALS) if d is not None else OTHER_SIGNALS

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest() writes

# A cycle is a scrape of every target plus planning: well under a second when healthy, up to the
# scrape timeouts (seconds) when a target hangs, minutes when it includes a rolling restart.
CYCLE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0)


class TunerMetrics:
    """Every ``tuner_*`` series. Thread-safe (prometheus_client is; the label bookkeeping is locked)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.cycle_duration = Histogram(
            "tuner_cycle_duration_seconds", "Duration of one tuner cycle (scrape, signals, plan, act).",
            buckets=CYCLE_BUCKETS, registry=r)
        self.step_duration = Histogram(
            "tuner_cycle_step_duration_seconds", "Duration of one step of a cycle.", ["step"],
            buckets=CYCLE_BUCKETS, registry=r)
        self.decisions = Counter(
            "tuner_decisions", "Decisions by rule, outcome (recommended, applied, deferred, held) and "
            "reason (the guard or short reason); one a decision, not one a cycle: a decision repeated by the "
            "next cycles counts again only once it changed.", ["rule", "outcome", "reason"], registry=r)
        self.restarts = Counter(
            "tuner_restarts", "Engine restarts by target and result (a rollout that restarted the engine).",
            ["target", "result"], registry=r)
        self.live_changes = Counter(
            "tuner_live_changes", "Changes the running engine took without a restart, by target and result.",
            ["target", "result"], registry=r)
        self.build_info = Info("tuner_build", "The tuner's version and Python.", registry=r)
        self.build_info.info({"version": __version__, "python": platform.python_version()})
        self.paused = Gauge(
            "tuner_paused", "1 while the tuner is paused (no change goes out: config decisions.paused or "
            "`vllm-tuner pause`), else 0.", registry=r)
        self.pinned = Gauge(
            "tuner_pinned", "1 for each engine flag pinned (the tuner holds changes to it).", ["flag"], registry=r)
        self.rollout_in_flight = Gauge(
            "tuner_rollout_in_flight", "1 while a rollout is being carried out, else 0.", registry=r)
        self.rollout_started = Gauge(
            "tuner_rollout_started_timestamp_seconds", "When the rollout in flight began (seconds since the "
            "epoch); 0 while none is.", registry=r)
        self.rollout_in_flight.set(0)
        self.scrape_errors = Counter(
            "tuner_scrape_errors", "Failed reads by target and source (engine, engine_info, gpu).",
            ["target", "source"], registry=r)
        units = {metric: unit for unit, metric in SIGNAL_METRICS.items()} | {OTHER_SIGNALS: "other units"}
        self.signals = {metric: Gauge(metric, f"The latest known value of each signal in {unit}; absent while "
                                      "unknown (docs/signals.md lists them).", ["target", "signal"], registry=r)
                        for metric, unit in units.items()}
        self.engine_arg = Gauge(
            "tuner_engine_arg_info", "Engine arguments: kind=current as running, kind=recommended as planned.",
            ["target", "flag", "value", "kind"], registry=r)
        self.last_cycle = Gauge(
            "tuner_last_cycle_timestamp_seconds", "When the last cycle finished (seconds since the epoch).",
            registry=r)
        # the pool's ConfigMap on Kubernetes (tuner.kube), as the leader finds it
        self.pool_unreadable = Gauge(
            "tuner_pool_unreadable", "1 while the leader acts on nothing of the pool because this key of its "
            "ConfigMap does not read (the log names the fix); 0 once it reads.", ["key"], registry=r)
        self.journal_set_aside = Counter(
            "tuner_pool_journal_set_aside", "Lines of the pool's journal that did not read, moved by the leader "
            "to the ConfigMap's journal.quarantine key (no unfinished rollout needed them).", registry=r)
        self.epoch_raised = Counter(
            "tuner_pool_epoch_raised", "Times a leader's epoch was raised above the one the pool's ConfigMap "
            "holds (a re-created Lease, an edited epoch).", registry=r)
        self.left_drained = Gauge(
            "tuner_replica_left_drained_seconds", "How long a replica has been out of the pool because a rollout's "
            "way back failed (the machine's FAILED; /status says why); absent for every replica in the pool. "
            "A person is asked after rollout.left_drained_ask_after_seconds.", ["replica"], registry=r)
        self._lock = threading.Lock()
        self._left_drained: set[str] = set()
        self._signal_labels: dict[str, set[str]] = {}
        self._arg_labels: dict[str, set[tuple[str, str, str]]] = {}
        self._pins: set[str] = set()
        self._decided: dict[str, frozenset[tuple[str, str, str, str]]] = {}  # target → last cycle's decisions

    def set_left_drained(self, seconds: Mapping[str, float]) -> None:
        """Replica → seconds out of the pool; a replica not given any more loses its series."""
        with self._lock:
            for name in self._left_drained - set(seconds):
                self.left_drained.remove(name)
            for name, value in seconds.items():
                self.left_drained.labels(replica=name).set(value)
            self._left_drained = set(seconds)

    def observe_cycle(self, seconds: float, *, finished_at: float) -> None:
        self.cycle_duration.observe(seconds)
        self.last_cycle.set(finished_at)

    def observe_step(self, step: str, seconds: float) -> None:
        self.step_duration.labels(step=step).observe(seconds)

    def count_decision(self, *, rule: str, outcome: str, reason: str) -> None:
        self.decisions.labels(rule=rule, outcome=outcome, reason=reason).inc()

    def count_decisions(self, target: str, decisions: set[tuple[str, str, str, str]]) -> None:
        """This cycle's decisions of one target as (rule, outcome, reason, what): each counted once, when
        it is new — the last cycle did not make it. ``what`` tells two decisions of one rule apart (the
        change it proposes) and is not a label."""
        with self._lock:
            seen = self._decided.get(target, frozenset())
            self._decided[target] = frozenset(decisions)
        for rule, outcome, reason, _ in sorted(decisions - seen):
            self.count_decision(rule=rule, outcome=outcome, reason=reason)

    def count_restart(self, *, target: str, result: str) -> None:
        self.restarts.labels(target=target, result=result).inc()

    def count_live_change(self, *, target: str, result: str) -> None:
        self.live_changes.labels(target=target, result=result).inc()

    def set_rollout(self, *, started_at: float | None) -> None:
        """A rollout began at ``started_at`` and is in flight; None: none is."""
        self.rollout_in_flight.set(0 if started_at is None else 1)
        self.rollout_started.set(0 if started_at is None else started_at)

    def set_control(self, *, paused: bool, pins: set[str] | frozenset[str]) -> None:
        """``tuner_paused`` and ``tuner_pinned{flag}``: the switches in force."""
        self.paused.set(1 if paused else 0)
        with self._lock:
            for flag in self._pins - set(pins):
                self.pinned.remove(flag)
            for flag in pins:
                self.pinned.labels(flag=flag).set(1)
            self._pins = set(pins)

    def count_scrape_error(self, *, target: str, source: str) -> None:
        self.scrape_errors.labels(target=target, source=source).inc()

    def set_signals(self, target: str, signals: Mapping[str, Signal]) -> None:
        """Known values become gauges; a signal that became unknown is removed, not set to 0."""
        known = {name: s.value for name, s in signals.items() if s.value is not None}
        with self._lock:
            for name in self._signal_labels.get(target, set()) - known.keys():
                self.signals[signal_metric(name)].remove(target, name)
            for name, value in known.items():
                assert value is not None
                self.signals[signal_metric(name)].labels(target=target, signal=name).set(value)
            self._signal_labels[target] = set(known)

    def set_engine_args(self, target: str, *, current: Mapping[str, str],
                        recommended: Mapping[str, str]) -> None:
        """Replace the target's ``tuner_engine_arg_info`` series (info-style: value 1, value in a label)."""
        wanted = {(flag, value, "current") for flag, value in current.items()}
        wanted |= {(flag, value, "recommended") for flag, value in recommended.items()}
        with self._lock:
            for flag, value, kind in self._arg_labels.get(target, set()) - wanted:
                self.engine_arg.remove(target, flag, value, kind)
            for flag, value, kind in wanted:
                self.engine_arg.labels(target=target, flag=flag, value=value, kind=kind).set(1)
            self._arg_labels[target] = wanted

    def forget_target(self, target: str) -> None:
        self.set_signals(target, {})
        with self._lock:
            self._decided.pop(target, None)
        self.set_engine_args(target, current={}, recommended={})

    def render(self) -> bytes:
        return generate_latest(self.registry)
