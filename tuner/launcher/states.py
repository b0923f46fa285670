"""The launcher's pod states as a table-driven machine: a pure ``step(pod, observation, now)``, no I/O, no
clock, stdlib only (the launcher runs under the engine image's Python). ``launching.Launcher`` observes
the engine (exit code, ``/health``, the processes left of its group, desired.json, the kubelet's SIGTERM),
calls ``step`` and carries out the effects it returns, in order.

==================  =========================================================================================
waiting             no desired.json yet: the agent may still be writing it; it appears → start, or after
                    ``desired_wait_seconds`` the base command line starts anyway (the engine never waits for
                    an agent that is not there)
starting            engine spawned, waiting for ``GET /health`` 200 (``start_timeout_seconds``) → serving |
                    draining; exit or timeout → candidate-failed (a *candidate*: any start but a first start
                    without overrides) or the launcher exits with the engine's code (that first start)
serving, draining   engine healthy; draining = desired.json ``drain: true`` (readiness false, engine kept);
                    leader exits → stopping the rest, then the launcher exits with the leader's code
                    (unplanned: ordinary Kubernetes restarts apply); desired command line differs → stopping
stopping            SIGTERM to the engine's leader (then to what is left of its group once it exited), wait
                    until *every* process of the group (and every descendant) is gone, SIGKILL to all at
                    ``stop_timeout_seconds``; then start the desired command line
candidate-failed    nothing runs; readiness false, liveness OK; the next desired.json generation starts again
terminating         the kubelet's SIGTERM: the same stop, then exit with the engine's exit code
==================  =========================================================================================

The engine's ``/health`` answers come in as observations too, every one of them (``health``), and the
table keeps their runs:

- **readiness** (``Pod.healthy``) goes away only after ``unready_after`` failed answers in a row and comes
  back after ``ready_after`` good ones (hysteresis: one slow answer of a loaded engine is not an outage);
- **liveness** (``liveness``) fails when a serving (or drained) engine's ``/health`` has failed without a
  break for ``liveness_engine_seconds``: a wedged engine that still runs gets its container restarted.
  Never while it starts (``start_timeout_seconds`` judges that), stops, or after a failed candidate.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

WAITING, STARTING, SERVING, DRAINING = "waiting", "starting", "serving", "draining"
STOPPING, CANDIDATE_FAILED, TERMINATING = "stopping", "candidate-failed", "terminating"
RUNNING = (STARTING, SERVING, DRAINING)  # an engine runs (or starts) and no stop is under way


@dataclass(frozen=True)
class Limits:
    start_timeout_seconds: float
    stop_timeout_seconds: float
    kill_timeout_seconds: float
    force_after_seconds: float | None  # a planned relaunch: SIGINT this long after the SIGTERM
    desired_wait_seconds: float = 0.0  # waiting: how long desired.json may take to appear
    unready_after: int = 3  # failed /health answers in a row that take readiness away
    ready_after: int = 2  # good answers in a row that give it back
    liveness_engine_seconds: float | None = None  # a serving engine's /health failing this long: not live


@dataclass(frozen=True)
class Stop:
    """A stop under way, and what follows it."""

    then: str  # "start" | "failed" | "exit"
    reason: str
    started: float
    deadline: float  # SIGKILL after this
    code: int | None = None  # for "exit": the code to exit with (None: the engine's)
    killed: bool = False
    forced: bool = False  # SIGINT sent after the SIGTERM (a planned relaunch)
    stragglers_signalled: bool = False  # SIGTERM to what is left of the group once the leader exited
    kill_deadline: float = 0.0
    survivors: tuple[int, ...] = ()  # processes still there after SIGKILL plus kill_timeout_seconds


@dataclass(frozen=True)
class Pod:
    state: str = STARTING
    engine: bool = False  # an engine was spawned and is not yet known to be gone
    spawned_at: float | None = None
    candidate: bool = False
    stop: Stop | None = None
    terminating: bool = False  # the kubelet's SIGTERM was taken in
    waiting_since: float | None = None  # waiting: since when
    healthy: bool = False  # readiness's view of the engine's /health (with hysteresis)
    ok_streak: int = 0  # good /health answers in a row (this engine)
    fail_streak: int = 0  # failed ones in a row
    failing_since: float | None = None  # the first failed answer of the current run of failures
    answered_at: float | None = None  # the last answer, good or not


@dataclass(frozen=True)
class Observation:
    """What the launcher sees at one tick."""

    exit_code: int | None = None  # the engine's leader exited with this (None: it runs, or no engine)
    health: tuple[bool, ...] = ()  # the engine's /health answers since the last tick, oldest first (200: True)
    left: tuple[int, ...] = ()  # processes of the engine's group still alive
    other_argv: bool = False  # desired.json asks for another command line than the running one
    fresh_request: bool = False  # a desired.json generation not acted on yet
    drained: bool = False  # desired.json says drain: true
    term: bool = False  # the kubelet's SIGTERM came
    generation: int | None = None  # desired.json's generation (for the reasons)
    desired_seen: bool = False  # desired.json is there (readable or not): the agent has spoken


class Do(enum.Enum):
    """What the launcher carries out for a step."""

    TERM_LEADER = "sigterm-leader"  # SIGTERM to the engine's leader only
    TERM_GROUP = "sigterm-group"  # SIGTERM to every process of the engine's group
    INT_LEADER = "sigint-leader"  # a planned relaunch: stop waiting for attached connections
    KILL_GROUP = "sigkill-group"
    STOPPING = "stopping"  # a stop begins (``reason``): the health poller stops watching
    STOPPED = "stopped"  # no process of the engine is left
    START = "start"  # spawn the desired command line (then ``spawned`` or ``spawn_failed``)
    HEALTHY = "healthy"  # the engine answered /health the first time
    UNREADY = "unready"  # readiness lost: ``unready_after`` failed /health answers in a row (``reason``)
    READY_AGAIN = "ready-again"  # readiness back: ``ready_after`` good answers in a row (``reason``)
    TAKEN = "taken"  # the fresh desired.json request is acted on
    RELAUNCH = "relaunch"  # a planned relaunch begins
    UNPLANNED_EXIT = "unplanned-exit"  # the serving engine exited on its own (``code``)
    CANDIDATE_FAILED = "candidate-failed"  # (``reason``, ``code``)
    EXIT = "exit"  # the launcher exits with ``code``


@dataclass(frozen=True)
class Effect:
    do: Do
    reason: str = ""
    code: int | None = None
    stop: Stop | None = None  # STOPPED: the stop that ended (how long, whether SIGKILL was needed)


def step(pod: Pod, obs: Observation, now: float, limits: Limits) -> tuple[Pod, tuple[Effect, ...]]:
    """One tick of the table above: the pod after it and what to carry out, in order."""
    effects: list[Effect] = []
    if obs.term and not pod.terminating:
        pod = _terminate(pod, obs, now, limits, effects)
    if pod.engine and pod.stop is None and pod.state in RUNNING:
        pod = _answers(pod, obs.health, now, limits, effects)
    if pod.stop is not None:
        pod = _stopping(pod, obs, now, limits, effects)
    elif pod.state == WAITING:
        pod = _waiting(pod, obs, now, limits, effects)
    elif pod.state == STARTING and pod.engine:
        pod = _starting(pod, obs, now, limits, effects)
    elif pod.state in (SERVING, DRAINING):
        pod = _serving(pod, obs, now, limits, effects)
    elif pod.state == CANDIDATE_FAILED and obs.fresh_request:
        effects.append(Effect(Do.START))
    return pod, tuple(effects)


def waiting(now: float) -> Pod:
    """The launcher's first state: no engine yet, desired.json awaited."""
    return Pod(state=WAITING, waiting_since=now)


def spawned(pod: Pod, *, now: float, candidate: bool) -> Pod:
    """The engine runs (not yet healthy); the /health record starts afresh."""
    return dataclasses.replace(pod, state=STARTING, engine=True, spawned_at=now, candidate=candidate,
                               waiting_since=None, healthy=False, ok_streak=0, fail_streak=0, failing_since=None,
                               answered_at=None)


def liveness(pod: Pod, now: float, limits: Limits) -> str | None:
    """Why the engine's container should be restarted (None: it should not): a serving or drained engine
    whose /health has failed without a break for ``liveness_engine_seconds``. Start-up, a stop and a failed
    candidate never count (their own deadlines judge them)."""
    if limits.liveness_engine_seconds is None or pod.state not in (SERVING, DRAINING) or pod.stop is not None:
        return None
    if pod.failing_since is None or now - pod.failing_since < limits.liveness_engine_seconds:
        return None
    return (f"the engine's /health has failed for {now - pod.failing_since:.0f}s without a break "
            f"({pod.fail_streak} answers): a wedged engine")


def spawn_failed(pod: Pod, *, candidate: bool, reason: str, code: int) -> tuple[Pod, tuple[Effect, ...]]:
    """The command could not be run at all: a candidate fails, a first start ends the launcher."""
    pod = dataclasses.replace(pod, engine=False, spawned_at=None)
    if candidate:
        return dataclasses.replace(pod, state=CANDIDATE_FAILED), (Effect(Do.CANDIDATE_FAILED, reason, code),)
    return pod, (Effect(Do.EXIT, reason, code),)


def _begin_stop(pod: Pod, then: str, reason: str, now: float, limits: Limits, obs: Observation,
                effects: list[Effect], *, code: int | None = None) -> Pod:
    stop = Stop(then, reason, now, now + limits.stop_timeout_seconds, code=code)
    effects.append(Effect(Do.STOPPING, reason))
    if pod.engine:
        if obs.exit_code is None:
            effects.append(Effect(Do.TERM_LEADER))
        else:  # the leader is gone already: what is left of its group
            effects.append(Effect(Do.TERM_GROUP))
            stop = dataclasses.replace(stop, stragglers_signalled=True)
    return dataclasses.replace(pod, stop=stop, state=TERMINATING if pod.terminating else STOPPING)


def _terminate(pod: Pod, obs: Observation, now: float, limits: Limits, effects: list[Effect]) -> Pod:
    pod = dataclasses.replace(pod, terminating=True)
    if pod.stop is not None:  # exit with what the engine exits with
        return dataclasses.replace(pod, state=TERMINATING, stop=dataclasses.replace(pod.stop, then="exit", code=None))
    if pod.engine and pod.state in RUNNING:
        return _begin_stop(pod, "exit", "the kubelet's SIGTERM", now, limits, obs, effects)
    effects.append(Effect(Do.EXIT, "the kubelet's SIGTERM", 0))
    return dataclasses.replace(pod, state=TERMINATING)


def _answers(pod: Pod, health: tuple[bool, ...], now: float, limits: Limits, effects: list[Effect]) -> Pod:
    """The engine's /health answers, one at a time: their runs, and readiness with hysteresis once it
    served (while it starts, the first good answer makes it serving: ``_starting``)."""
    for ok in health:
        if ok:
            pod = dataclasses.replace(pod, ok_streak=pod.ok_streak + 1, fail_streak=0, failing_since=None,
                                      answered_at=now)
        else:
            pod = dataclasses.replace(pod, ok_streak=0, fail_streak=pod.fail_streak + 1, answered_at=now,
                                      failing_since=pod.failing_since if pod.failing_since is not None else now)
        if pod.state == STARTING:
            continue
        if pod.healthy and pod.fail_streak >= limits.unready_after:
            pod = dataclasses.replace(pod, healthy=False)
            effects.append(Effect(Do.UNREADY, f"{pod.fail_streak} failed /health answers in a row"))
        elif not pod.healthy and pod.ok_streak >= limits.ready_after:
            pod = dataclasses.replace(pod, healthy=True)
            effects.append(Effect(Do.READY_AGAIN, f"{pod.ok_streak} good /health answers in a row"))
    return pod


def _waiting(pod: Pod, obs: Observation, now: float, limits: Limits, effects: list[Effect]) -> Pod:
    if obs.desired_seen:
        effects.append(Effect(Do.START, "desired.json is there"))
    elif now >= (pod.waiting_since or 0.0) + limits.desired_wait_seconds:
        effects.append(Effect(Do.START, f"no desired.json after {limits.desired_wait_seconds:g}s: the engine "
                                        "starts on its own command line"))
    return pod


def _starting(pod: Pod, obs: Observation, now: float, limits: Limits, effects: list[Effect]) -> Pod:
    then = "failed" if pod.candidate else "exit"
    if obs.exit_code is not None:
        reason = f"the engine exited with code {obs.exit_code} before it was healthy"
        return _begin_stop(pod, then, reason, now, limits, obs, effects, code=obs.exit_code)
    if pod.ok_streak:
        effects.append(Effect(Do.HEALTHY))
        return dataclasses.replace(pod, state=DRAINING if obs.drained else SERVING, healthy=True)
    assert pod.spawned_at is not None
    if now > pod.spawned_at + limits.start_timeout_seconds:
        reason = f"the engine was not healthy after {limits.start_timeout_seconds:g}s"
        return _begin_stop(pod, then, reason, now, limits, obs, effects, code=1)
    if obs.fresh_request and obs.other_argv:
        effects.append(Effect(Do.TAKEN))
        reason = f"desired generation {obs.generation} asks for another command line"
        return _begin_stop(pod, "start", reason, now, limits, obs, effects)
    return pod


def _serving(pod: Pod, obs: Observation, now: float, limits: Limits, effects: list[Effect]) -> Pod:
    if obs.exit_code is not None:
        effects.append(Effect(Do.UNPLANNED_EXIT, code=obs.exit_code))
        reason = f"the engine exited unplanned with code {obs.exit_code}"
        return _begin_stop(pod, "exit", reason, now, limits, obs, effects, code=obs.exit_code)
    effects.append(Effect(Do.TAKEN))
    if obs.other_argv:
        effects.append(Effect(Do.RELAUNCH))
        return _begin_stop(pod, "start", f"relaunch for desired generation {obs.generation}", now, limits, obs,
                           effects)
    return dataclasses.replace(pod, state=DRAINING if obs.drained else SERVING)


def _stopping(pod: Pod, obs: Observation, now: float, limits: Limits, effects: list[Effect]) -> Pod:
    stop = pod.stop
    assert stop is not None
    if pod.engine and (obs.left or obs.exit_code is None):
        if obs.left and obs.exit_code is not None and not stop.stragglers_signalled:
            effects.append(Effect(Do.TERM_GROUP, "the engine's leader exited"))
            stop = dataclasses.replace(stop, stragglers_signalled=True)
        force = limits.force_after_seconds
        if (force is not None and stop.then == "start" and not pod.terminating and not stop.forced
                and obs.exit_code is None and now > stop.started + force):
            effects.append(Effect(Do.INT_LEADER))
            stop = dataclasses.replace(stop, forced=True)
        if not stop.killed and now > stop.deadline:
            effects.append(Effect(Do.KILL_GROUP))
            stop = dataclasses.replace(stop, killed=True, kill_deadline=now + limits.kill_timeout_seconds)
        elif stop.killed and now > stop.kill_deadline:
            stop = dataclasses.replace(stop, survivors=tuple(obs.left))
        return dataclasses.replace(pod, stop=stop)
    effects.append(Effect(Do.STOPPED, stop.reason, stop=stop))
    had_engine = pod.engine
    pod = dataclasses.replace(pod, stop=None)
    if stop.then == "start" and not pod.terminating:
        effects.append(Effect(Do.START))
        return pod
    if stop.then == "failed" and not pod.terminating:
        effects.append(Effect(Do.CANDIDATE_FAILED, stop.reason, obs.exit_code if had_engine else None))
        return dataclasses.replace(pod, state=CANDIDATE_FAILED, engine=False, spawned_at=None)
    code = stop.code if stop.code is not None else (obs.exit_code if had_engine else 0)
    effects.append(Effect(Do.EXIT, stop.reason, code if code is not None else 0))
    return dataclasses.replace(pod, engine=False)
