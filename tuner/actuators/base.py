"""The actuator contract: what the rollout needs from whatever runs the engine replicas.

One contract, several implementations (``process``: the tuner supervises local engine processes;
``systemd``: engines are instances of ``vllm@.service``; ``fake``: in-memory, for the unit tier).
It is shaped so that a Kubernetes actuator fits later without changing it: a replica is addressed
by name, arguments are an argv list (never a shell string), and every call is bounded by a deadline.

Drain hooks are a separate contract (``Drainer``): taking a replica out of the load balancer is not
the same job as restarting it, and users combine them freely (systemd + nginx, process + command…).

Errors: ``TemporaryActuatorError(delay=)`` for "try again later", ``PermanentActuatorError`` for
"a human must look" (tuner.errors).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tuner.errors import PermanentActuatorError


class State(enum.Enum):
    RUNNING = "running"  # the process/unit is up (not necessarily healthy: ask the engine)
    STOPPED = "stopped"  # cleanly stopped, or never started
    FAILED = "failed"  # exited on its own with an error, or failed to start
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    name: str
    state: State
    pid: int | None = None
    argv: tuple[str, ...] | None = None  # the engine arguments it runs with (after the executable)
    detail: str = ""  # exit code, systemd Result=, last log line…


@dataclass(frozen=True, slots=True)
class Replica:
    name: str
    base_url: str  # where /health, /v1/models and /metrics live, e.g. http://127.0.0.1:8001


def is_running_already(status: ReplicaStatus, argv: Sequence[str], *, who: str) -> bool:
    """``start``'s idempotence: True if the replica runs exactly ``argv`` (nothing to do); raises
    ``PermanentActuatorError`` if it runs anything else (arguments change only by a restart)."""
    if status.state is not State.RUNNING:
        return False
    if status.argv == tuple(argv):
        return True
    pid = f" (pid {status.pid})" if status.pid is not None else ""
    raise PermanentActuatorError(f"{who}{pid} is running other arguments; stop it first")


@runtime_checkable
class Actuator(Protocol):
    """Runs engine replicas. Every method is synchronous and bounded by its deadline."""

    def replicas(self) -> Sequence[Replica]: ...

    def status(self, name: str) -> ReplicaStatus:
        """What runs now. ``argv`` is set only when the actuator knows the arguments of the *live*
        process (it launched it, or a restarted tuner re-adopted it); None means unknown."""

    def start(self, name: str, argv: Sequence[str]) -> None:
        """Start the replica with these engine arguments (not waiting for health).

        Idempotent: a replica already running exactly ``argv`` is left alone. One running anything
        else raises ``PermanentActuatorError`` (stop it first: arguments change only by a restart).
        """

    def adopt(self, name: str, argv: Sequence[str]) -> ReplicaStatus:
        """At tuner start: take the replica over, ``argv`` being what the tuner believes it should run
        (the configuration's arguments, or what the last rollout left).

        A replica this actuator never started (no pid file, no EnvironmentFile, …) is started with
        ``argv``. One running arguments the actuator cannot read back is recorded as running ``argv`` if
        its live command line ends with exactly ``argv``. Anything else is left as it is. Returns the
        status after: ``argv`` None means unknown arguments (rollouts of it are refused), with ``detail``
        saying why and what to do.
        """

    def stop(self, name: str, *, timeout_seconds: float, force_after_seconds: float | None = None) -> ReplicaStatus:
        """SIGTERM (or the platform's equivalent), then SIGKILL after ``timeout_seconds``; returns once
        the replica is gone (STOPPED, ``detail`` says whether it had to be forced or killed). Idempotent.

        ``force_after_seconds``: if the engine still runs that long after the SIGTERM, send SIGINT to its
        main process. vLLM's HTTP server (uvicorn) waits for every attached client connection to close
        before it shuts the engine down, and with clients attached it never does; a SIGINT after the
        SIGTERM makes it stop waiting (uvicorn's forced exit), so the engine exits — and frees its GPU —
        without waiting for the SIGKILL deadline (docs/reliability.md, measured).

        Every method raises ``PermanentActuatorError`` for a name that is not one of ``replicas()``.
        """


@runtime_checkable
class Drainer(Protocol):
    """Routes traffic away from a replica and back."""

    def drain(self, name: str) -> None: ...

    def undrain(self, name: str) -> None: ...
