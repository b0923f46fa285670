"""Stopping a child process for sure: ``stop(popen, …)`` ends it and reads its exit status, or raises.

A ``subprocess.Popen`` whose exit status was never read warns from its ``__del__`` ("subprocess N is still
running", a ``ResourceWarning``, even when the child has long exited), and one dropped while its child
runs leaves that child behind with nobody to stop it. Both happen when a stop's last ``wait(timeout=…)``
raises ``TimeoutExpired`` and the object goes out of scope. So every place that stops a child it started
goes through ``stop``: the first signal (SIGTERM unless told otherwise; none when the caller already asked
the child to go), up to ``timeout_seconds`` for it to exit, then SIGKILL and up to ``kill_timeout_seconds``
more. ``group``: signal the child's whole process group (a child started with ``start_new_session``);
the group is signalled only while the child's own exit status is unread, so its id cannot have been
recycled. ``stop_all`` does the same for several children under one deadline; ``stopped`` guards a block
(``with stopped(subprocess.Popen(...), timeout_seconds=…) as proc:``).

A child that outlives SIGKILL too (stuck in the kernel: uninterruptible sleep) raises ``Unstoppable``,
and its ``Popen`` is kept here (``unreaped``) and reaped by a later ``stop``: never an unreferenced
``Popen`` with a live child behind it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

P = TypeVar("P", bound="subprocess.Popen[Any]")

_unreaped: list[subprocess.Popen[Any]] = []
_lock = threading.Lock()


class Unstoppable(RuntimeError):
    """The child outlived SIGKILL by the kill deadline (its ``Popen`` is kept in ``unreaped()``)."""


def unreaped() -> list[subprocess.Popen[Any]]:
    """The children that outlived their SIGKILL and have not been reaped since (a later ``stop`` reaps them)."""
    with _lock:
        _unreaped[:] = [p for p in _unreaped if p.poll() is None]
        return list(_unreaped)


def _send(proc: subprocess.Popen[Any], sig: int, group: bool) -> None:
    if proc.poll() is not None:  # reaped: its pid (and group id) may belong to someone else now
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def stop(proc: subprocess.Popen[Any], *, timeout_seconds: float, signal_first: int | None = signal.SIGTERM,
         group: bool = False, kill_timeout_seconds: float = 10.0,
         before_kill: Callable[[], object] | None = None) -> int:
    """End ``proc`` and return its exit status (``Popen.returncode``): ``signal_first`` (None: send nothing,
    the caller has asked it to go another way), up to ``timeout_seconds`` for it to exit, then
    ``before_kill()`` if given (a caller's own escalation, e.g. SIGKILL to a namespace's PID 1), SIGKILL, and
    up to ``kill_timeout_seconds``. A child that has already exited is only reaped. Raises ``Unstoppable``
    if it outlives SIGKILL by ``kill_timeout_seconds``."""
    unreaped()  # reap what earlier calls could not
    if proc.poll() is not None:
        return proc.returncode
    if signal_first is not None:
        _send(proc, signal_first, group)
    try:
        return proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        pass
    except BaseException:  # interrupted while waiting (KeyboardInterrupt): still end the child, then go on
        _kill(proc, group, kill_timeout_seconds)
        raise
    try:
        if before_kill is not None:
            before_kill()
    finally:
        _kill(proc, group, kill_timeout_seconds)
    return proc.returncode


def _kill(proc: subprocess.Popen[Any], group: bool, timeout_seconds: float) -> None:
    _send(proc, signal.SIGKILL, group)
    try:
        proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        with _lock:
            _unreaped.append(proc)
        raise Unstoppable(f"pid {proc.pid} ({_name(proc)}) outlived SIGKILL by {timeout_seconds:g} s "
                          "(stuck in the kernel?); it is reaped once it exits") from None


def stop_all(procs: Iterable[subprocess.Popen[Any]], *, timeout_seconds: float,
             signal_first: int | None = signal.SIGTERM, group: bool = False,
             kill_timeout_seconds: float = 10.0) -> list[int]:
    """``stop`` each of ``procs`` under one deadline: the first signal to all of them at once, up to
    ``timeout_seconds`` in all for them to exit, then SIGKILL to each one left. Every one of them is
    stopped even when one raises; then the first ``Unstoppable`` is raised, if any."""
    procs = list(procs)
    if signal_first is not None:
        for proc in procs:
            _send(proc, signal_first, group)
    deadline = time.monotonic() + timeout_seconds
    codes: list[int] = []
    failed: Unstoppable | None = None
    for proc in procs:
        try:
            codes.append(stop(proc, timeout_seconds=max(0.0, deadline - time.monotonic()), signal_first=None,
                              group=group, kill_timeout_seconds=kill_timeout_seconds))
        except Unstoppable as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
    return codes


def _name(proc: subprocess.Popen[Any]) -> str:
    args = proc.args
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args)[:80]
    first = next(iter(args), "?")
    return os.fsdecode(first) if isinstance(first, (str, bytes, os.PathLike)) else str(first)


@contextlib.contextmanager
def stopped(proc: P, *, timeout_seconds: float, signal_first: int | None = signal.SIGTERM, group: bool = False,
            kill_timeout_seconds: float = 10.0) -> Iterator[P]:
    """``with stopped(subprocess.Popen(...), timeout_seconds=10) as proc:`` — the child is stopped (``stop``)
    when the block ends, however it ends, and its pipes are closed (as ``Popen``'s own ``with`` does, which
    waits without a deadline and never signals)."""
    try:
        yield proc
    finally:
        try:
            stop(proc, timeout_seconds=timeout_seconds, signal_first=signal_first, group=group,
                 kill_timeout_seconds=kill_timeout_seconds)
        finally:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
