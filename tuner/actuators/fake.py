"""In-memory actuator and drainer, after VPA's ``fake_pods_restriction.go``: for unit tests and dry runs.

``FakeActuator`` keeps each replica's state and argv in a dict and records every call. Scripted
behaviours stand in for what real engines do, as predicates on the argv so that one test suite can
script fake and real engines alike (``tests/support/stub_engine.py``): ``fails(argv)`` returning a
reason makes a start end in FAILED (an engine that rejects its flags); ``ignores_sigterm(argv)``
makes a stop report a SIGKILL (vLLM with clients connected). ``crash(name)`` kills a running one.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence

from tuner.actuators import base
from tuner.errors import PermanentActuatorError


class FakeActuator:
    def __init__(
        self,
        replicas: Sequence[base.Replica],
        *,
        running: Mapping[str, Sequence[str]] | None = None,
        fails: Callable[[Sequence[str]], str | None] | None = None,
        ignores_sigterm: Callable[[Sequence[str]], bool] | None = None,
    ) -> None:
        self._replicas = tuple(replicas)
        self._fails = fails or (lambda argv: None)
        self._ignores_sigterm = ignores_sigterm or (lambda argv: False)
        self.calls: list[tuple[str, ...]] = []
        self._pids = itertools.count(1000)
        self._lock = threading.Lock()
        self._status = {r.name: base.ReplicaStatus(r.name, base.State.STOPPED) for r in self._replicas}
        for name, argv in (running or {}).items():
            self._check(name)
            self._status[name] = base.ReplicaStatus(name, base.State.RUNNING, next(self._pids), tuple(argv))

    def _check(self, name: str) -> None:
        if name not in self._status:
            known = ", ".join(self._status)
            raise PermanentActuatorError(f"fake actuator: no replica named {name!r} (known: {known})")

    def replicas(self) -> Sequence[base.Replica]:
        return self._replicas

    def status(self, name: str) -> base.ReplicaStatus:
        self._check(name)
        return self._status[name]

    def start(self, name: str, argv: Sequence[str]) -> None:
        self._check(name)
        with self._lock:
            self.calls.append(("start", name, *argv))
            current = self._status[name]
            if current.state is base.State.RUNNING:
                if current.argv == tuple(argv):
                    return
                raise PermanentActuatorError(f"fake actuator: {name} is running other arguments; stop it first")
            reason = self._fails(argv)
            if reason:
                self._status[name] = base.ReplicaStatus(name, base.State.FAILED, None, tuple(argv), reason)
            else:
                self._status[name] = base.ReplicaStatus(name, base.State.RUNNING, next(self._pids), tuple(argv))

    def adopt(self, name: str, argv: Sequence[str]) -> base.ReplicaStatus:
        self._check(name)
        if self._status[name].state is base.State.STOPPED and not self._status[name].detail:  # never started
            self.start(name, argv)
        return self.status(name)

    def stop(self, name: str, *, timeout_seconds: float, force_after_seconds: float | None = None) -> base.ReplicaStatus:
        self._check(name)
        with self._lock:
            self.calls.append(("stop", name))
            was = self._status[name]
            detail = ""
            if was.state is base.State.RUNNING:
                stubborn = self._ignores_sigterm(was.argv or ())
                if not stubborn:
                    detail = "stopped on SIGTERM"
                elif force_after_seconds is not None and force_after_seconds < timeout_seconds:
                    detail = f"stopped: SIGTERM, then SIGINT after {force_after_seconds:g}s"
                else:
                    detail = f"killed with SIGKILL after {timeout_seconds:g}s"
            self._status[name] = base.ReplicaStatus(name, base.State.STOPPED, None, None, detail)
            return self._status[name]

    def crash(self, name: str, detail: str = "exited with status 1") -> None:
        self._check(name)
        with self._lock:
            was = self._status[name]
            self._status[name] = base.ReplicaStatus(name, base.State.FAILED, None, was.argv, detail)


class FakeDrainer:
    """Remembers which replicas are drained; ``failing`` names make drain/undrain raise."""

    def __init__(self, *, failing: frozenset[str] = frozenset()) -> None:
        self.drained: set[str] = set()
        self.failing = set(failing)
        self.calls: list[tuple[str, str]] = []

    def drain(self, name: str) -> None:
        self.calls.append(("drain", name))
        if name in self.failing:
            raise PermanentActuatorError(f"fake drainer: cannot drain {name}")
        self.drained.add(name)

    def undrain(self, name: str) -> None:
        self.calls.append(("undrain", name))
        if name in self.failing:
            raise PermanentActuatorError(f"fake drainer: cannot undrain {name}")
        self.drained.discard(name)
