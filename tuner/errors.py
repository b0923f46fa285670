"""The exception tree of vllm-tuner.

::

    TunerError
    ├── ConfigError            bad configuration or rule file; the CLI exits 2
    │   └── StorageError       the tuner's own state or journal cannot be written at start
    ├── StartError             (cli) ``run`` cannot start for a reason outside the configuration; exit 2
    ├── UnreachableError       (cli.operating) the running tuner's /status or its journal cannot be read; exit 1
    ├── ControlFileError       (runtime.control) the runtime switches (control.json) cannot be written; exit 2
    ├── SourceError            a scrape or read failed; no decision from that window (transient); the
    │                          CLI exits 1 when no target or file it was given could be read
    ├── ActuatorError          an actuator could not act
    │   ├── TemporaryActuatorError(delay=)   try again after ``delay`` seconds
    │   └── PermanentActuatorError           do not retry; a human must look
    ├── JournalError           (rollout.journal) the journal cannot be read back consistently
    ├── JournalWriteError      (rollout.journal) a record could not be made durable; nothing of it is left
    │   └── PoolUnreadableError  (kube.store) a key of the pool's ConfigMap does not read: no leader writes
    ├── LockedError            (rollout.locks) another process holds the state's lock
    ├── ApiError               (kube.api) a request to the Kubernetes API server failed (``code``)
    ├── AdoptionError          (kube.injecting) a workload asked for the tuner but cannot be adopted; exit 2
    │   └── Refused            (kube.injecting) every problem of one ``inject`` run, one line each
    ├── StartupProblem         (kube.running) the agent cannot start as configured: it runs degraded (fails open)
    └── Deposed                (kube.store) a newer leader wrote to the pool's ConfigMap

Each lives beside the code that raises it (the module in parentheses; the rest here);
``tests/unit/test_errors.py`` holds that this tree names every one. A guard that says "no" is a
``guards.Ruling`` value, never an exception. Each exception builds its
message from its fields and keeps them, so callers can inspect ``err.path`` or ``err.url``.
"""

from __future__ import annotations

from collections.abc import Sequence


class TunerError(Exception):
    """Base of every error vllm-tuner raises on purpose."""


class ConfigError(TunerError):
    """A configuration or rule file is invalid.

    ``problems`` holds ``(field path, what was wrong / expected)`` pairs.
    """

    def __init__(self, file: str, problems: Sequence[tuple[str, str]]) -> None:
        self.file = file
        self.problems = list(problems)
        lines = [f"{file}: {len(self.problems)} problem(s)"]
        lines += [f"  - {where or '<top level>'}: {what}" for where, what in self.problems]
        super().__init__("\n".join(lines))


class StorageError(ConfigError):
    """At start, the tuner cannot write where its configuration says its own files live
    (``daemon.state_file``, ``rollout.journal_file``): a read-only or full file system, a missing
    permission. One line; the CLI exits 2. (Mid-run, the same failure is logged and the daemon goes on:
    docs/reliability.md.)"""

    def __init__(self, path: str, setting: str, reason: str) -> None:
        self.path, self.setting, self.reason = path, setting, reason
        self.file, self.problems = path, [(setting, reason)]
        TunerError.__init__(self, f"{setting} {path}: cannot write there ({reason}); the tuner needs a writable "
                                  "directory with free space for its state and journal")


class SourceError(TunerError):
    """Reading a source failed; the window it belongs to is invalid."""

    def __init__(self, source: str, reason: str) -> None:
        self.source = source
        self.reason = reason
        super().__init__(f"{source}: {reason}")


class ActuatorError(TunerError):
    """An actuator could not do what it was asked."""


class TemporaryActuatorError(ActuatorError):
    def __init__(self, message: str, *, delay: float = 30.0) -> None:
        self.delay = delay
        super().__init__(f"{message} (retry in {delay:g}s)")


class PermanentActuatorError(ActuatorError):
    pass
