"""The tuner as a subprocess: ``vllm-tuner run --config FILE`` in its own process group, its /status, its log."""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from harness.live.config import REPO_ROOT
from tuner.actuators import children


class TunerProcess:
    """``vllm-tuner run --config FILE`` in its own process group, output appended to ``log_path``."""

    def __init__(self, config_path: Path, *, listen_port: int, log_path: Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.config_path, self.listen_port, self.log_path = config_path, listen_port, log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def start(self) -> TunerProcess:
        with open(self.log_path, "ab") as log:
            log.write(f"=== test: starting the tuner at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tuner", "run", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                cwd=str(REPO_ROOT), start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, Any] | None:
        try:
            r = httpx.get(self.url + "/status", timeout=5)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a power cut would: no cleanup at all."""
        if self.proc is not None:
            children.stop(self.proc, timeout_seconds=0, signal_first=None, group=True, kill_timeout_seconds=30)

    def terminate(self, timeout: float = 120) -> int | None:
        """SIGTERM (the tuner finishes its current step and persists its state), SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        return children.stop(self.proc, timeout_seconds=timeout, group=True, kill_timeout_seconds=30)

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return b"".join(collections.deque(f, maxlen=n)).decode("utf-8", "replace")
        return "<no log>"
