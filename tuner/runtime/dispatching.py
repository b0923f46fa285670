"""The one dispatcher both roots run (the daemon's ``vllm-tuner run`` and the Kubernetes leader): it takes a
cycle's actions and the pool's change, hands the change to the one rollout driver (a restart or a live
change), advances the rollout in flight at every cycle and between cycles, and books it once it finished.
With it, the start-up both roots run: a finished rollout not booked yet is booked, an unfinished one is
resumed (machine Rule 3), and the replicas are taken over. It decides nothing (``planning.stepping`` and
``planning.pooling`` do).

Owned state. In apply mode the tuner owns each engine's command line: ``targets[].args`` at first,
then what the last finished rollout left (``runtime.state``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from tuner import config
from tuner.actuators import base
from tuner.errors import StorageError, TunerError
from tuner.model import knobs
from tuner.planning import guards, pooling, verification
from tuner.planning import history as history_mod
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rules.schema import Verify
from tuner.runtime import (
    driving,
    engineside,
    results,
    selfmetrics,
    verifying,
    views,
)
from tuner.runtime.state import TunerState
from tuner.signals import Signal
from tuner.sources import engines, live_knobs

log = logging.getLogger("tuner.run")


class Dispatcher:
    """``cycle.Dispatcher``: takes a cycle's actions (keep-warm, sleep, wake, a GPU power cap)
    and hands the pool's change to the one rollout machine — a restart or a live change, the same
    driver, journal and recovery — then advances the rollout in flight a step at a time (at every cycle
    and between cycles: ``advance``) and books it once it finished. It decides nothing: the change
    carries what its rollout needs (``pooling.PoolChange``). ``build`` builds it, for the daemon and
    the Kubernetes leader alike."""

    def __init__(self, settings: config.TunerSettings, state: TunerState, driver: driving.RolloutDriver,
                 client: engines.EngineClient, journal: journaling.JournalLike, *, kind: knobs.EngineKind,
                 verifier: verifying.SignalVerifier | None = None, power: Any = None,
                 clock: Callable[[], float] | None = None, sleep: Callable[[float], Any] | None = None) -> None:
        self.settings, self.state, self.driver, self.client = settings, state, driver, client
        self.journal, self.verifier, self.power, self.kind = journal, verifier, power, kind
        self.clock = clock or time.time
        # waits return early when the tuner is stopping
        self.sleep = sleep or (lambda seconds: self.driver.stop_event.wait(seconds))
        self.in_flight: machine.Rollout | None = None  # the rollout being carried out
        self.held_down: dict[str, tuple[str, float | None]] = {}  # replicas down and held: the hold (said once)
        self._changes: tuple[history_mod.Change, ...] = ()  # ... and the changes it books

    @property
    def replicas(self) -> Mapping[str, base.Replica]:
        return self.driver.replicas

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    @property
    def verifying(self) -> tuple[history_mod.Change, ...]:
        """``cycle.Dispatcher.verifying``: the live rollout in flight's changes while it may be superseded."""
        return self._changes if self.in_flight is not None and machine.supersedable(self.in_flight) else ()

    def recover(self) -> results.RolloutOutcome | None:
        """Take up (machine Rule 3) the rollout a killed tuner left in the journal, judged by the checks
        and baselines journaled with its decision, and advance it; it is booked like any other once it
        finished. None if there was none."""
        unfinished = self.driver.recover()
        if unfinished is None:
            return None
        log.warning("resuming %s", machine.describe(unfinished))
        record = self._decision_of(unfinished.id)
        changes: list[history_mod.Change] = []
        if record is not None:
            changes = [_change_from(c) for c in record.get("changes", [])]
            if self.verifier is not None:
                self.verifier.expect(unfinished.id, baselines=record.get("baselines", {}),
                                     checks=[verification.Check.from_dict(c) for c in record.get("checks", [])])
        self.in_flight, self._changes = unfinished, tuple(changes)
        outcome = self._advance()
        log.warning("%s", outcome.summary)
        return outcome

    def book_unbooked(self) -> results.RolloutOutcome | None:
        """Book the journal's last finished rollout if the saved state does not include it yet: the tuner
        died between the rollout's last record and saving its booking. Once: the booking saves the
        rollout's id with it. A state that does not say what it booked (a first start, a state file
        from an older tuner) takes everything already in the journal as booked."""
        finished = [r for r in journaling.replay(self.journal.records).values()
                    if machine.outcome(r) is not machine.Outcome.RUNNING]
        last = finished[-1] if finished else None
        if self.state.booked_rollout is None:
            self.state.booked_rollout = last.id if last is not None else ""
            return None
        if last is None or last.id == self.state.booked_rollout:
            return None
        record = self._decision_of(last.id)
        changes = [_change_from(c) for c in record.get("changes", [])] if record is not None else []
        outcome = self.book(self.driver.restored(last), changes)
        log.warning("booked %s, which finished before the tuner stopped", outcome.summary)
        return outcome

    def _decision_of(self, rollout_id: str) -> journaling.Record | None:
        return decision_of(self.journal.records, rollout_id)

    def __call__(self, actions: Sequence[tuple[str, guards.Action]], change: pooling.PoolChange | None, *,
                 now: float, signals: Mapping[str, Mapping[str, Signal]],
                 should_stop: Callable[[], bool]) -> results.RolloutOutcome:
        replicas = self.replicas
        notes = [self._act(name, action, now=now) for name, action in actions if name in replicas]
        if (self.in_flight is not None and change is not None and not should_stop()
                and pooling.continues(change, self.verifying)):
            # machine Rule 6: the next live step the same way, or a breach rule's reversal; its verification
            # judges the newest value
            why = pooling.why_continues(change, self.verifying)
            superseded = self.driver.supersede(
                self.in_flight, f"superseded by {change.id} ({change.text()}): {why}; its verification judges "
                                "the newest value")
            self.in_flight = None
            notes.append(self.book(superseded, self._changes).summary)
        if self.in_flight is None and change is not None and not should_stop():
            self._begin(change, now=now, signals=signals)
        return self._advance(notes)

    def advance(self) -> results.RolloutOutcome | None:
        """Between cycles: the rollout in flight carried as far as it goes now (None when there is none)."""
        return self._advance() if self.in_flight is not None else None

    def _begin(self, change: pooling.PoolChange, *, now: float, signals: Mapping[str, Mapping[str, Signal]]) -> None:
        """Journal the decision and begin its rollout (the driver journals that, write-ahead)."""
        baselines = {name: verifying.values_of(signals.get(name, {})) for name in change.new_args}
        extra: dict[str, Any] = {"live": True, "values": change.values, "before": change.before} if change.live else {}
        self.journal.append("decision", at=now, rollout=change.id, target=change.leader,
                            changes=[change_record(c) for c in change.changes],
                            summary=change.plan.summary(), checks=[c.as_dict() for c in change.checks],
                            baselines={name: {k: v for k, v in values.items() if v is not None}
                                       for name, values in baselines.items()}, **extra)
        if self.verifier is not None:
            self.verifier.expect(change.id, checks=change.checks, baselines=baselines)
        if change.resets and self.driver.live is not None:  # the pre-step the change asks for
            seq = int(now * 1000) % (2 ** 31)
            for replica in self.replicas.values():
                why = self.driver.live.ask(replica, seq=seq, values=dict.fromkeys(change.resets))
                if why is not None:
                    log.warning("%s: the live %s not reset before the restart: %s", replica.name,
                                ", ".join(change.resets), why)
        values = {n: (change.before.get(n, {}), change.values) for n in change.new_args} if change.live else None
        limits = self.settings.rollout.limits(ack_timeout_seconds=self.settings.live.ack_timeout_seconds)
        if change.live:  # judged over the live path's own window (evidence proportional to cost)
            limits = dataclasses.replace(limits, verify_seconds=self.settings.live.verify_seconds)
        self.in_flight = self.driver.begin(change.id, {n: a.argv() for n, a in change.new_args.items()},
                                           limits=limits, live=values)
        self._changes = change.changes

    def _advance(self, notes: Sequence[str] = ()) -> results.RolloutOutcome:
        """The rollout in flight as far as it goes now; booked once it finished."""
        if self.in_flight is None:
            return results.RolloutOutcome(summary="; ".join(notes))
        try:
            rollout = self.driver.advance(self.in_flight)
        except BaseException:
            # The journal holds what was durable (a full disk stops the rollout on its last durable
            # state): the rollout is taken up from there (``resumed``), not from this memory.
            self.in_flight = None
            raise
        if machine.outcome(rollout) is machine.Outcome.RUNNING and not self.driver.stop_event.is_set():
            self.in_flight = rollout
            return results.RolloutOutcome(summary="; ".join([*notes, machine.describe(rollout)]),
                                          state=rollout_state(rollout))
        self.in_flight = None
        return self.book(rollout, self._changes, notes)

    def _act(self, name: str, action: guards.Action, *, now: float) -> str:
        """One action not tied to a restart: keep-warm, sleep, wake, a GPU power cap or restore."""
        url = self.replicas[name].base_url
        error: str | None
        if action.kind == "sleep":
            error = self.client.sleep(url, level=action.level or 1)
        elif action.kind == "wake":
            error = self.client.wake(url)
        elif action.kind in ("power-cap", "power-restore"):
            if self.power is None:
                error = "gpu_control is not enabled"
            else:
                error = "; ".join(self.power.apply(cap=action.kind == "power-cap", reason=action.reason).errors) \
                    or None
        else:
            error = self.client.warm(url, self.kind, requests=action.requests, max_tokens=action.max_tokens)
        if action.kind in ("sleep", "wake", "power-cap", "power-restore"):
            self.journal.append("decision", at=now, target=name, action=action.as_dict(), error=error)
        return f"{name}: {action.label()}" + (f" failed: {error}" if error else "")

    def booking(self, rollout: machine.Rollout, changes: Sequence[history_mod.Change], *,
                histories: Mapping[str, history_mod.History] | None = None) -> tuple[
            dict[str, pooling.ReplicaOutcome], dict[str, history_mod.History], dict[str, knobs.EngineArgs]]:
        """What booking a finished rollout makes of the state (``pooling.book``; ``histories``: the state's
        unless given), the state left as it is: each replica's outcome, and the histories and arguments it
        books."""
        result = machine.outcome(rollout)
        outcomes: dict[str, pooling.ReplicaOutcome] = {}
        for p in rollout.progress:
            tried = knobs.EngineArgs.parse(rollout.new_argv[p.name])
            if p.state is machine.State.DONE:
                outcomes[p.name] = pooling.ReplicaOutcome("ok", tried)
            elif p.state is machine.State.ROLLED_BACK or p.state in machine.FAILURES:
                outcomes[p.name] = pooling.ReplicaOutcome(
                    "rolled_back" if p.state is machine.State.ROLLED_BACK else "failed", tried,
                    reason=p.reason or rollout.aborted or "rolled back", bad_args=p.bad_args)
        histories, args = pooling.book(
            self.state.histories() if histories is None else histories, self.state.args, changes=changes, outcomes=outcomes,
            pool_new_args={n: knobs.EngineArgs.parse(a) for n, a in rollout.new_argv.items()},
            rolled_back=result is machine.Outcome.ROLLED_BACK, now=self.clock(),
            reject_seconds=self.settings.decisions.safety.reject_seconds)
        return outcomes, dict(histories), dict(args)

    def book(self, rollout: machine.Rollout, changes: Sequence[history_mod.Change],
             notes: Sequence[str] = ()) -> results.RolloutOutcome:
        """Record a finished rollout (``pooling.book``) and persist it. An interrupted one (the tuner is
        stopping) is left to the journal: the next start resumes it and books it then, once."""
        result = machine.outcome(rollout)
        if result is machine.Outcome.RUNNING:
            return results.RolloutOutcome(
                summary="; ".join([*notes, machine.describe(rollout) + " (interrupted: resumed at the next start)"]),
                state=rollout_state(rollout))
        outcomes, histories, args = self.booking(rollout, changes)
        self.state.booked_rollout = rollout.id  # saved with the booking, in one atomic write
        self.state.book(histories, args)
        return results.RolloutOutcome(summary="; ".join([*notes, machine.describe(rollout)]),
                                      results={n: o.result for n, o in outcomes.items()}, state=rollout_state(rollout))


def decision_of(records: Sequence[journaling.Record], rollout_id: str) -> journaling.Record | None:
    """The decision record that began rollout ``rollout_id`` (None: not in ``records``)."""
    return next((r for r in reversed(journaling.decisions(records)) if r.get("rollout") == rollout_id), None)


def changes_of(records: Sequence[journaling.Record], rollout_id: str) -> list[history_mod.Change]:
    """The changes rollout ``rollout_id`` books, from its decision record."""
    record = decision_of(records, rollout_id)
    return [_change_from(c) for c in record.get("changes", [])] if record is not None else []


def change_record(change: history_mod.Change) -> dict[str, Any]:
    """A change as a decision record holds it: everything its booking needs after a restart
    (``_change_from`` reads it back)."""
    return {**change.as_dict(), "knob": change.knob, "direction": change.direction, "adds_load": change.adds_load,
            "breach": change.breach}


def _change_from(data: Mapping[str, Any]) -> history_mod.Change:
    """A journaled decision's change, back as the value ``history_mod.applied`` books — every field: a
    live change taken up after a restart is booked as live (no restart), not as a rolling restart."""
    knob = str(data.get("knob", data["flag"]))
    return history_mod.Change(flag=str(data["flag"]), knob=knob,
                              from_value=knobs.parse_value(knob, str(data["from"])),
                              to_value=knobs.parse_value(knob, str(data["to"])),
                              rule=str(data.get("rule", "?")), reason=str(data.get("reason", "")),
                              direction=int(data.get("direction", 0)),
                              adds_load=bool(data.get("adds_load", False)),
                              experimental=bool(data.get("experimental", False)),
                              verify=tuple(Verify.model_validate(v) for v in data.get("verify", ())),
                              live=bool(data.get("live", False)), breach=bool(data.get("breach", False)))


def confirm_for(client: engines.EngineClient, actuator: base.Actuator, *, kind: knobs.EngineKind
                ) -> driving.Confirmer:
    """The new values are live: the running process has exactly these arguments, and where the engine
    reports a value itself (the served max_model_len) it agrees."""
    def confirm(replica: base.Replica, argv: Sequence[str]) -> str | None:
        status = actuator.status(replica.name)
        if status.argv is not None and tuple(status.argv) != tuple(argv):
            return f"the process runs {' '.join(status.argv)}"
        try:
            wanted = knobs.explicit(knobs.EngineArgs.parse(argv), "max_model_len", kind)
        except ValueError as exc:
            return f"--max-model-len: {exc}"
        if wanted is not None:
            served, why = client.served_max_model_len(replica.base_url, kind)
            if served is None:  # not a disagreement: the engine's self-report cannot be read
                return driving.Unreadable(f"the served max_model_len is unreadable: {why}")
            if served != wanted:
                return f"the engine serves max_model_len {served}, expected {wanted}"
        return None

    return confirm


def rollout_state(rollout: machine.Rollout) -> dict[str, Any]:
    """The rollout as /status shows it: id, kind (restart or live), outcome, each replica's state, and why
    where one failed."""
    return {"id": rollout.id, "kind": rollout.kind.value, "outcome": machine.outcome(rollout).value,
            "replicas": {p.name: p.state.value for p in rollout.progress},
            "reasons": {p.name: p.reason for p in rollout.progress if p.reason}}

def build(settings: config.TunerSettings, state: TunerState, client: engines.EngineClient, *,
               actuator: base.Actuator, drainer: base.Drainer, journal: journaling.JournalLike,
               kind: knobs.EngineKind, stop_event: threading.Event, server_load: bool | Callable[[], bool],
               drains: bool,
               plugin: Callable[[str], live_knobs.Channel | None],
               on_transition: Callable[[machine.Rollout], None] | None = None,
               restore: Callable[[machine.Rollout], machine.Rollout] | None = None,
               admission: Callable[[machine.Rollout, str], str | None] | None = None,
               departed: Callable[[Collection[str]], Collection[str]] | None = None,
               power: Any = None, clock: Callable[[], float] = time.time) -> Dispatcher:
    """The dispatcher over one actuator, drainer and journal — the daemon's (``vllm-tuner run``) and the
    Kubernetes leader's (``kube.leading``) are built here, the same way: one driver for restarts and
    live changes (``plugin``: where a replica's engine-side plugin is reached — its control directory, its
    pod's agent — None where the engine's own live API is the only way), the same verifier, confirmation and
    masked logs."""
    redactor = state.redactor
    verifier = verifying.SignalVerifier(client, kind=kind)
    r = settings.rollout
    driver = driving.RolloutDriver(
        actuator=actuator, drainer=drainer, prober=engineside.EngineProber(client, kind=kind, server_load=server_load),
        journal=journal, poll_seconds=r.poll_seconds, idle_settle_seconds=r.idle_settle_seconds,
        hold_timeout_seconds=r.hold_timeout_seconds, verifier=verifier,
        confirm=confirm_for(client, actuator, kind=kind),
        on_bad_args=lambda name, argv, why: log.warning("%s: arguments failed: %s (%s)", name,
                                                        " ".join(redactor.argv(argv)), why),
        on_transition=on_transition, stop_event=stop_event, drains=drains, restore=restore, admission=admission,
        departed=departed, clock=clock,
        live_control=engineside.EngineLive(client, kind=kind, plugin=plugin),
    )
    return Dispatcher(settings, state, driver, client, journal, kind=kind, verifier=verifier, power=power, clock=clock)

def resumed(dispatcher: Dispatcher, state: TunerState) -> bool:
    """The journal holds no unfinished rollout, or the one it holds was resumed now. A journal append
    that failed mid-rollout (a full or read-only disk) stopped the rollout at a safe step and left it
    unfinished in the journal: it is resumed (machine Rule 3) before anything else, at the first cycle
    whose journal takes records again. False while it cannot be: the cycle then starts no rollout."""
    if dispatcher.busy:
        return True  # the dispatcher holds it in flight
    records = dispatcher.journal.records
    last = next((i for i in range(len(records) - 1, -1, -1) if records[i]["kind"] == "rollout"), None)
    if last is None or journaling.unfinished(records[last:]) is None:
        return True
    try:
        outcome = dispatcher.recover()
    except journaling.JournalWriteError as exc:
        log.error("the unfinished rollout is not resumed yet: %s", exc)
        return False
    if outcome is not None:
        state.rollout_state = dict(outcome.state)
    return journaling.unfinished(dispatcher.journal.records) is None


def carry_on(dispatcher: Dispatcher, state: TunerState, metrics: selfmetrics.TunerMetrics | None, *,
             passing: tuple[type[BaseException], ...] = ()) -> results.RolloutOutcome | None:
    """Between cycles, in both roots: the rollout in flight carried as far as it goes now, shown on
    /status and counted once it finished (then said once, as a cycle would have). A condition it names
    itself (a full disk) is said in one line; the journal holds the rollout and the next cycle takes it up.
    ``passing``: what the root handles itself (the leader's loss of its term). None when nothing ran."""
    if not dispatcher.busy:
        return None
    try:
        outcome = dispatcher.advance()
    except passing:
        raise
    except TunerError as exc:
        log.error("rollout failed: %s", exc)
        return None
    if outcome is not None:
        state.rollout_state = dict(outcome.state)
        if metrics is not None:
            views.count_finished(metrics, outcome)
        if not dispatcher.busy:
            log.info(outcome.summary)
    return outcome


def _start_the_rest(dispatcher: Dispatcher, state: TunerState) -> None:
    """Before a rollout is resumed: every replica it does not hold in flight that is down (a host reboot
    took them all) is started now, on what it ran — the new arguments where the rollout is done, the old
    ones where it is pending or rolled back (or not part of it). Else they stayed down until the rollout
    ended, and Rule 2 held the next replica for want of serving ones until the hold timeout aborted it."""
    unfinished = journaling.unfinished(dispatcher.journal.records)
    if unfinished is None:
        return  # nothing to resume: the take-over below starts what is down
    unfinished = dispatcher.driver.restored(unfinished)
    actuator = dispatcher.driver.actuator
    for name in dispatcher.replicas:
        if name in unfinished.in_flight or actuator.status(name).state is base.State.RUNNING:
            continue
        argv: Sequence[str] = state.args[name].argv()
        where = "not part of it"
        if name in unfinished.order:
            p = unfinished.of(name)
            where = p.state.value
            argv = unfinished.argv_in_force(name)
        actuator.adopt(name, argv)
        log.warning("started %s (down at start; %s in the unfinished rollout %s): %s", name, where, unfinished.id,
                    " ".join(state.redactor.argv(argv)))


def tend(dispatcher: Dispatcher, state: TunerState, result: results.CycleResult, *, now: float) -> list[str]:
    """After a cycle: each replica whose scrape failed and that no rollout holds is asked of the actuator
    (the process actuator reaps an engine that exited: no zombie). One that is down is said, with how it
    ended, and started again on the arguments the tuner owns — the start-up's path (``adopt``) — within
    the restart budget (``decisions.safety``: each such start counts as a restart); beyond it, it stays
    down and the hold is said once. Returns what was said (one line per replica)."""
    in_flight = set(dispatcher.in_flight.in_flight) if dispatcher.in_flight is not None else set()
    actuator = dispatcher.driver.actuator
    said: list[str] = []
    for name, target in result.targets.items():
        if target.scrape_error is None or name in in_flight or name not in dispatcher.replicas:
            dispatcher.held_down.pop(name, None)
            continue
        status = actuator.status(name)
        if status.state is base.State.RUNNING:
            continue
        how = status.detail or status.state.value
        history = state.history(name)
        budget = guards.restart_budget(history, dispatcher.settings.decisions.safety, now=now)
        if not budget.allowed:
            line = f"{name} is down ({how}); not started again: {budget.reason}"
            # said once while it stands: keyed on the hold itself (the guard and when it lifts), not on its
            # reason, whose countdown ("…; next in 59m59s") changes every second (keyed on the reason, the hold
            # was said again each time two cycles straddled a second)
            held = (budget.guard, budget.until)
            if dispatcher.held_down.get(name) != held:
                log.warning("%s", line)
                said.append(line)
            dispatcher.held_down[name] = held
            continue
        dispatcher.held_down.pop(name, None)
        argv = state.args[name].argv()
        line = f"{name} is down ({how}); starting it again: {' '.join(state.redactor.argv(argv))} ({budget.reason})"
        log.warning("%s", line)
        said.append(line)
        try:
            actuator.adopt(name, argv)
        except TunerError as exc:
            log.error("%s: starting it again failed: %s", name, exc)
        state.set_history(name, history_mod.restarted(history, now=now))
        with contextlib.suppress(StorageError):
            state.save()
    return said


def start_up(dispatcher: Dispatcher, state: TunerState) -> None:
    """A tuner killed mid-rollout takes that rollout up before anything else (it goes on between cycles
    and at every cycle, and no other change goes out until it is booked). This runs inside the first
    cycle, so systemd has READY=1 and watchdog pings meanwhile, and /healthz and /status answer (/status
    shows the resumed rollout's progress). A rollout that finished but was not booked (killed in
    between) is booked first. Then every replica the rollout does not carry is taken over: what was
    never started is started, what runs is learnt."""
    booked = dispatcher.book_unbooked()
    _start_the_rest(dispatcher, state)
    for outcome in (booked, dispatcher.recover()):
        if outcome is not None:
            state.rollout_state = dict(outcome.state)
    actuator = dispatcher.driver.actuator
    names = list(dispatcher.replicas)
    in_flight = dispatcher.in_flight.in_flight if dispatcher.in_flight is not None else ()
    for i, name in enumerate(names):
        if name in in_flight:
            continue  # the resumed rollout carries it (its path starts and confirms it)
        before = actuator.status(name)
        after = actuator.adopt(name, state.args[name].argv())
        shown = " ".join(state.redactor.argv(state.args[name].argv()))
        if before.state is not base.State.RUNNING and after.state is base.State.RUNNING:
            log.info("started %s: %s", name, shown)
            if dispatcher.settings.rollout.start_one_at_a_time and i + 1 < len(names):
                _wait_started(dispatcher, name)
        if after.state is base.State.RUNNING and after.argv is None:
            log.warning("%s: %s", name, after.detail)
        elif after.argv is not None and tuple(after.argv) != tuple(state.args[name].argv()):
            log.warning("%s runs %s, not the arguments the tuner owns (%s); a rollout rolls back to what runs",
                        name, " ".join(state.redactor.argv(after.argv)), shown)
    state.save()


def _wait_started(dispatcher: Dispatcher, name: str) -> None:
    """Until the engine the tuner just started answers /health, exits, or start_timeout_seconds pass (or
    the tuner is stopping); the next engine starts after it."""
    rollout = dispatcher.settings.rollout
    deadline = dispatcher.clock() + rollout.start_timeout_seconds
    replica, actuator = dispatcher.replicas[name], dispatcher.driver.actuator
    while not dispatcher.driver.stop_event.is_set():
        if dispatcher.driver.prober.is_healthy(replica):
            log.info("%s is healthy; starting the next engine", name)
            return
        if actuator.status(name).state is not base.State.RUNNING:
            log.warning("%s exited while starting; starting the next engine", name)
            return
        if dispatcher.clock() >= deadline:
            log.warning("%s not healthy after %.0f s; starting the next engine", name, rollout.start_timeout_seconds)
            return
        dispatcher.sleep(rollout.poll_seconds)
