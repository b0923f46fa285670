"""The journal: an append-only JSON-lines file of decisions and rollout transitions, fsync'd per record.

One record per line, each a JSON object with ``v`` (format version), ``seq`` (1, 2, …), ``at`` (the
driver's clock, seconds) and ``kind``:

- ``decision``: whatever the daemon decided (free-form fields), e.g. a plan, a guard verdict, a bad
  argument set. Kept so that no decision is lost across restarts.
- ``rollout``: a rollout began; ``rollout`` holds its whole initial value (replicas, order, old and new
  argv, limits; a live rollout its ``kind`` and old and new live values too), enough to rebuild it.
- ``event``: one transition, written *before* the step it leads to is carried out (write-ahead), with
  ``rollout_id``, ``replica``, ``event``, ``reason`` and, for the reader, ``from``/``to``/``leg``.
- ``abort``: the rollout admits no more replicas.

Recovery is replay: ``replay(records)`` folds every ``event`` through ``machine.handle`` (the same pure
function that produced it, with the recorded ``at`` as ``now``), so the rebuilt rollout is exactly the
one the dead tuner held. A crash can tear only the last line (a record is not acknowledged before all
of it is written and fsync'd); opening the journal drops such a tail. A bad line anywhere else is
corruption and raises ``JournalError``: guessing would risk a replica on unknown arguments.

A write that fails (a full disk, an I/O error, a short write that cannot complete, a failed fsync) is
undone: the file is truncated back to its last complete record and ``JournalWriteError`` is raised, so
nothing is acknowledged that is not durable and no half record is left for the next one to be glued to
(which would turn a full disk into mid-file corruption). The journal stays appendable: once space is
back the next append goes on where the last good record ended.

The journal's owner holds ``<journal>.lock`` (``locks``) from open to close: a second tuner on the same
journal is refused with the first one's pid. ``read_records`` reads without the lock and changes nothing.

Secrets: with a ``redactor`` (``model.secrets``), every record is masked before it is written — the
argv of a ``rollout`` record reads ``--api-key ***``, and a secret value met in any text (a reason) is
replaced. What the journal holds in memory is what the file holds. A rollout rebuilt from it has masked
arguments; ``restored`` puts the real values back from the configuration before anything is started
with them (the tuner never changes a secret flag, so the configured value is the one they had).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno as errno_mod
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Self

from tuner.errors import ConfigError, TunerError
from tuner.model import secrets
from tuner.portable import untrusted
from tuner.rollout import locks, machine

VERSION = 1
Record = Mapping[str, Any]


class JournalError(TunerError):
    """The journal cannot be read back consistently."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        super().__init__(
            f"{path}:{line}: {reason}; the journal is append-only JSON lines written by vllm-tuner — "
            "move the file aside to start from an empty history"
        )


class JournalWriteError(TunerError):
    """A record could not be made durable. Nothing of it is left in the file and it was not acknowledged.

    ``errno`` is the failing call's errno (``ENOSPC``, ``EIO``…), ``reason`` its text."""

    def __init__(self, path: str, errno: int | None, reason: str) -> None:
        self.path, self.errno, self.reason = path, errno, reason
        code = f" [errno {errno}]" if errno is not None else ""
        super().__init__(
            f"{path}: cannot append to the journal: {reason}{code}; the record was not written (the file is "
            "back at its last complete record) and the step it guards was not taken; free space or fix "
            "the disk and the next append goes on"
        )


def _parse(data: bytes, path: str) -> tuple[list[dict[str, Any]], int, bytes]:
    """(records, length of the complete records, the torn tail) of a journal's bytes."""
    good = data.rfind(b"\n") + 1
    tail = data[good:]
    lines = data[:good].split(b"\n")[:-1]
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "kind" not in record:
                raise ValueError("not a journal record")
        except ValueError as exc:
            if i == len(lines) and not tail:
                # The last complete line is unreadable: a torn write that happened to end in "\n".
                good -= len(line) + 1
                tail = line
                break
            raise JournalError(path, i, f"unreadable record ({exc})") from exc
        records.append(record)
    return records, good, tail


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """The journal's complete records, read without taking its lock or repairing a torn tail (for
    readers beside a running tuner). A missing file has none."""
    try:
        data = _read(Path(path))
    except FileNotFoundError:
        return []
    return list(_parse(data, str(path))[0])


JOURNAL_MAX_BYTES = 1 << 30  # a journal this large is not one the tuner wrote (a record is ~1 KiB)


def _read(path: Path) -> bytes:
    """The journal's bytes through the one bounded reader: a FIFO or a device at its path is a ConfigError
    that says so, never a read that waits for a writer."""
    try:
        return untrusted.read_bytes(path, max_bytes=JOURNAL_MAX_BYTES, follow_symlinks=True)
    except untrusted.Untrusted as exc:
        raise ConfigError(str(path), [("rollout.journal_file", f"{exc.reason}; expected the tuner's journal, "
                                       "a regular file (or a path where it can create one)")]) from None


class JournalLike(Protocol):
    """What the rollout driver needs of a journal: this file (``Journal``), or the pool's ConfigMap on
    Kubernetes (``tuner.kube.store.ConfigMapJournal``). ``append`` returns once the record is durable."""

    @property
    def records(self) -> Sequence[Record]: ...

    def append(self, kind: str, *, at: float, **fields: Any) -> Record: ...


class Journal:
    """The file. ``records`` holds everything loaded at open plus everything appended since.

    Opening takes ``<path>.lock`` (``locks.LockedError`` if another process holds it); ``close`` gives it
    back. ``lock=False`` is for tests that must open a journal twice in one process."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True, lock: bool = True,
                 redactor: secrets.Redactor | None = None) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._redactor = redactor
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owner = locks.acquire(locks.lock_path(self.path)) if lock else None
        try:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
            try:
                if created and fsync:
                    _fsync_dir(self.path.parent)
                self.dropped_tail = b""  # a torn last record dropped at open (for the log)
                self._records: list[dict[str, Any]] = self._load()
            except BaseException:
                os.close(self._fd)
                raise
        except BaseException:
            if self._owner is not None:
                self._owner.release()
            raise
        self._damaged = False  # a failed write could not be undone: repair before the next one

    def _load(self) -> list[dict[str, Any]]:
        records, good, tail = _parse(_read(self.path), str(self.path))
        if tail:
            os.ftruncate(self._fd, good)
            if self._fsync:
                os.fsync(self._fd)
        self.dropped_tail = tail
        self._size = good  # the length of the complete, durable records
        return records

    @property
    def records(self) -> Sequence[Record]:
        return tuple(self._records)

    def append(self, kind: str, *, at: float, **fields: Any) -> Record:
        """Write one record and fsync it; return it once it is durable."""
        if self._redactor is not None:
            fields = self._redactor.data(fields)
        with self._lock:
            seq = (self._records[-1].get("seq", 0) if self._records else 0) + 1
            record = {"v": VERSION, "seq": seq, "at": at, "kind": kind, **fields}
            line = json.dumps(record, separators=(",", ":"), sort_keys=True, ensure_ascii=False) + "\n"
            data = line.encode("utf-8")
            if self._fd < 0:
                raise ValueError(f"{self.path}: the journal is closed")
            try:
                if self._damaged:
                    self._truncate()
                _write_all(self._fd, data)
                if self._fsync:
                    os.fsync(self._fd)
            except BaseException as exc:
                self._undo()
                if isinstance(exc, OSError):
                    raise JournalWriteError(str(self.path), exc.errno, exc.strerror or str(exc)) from exc
                raise
            self._size += len(data)
            self._records.append(record)
            return record

    def _truncate(self) -> None:
        os.ftruncate(self._fd, self._size)
        if self._fsync:
            os.fsync(self._fd)
        self._damaged = False

    def _undo(self) -> None:
        """Cut whatever part of the failed record reached the file. If even that fails (the disk is gone),
        the next append tries again before writing."""
        self._damaged = True
        with contextlib.suppress(OSError):
            self._truncate()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._owner is not None:
                self._owner.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written: the kernel may take less than asked (a signal, a
    nearly full disk); the call after a short one reports why (``ENOSPC``…). Zero bytes is a failure."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno_mod.EIO, f"the file system took 0 of the last {len(view)} bytes "
                          f"({len(data) - len(view)} of {len(data)} written)")
        view = view[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- pure: records ↔ values ------------------------------------------------------------------------


def rollout_fields(rollout: machine.Rollout) -> dict[str, Any]:
    """The ``rollout`` record's payload: the rollout's initial value."""
    limits = rollout.limits
    return {
        "rollout": {
            "id": rollout.id,
            "replicas": list(rollout.replicas),
            "order": list(rollout.order),
            "old_argv": {n: list(a) for n, a in rollout.old_argv.items()},
            "new_argv": {n: list(a) for n, a in rollout.new_argv.items()},
            "limits": {f: getattr(limits, f) for f in machine.Limits.__dataclass_fields__},
            "created_at": rollout.created_at,
            "measured_start_seconds": rollout.measured_start_seconds,
            **({"kind": rollout.kind.value,
                "old_values": {n: dict(v) for n, v in rollout.old_values.items()},
                "new_values": {n: dict(v) for n, v in rollout.new_values.items()}}
               if rollout.kind is machine.Kind.LIVE else {}),
        }
    }


def event_fields(
    before: machine.Rollout, after: machine.Rollout, name: str, event: machine.Event, reason: str = ""
) -> dict[str, Any]:
    """The ``event`` record's payload; ``from``/``to``/``leg`` are for readers, replay ignores them."""
    p, q = before.of(name), after.of(name)
    return {
        "rollout_id": before.id,
        "replica": name,
        "event": event.value,
        "reason": reason,
        "from": p.state.value,
        "to": q.state.value,
        "leg": q.leg.value,
    }


def _rollout_from(payload: Mapping[str, Any]) -> machine.Rollout:
    changes = {n: (payload["old_argv"][n], payload["new_argv"][n]) for n in payload["order"]}
    live = None
    if payload.get("kind", machine.Kind.RESTART.value) == machine.Kind.LIVE.value:
        live = {n: (payload["old_values"][n], payload["new_values"][n]) for n in payload["order"]}
    return machine.new(
        payload["id"],
        replicas=payload["replicas"],
        changes=changes,
        order=payload["order"],
        limits=machine.Limits(**payload["limits"]),
        now=payload["created_at"],
        measured_start_seconds=payload.get("measured_start_seconds"),
        live=live,
    )


def restored(rollout: machine.Rollout, restore: Callable[[str, Sequence[str]], Sequence[str]]) -> machine.Rollout:
    """The rollout with each replica's old and new argv passed through ``restore(replica, argv)``: the
    masked secrets of a replayed rollout put back from the configuration."""
    return dataclasses.replace(
        rollout, old_argv={n: tuple(restore(n, a)) for n, a in rollout.old_argv.items()},
        new_argv={n: tuple(restore(n, a)) for n, a in rollout.new_argv.items()})


def replay(records: Iterable[Record]) -> dict[str, machine.Rollout]:
    """Every rollout in the journal, rebuilt through ``machine.handle``, in the order they began."""
    rollouts: dict[str, machine.Rollout] = {}
    for record in records:
        fold(rollouts, record)
    return rollouts


def fold(rollouts: dict[str, machine.Rollout], record: Record) -> None:
    """One record into ``rollouts`` (a step of ``replay``). A record that does not replay raises
    (``KeyError``, ``TypeError``, ``ValueError``, ``machine.RolloutError``) and changes nothing."""
    kind = record["kind"]
    if kind == "rollout":
        r = _rollout_from(record["rollout"])
        rollouts[r.id] = r
    elif kind == "event":
        rid = record["rollout_id"]
        rollouts[rid] = machine.handle(
            rollouts[rid], record["replica"], machine.Event(record["event"]),
            now=record["at"], reason=record.get("reason", ""),
        )
    elif kind == "abort":
        rid = record["rollout_id"]
        rollouts[rid] = machine.abort(rollouts[rid], record.get("reason", ""))


def unfinished(records: Iterable[Record]) -> machine.Rollout | None:
    """The rollout a restarted tuner must resume (Rule 3), if any. At most one runs at a time."""
    running = [r for r in replay(records).values() if machine.outcome(r) is machine.Outcome.RUNNING]
    return running[-1] if running else None


def measured_start_seconds(records: Iterable[Record], *, last: int = 5) -> float | None:
    """The slowest engine start over the last ``last`` rollouts: the next health wait is sized from it."""
    values = [r.measured_start_seconds for r in list(replay(records).values())[-last:]]
    known = [v for v in values if v is not None]
    return max(known) if known else None


def bad_argv(records: Iterable[Record]) -> list[tuple[str, tuple[str, ...], str]]:
    """(replica, argv, reason) for every argument set an engine could not run, oldest first."""
    out = []
    for r in replay(records).values():
        for p in r.progress:
            if p.bad_args:
                out.append((p.name, r.new_argv[p.name], p.reason))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class LeftDrained:
    """A replica a finished rollout left out of the pool (machine ``FAILED``): its way back failed."""

    replica: str
    rollout_id: str
    since: float  # when its last transition (to FAILED) was journaled
    reason: str


def left_drained(records: Iterable[Record]) -> dict[str, LeftDrained]:
    """Replica → ``LeftDrained`` for every replica whose last rollout to touch it finished with it drained
    (machine ``LEFT_DRAINED``). A later rollout that drained it again (and so undrains it at its end) clears
    it; one that never admitted it (PENDING when it halted) does not. A live rollout drains nothing (its
    ``FAILED`` is values not put back), so it neither leaves a replica drained nor clears one. Pure: a
    restarted tuner finds the same."""
    out: dict[str, LeftDrained] = {}
    for r in replay(records).values():
        if machine.outcome(r) is machine.Outcome.RUNNING or r.kind is machine.Kind.LIVE:
            continue
        for p in r.progress:
            if p.state in machine.LEFT_DRAINED:
                out[p.name] = LeftDrained(p.name, r.id, p.since if p.since is not None else r.created_at, p.reason)
            elif p.state is not machine.State.PENDING:
                out.pop(p.name, None)
    return out


def decisions(records: Iterable[Record]) -> list[Record]:
    return [r for r in records if r["kind"] == "decision"]
