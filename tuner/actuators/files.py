"""What the actuators and drainers share: atomic file replacement for files handed to other programs,
and running a helper command (systemctl, nginx, a drain hook) — an argv, never a shell, with a deadline."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tuner.errors import PermanentActuatorError, TemporaryActuatorError


def run(argv: Sequence[str], *, who: str, timeout_seconds: float, delay: float = 30.0
        ) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with output captured. A missing program is permanent (a human must install or
    configure it); a run past ``timeout_seconds`` is temporary (retried after ``delay``). The exit code
    is the caller's to judge."""
    argv = list(argv)
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_seconds, check=False,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise PermanentActuatorError(f"{who}: cannot run {argv[0]!r}: {exc.strerror}") from exc
    except subprocess.TimeoutExpired as exc:
        raise TemporaryActuatorError(f"{who}: `{' '.join(argv)}` took longer than {timeout_seconds:g}s",
                                     delay=delay) from exc


def write_atomically(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that readers (systemd, nginx, a restarted tuner) see the old
    file or the new one, never a mix: a temp file in the same directory, every byte written (short
    writes are continued), fsync, close, rename, fsync the directory (the rename itself must survive a
    power cut). Any failure before the rename (a full disk, EIO, a rename onto a directory) removes the
    temp file and raises the ``OSError``; the old file is untouched."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(f"{tmp}: the file system took 0 of {len(view)} bytes")
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)  # close can report a deferred write error too (NFS)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
