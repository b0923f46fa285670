"""The rollout machine's vocabulary and transition tables (``rollout.machine`` walks them; its docstring
holds the rules). Pure data: no I/O, no clock."""

from __future__ import annotations

import enum
from collections.abc import Mapping

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

BEFORE_STOP = (_S.DRAINING, _S.WAITING_IDLE)  # the engine still runs the old arguments
FORWARD: Mapping[tuple[State, Event], State] = {
    **{(s, e): t for s, e, t in _MAIN_PATH},
    **{(s, e): _S.ROLLING_BACK for s in _STEPS_ON_PATH for e in (_E.FAILED, _E.CRASHED)},
    **{(s, _E.INTERRUPTED): t for s, t in _RESUME_AT.items()},
    **{(s, _E.FOUND_DOWN): _S.STOPPING for s in _STEPS_ON_PATH},
    **{(s, _E.FAILED_BEFORE_STOP): _S.UNDRAINING for s in BEFORE_STOP},  # onto the back leg: undrain only
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

STEP_OF: Mapping[State, Step] = {
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
IN_FLIGHT: frozenset[State] = frozenset(STEP_OF)
TERMINAL: frozenset[State] = frozenset({_S.DONE, _S.ROLLED_BACK, _S.FAILED, _S.FAILED_SERVING, _S.LEFT})
FAILURES: frozenset[State] = frozenset({_S.FAILED, _S.FAILED_SERVING})  # the rollout's outcome is FAILED
LEFT_DRAINED: frozenset[State] = frozenset({_S.FAILED})  # out of the pool when the rollout ends
# Once started, the replica runs the new arguments: a crash there on the forward leg means the engine
# cannot run them, and the caller remembers the set as bad (a start past its deadline is only rejected).
NEW_ARGS_LIVE = frozenset({_S.WAITING_HEALTHY, _S.CONFIRMING_ARGS, _S.WARMING, _S.UNDRAINING, _S.VERIFYING})


# Where a tuner that stops mid-rollout may put a drained replica back in the pool: its engine runs
# arguments that may serve — the old ones before the stop, or this leg's once confirmed. Elsewhere the
# engine is down, starting, unconfirmed, or (back leg, before its restart) runs the arguments being
# rolled back. The next start resumes the rollout (Rule 3) and drains again where the path needs it.
MAY_SERVE: Mapping[Leg, frozenset[State]] = {
    Leg.FORWARD: frozenset({_S.DRAINING, _S.WAITING_IDLE, _S.WARMING, _S.UNDRAINING, _S.VERIFYING}),
    Leg.BACK: frozenset({_S.WARMING, _S.UNDRAINING, _S.RELEASING}),
}
