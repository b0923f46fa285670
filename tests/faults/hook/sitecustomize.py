"""Test-only fault hook, loaded by ``python`` through ``PYTHONPATH`` (``site`` imports ``sitecustomize``).

Nothing of the product reads it: the fault-injection tests start ``vllm-tuner run`` with this directory
first on ``PYTHONPATH`` and, in the environment,

- ``FAULTS_JOURNAL``: the journal's path;
- ``FAULTS_AT`` and ``FAULTS_SIGNAL`` (``KILL``, the default, or ``STOP``): when an fsync of the
  journal's file descriptor returns and the file holds k complete records (``FAULTS_AT=k``), or its last
  record has the given fields (``FAULTS_AT=replica=a,to=starting``), the process sends itself that
  signal — after record k is durable, before ``Journal.append`` returns, so the step
  that record guards (write-ahead) has not been taken. The point is exact: no polling, no race with the
  next record. ``STOP`` freezes every thread there until the test sends SIGCONT (e.g. after filling
  the disk);
- ``FAULTS_EROFS_FLAG``: a path; while that file exists, every ``os.write``/``os.fsync``/``os.ftruncate``
  on the journal's descriptor fails with EROFS, as on a file system the kernel remounted read-only
  after an I/O error (a tmpfs cannot be remounted read-only while the journal is open for writing).

The variables are removed from ``os.environ`` at once, so the engines the tuner launches (which inherit
its environment) carry no hook.
"""

from __future__ import annotations

import errno
import json
import os
import signal

_journal = os.environ.pop("FAULTS_JOURNAL", None)
_at = os.environ.pop("FAULTS_AT", None)
_signal = getattr(signal, "SIG" + os.environ.pop("FAULTS_SIGNAL", "KILL"))
_erofs_flag = os.environ.pop("FAULTS_EROFS_FLAG", None)
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != _here]
if _rest:  # the engines the tuner starts do not load this file
    os.environ["PYTHONPATH"] = os.pathsep.join(_rest)
else:
    os.environ.pop("PYTHONPATH", None)


def _is_journal(fd: int) -> bool:
    try:
        return os.path.realpath(f"/proc/self/fd/{fd}") == _target
    except OSError:
        return False


if _journal:
    _target = os.path.realpath(_journal)
    _real_fsync, _real_write, _real_ftruncate = os.fsync, os.write, os.ftruncate
    _fired = False

    def _read_only(fd: int) -> None:
        if _erofs_flag and os.path.exists(_erofs_flag) and _is_journal(fd):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    def _fsync(fd: int) -> None:
        global _fired
        _read_only(fd)
        _real_fsync(fd)
        if _at is None or _fired or not _is_journal(fd):
            return
        try:
            with open(_target, "rb") as f:
                data = f.read()
        except OSError:
            return
        if _at.isdigit():
            hit = data.count(b"\n") >= int(_at)
        else:
            lines = data.splitlines()
            try:
                last = json.loads(lines[-1]) if lines else {}
            except ValueError:
                return
            hit = all(str(last.get(k)) == v for k, v in (kv.split("=", 1) for kv in _at.split(",")))
        if hit:
            _fired = True
            os.kill(os.getpid(), _signal)

    def _write(fd: int, data: bytes) -> int:  # type: ignore[type-arg]
        _read_only(fd)
        return _real_write(fd, data)

    def _ftruncate(fd: int, length: int) -> None:
        _read_only(fd)
        _real_ftruncate(fd, length)

    os.fsync = _fsync
    os.write = _write  # type: ignore[assignment]
    os.ftruncate = _ftruncate
