"""The ``process`` actuator: the tuner starts and supervises N local engine processes itself.

Each replica runs ``command + argv`` (never through a shell) as the leader of its own session and
process group, with stdout and stderr appended to ``<log_dir>/<name>.log``. A pid file
(``<state_dir>/<name>.json``: pid, kernel start time, argv) lets a restarted tuner re-adopt engines
that outlived it, so a tuner killed mid-rollout still knows what each replica runs; the start time
guards against a recycled pid.

Secrets: the pid file and the log's header line hold the argv with every secret masked
(``model.secrets``: ``--api-key ***``) and the sha256 of the real one. A re-adopted engine's real
arguments are read back from ``/proc/<pid>/cmdline`` and accepted only if they hash to the recorded
value; otherwise they are unknown (``argv`` None: rollouts of that replica are refused, the detail
says why) — never guessed.

Stopping follows systemd's ``KillMode=mixed``: SIGTERM to the leader alone (vLLM's API server then
shuts its engine-core children down itself, draining for ``--shutdown-timeout``), SIGKILL to the whole
group after the deadline — with clients still connected vLLM never exits on its own — and to any
straggler the leader left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.actuators import base, files
from tuner.errors import PermanentActuatorError, TemporaryActuatorError
from tuner.model import secrets
from tuner.portable import untrusted

PIDFILE_MAX_BYTES = 1024 * 1024
PID_MAX = 1 << 22  # the kernel's largest pid_max


def _starttime(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait is missing
        return None
    return int(fields[19])


def still_running(record: Mapping[str, Any]) -> bool:
    """Whether the engine a pid file's record names (``read_pidfile``) still runs: its pid, with the kernel
    start time recorded (not a recycled pid), and not a zombie."""
    pid = record.get("pid")
    return isinstance(pid, int) and pid > 0 and _starttime(pid) == record.get("starttime")


def _cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return tuple(a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")[:-1])


def read_pidfile(path: Path) -> dict[str, Any] | None:
    """A pid file's record (pid, starttime, argv, …); None if there is none. An unreadable one is a
    ``PermanentActuatorError``: the engine it describes may still run."""
    try:
        data = untrusted.mapping(untrusted.read_json(path, max_bytes=PIDFILE_MAX_BYTES), what="the pid file")
        if data.get("pid") is None and isinstance(data.get("marker"), str):
            pass  # written before the spawn: the engine is found by its marker (``ProcessActuator._adopt``)
        else:
            untrusted.integer(data["pid"], what="pid", lo=1, hi=PID_MAX)  # never 0 or negative: a process group
        if not isinstance(data["argv"], list) or not all(isinstance(a, str) for a in data["argv"]):
            raise TypeError("argv is not a list of strings")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PermanentActuatorError(
            f"process actuator: unreadable pid file {path} ({exc}); remove it once no engine it names is running"
        ) from exc
    return data


MARKER_ENV = "VLLM_TUNER_ENGINE_MARKER"  # in each engine's environment: which start of which replica it is


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in untrusted.read_bytes(f"/proc/{pid}/environ", max_bytes=PIDFILE_MAX_BYTES).split(b"\0")
    except (OSError, untrusted.Untrusted):
        return False


def _find_marked(marker: str) -> int | None:
    """The session leader whose environment holds ``MARKER_ENV=marker``: an engine spawned by a tuner
    killed before it wrote the engine's pid (procfs; processes of this uid only)."""
    entry = f"{MARKER_ENV}={marker}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        pid = int(d.name)
        with contextlib.suppress(OSError):
            if os.getsid(pid) == pid and _environ_has(pid, entry) and _starttime(pid) is not None:
                return pid
    return None


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


@dataclass
class _Proc:
    pid: int
    starttime: int | None  # /proc/<pid>/stat field 22, in clock ticks since boot
    argv: tuple[str, ...] | None  # None: a re-adopted engine whose real arguments could not be read back
    popen: subprocess.Popen[bytes] | None = None  # None: adopted from an earlier tuner
    stopping: bool = False
    unknown: str = ""  # why argv is None


def _open_log(path: Path) -> Any:
    """The engine's log for appending, opened without blocking (a FIFO at its path must not hold the tuner:
    with no reader the open fails, with one it is refused) and only if it is a regular file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        raise PermanentActuatorError(f"process actuator: cannot open the engine log {path}: "
                                     f"{exc.strerror or exc}; expected a regular file or none") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermanentActuatorError(f"process actuator: the engine log {path} is not a regular file "
                                         "(FIFOs, devices and directories are refused)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


class ProcessActuator:
    def __init__(
        self,
        replicas: Sequence[base.Replica],
        *,
        command: Sequence[str],
        state_dir: str | os.PathLike[str],
        log_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        poll_seconds: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        redactor: secrets.Redactor = secrets.DEFAULT,
    ) -> None:
        if not command:
            raise PermanentActuatorError("process actuator: `command` is empty; e.g. [\"vllm\", \"serve\"]")
        self._replicas = tuple(replicas)
        self.command = tuple(command)
        self.state_dir = Path(state_dir)
        self.log_dir = Path(log_dir) if log_dir is not None else self.state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._env = None if env is None else {**os.environ, **env}
        self._cwd = cwd
        self._poll = poll_seconds
        self._clock = clock
        self._redactor = redactor
        self._procs: dict[str, _Proc | None] = {}
        self._last: dict[str, base.ReplicaStatus] = {}  # how each replica's last process ended
        self._locks = {r.name: threading.RLock() for r in self._replicas}
        for r in self._replicas:
            self._procs[r.name] = self._adopt(r.name)

    # --- bookkeeping -------------------------------------------------------------------------------

    def _env_for(self, name: str) -> dict[str, str] | None:
        """The engine's environment; ``{name}`` in a value is the replica's name (a per-replica directory)."""
        if self._env is None:
            return None
        return {k: v.replace("{name}", name) for k, v in self._env.items()}

    def _pidfile(self, name: str) -> Path:
        return self.state_dir / f"{name}.json"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _adopt(self, name: str) -> _Proc | None:
        data = read_pidfile(self._pidfile(name))
        if data is None:
            return None
        if data.get("pid") is None:  # the tuner died between its write-ahead record and the spawn's
            found = _find_marked(str(data["marker"]))
            if found is None:  # never spawned, or gone since: nothing to adopt
                with contextlib.suppress(FileNotFoundError):
                    self._pidfile(name).unlink()
                return None
            data = {**data, "pid": found, "starttime": _starttime(found)}
        pid, starttime = int(str(data["pid"])), data.get("starttime")
        recorded = tuple(str(a) for a in data["argv"])
        digest = data.get("argv_sha256")
        if digest is None:  # written before argv were stored masked: the real ones, in clear
            proc = _Proc(pid, starttime, recorded)
            if _starttime(pid) == starttime and self._redactor.argv(recorded) != list(recorded):
                self._write_pidfile(name, proc)  # no longer in clear
            return proc
        live: tuple[str, ...] | None = None
        for attempt in range(3):  # a process caught mid-exec or mid-exit shows no command line for a moment
            if _starttime(pid) != starttime:
                return _Proc(pid, starttime, recorded)  # gone: status() reports how it ended
            live = _cmdline(pid)
            real = live[len(live) - len(recorded):] if live and len(live) >= len(recorded) else None
            if real is not None and secrets.digest_matches(real, digest):
                return _Proc(pid, starttime, real)
            if attempt < 2:
                time.sleep(0.05)
        why = "is unreadable" if not live else "does not match the one its pid file recorded (sha256)"
        return _Proc(pid, starttime, None, unknown=(
            f"pid {pid}'s command line (/proc/{pid}/cmdline) {why}: its arguments are unknown and rollouts of "
            f"{name} are refused; restart it (or stop it and remove {self._pidfile(name)}) to let the tuner own it"))

    def _write_pidfile(self, name: str, proc: _Proc, *, marker: str | None = None) -> None:
        """pid, start time, the argv masked and the real one's sha256 (``model.secrets``), and the marker
        in the engine's environment. ``proc.pid`` 0: the write-ahead record before the spawn (no pid yet)."""
        argv = proc.argv or ()
        record = {"pid": proc.pid or None, "starttime": proc.starttime, "argv": self._redactor.argv(argv),
                  "argv_sha256": secrets.digest(argv), "command": self._redactor.argv(self.command),
                  "marker": marker}
        files.write_atomically(self._pidfile(name), json.dumps(record).encode(), mode=0o600)

    def _check(self, name: str) -> None:
        if name not in self._locks:
            known = ", ".join(self._locks)
            raise PermanentActuatorError(f"process actuator: no replica named {name!r} (known: {known})")

    def _exit_of(self, proc: _Proc) -> str | None:
        """None while it runs; otherwise how it ended."""
        if proc.popen is not None:
            rc = proc.popen.poll()
            return None if rc is None else _describe_exit(rc)
        with contextlib.suppress(ChildProcessError):  # our own child from an earlier instance: reap it
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                return _describe_exit(os.waitstatus_to_exitcode(status))
        if _starttime(proc.pid) == proc.starttime:
            return None
        return "exited while unsupervised (status unknown)"

    def _forget(self, name: str, last: base.ReplicaStatus) -> None:
        self._procs[name] = None
        self._last[name] = last
        with contextlib.suppress(FileNotFoundError):
            self._pidfile(name).unlink()

    def _last_log_line(self, name: str) -> str:
        try:
            tail = untrusted.read_tail(self.log_path(name), max_bytes=4096)
        except (OSError, untrusted.Untrusted):
            return ""
        lines = [x for x in tail.decode("utf-8", "replace").splitlines() if x.strip()]
        return self._redactor.text(lines[-1].strip())[:300] if lines else ""

    # --- the contract ------------------------------------------------------------------------------

    def replicas(self) -> Sequence[base.Replica]:
        return self._replicas

    def status(self, name: str) -> base.ReplicaStatus:
        self._check(name)
        with self._locks[name]:
            proc = self._procs[name]
            if proc is None:
                return self._last.get(name) or base.ReplicaStatus(name, base.State.STOPPED)
            ended = self._exit_of(proc)
            if ended is None:
                return base.ReplicaStatus(name, base.State.RUNNING, proc.pid, proc.argv, proc.unknown)
            line = self._last_log_line(name)
            detail = f"{ended}; last log line: {line}" if line else ended
            state = base.State.STOPPED if ended == "exited with status 0" else base.State.FAILED
            last = base.ReplicaStatus(name, state, None, proc.argv, detail)
            self._forget(name, last)
            return last

    def adopt(self, name: str, argv: Sequence[str]) -> base.ReplicaStatus:
        """The tuner is the supervisor: an engine not running (no live process behind its pid file) is
        started with ``argv``; a running one was re-adopted from its pid file with its own argv."""
        self._check(name)
        with self._locks[name]:
            if self.status(name).state is not base.State.RUNNING:
                self.start(name, argv)
            return self.status(name)

    def start(self, name: str, argv: Sequence[str]) -> None:
        self._check(name)
        argv = tuple(argv)
        if any("\0" in a for a in argv):
            raise PermanentActuatorError(f"process actuator: {name}: an argument contains a NUL byte")
        with self._locks[name]:
            if base.is_running_already(self.status(name), argv, who=f"process actuator: {name}"):
                return
            log = _open_log(self.log_path(name))
            # Write-ahead: the pid file names the engine's marker before the engine exists, so a tuner
            # killed between the spawn and the pid's write is not left with an engine it cannot find (its
            # own session outlives the tuner): the next tuner adopts it by the marker (``_adopt``).
            marker = f"{name}-{uuid.uuid4().hex}"
            env = {**(self._env_for(name) or os.environ), MARKER_ENV: marker}
            try:
                self._write_pidfile(name, _Proc(0, None, argv), marker=marker)
                shown = self._redactor.argv([*self.command, *argv])
                log.write(f"=== vllm-tuner: starting {name}: {json.dumps(shown)}\n".encode())
                log.flush()
                popen = subprocess.Popen(
                    [*self.command, *argv],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True, env=env, cwd=self._cwd,
                )
            except OSError as exc:
                with contextlib.suppress(FileNotFoundError):  # the write-ahead record of a start that never was
                    self._pidfile(name).unlink()
                raise PermanentActuatorError(
                    f"process actuator: cannot run {self.command[0]!r} for {name}: {exc.strerror or exc}"
                ) from exc
            finally:
                log.close()
            proc = _Proc(popen.pid, _starttime(popen.pid), argv, popen)
            self._procs[name] = proc
            self._write_pidfile(name, proc, marker=marker)

    def stop(self, name: str, *, timeout_seconds: float, force_after_seconds: float | None = None) -> base.ReplicaStatus:
        self._check(name)
        with self._locks[name]:
            proc = self._procs[name]
            if proc is None or self._exit_of(proc) is not None:
                if proc is not None and proc.popen is not None:
                    self._killpg(proc.pid)  # our child's group: its pgid cannot have been recycled yet
                stopped = base.ReplicaStatus(name, base.State.STOPPED, detail="was not running")
                self._forget(name, stopped)
                return stopped
            proc.stopping = True
            began = self._clock()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            forced = False
            if force_after_seconds is not None and force_after_seconds < timeout_seconds:
                ended = self._wait(proc, force_after_seconds)
                if ended is None:  # uvicorn waits for attached clients: a SIGINT now ends that wait
                    forced = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGINT)
                    ended = self._wait(proc, timeout_seconds - force_after_seconds)
            else:
                ended = self._wait(proc, timeout_seconds)
            took = self._clock() - began
            if ended is None:
                self._killpg(proc.pid)
                ended = self._wait(proc, 10.0)
                if ended is None:
                    raise TemporaryActuatorError(
                        f"process actuator: {name} (pid {proc.pid}) survived SIGKILL for 10 s", delay=10
                    )
                detail = f"killed with SIGKILL after {took:.1f}s (SIGTERM ignored)"
            elif forced:
                detail = f"stopped after {took:.1f}s: SIGTERM, then SIGINT after {force_after_seconds:g}s ({ended})"
            else:
                detail = f"stopped on SIGTERM after {took:.1f}s ({ended})"
            self._killpg(proc.pid)  # stragglers: engine-core children the leader left behind
            stopped = base.ReplicaStatus(name, base.State.STOPPED, None, None, detail)
            self._forget(name, stopped)
            return stopped

    def _wait(self, proc: _Proc, timeout_seconds: float) -> str | None:
        deadline = self._clock() + timeout_seconds
        while True:
            ended = self._exit_of(proc)
            if ended is not None or self._clock() >= deadline:
                return ended
            time.sleep(min(self._poll, max(0.0, deadline - self._clock())))

    @staticmethod
    def _killpg(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
