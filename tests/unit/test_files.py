"""Atomic file replacement: readers see the old file or the new one, and a failure leaves no debris."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.actuators import files


def _debris(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_replaces_the_file_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "vllm-a.env"
    target.write_text("old\n")
    files.write_atomically(target, b"VLLM_ARGS=--max-num-seqs 8\n", mode=0o640)
    assert target.read_bytes() == b"VLLM_ARGS=--max-num-seqs 8\n"
    assert target.stat().st_mode & 0o777 == 0o640
    assert _debris(tmp_path) == []


def test_a_failed_rename_leaves_no_temp_file_behind(tmp_path: Path) -> None:
    target = tmp_path / "upstreams.conf"
    target.mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(IsADirectoryError):
        files.write_atomically(target, b"server 127.0.0.1:8001;\n")
    assert _debris(tmp_path) == []


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")

    def enospc(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", enospc)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and _debris(tmp_path) == []


_FULL = r"""
import json, os, sys
from tuner.actuators import files
mnt = sys.argv[1]
target = os.path.join(mnt, "state.json")
files.write_atomically(target, b"old" * 100)
out = {}
try:
    files.write_atomically(target, b"n" * 200_000)  # more than the 64 KiB file system holds
    out["written"] = True
except OSError as exc:
    out["errno"] = exc.errno
out["content"] = open(target, "rb").read()[:3].decode()
out["files"] = sorted(os.listdir(mnt))
print(json.dumps(out))
"""


def test_a_full_disk_on_a_real_tmpfs_keeps_the_old_file(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    wrapper = 'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -c "$3" "$1"'
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", wrapper, "sh", str(mnt),
                           sys.executable, _FULL], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"errno": errno.ENOSPC, "content": "old", "files": ["state.json"]}
