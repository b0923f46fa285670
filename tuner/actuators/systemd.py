"""The ``systemd`` actuator: each engine replica is an instance of ``vllm@.service``.

The tuner writes a replica's engine arguments to ``<env_dir>/<instance>.env`` (atomically: temp
file, fsync, rename) as one variable, ``VLLM_ARGS``, which the unit expands unquoted in ``ExecStart=``
(``deploy/systemd/vllm@.service``)::

    EnvironmentFile=/var/lib/vllm-tuner/env/%i.env
    ExecStart=/usr/local/bin/vllm serve $VLLM_ARGS

systemd, not a shell, splits ``$VLLM_ARGS`` into words, so the value is quoted for systemd's two
parsers in turn (``quote_environment``): each argument in double quotes for the word splitting of
``$VAR`` (``\\`` and ``"`` escaped), and the whole value in double quotes for the EnvironmentFile reader
(``\\ " ` $`` escaped). Spaces, quotes, ``$``, ``%`` and empty arguments survive unchanged — checked
against real systemd 252 in ``tests/contract/test_actuators.py``. Newlines and NUL bytes cannot be
represented and are refused. A comment line carries the same argv as JSON, for ``status()``.

systemd re-reads the file at every start and the tuner writes it only right before starting a
stopped unit, so the file is what the running engine got. Everything else goes through the
``systemctl`` command line (argv, never a shell; a configurable prefix such as ``sudo -n systemctl``
or ``nsenter -t PID -m -p systemctl``), and the outcome is read from ``systemctl show``.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tuner.actuators import base, files
from tuner.errors import PermanentActuatorError, TemporaryActuatorError
from tuner.model import secrets
from tuner.portable import untrusted

_SHOW = ("LoadState", "ActiveState", "SubState", "Result", "MainPID", "ExecMainStatus", "ExecMainCode")
_ARGV_MARK = "# argv: "


def quote_environment(variable: str, argv: Sequence[str]) -> str:
    """``VARIABLE="…"``: a line of an EnvironmentFile whose value systemd splits back into ``argv``."""
    for i, arg in enumerate(argv):
        if any(c in arg for c in "\n\r\0"):  # the value is not quoted back: it may be a secret
            raise PermanentActuatorError(
                f"systemd actuator: argument {i} contains a newline or NUL byte, which an EnvironmentFile "
                "cannot carry"
            )
    words = " ".join('"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"' for a in argv)
    value = "".join("\\" + c if c in '"\\`$' else c for c in words)
    return f'{variable}="{value}"'


def environment_file(variable: str, argv: Sequence[str]) -> str:
    return (
        "# Written by vllm-tuner (atomically, right before it starts the unit). Edits are overwritten.\n"
        f"{_ARGV_MARK}{json.dumps(list(argv), ensure_ascii=False)}\n"
        f"{quote_environment(variable, argv)}\n"
    )


ENV_MAX_BYTES = 1024 * 1024  # a replica's EnvironmentFile: one argv line and a few settings


class SystemdActuator:
    def __init__(
        self,
        replicas: Sequence[base.Replica],
        *,
        unit: str = "vllm@{name}.service",
        env_dir: str | os.PathLike[str] = "/var/lib/vllm-tuner/env",
        variable: str = "VLLM_ARGS",
        systemctl: Sequence[str] = ("systemctl",),
        command_timeout_seconds: float = 30.0,
        proc_root: str | os.PathLike[str] = "/proc",
        poll_seconds: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        redactor: secrets.Redactor = secrets.DEFAULT,
    ) -> None:
        self._replicas = tuple(replicas)
        self._redactor = redactor
        self._unit = unit
        self.env_dir = Path(env_dir)
        self._variable = variable
        self._systemctl = tuple(systemctl)
        self._timeout = command_timeout_seconds
        self._poll = poll_seconds
        self._clock = clock
        self._locks = {r.name: threading.RLock() for r in self._replicas}
        self._proc_root = Path(proc_root)

    def unit(self, name: str) -> str:
        if name not in self._locks:
            known = ", ".join(self._locks)
            raise PermanentActuatorError(f"systemd actuator: no replica named {name!r} (known: {known})")
        return self._unit.format(name=name)

    def env_path(self, name: str) -> Path:
        return self.env_dir / f"{name}.env"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [*self._systemctl, *args]
        done = files.run(cmd, who="systemd actuator", timeout_seconds=self._timeout, delay=10)
        if check and done.returncode != 0:
            raise PermanentActuatorError(
                f"systemd actuator: `{' '.join(cmd)}` exited {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()[:500]}"
            )
        return done

    def show(self, name: str) -> Mapping[str, str]:
        """The unit's ``systemctl show`` properties this actuator reads."""
        out = self._run("show", "-p", ",".join(_SHOW), self.unit(name)).stdout
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        if props.get("LoadState") != "loaded":
            raise PermanentActuatorError(
                f"systemd actuator: {self.unit(name)} is {props.get('LoadState', 'unknown')}; install "
                "deploy/systemd/vllm@.service (and run `systemctl daemon-reload`)"
            )
        return props

    def written_argv(self, name: str) -> tuple[str, ...] | None:
        """The argv in the replica's EnvironmentFile, or None if there is no file written by the tuner."""
        try:
            raw = untrusted.read_bytes(self.env_path(name), max_bytes=ENV_MAX_BYTES, follow_symlinks=True)
        except FileNotFoundError:
            return None
        except untrusted.Untrusted as exc:
            raise PermanentActuatorError(f"systemd actuator: {exc.reason}; expected the EnvironmentFile the "
                                         "tuner writes for the replica") from None
        text = raw.decode("utf-8", "replace")
        for line in text.splitlines():
            if line.startswith(_ARGV_MARK):
                return tuple(json.loads(line[len(_ARGV_MARK):]))
        return None

    # --- the contract ------------------------------------------------------------------------------

    def replicas(self) -> Sequence[base.Replica]:
        return self._replicas

    def status(self, name: str) -> base.ReplicaStatus:
        props = self.show(name)
        active, sub, result = props.get("ActiveState", ""), props.get("SubState", ""), props.get("Result", "")
        pid = int(props.get("MainPID") or 0) or None
        detail = f"{active}/{sub} Result={result} ExecMainStatus={props.get('ExecMainStatus', '')}"
        if active == "activating" and sub == "auto-restart":
            state = base.State.FAILED  # the engine died; systemd's Restart= is about to try again
        elif active in ("active", "reloading", "activating", "deactivating"):
            state = base.State.RUNNING
        elif active == "failed":
            state = base.State.FAILED
        elif active == "inactive":
            state = base.State.STOPPED
        else:
            state = base.State.UNKNOWN
        argv = self.written_argv(name) if state is base.State.RUNNING else None
        return base.ReplicaStatus(name, state, pid if state is base.State.RUNNING else None, argv, detail)

    def start(self, name: str, argv: Sequence[str]) -> None:
        unit, argv = self.unit(name), tuple(argv)
        content = environment_file(self._variable, argv).encode("utf-8")
        with self._locks[name]:
            current = self.status(name)
            if base.is_running_already(current, argv, who=f"systemd actuator: {unit}"):
                return
            if current.state is base.State.FAILED:
                self._run("reset-failed", unit, check=False)  # also clears the start rate limit
            self.env_dir.mkdir(parents=True, exist_ok=True)
            files.write_atomically(self.env_path(name), content, mode=0o640)
            self._run("start", unit)

    def cmdline(self, pid: int) -> tuple[str, ...] | None:
        """The live command line of the unit's main process (``<proc_root>/<MainPID>/cmdline``)."""
        try:
            raw = (self._proc_root / str(pid) / "cmdline").read_bytes()
        except OSError:
            return None
        return tuple(a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")[:-1]) or None

    def adopt(self, name: str, argv: Sequence[str]) -> base.ReplicaStatus:
        """No EnvironmentFile yet: the first start (write it, start the unit). A file the tuner did not
        write (no ``# argv:`` line) under a running unit: rewritten in the tuner's form if the engine's
        command line ends with exactly ``argv`` — what runs is then known — else left alone and
        reported. A unit that is stopped or failed with an existing file is left to its owner."""
        unit, argv = self.unit(name), tuple(argv)
        with self._locks[name]:
            if not self.env_path(name).exists():
                current = self.status(name)
                if current.state is not base.State.RUNNING:
                    self.start(name, argv)
                    return self.status(name)
            elif self.written_argv(name) is not None:
                return self.status(name)
            current = self.status(name)
            if current.state is not base.State.RUNNING or current.pid is None:
                return current
            live = self.cmdline(current.pid)
            if live is not None and argv and live[-len(argv):] == argv:
                self.env_dir.mkdir(parents=True, exist_ok=True)
                files.write_atomically(self.env_path(name), environment_file(self._variable, argv).encode("utf-8"),
                                       mode=0o640)
                return self.status(name)
            shown = (" ".join(self._redactor.argv(live)) if live is not None
                     else f"unreadable ({self._proc_root}/{current.pid}/cmdline)")
            return base.ReplicaStatus(name, current.state, current.pid, None, (
                f"{unit} runs arguments vllm-tuner did not write ({self.env_path(name)} has no "
                f"'{_ARGV_MARK.strip()}' line) and its command line [{shown}] does not end with the configured "
                f"arguments [{' '.join(self._redactor.argv(argv))}]: rollouts of {name} are refused. Make targets[].args say what "
                f"runs, or stop the unit and remove the file so that the tuner starts it"))

    def stop(self, name: str, *, timeout_seconds: float, force_after_seconds: float | None = None) -> base.ReplicaStatus:
        unit = self.unit(name)
        with self._locks[name]:
            began = self._clock()
            props = self.show(name)
            if props.get("ActiveState") in ("inactive", "failed"):
                self._run("reset-failed", unit, check=False)
                return base.ReplicaStatus(name, base.State.STOPPED, detail="was not running")
            self._run("stop", "--no-block", unit)
            forced = False
            if force_after_seconds is not None and force_after_seconds < timeout_seconds:
                down = self._wait_down(name, force_after_seconds)
                if not down:  # uvicorn waits for attached clients: a SIGINT to the main process ends that
                    forced = True
                    self._run("kill", "--kill-whom=main", "--signal=SIGINT", unit, check=False)
                    down = self._wait_down(name, timeout_seconds - force_after_seconds)
            else:
                down = self._wait_down(name, timeout_seconds)
            if down:
                how = f", SIGINT after {force_after_seconds:g}s" if forced else ""
                detail = f"stopped after {self._clock() - began:.1f}s{how}"
            else:
                # The hard deadline: with clients connected, vLLM does not exit on its own.
                self._run("kill", "--signal=SIGKILL", unit, check=False)
                if not self._wait_down(name, 10.0):
                    raise TemporaryActuatorError(f"systemd actuator: {unit} survived SIGKILL for 10 s", delay=10)
                detail = f"killed with SIGKILL after {self._clock() - began:.1f}s (SIGTERM ignored)"
            self._run("reset-failed", unit, check=False)
            return base.ReplicaStatus(name, base.State.STOPPED, None, None, detail)

    def _wait_down(self, name: str, timeout_seconds: float) -> bool:
        deadline = self._clock() + timeout_seconds
        while True:
            props = self.show(name)
            if props.get("ActiveState") in ("inactive", "failed"):
                return True
            if self._clock() >= deadline:
                return False
            time.sleep(min(self._poll, max(0.0, deadline - self._clock())))
