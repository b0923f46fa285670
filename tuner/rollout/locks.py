"""Lock files: one tuner per state file and per journal.

Two daemons on one configuration would both own the same engines' command lines: each would roll the
pool out on its own, journal into the same file and overwrite the other's state. The owner of a state
file or journal therefore holds an exclusive ``flock`` on a lock file beside it (``<file>.lock``) for as
long as it runs; a second one is refused at once (non-blocking) with the first one's pid.

- ``flock`` belongs to the open file description: the kernel drops it when the holder exits, however it
  dies (SIGKILL included), so a lock is never stale. Opening the same file twice in one process is
  refused as well.
- The descriptor is close-on-exec, so an engine the tuner starts does not inherit (and keep) the lock.
- The lock file is never removed: unlinking it would let a third process lock a new inode while the
  second still waits on the old one. Its content is only the holder's pid, for the error message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Self

from tuner.errors import TunerError


class LockedError(TunerError):
    """Another process holds the lock: it already owns this state."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path, self.pid = path, pid
        who = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(
            f"{path} is held by another vllm-tuner ({who}): two tuners on one state would fight over the same "
            "engines; stop the other one, or give this one its own daemon.state_file and rollout.journal_file"
        )


class LockFile:
    """A held lock; ``release()`` (or leaving the ``with`` block) gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_path(path: str | os.PathLike[str]) -> Path:
    """The lock file that guards ``path``: ``state.json`` → ``state.json.lock``."""
    p = Path(path)
    return p.with_name(p.name + ".lock")


def acquire(path: str | os.PathLike[str]) -> LockFile:
    """Take the exclusive lock on ``path`` (the lock file itself, created if missing) or raise
    ``LockedError`` naming the holder. Never blocks."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        raise LockedError(str(target), int(text) if text.isdigit() else None) from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # a full disk must not stop the tuner from holding its lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return LockFile(target, fd)
