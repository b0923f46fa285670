"""Processes: spawn the engine in its own session and process group, see who is left of it, signal
it, reap every child (the launcher is PID 1, or a child subreaper outside a container).

Linux only (``/proc``). One reaper: ``reap()`` is the only place that waits for children, so the engine's
exit status is never lost to another ``wait``; ``subprocess`` is not used for the engine for that reason.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
# Dispositions the engine must not inherit: Python ignores SIGPIPE and SIGXFSZ; the launcher catches the rest.
_RESET = tuple(getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT",
                                              "SIGCHLD", "SIGUSR1", "SIGUSR2", "SIGALRM") if hasattr(signal, n))


def become_subreaper() -> bool:
    """Orphans of the engine re-parent to us (as they would to PID 1). True when that holds."""
    if os.getpid() == 1:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class LogTail:
    """Copies the engine's output to the launcher's stdout (the container log) and keeps the last lines."""

    def __init__(self, fd: int, *, lines: int = 40, out_fd: int = 1) -> None:
        self._fd, self._out = fd, out_fd
        self._lines: collections.deque[str] = collections.deque(maxlen=lines)
        self._partial = b""
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._pump, name="engine-log", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self._fd, 65536)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                with contextlib.suppress(OSError):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(self._out, view):]
                self._keep(chunk)
        finally:
            if self._partial:
                self._keep(b"\n")
            with contextlib.suppress(OSError):
                os.close(self._fd)

    def _keep(self, chunk: bytes) -> None:
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        if len(self._partial) > 4096:  # a runaway line: keep its start
            complete.append(self._partial[:4096])
            self._partial = b""
        with self._lock:
            for line in complete:
                text = line.decode("utf-8", "replace").rstrip("\r")[:1000]
                if text.strip():
                    self._lines.append(text)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)


@dataclass
class Spawned:
    pid: int
    log: LogTail


def spawn(argv: Sequence[str], env: Mapping[str, str]) -> Spawned:
    """Start ``argv`` (PATH lookup, never a shell) as the leader of a new session and process group,
    stdin from /dev/null, stdout+stderr through a pipe to ``LogTail``. Raises OSError if it cannot exec."""
    r, w = os.pipe()
    try:
        pid = os.posix_spawnp(
            argv[0], list(argv), dict(env),
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_DUP2, w, 2)],
            setsid=True, setsigdef=_RESET,
        )
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return Spawned(pid, LogTail(r))


def reap() -> list[tuple[int, int]]:
    """Every child that has exited, as ``(pid, exit code)``: the code, or 128 + signal (as a shell says)."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == 0:
            break
        code = os.waitstatus_to_exitcode(status)
        out.append((pid, 128 - code if code < 0 else code))
    return out


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str


def _stat(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    try:
        return Proc(pid, int(fields[1]), int(fields[2]), fields[0])
    except (IndexError, ValueError):
        return None


def processes() -> list[Proc]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = _stat(int(name))
            if p is not None:
                out.append(p)
    return out


def remaining(pgid: int, *, root: int | None = None) -> list[int]:
    """Live (not zombie) processes of group ``pgid`` plus every descendant of ``root`` (the launcher:
    it also catches an engine child that left the group with setsid and was re-parented to us)."""
    return sorted(p.pid for p in _remaining(pgid, root=root))


def _remaining(pgid: int, *, root: int | None) -> list[Proc]:
    procs = processes()
    me = root if root is not None else os.getpid()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for p in procs:
        children[p.ppid].append(p.pid)
    found: set[int] = {p.pid for p in procs if p.pgid == pgid}
    stack = [me]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
            stack.append(c)
    return [p for p in procs if p.pid in found and p.pid != me and p.state not in ("Z", "X")]


def signal_all(pgid: int, sig: int, *, root: int | None = None) -> list[int]:
    """Send ``sig`` to the group, and once to every other process ``remaining`` lists (a descendant that
    left the group); returns who was alive to get it. A member of the group gets it once: a second SIGTERM
    lands in the middle of a handler (measured: a child's handler ran twice)."""
    try:
        os.killpg(pgid, sig)
        grouped = True
    except (ProcessLookupError, PermissionError):
        grouped = False
    targets = _remaining(pgid, root=root)
    for p in targets:
        if grouped and p.pgid == pgid:
            continue
        try:
            os.kill(p.pid, sig)
        except OSError as exc:
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise
    return sorted(p.pid for p in targets)
