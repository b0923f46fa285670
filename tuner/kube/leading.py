"""The leader's work: the tuner's cycle over the pool's pods (``runtime.cycle.run_cycle``, the one decision
path), with the pods as targets — they come and go, so the targets are taken from the API server at every
cycle — and, in apply mode, the rollout driver over the pods' launchers (``acting``), journaling into the
pool's ConfigMap (``store.ConfigMapJournal``, fenced by the leader's epoch).

Per cycle:

1. **read once**: the pool's pods (label selector), and the pool's ConfigMap parsed once into typed
   documents (``documents.inspect``), with the operator's switches — the pause and pins annotated on it
   (``switches``) — taken as the daemon takes ``vllm-tuner pause``/``pin`` (``runtime.control.take``: the
   decisions' guards, ``/status``, ``tuner_paused`` and ``tuner_pinned``); read before anything else, so a
   pool with no pod reporting yet shows them too.
2. **the pool's view** (``poolview.view``, pure): the members (the pods that run, have an IP, are not being
   deleted and whose agent reports a running launcher: name = pod name, URL = pod IP + engine port, args =
   what its launcher runs), the hold (the pods run different base command lines: the Deployment is rolling,
   and the leader does not fight it: no rollout begins), and **the user wins** (every pod runs a base
   command line other than the one the pool's verified overrides were computed for: ``helm upgrade``
   changed the Deployment's args; the overrides are dropped from the pool, the launchers dropped them
   already, and a journal note says so).
3. **the cycle**: collect → step → pool → act → report, as ``vllm-tuner run`` does.
4. **one write** (``poolview.settle``, a compare-and-swap): bad journal lines set aside, the keys of gone
   pods removed, the user's win, the **verified arguments** (a rollout that finished *done* makes its
   overrides the pool's ``pool``: what a new pod starts on) and the decision history (``state``). The rollout
   driver writes the journal at each of its steps (``store.ConfigMapJournal``); the record that finishes a
   rollout is written with its booking (``Leader.booking``), so no leader's end between the two loses it.

A new leader first books the journal's last finished rollout if the pool's saved history does not include it
(``booked_rollout``: a leader of an older version finished it and died or was deposed before its save), as a
restarted daemon does, then resumes the rollout the journal holds unfinished (machine Rule 3) — the one a dead or deposed
leader left — with every pod in flight put back on a step that is safe to repeat.

The cycles run on the runtime's loop (``scheduling.Loop``, the daemon's), one per term. The dispatcher
(``runtime.dispatching.build``, built as the daemon builds it) lives as long as the leadership term: a
rollout — a restart or a live change — is advanced at every cycle and between cycles (``dispatching.carry_on``),
so cycles go on while it is verified. A live change goes to vLLM's runtime_config on the pod's IP where the engine
has it, else to the pod's engine-side plugin through the pod's agent (``acting.RelayedPlugin``: the
leader cannot reach a pod's files); the collectors read the live knobs the same way
(``collecting.collector_for``, as ``vllm-tuner run`` builds them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from tuner import config
from tuner.kube import acting, documents, poolview, switches
from tuner.kube import store as store_mod
from tuner.kube.api import KubeApi
from tuner.kube.electing import Leadership
from tuner.model import knobs
from tuner.planning import history as history_mod
from tuner.planning import stepping
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rules.schema import Rule
from tuner.runtime import (
    clocks,
    collecting,
    control,
    cycle,
    dispatching,
    drained,
    results,
    scheduling,
    selfmetrics,
)
from tuner.runtime.state import TunerState
from tuner.sources import engines

log = logging.getLogger("tuner.kube.leader")

_TERM_POLL_SECONDS = 0.2  # how soon the term's end (stop, or deposed in a cycle) stops the loop


def claim(store: store_mod.PoolStore, epoch: int, *, identity: str,
          advance: Callable[[int], Leadership | None] | None, attempts: int = 8) -> int:
    """A leadership's first write: the ConfigMap's epoch becomes this leader's, so that older leaders' writes
    are refused from then on; the epoch it holds.

    Refused for a higher epoch, or for this one written by another leader (``Deposed``): while this agent
    still holds the Lease, the Lease was re-created (its leaseTransitions began again at 0), the epoch was
    edited, or another agent got the same epoch from another Lease and wrote first — ``advance`` (the
    elector's) raises this leader's epoch above the ConfigMap's and the claim is made again, at most
    ``attempts`` times. Where it does not hold the Lease, ``Deposed``. A key that does not read:
    ``PoolUnreadableError``."""
    advances = 0
    while True:
        store.refresh()
        try:
            store.update(lambda d: d, epoch=epoch, leader=identity)
            return epoch
        except store_mod.Deposed as exc:
            raised = advance(exc.current) if advance is not None and advances < attempts else None
            if raised is None:
                raise
            advances += 1
            epoch = raised.epoch


class Leader:
    def __init__(self, settings: config.TunerSettings, *, api: KubeApi, store: store_mod.PoolStore, identity: str,
                 rules: Sequence[Rule], client: engines.EngineClient,
                 metrics: selfmetrics.TunerMetrics | None = None, clock: Callable[[], float] = time.time,
                 loop_clock: clocks.LoopClock | None = None) -> None:
        assert settings.kubernetes is not None
        self.settings, self.k = settings, settings.kubernetes
        self.api, self.store, self.identity, self.rules, self.client = api, store, identity, tuple(rules), client
        self.metrics, self.clock = metrics, clock
        self.loop_clock = loop_clock  # the cycle's clock (runtime.clocks); ``clock`` is its ``now`` where given
        self.gatherer = collecting.Gatherer()
        self.maintenance = (scheduling.MaintenanceWindows(settings.daemon.maintenance_windows,
                                                          timezone=settings.daemon.maintenance_timezone)
                            if settings.daemon.maintenance_windows else None)
        self.state = TunerState(targets={}, args={}, config_args={})
        self.last: results.CycleResult | None = None  # the last cycle's result
        self.cycles = 0
        self.pool: acting.PoolActions | None = None  # this term's actions on the pods
        self.dispatcher: dispatching.Dispatcher | None = None  # this term's dispatcher (apply mode)
        self.collectors: dict[str, collecting.Collector] = {}  # by pod, rebuilt when its target changes
        self._tracked = False  # the pods run with --enable-server-load-tracking
        self._unreadable_said: tuple[str, ...] = ()  # the problems last said (once, until they change)
        # a pod a failed rollout left drained: /status, the metric, and after the bound a Warning Event on it
        self.left_drained = drained.LeftDrainedWatch(
            ask_after_seconds=settings.rollout.left_drained_ask_after_seconds, metrics=metrics,
            ask=lambda pod, message: self.api.create_event(pod=pod, pod_uid=None, reason="ReplicaLeftDrained",
                                                           message=message, type="Warning",
                                                           component="vllm-tuner-leader"))
        self._unreadable_keys: set[str] = set()

    # --- leading -------------------------------------------------------------------------------------

    def lead(self, leadership: Leadership, stop: threading.Event, *,
             advance: Callable[[int], Leadership | None] | None = None) -> None:
        """Cycles every ``scrape.interval_seconds`` until ``stop`` (set when the leadership ends). First the
        claim (``_claim``); ``advance`` is the elector's (a new epoch while this agent holds the Lease)."""
        for part in (self.state.targets, self.state.args, self.state.config_args):  # the same object: /status reads it
            part.clear()
        self.state.pending, self.state.rollout_state, self.state.booked_rollout = None, {}, None
        epoch = self._claim(leadership.epoch, stop, advance)
        if epoch is None:
            return
        journal = store_mod.ConfigMapJournal(self.store, epoch=epoch, leader=self.identity, metrics=self.metrics)
        self._build(journal, stop)
        log.info("leading the pool %s (epoch %d)", self.k.pool, epoch)
        try:
            self._lead(journal, stop)
        finally:  # the switches are the leader's to show: a follower's series say nothing is in force
            self.state.control = {}
            if self.metrics is not None:
                self.metrics.set_control(paused=False, pins=set())

    def _lead(self, journal: store_mod.ConfigMapJournal, stop: threading.Event) -> None:
        """The runtime's loop (``scheduling.Loop``, the daemon's): a cycle every ``scrape.interval_seconds``
        and, between cycles, the rollout in flight carried on every ``rollout.poll_seconds`` — until ``stop``
        or a write refused for a newer epoch (``Deposed``) ends the term."""
        ended = threading.Event()
        first = [True]

        def step() -> None:
            if stop.is_set() or ended.is_set():
                return
            try:
                self.cycle(journal, stop, recover=first[0])
                first[0] = False
                self._readable()
            except store_mod.Deposed as exc:
                log.warning("%s: no longer acting", exc)
                ended.set()
            except store_mod.PoolUnreadableError as exc:
                self._unreadable(exc)
            except Exception:  # a failing cycle is reported and the next one tries again
                log.exception("the leader's cycle failed")

        def between() -> None:
            if stop.is_set() or ended.is_set():
                return
            try:
                self._between()
            except store_mod.Deposed as exc:
                log.warning("%s: no longer acting", exc)
                ended.set()
            except store_mod.PoolUnreadableError as exc:
                self._unreadable(exc)

        loop = scheduling.Loop(step, interval_seconds=self.settings.scrape.interval_seconds, between=between,
                               between_seconds=self.settings.rollout.poll_seconds)
        loop.start()
        try:
            while not (stop.is_set() or ended.is_set()):
                stop.wait(_TERM_POLL_SECONDS)
        finally:
            loop.stop()

    def _claim(self, epoch: int, stop: threading.Event,
               advance: Callable[[int], Leadership | None] | None) -> int | None:
        """``claim``, then the pool's decision history loaded; the epoch this leadership holds. None when
        deposed (not leading). A key that does not read: said once, and tried again every interval while
        this agent leads — nothing is written until a human fixes it."""
        while not stop.is_set():
            try:
                epoch = claim(self.store, epoch, identity=self.identity, advance=advance)
                self._load_history()
                self._readable()
                return epoch
            except store_mod.PoolUnreadableError as exc:
                self._unreadable(exc)
                stop.wait(self.settings.scrape.interval_seconds)
            except store_mod.Deposed as exc:
                log.warning("%s: not leading", exc)
                stop.wait(self.settings.scrape.interval_seconds)
                return None
        return None

    def _unreadable(self, exc: store_mod.PoolUnreadableError) -> None:
        """A key of the pool's ConfigMap does not read: one line per problem when it begins (or changes),
        and ``tuner_pool_unreadable{key}`` 1 while it lasts."""
        lines = tuple(p.line(exc.configmap) for p in exc.problems)
        if lines != self._unreadable_said:
            for line in lines:
                log.error("%s", line)
            self._unreadable_said = lines
        keys = {p.key for p in exc.problems}
        if self.metrics is not None:
            for key in self._unreadable_keys - keys:
                self.metrics.pool_unreadable.labels(key=key).set(0)
            for key in keys:
                self.metrics.pool_unreadable.labels(key=key).set(1)
        self._unreadable_keys = keys

    def _readable(self) -> None:
        if not self._unreadable_said:
            return
        log.info("the pool's ConfigMap %s reads again: the leader acts on the pool", self.store.name)
        if self.metrics is not None:
            for key in self._unreadable_keys:
                self.metrics.pool_unreadable.labels(key=key).set(0)
        self._unreadable_said, self._unreadable_keys = (), set()

    def _between(self) -> None:
        """Between cycles: the rollout in flight goes on (``dispatching.carry_on``, the daemon's too)."""
        if self.dispatcher is None:
            return
        try:
            dispatching.carry_on(self.dispatcher, self.state, self.metrics,
                                 passing=(store_mod.Deposed, store_mod.PoolUnreadableError))
        except (store_mod.Deposed, store_mod.PoolUnreadableError):
            raise
        except Exception:  # the journal holds the rollout: the next cycle takes it up again
            log.exception("advancing the rollout failed")

    def cycle(self, journal: store_mod.ConfigMapJournal, stop: threading.Event, *, recover: bool = False) -> None:
        """One cycle: the pool's ConfigMap read once into typed documents, the pool's view (``poolview.view``),
        the runtime's cycle over the members, then one write with everything the cycle settled
        (``poolview.settle``: bad journal lines set aside, gone pods forgotten, the user's win, the
        verified arguments, the decision history)."""
        now = self.clock()
        listed = self.api.list_pods()
        data = self.store.refresh()
        decisions = control.take(self.settings.decisions, switches.read(self.store.annotations,
                                                                        configmap=self.store.name),
                                 state=self.state, metrics=self.metrics)
        found = documents.inspect(data)
        if found.problems:
            raise store_mod.PoolUnreadableError(self.store.name, found.problems)
        if recover:
            self.book_unbooked(journal)
        pool = poolview.view(found, listed, now=now)
        # The actuator knows every pod with an IP (one being deleted too: a rollout may still name it and
        # leaves it, machine Rule 4); the targets are the pods that run and report.
        replicas = {p.name: acting.replica_of(p, self.k) for p in listed if p.ip}
        targets = [config.Target(name=name, kind=self.k.engine_kind, metrics_url=replicas[name].base_url + "/metrics",
                                 base_url=replicas[name].base_url, args=list(argv))
                   for name, argv in pool.members.items()]
        self._track(targets, keep=pool.unfinished)
        if self.pool is not None:
            self.pool.replicas = dict(replicas)
        kind = self.k.engine_kind
        self._tracked = kind == "vllm" and all("--enable-server-load-tracking" in (t.args or ()) for t in targets)
        dispatcher = self.dispatcher if targets else None
        if dispatcher is not None:
            if not dispatcher.busy and journaling.unfinished(journal.records) is not None:
                recover = True  # a rollout stopped by a failed journal write: taken up from the journal
            if recover:
                outcome = dispatcher.recover()
                if outcome is not None:
                    self.state.rollout_state = dict(outcome.state)
                    self._track(targets)
        if not targets:
            log.info("cycle: no pod of the pool %s reports yet", self.k.pool)
            self.settle(journal, pool, history=False)  # no pod: the saved history stays as it is
            return
        settings = self.settings.model_copy(update={"targets": targets, "decisions": decisions})
        rolling = dispatcher if pool.hold is None or (dispatcher is not None and dispatcher.busy) else None
        result = cycle.run_cycle(self.state, settings=settings, collectors=self._collectors(targets),
            rules=self.rules, dispatcher=rolling, maintenance=self.maintenance, metrics=self.metrics,
            gatherer=self.gatherer, now=now, should_stop=stop.is_set, clock=self.loop_clock)
        if pool.hold is not None:
            log.info("no rollout: %s", pool.hold)
        self.last, self.cycles = result, self.cycles + 1
        if self.dispatcher is not None:
            self.state.left_drained = self.left_drained.check(journal.records, now=now)
        self.settle(journal, pool)

    def settle(self, journal: store_mod.ConfigMapJournal, pool: poolview.PoolView, *,
               history: bool = True) -> poolview.Settled | None:
        """The cycle's one write (``poolview.settle``), a compare-and-swap: what it changed, None when it
        changed nothing. ``history``: the decision history saved with it (not while no pod reports: the
        state then follows no pod, and the pool's history is kept for the pods to come)."""
        state = documents.state_text(self.state.histories(), self.state.booked_rollout) if history else None
        out: dict[str, poolview.Settled] = {}

        def change(data: dict[str, str]) -> dict[str, str] | None:
            out["settled"] = poolview.settle(data, pool, state=state, epoch=journal.epoch, budget=journal.budget)
            return out["settled"].data

        self.store.update(change, epoch=journal.epoch, leader=self.identity)
        settled = out.get("settled")
        if settled is None or settled.data is None:
            return None
        journal.compactions += settled.compactions
        journal.said_set_aside(settled.bad)
        for note in settled.notes:
            log.warning("%s", note)
        if settled.verified is not None:
            log.info("the pool's verified arguments: %s (rollout %s)", list(settled.verified.overrides) or "the base",
                     settled.verified.rollout)
        return settled

    def booking(self, rollout: machine.Rollout, records: Sequence[journaling.Record]) -> str | None:
        """The pool's ``state`` with ``rollout`` booked (``Dispatcher.booking``, the state left as it is),
        written with the journal record that finishes it (``ConfigMapJournal.booking``): a leader deposed
        or killed right after does not lose its cooldowns and rejected values. The term books it in memory
        just after, as the daemon does, and saves the same at the cycle's write."""
        if self.dispatcher is None:
            return None
        try:
            before = self.state.histories()
            seed = next((before[n] for n in sorted(before)), history_mod.History())
            before = {**dict.fromkeys(rollout.order, seed), **before}  # as ``book_unbooked`` tracks them
            _, booked, _ = self.dispatcher.booking(rollout, dispatching.changes_of(records, rollout.id),
                                                   histories=before)
            return documents.state_text({**before, **booked}, rollout.id)
        except Exception:  # never the reason a rollout's record is not written: booked in memory, saved later
            log.exception("booking %s with its last record failed", rollout.id)
            return None

    # --- pieces --------------------------------------------------------------------------------------

    def book_unbooked(self, journal: store_mod.ConfigMapJournal) -> results.RolloutOutcome | None:
        """The start of a term, the daemon's too (``dispatching.start_up``): the journal's last finished
        rollout, booked if the pool's saved history does not include it — a leader that finished it died
        or was deposed before its cycle saved the booking. Saved with the history (``booked_rollout``), so
        it is booked once, by whichever leader saves first. A replica it moved that the saved history does
        not know takes the pool's history, as a new pod does (``_track``)."""
        if self.dispatcher is None:
            return None
        finished = [r for r in journaling.replay(journal.records).values()
                    if machine.outcome(r) is not machine.Outcome.RUNNING]
        seed = next((self.state.targets[n].history for n in sorted(self.state.targets)), history_mod.History())
        for name in finished[-1].order if finished else ():
            self.state.targets.setdefault(name, stepping.TargetState(history=seed))
        outcome = self.dispatcher.book_unbooked()
        if outcome is not None:
            self.state.rollout_state = dict(outcome.state)
        return outcome

    def _collectors(self, targets: Sequence[config.Target]) -> list[collecting.Collector]:
        """One per pod, kept while its target stays the same (its slow reads are cached across cycles)."""
        out = []
        for t in targets:
            kept = self.collectors.get(t.name)
            if kept is None or kept.target != t:
                kept = collecting.collector_for(t, self.settings, client=self.client, live=self._plugin,
                                                stamp=self.clock)
            out.append(kept)
        self.collectors = {c.target.name: c for c in out}
        return out

    def _plugin(self, name: str) -> acting.RelayedPlugin:
        assert self.pool is not None  # built at the start of the term
        return acting.RelayedPlugin(self.pool, name)

    def _build(self, journal: store_mod.ConfigMapJournal, stop: threading.Event) -> None:
        """This term's pod actions and, in apply mode, its dispatcher (the pods are filled in per cycle)."""
        self.pool = acting.PoolActions(self.store, self.api, self.k, epoch=journal.epoch, leader=self.identity,
                                       replicas=[], stop=stop)
        self.collectors = {}  # their live channel goes through this term's pool actions
        if self.settings.mode != "apply":
            self.dispatcher = None
            journal.booking = None
            return
        r = self.settings.rollout
        self.dispatcher = dispatching.build(
            self.settings, self.state, self.client, actuator=acting.KubeActuator(self.pool),
            drainer=acting.KubeDrainer(self.pool), journal=journal, kind=self.k.engine_kind, stop_event=stop,
            server_load=lambda: self._tracked, drains=True,
            plugin=self._plugin if self.settings.live.enabled else lambda name: None,
            admission=acting.DisruptionCheck(self.api, self.k, allow_downtime=r.allow_downtime),
            departed=acting.departed(self.api), clock=self.clock)
        journal.booking = self.booking

    def _track(self, targets: Sequence[config.Target], keep: Sequence[str] = ()) -> None:
        """The state follows the pods: a new pod inherits the pool's history (cooldowns, rejected and bad
        arguments are the pool's: its replicas are interchangeable), a gone one is forgotten (unless an
        unfinished rollout still names it). Every target's args are what its launcher runs."""
        names = {t.name for t in targets}
        seed = next((self.state.targets[n].history for n in sorted(self.state.targets)), history_mod.History())
        for name in list(self.state.targets):
            if name not in names and name not in keep:
                del self.state.targets[name]
        for name in list(self.state.args):
            if name not in names and name not in keep:
                del self.state.args[name]
                self.state.config_args.pop(name, None)
        for t in targets:
            self.state.targets.setdefault(t.name, stepping.TargetState(history=seed))
            self.state.args[t.name] = knobs.EngineArgs.parse(t.args or [])
            self.state.config_args[t.name] = list(t.args or [])
        for name in keep:
            self.state.targets.setdefault(name, stepping.TargetState(history=seed))

    def _load_history(self) -> None:
        """The pool's decision history from the ConfigMap (``PoolUnreadableError`` where it does not read:
        never replaced by an empty one)."""
        found = documents.inspect(self.store.data)
        state = [p for p in found.problems if p.key == "state"]
        if state:
            raise store_mod.PoolUnreadableError(self.store.name, state)
        for name, history in found.histories.items():
            self.state.targets[name] = stepping.TargetState(history=history)
        self.state.booked_rollout = found.booked_rollout

