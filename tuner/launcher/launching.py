"""The launcher's loop: PID 1 of the engine container.

It starts the engine (the base command line plus desired.json's overrides) in its own process group,
reaps every zombie, answers the kubelet's probes, relaunches the engine in place when desired.json asks
for another command line, and forwards the kubelet's SIGTERM. One thread (the loop) decides; the probe
server, the health poller (``health``) and the log pump only read or report.

States (``status.json`` ``state``) and what moves them: the table in ``states`` (a pure
``step(pod, observation, now)``); this module observes, calls it, and carries out its effects.

Readiness (``/readyz``) is true only in serving, with this engine's ``/health`` good (it goes away after
``unready_after`` failed answers in a row and comes back after ``ready_after`` good ones: the table's
hysteresis), no drain, and the running command line equal to the one desired.json asks for. Liveness
(``/livez``) is true while the loop turns (also through a planned relaunch), and false when it stalls for
``wedge_seconds``, when the engine's processes survive SIGKILL that long, or when a serving engine's
``/health`` has failed without a break for ``liveness_engine_seconds`` (``states.liveness``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..portable import argv as argvs
from ..portable import pod_protocol as protocol
from ..portable import secrets
from . import probes, processes, states
from .health import HealthPoller, derive_health_url


@dataclass(frozen=True)
class Settings:
    state_dir: Path
    probe_host: str = "127.0.0.1"
    """Where /livez, /readyz and /status listen. The kubelet probes the pod IP, so the manifests say
    0.0.0.0 (every address, IPv6 too where the host has it: ``probes.ProbeServer``); the launcher's own
    default keeps them on loopback."""
    probe_port: int = 8081
    health_url: str | None = None
    """The engine's health endpoint; None: http://127.0.0.1:<--port, default 8000>/health of the running
    command line (its --host when that is a specific address)."""
    start_timeout_seconds: float = 1200.0
    stop_timeout_seconds: float = 60.0
    """SIGTERM → SIGKILL. Keep it above the engine's --shutdown-timeout and, with the preStop sleep, below
    the pod's terminationGracePeriodSeconds."""
    kill_timeout_seconds: float = 15.0
    force_after_seconds: float | None = 10.0
    """A planned relaunch (never the kubelet's SIGTERM): SIGINT to the engine's leader this long after its
    SIGTERM. vLLM's HTTP server otherwise waits for every attached connection (a router's or the tuner's
    idle keep-alive ones) until its --shutdown-timeout before it stops the engine; the agent drained the
    replica and waited for it to be idle first (the process actuator's ``rollout.force_after_seconds``).
    None: SIGTERM, then SIGKILL at ``stop_timeout_seconds``."""
    poll_seconds: float = 0.5
    """How often desired.json is read, and the engine's /health while it starts."""
    health_period_seconds: float = 2.0
    """How often the engine's /health is read once it serves (vLLM logs every request it answers)."""
    wedge_seconds: float = 30.0
    status_every_seconds: float = 5.0
    desired_wait_seconds: float = 30.0
    """No desired.json at start: wait this long for the agent to write it, then start the base command line
    (an agent that failed, or none at all, never keeps the engine from starting)."""
    unready_after: int = 3
    """Readiness goes away after this many failed /health answers in a row (one slow answer is not an outage)."""
    ready_after: int = 2
    """... and comes back after this many good ones."""
    liveness_engine_seconds: float | None = 60.0
    """/livez fails when a serving engine's /health has failed without a break this long (a wedged engine
    that still runs); never while it starts or through a planned relaunch. None: liveness is the loop's only."""


def log(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"vllm-tuner-launcher: {message}\n")
        sys.stderr.flush()


@dataclass
class Engine:
    serial: int
    argv: list[str]
    generation: int | None
    overrides: list[tuple[str, argvs.Value]]
    candidate: bool
    pid: int
    log: processes.LogTail
    health_url: str
    spawned_at: float  # monotonic
    spawned_wall: float
    healthy_at: float | None = None
    exit_code: int | None = None


class Launcher:
    def __init__(self, settings: Settings, base_argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        if not base_argv:
            raise ValueError("no engine command line after --")
        self.settings = settings
        self.base = list(base_argv)
        self.base_sha256 = argvs.sha256(self.base)
        self.env = dict(os.environ if env is None else env)
        self.state_dir = Path(settings.state_dir)
        self.desired_path = self.state_dir / protocol.DESIRED
        self.status_path = self.state_dir / protocol.STATUS
        self.health = HealthPoller(settings.poll_seconds)
        self.limits = states.Limits(settings.start_timeout_seconds, settings.stop_timeout_seconds,
                                    settings.kill_timeout_seconds, settings.force_after_seconds,
                                    desired_wait_seconds=settings.desired_wait_seconds,
                                    unready_after=settings.unready_after, ready_after=settings.ready_after,
                                    liveness_engine_seconds=settings.liveness_engine_seconds)
        self.pod = states.waiting(time.monotonic())
        self.state = states.WAITING
        self.state_since = time.time()
        self.started_at = time.time()
        self.engine: Engine | None = None
        self.desired: protocol.Desired | None = None
        self.desired_error: str | None = None
        self.overrides_dropped: str | None = None
        self.overrides_refused: str | None = None
        self.allowed: protocol.Allowed | None = None  # the first allow-list found, kept for good
        self.allowed_error: str | None = None
        self.observed_generation: int | None = None
        self.planned_restarts = 0
        self.reaped_orphans = 0
        self.last_exit: dict[str, Any] | None = None
        self.candidate_failure: dict[str, Any] | None = None
        self.last_relaunch: dict[str, Any] | None = None
        self.exit_code: int | None = None
        self.heartbeat = time.monotonic()
        self.readiness: probes.Answer = (False, "starting")
        self._relaunch: dict[str, Any] | None = None
        self._serial = 0
        self._started_once = False
        self._unlive: str | None = None  # why /livez fails for the engine's sake (logged once per run)
        self._fresh_request = False
        self._term = False
        self._desired_stat: tuple[int, int, int] | None = None
        self._next_desired_poll = 0.0
        self._status_doc: dict[str, Any] = {}
        self._status_written: tuple[Any, ...] | None = None
        self._status_written_at = 0.0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.server: probes.ProbeServer | None = None

    @property
    def stop(self) -> states.Stop | None:
        return self.pod.stop

    # -- probes (called from the server's threads) ------------------------------------------------
    def live(self) -> probes.Answer:
        now = time.monotonic()
        age = now - self.heartbeat
        if age > self.settings.wedge_seconds:
            return False, f"the launcher's loop has not turned for {age:.0f}s"
        pod = self.pod
        stop = pod.stop
        if stop is not None and stop.killed and stop.survivors and now > stop.kill_deadline + self.settings.wedge_seconds:
            return False, f"engine processes survived SIGKILL: {list(stop.survivors)}"
        wedged = states.liveness(pod, now, self.limits)
        if wedged is not None:
            return False, wedged
        return True, f"alive ({self.state})"

    def ready(self) -> probes.Answer:
        return self.readiness

    def public_status(self) -> dict[str, Any]:
        doc = dict(self._status_doc)
        doc.pop("log_tail", None)
        if isinstance(doc.get("candidate_failure"), dict):
            doc["candidate_failure"] = {k: v for k, v in doc["candidate_failure"].items() if k != "log_tail"}
        if isinstance(doc.get("last_exit"), dict):
            doc["last_exit"] = {k: v for k, v in doc["last_exit"].items() if k != "log_tail"}
        doc["live"] = self.live()[0]
        return doc

    # -- the loop ---------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self._term = True

    def install_signals(self) -> None:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)

    def listen(self) -> None:
        """Bind the probe server (OSError when the address is taken)."""
        self.server = probes.ProbeServer(self.settings.probe_host, self.settings.probe_port, live=self.live,
                                         ready=self.ready, status=self.public_status)

    def run(self) -> int:
        """Until the engine is gone for good; returns the exit code."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.server is None:
            self.listen()
        assert self.server is not None
        self.server.start()
        if not processes.become_subreaper():
            log("warning: not PID 1 and cannot become a child subreaper: orphans of the engine are not reaped here")
        log(f"probes on {self.server.where} (/livez /readyz /status); "
            f"state in {self.state_dir}; base sha256 {self.base_sha256[:12]}")
        self.health.start()
        try:
            self._load_allowed()
            self._poll_desired(force=True)
            self.tick()  # desired.json there (or no wait): the engine starts now
            while self.exit_code is None:
                self._wait(0.2)
                self.tick()
            # The group is gone when none of it is alive; a member that died since the last tick is still our
            # zombie (re-parented to us): reap it, or it outlives us as a zombie of whoever inherits it.
            self.reaped_orphans += len(processes.reap())
            self._set_state("exited")
            self._write_status(force=True)
            return self.exit_code
        finally:
            self.health.stop()
            if self.engine is not None:  # only after a crash of the loop itself: leave nothing behind
                with contextlib.suppress(OSError):
                    processes.signal_all(self.engine.pid, signal.SIGKILL)
            if self.server is not None:
                self.server.stop()

    def _wait(self, seconds: float) -> None:
        with contextlib.suppress(InterruptedError, OSError):
            select.select([self._wake_r], [], [], seconds)
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 512):
                pass

    def tick(self) -> None:
        now = time.monotonic()
        self.heartbeat = now
        for pid, code in processes.reap():
            if self.engine is not None and pid == self.engine.pid and self.engine.exit_code is None:
                self.engine.exit_code = code
                log(f"engine pid {pid} exited with code {code}")
            else:
                self.reaped_orphans += 1
        self._poll_desired()
        e = self.engine
        ending = e is not None and (self.pod.stop is not None or self._term or e.exit_code is not None)
        obs = states.Observation(
            exit_code=e.exit_code if e is not None else None, health=self.health.take(e.serial) if e else (),
            left=tuple(processes.remaining(e.pid)) if e is not None and ending else (),
            other_argv=e is not None and self.wanted()[0] != e.argv, fresh_request=self._fresh_request,
            drained=self.drained(), term=self._term, generation=self.observed_generation,
            desired_seen=self.desired is not None or self._desired_stat is not None)
        self.pod, effects = states.step(self.pod, obs, now, self.limits)
        self._set_state(self.pod.state)
        self._carry_out(effects, now)
        self.readiness = self._readiness(now)
        unlive = states.liveness(self.pod, now, self.limits)
        if unlive is not None and self._unlive is None:
            log(f"liveness fails: {unlive}; the kubelet restarts the container")
        self._unlive = unlive
        self._write_status()

    # -- desired.json -------------------------------------------------------------------------------
    def _poll_desired(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_desired_poll:
            return
        self._next_desired_poll = now + self.settings.poll_seconds
        try:
            st = os.stat(self.desired_path)
            key: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_ino, st.st_size)
        except FileNotFoundError:
            key = None
        except OSError as exc:
            self.desired_error = f"cannot stat {self.desired_path}: {exc.strerror}"
            return
        if key == self._desired_stat and not force:
            return
        self._desired_stat = key
        try:
            desired = protocol.read_desired(self.desired_path)
        except protocol.ProtocolError as exc:
            self.desired_error = str(exc)
            log(f"ignoring desired.json: {exc}")
            return
        if desired is None:
            return
        if self.observed_generation is not None and desired.generation <= self.observed_generation:
            self.desired_error = (f"desired.json generation {desired.generation} is not greater than "
                                  f"{self.observed_generation}: ignored")
            return
        refused = self._refusal(desired)
        if refused is not None:  # the generation is taken (its drain too); the engine keeps what it runs
            previous = self.desired
            self.overrides_refused = (f"desired.json generation {desired.generation}: {refused}; the engine keeps "
                                      "the arguments it has")
            log(f"refusing the overrides: {self.overrides_refused}")
            desired = dataclasses.replace(desired, overrides=previous.overrides if previous else (),
                                          base_sha256=previous.base_sha256 if previous else None)
        else:
            self.overrides_refused = None
        self.desired, self.observed_generation, self.desired_error = desired, desired.generation, None
        self._fresh_request = True
        log(f"desired generation {desired.generation}: {len(desired.overrides)} override(s), drain={desired.drain}")

    def _load_allowed(self) -> None:
        """The allow-list, read at start and, while there is none, again before overrides are judged; the
        first one found is kept for good (a later file never widens it)."""
        if self.allowed is not None:
            return
        try:
            self.allowed = protocol.read_allowed(self.state_dir)
            self.allowed_error = None
        except protocol.ProtocolError as exc:
            self.allowed_error = str(exc)
        if self.allowed is not None:
            log(f"allowed overrides: {self.allowed.describe()}")

    def _refusal(self, desired: protocol.Desired) -> str | None:
        """Why ``desired``'s overrides may not pass the allow-list (None: they may, or there are none)."""
        if not desired.overrides:
            return None
        self._load_allowed()
        if self.allowed is None:
            return (f"no allow-list ({self.allowed_error or f'{protocol.ALLOWED} is missing'}): no override may "
                    "pass (the agent writes it from its rules before the engine starts)")
        return self.allowed.refusal(desired.overrides)

    def wanted(self) -> tuple[list[str], list[tuple[str, argvs.Value]]]:
        """The command line desired.json asks for, and the overrides in it."""
        d = self.desired
        self.overrides_dropped = None
        if d is None or not d.overrides:
            return list(self.base), []
        if d.base_sha256 != self.base_sha256:
            self.overrides_dropped = (
                f"desired.json generation {d.generation} was computed for base {str(d.base_sha256)[:12]}, "
                f"this pod's base is {self.base_sha256[:12]} (the Deployment's command changed: the user wins)")
            return list(self.base), []
        return argvs.apply(self.base, d.overrides), list(d.overrides)

    def drained(self) -> bool:
        return bool(self.desired and self.desired.drain)

    # -- transitions --------------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if state != self.state:
            log(f"state {self.state} → {state}")
            self.state, self.state_since = state, time.time()

    def _start(self) -> None:
        self._fresh_request = False
        argv, overrides = self.wanted()
        candidate = self._started_once or bool(overrides)
        self._started_once = True
        self._serial += 1
        url = self.settings.health_url or derive_health_url(argv)
        env = self.env
        control = self.state_dir / protocol.CONTROL_DIR
        if protocol.ENV_CONTROL_DIR not in env and control.is_dir():  # the agent's live knobs (plugin/README.md)
            env = {**env, protocol.ENV_CONTROL_DIR: str(control)}
        try:
            spawned = processes.spawn(argv, env)
        except OSError as exc:
            reason = f"cannot run {argv[0]!r}: {exc.strerror or exc}"
            log(reason)
            self.engine = None
            if not candidate:
                self.last_exit = {"code": 127, "at": time.time(), "planned": False, "reason": reason}
            self.pod, effects = states.spawn_failed(self.pod, candidate=candidate, reason=reason, code=127)
            self._set_state(self.pod.state)
            self._carry_out(effects, time.monotonic())
            return
        now = time.monotonic()
        self.engine = Engine(self._serial, argv, self.observed_generation, overrides, candidate, spawned.pid,
                             spawned.log, url, now, time.time())
        self.health.watch(self._serial, url, period=self.settings.poll_seconds)
        log(f"engine pid {spawned.pid} started{' (candidate)' if candidate else ''}: {secrets.DEFAULT.argv(argv)}")
        self.pod = states.spawned(self.pod, now=now, candidate=candidate)
        self._set_state(self.pod.state)

    def _carry_out(self, effects: Sequence[states.Effect], now: float) -> None:
        """The effects of one step, in order (``states.Do``)."""
        e = self.engine
        for fx in effects:
            do = fx.do
            if do is states.Do.STOPPING:
                log(f"stopping the engine: {fx.reason}")
                self.health.watch(0, None)
            elif do is states.Do.TERM_LEADER and e is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e.pid, signal.SIGTERM)
            elif do is states.Do.TERM_GROUP and e is not None:
                if fx.reason:
                    log(f"{fx.reason}; SIGTERM to what is left of its group: {processes.remaining(e.pid)}")
                processes.signal_all(e.pid, signal.SIGTERM)
            elif do is states.Do.INT_LEADER and e is not None:
                log(f"SIGINT to the engine {self.settings.force_after_seconds:g}s after its SIGTERM (a planned "
                    "relaunch: stop waiting for attached connections)")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e.pid, signal.SIGINT)
            elif do is states.Do.KILL_GROUP and e is not None:
                log(f"SIGKILL after {self.settings.stop_timeout_seconds:g}s: {processes.remaining(e.pid)}")
                processes.signal_all(e.pid, signal.SIGKILL)
            elif do in (states.Do.UNREADY, states.Do.READY_AGAIN) and e is not None:
                log(f"engine pid {e.pid}: readiness {'lost' if do is states.Do.UNREADY else 'back'}: {fx.reason}")
            elif do is states.Do.HEALTHY and e is not None:
                e.healthy_at = now
                self.health.period = self.settings.health_period_seconds
                log(f"engine pid {e.pid} healthy after {now - e.spawned_at:.1f}s")
                if self._relaunch is not None:
                    self._relaunch.update(start_seconds=round(now - e.spawned_at, 3),
                                          total_seconds=round(now - self._relaunch.pop("t0"), 3), result="healthy")
                    self.last_relaunch, self._relaunch = self._relaunch, None
            elif do is states.Do.TAKEN:
                self._fresh_request = False
            elif do is states.Do.RELAUNCH:
                self.planned_restarts += 1
                self._relaunch = {"generation": self.observed_generation, "requested_at": time.time(),
                                  "t0": now, "result": "stopping"}
            elif do is states.Do.UNPLANNED_EXIT and e is not None:
                self.last_exit = {"code": fx.code, "at": time.time(), "planned": False,
                                  "log_tail": self._scrub(e.log.lines())}
            elif do is states.Do.STOPPED and fx.stop is not None:
                self._stopped(e, fx.stop, now)
            elif do is states.Do.START:
                if fx.reason and not self._started_once:
                    log(f"first start: {fx.reason}")
                self._start()
            elif do is states.Do.CANDIDATE_FAILED:
                tail = self._scrub(e.log.lines()) if e is not None else []
                self._candidate_failed(fx.reason, code=fx.code, tail=tail)
            elif do is states.Do.EXIT:
                if e is not None:
                    tail = self._scrub(e.log.lines())
                    if self.last_exit is None or self.last_exit.get("code") != fx.code:
                        self.last_exit = {"code": fx.code, "at": time.time(), "planned": self._term,
                                          "reason": fx.reason, "log_tail": tail}
                    self.engine = None
                self.exit_code = fx.code if fx.code is not None else 0

    def _stopped(self, e: Engine | None, stop: states.Stop, now: float) -> None:
        seconds = round(now - stop.started, 3)
        if e is not None:
            log(f"engine stopped in {seconds:.1f}s{' (SIGKILL)' if stop.killed else ''}: no process of it is left")
        if self._relaunch is not None and stop.then == "start":
            self._relaunch.update(stop_seconds=seconds, killed=stop.killed, forced=stop.forced, result="starting")

    def _candidate_failed(self, reason: str, *, code: int | None, tail: list[str]) -> None:
        e = self.engine
        self.candidate_failure = {"generation": e.generation if e else self.observed_generation,
                                  "argv": secrets.DEFAULT.argv(e.argv) if e else None, "reason": reason,
                                  "exit_code": code, "at": time.time(), "log_tail": tail}
        if self._relaunch is not None:
            self._relaunch.update(result="failed", reason=reason)
            self._relaunch.pop("t0", None)
            self.last_relaunch, self._relaunch = self._relaunch, None
        self.engine = None
        log(f"candidate failed: {reason}; waiting for the next desired.json generation")

    # -- readiness and status -----------------------------------------------------------------------
    def _readiness(self, now: float) -> probes.Answer:
        e, pod = self.engine, self.pod
        if self.state not in ("serving", "draining") or e is None:
            return False, f"not serving ({self.state})"
        if self.drained():
            return False, "drained (desired.json drain: true)"
        if self.wanted()[0] != e.argv:
            return False, "the running command line is not the desired one yet"
        last = self.health.last(e.serial)
        detail = last[2] if last is not None else "no answer"
        if not pod.healthy:
            return False, f"engine {detail} ({pod.fail_streak} failed, {pod.ok_streak} good /health answers in a row)"
        # the poller itself stuck: each answer takes at most its timeout, so answers come at least this often
        max_age = 4 * max(self.settings.poll_seconds, self.settings.health_period_seconds) + 5.0
        if pod.answered_at is not None and now - pod.answered_at > max_age:
            return False, f"the engine's last /health answer is {now - pod.answered_at:.0f}s old"
        return True, "ready"

    def status(self) -> dict[str, Any]:
        e = self.engine
        wanted_argv, wanted_overrides = self.wanted()
        return {
            "v": protocol.VERSION,
            "state": self.state,
            "ready": self.readiness[0],
            "ready_reason": self.readiness[1],
            "launcher_pid": os.getpid(),
            "pid": e.pid if e is not None else None,
            "generation": self.observed_generation,
            "running_generation": e.generation if e is not None else None,
            "drain": self.drained(),
            "argv": secrets.DEFAULT.argv(e.argv) if e is not None else None,
            "overrides": [[f, v] for f, v in (e.overrides if e is not None else [])],
            "desired_argv": secrets.DEFAULT.argv(wanted_argv),
            "desired_overrides": [[f, v] for f, v in wanted_overrides],
            "base_argv": secrets.DEFAULT.argv(self.base),
            "base_sha256": self.base_sha256,
            "overrides_dropped": self.overrides_dropped,
            "overrides_refused": self.overrides_refused,
            "allowed_flags": self.allowed.describe() if self.allowed is not None else None,
            "desired_error": self.desired_error,
            "candidate": e.candidate if e is not None else None,
            "planned_restarts": self.planned_restarts,
            "last_relaunch": {k: v for k, v in self.last_relaunch.items() if k != "t0"} if self.last_relaunch else None,
            "last_exit": self.last_exit,
            "exit_code": self.exit_code,
            "candidate_failure": self.candidate_failure,
            "stopping": {"reason": self.stop.reason, "killed": self.stop.killed,
                         "survivors": list(self.stop.survivors)} if self.stop is not None else None,
            "health": {"ok_streak": self.pod.ok_streak, "fail_streak": self.pod.fail_streak,
                       "failing_seconds": round(time.monotonic() - self.pod.failing_since, 1)
                       if self.pod.failing_since is not None else None},
            "reaped_orphans": self.reaped_orphans,
            "engine_started_at": e.spawned_wall if e is not None else None,
            "started_at": self.started_at,
            "state_since": self.state_since,
            "updated_at": time.time(),
            "log_tail": self._scrub(e.log.lines()) if e is not None else [],
        }

    def _scrub(self, lines: list[str]) -> list[str]:
        """Log lines without the values of secret flags (an --api-key the engine may print)."""
        redactor = secrets.DEFAULT.learn(argvs=[self.base, self.engine.argv if self.engine else []])
        return [redactor.text(line) for line in lines]

    def _write_status(self, *, force: bool = False) -> None:
        doc = self.status()
        self._status_doc = doc
        key = tuple(str(v) for k, v in doc.items() if k not in ("updated_at", "log_tail"))
        now = time.monotonic()
        if not force and key == self._status_written and now - self._status_written_at < self.settings.status_every_seconds:
            return
        try:
            protocol.write_json(self.status_path, doc)
        except OSError as exc:
            log(f"cannot write {self.status_path}: {exc.strerror}")
            return
        self._status_written, self._status_written_at = key, now
