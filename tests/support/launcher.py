"""Run the in-pod launcher (``tuner/launcher``) as a process for tests, and talk to it as the agent would.

``LauncherProcess(state_dir, engine_argv)`` starts ``python -m tuner.launcher`` (or a built zipapp under a
given python) in its own process group with its probes on a free 127.0.0.1 port; ``status()`` reads
status.json, ``probe(path)`` GETs /livez /readyz /status, ``request(...)`` writes desired.json the way
the agent does (atomically, generation + 1, the launcher's base hash), ``wait(...)`` polls with a deadline.
A ``ProbeRecorder`` thread records every /livez and /readyz answer, as the kubelet would see them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from harness.ports import free_port
from tuner.actuators import children
from tuner.portable import argv as argvs
from tuner.portable import pod_protocol as protocol

REPO = Path(__file__).resolve().parents[2]
FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


# What the tests' overrides may set (the agent writes the real list from its rules: tuner.kube.podside).
TEST_ALLOWED = protocol.Allowed({"--max-num-seqs": protocol.Bound("int", 1, 65536),
                                 "--max-model-len": protocol.Bound("int", 1, 2**24),
                                 "--start-seconds": protocol.Bound("float", 0, 3600)})


def fake_engine_argv(port: int, *extra: str, python: str = sys.executable) -> list[str]:
    return [python, str(FAKE_ENGINE), "--port", str(port), *extra]


class LauncherProcess:
    def __init__(self, state_dir: Path, engine_argv: Sequence[str], *, python: str = sys.executable,
                 zipapp: Path | None = None, options: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_path: Path | None = None, wrapper: Sequence[str] = (),
                 allowed: protocol.Allowed | None = TEST_ALLOWED) -> None:
        self.state_dir = Path(state_dir)
        self.allowed = allowed  # written at start() unless one is there (None: none)
        self.engine_argv = list(engine_argv)
        self.probe_port = free_port()
        entry = [str(zipapp)] if zipapp is not None else ["-m", "tuner.launcher"]
        # --desired-wait 0: no agent here, the engine starts at once unless a test wrote desired.json first
        self.argv = [*wrapper, python, *entry, "--state-dir", str(self.state_dir), "--probe-port",
                     str(self.probe_port), "--poll", "0.2", "--desired-wait", "0", *options, "--", *self.engine_argv]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = log_path or self.state_dir / "launcher.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.generation = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.probe_port}"

    @property
    def base_sha256(self) -> str:
        return argvs.sha256(self.engine_argv)

    def start(self) -> LauncherProcess:
        if self.proc is not None:
            raise RuntimeError("this launcher was already started")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.allowed is not None and not (self.state_dir / protocol.ALLOWED).exists():
            protocol.write_allowed(self.state_dir, self.allowed)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=str(REPO), start_new_session=True)
        return self

    # -- reading -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return protocol.read_status(self.state_dir) or {}

    def probe(self, path: str, timeout: float = 5) -> tuple[int, str]:
        try:
            r = httpx.get(self.url + path, timeout=timeout)
        except httpx.HTTPError as exc:
            return 0, f"{type(exc).__name__}: {exc}"
        return r.status_code, r.text

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, predicate: Callable[[dict[str, Any]], Any], timeout: float, what: str, *,
             poll: float = 0.2) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st and predicate(st):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:g}s for the launcher: {what}; status: "
                                   f"{ {k: st.get(k) for k in ('state', 'ready_reason', 'generation', 'desired_error', 'candidate_failure')} }"
                                   f"\n{self.log_tail()}")
            if not self.alive():
                raise RuntimeError(f"the launcher exited ({self.proc.returncode if self.proc else None}) while "
                                   f"waiting for {what}\n{self.log_tail()}")
            time.sleep(poll)

    def wait_state(self, state: str, timeout: float, *, generation: int | None = None) -> dict[str, Any]:
        return self.wait(lambda st: st.get("state") == state and (generation is None or st.get("generation") == generation),
                         timeout, f"state {state}" + (f" at generation {generation}" if generation else ""))

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    # -- the agent's side ----------------------------------------------------------------------------
    def request(self, overrides: Sequence[tuple[str, argvs.Value]] = (), *, drain: bool = False,
                base_sha256: str | None = None) -> int:
        """Write the next desired.json generation; returns it."""
        self.generation += 1
        self.state_dir.mkdir(parents=True, exist_ok=True)
        protocol.write_desired(self.state_dir, generation=self.generation, overrides=overrides,
                               base_sha256=base_sha256 or self.base_sha256, drain=drain)
        return self.generation

    # -- stopping ------------------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM the launcher (as the kubelet does), SIGKILL its whole session after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self.kill_all()
        return self.proc.returncode

    def kill_all(self) -> None:
        """Last resort: SIGKILL the launcher's session (the engines it started have sessions of their own
        and are found through their parent)."""
        if self.proc is None:
            return
        pids = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        children.stop(self.proc, timeout_seconds=0, signal_first=None, group=True)  # reaped (or Unstoppable)

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return b"".join(collections.deque(f, maxlen=n)).decode("utf-8", "replace")
        return "<no log>"

    def wait_log(self, text: str, timeout: float = 10) -> None:
        """Until ``text`` is anywhere in the launcher's log. The loop logs what it saw at its next turn,
        which can come after a probe or status.json already tells (measured: a probe answered 503 before
        the loop had logged "liveness fails" on a loaded box)."""
        deadline = time.monotonic() + timeout
        while text.encode() not in self.log_path.read_bytes():
            assert time.monotonic() < deadline, (f"not in the launcher's log within {timeout:g}s: {text!r}\n"
                                                 f"{self.log_tail()}")
            time.sleep(0.1)

    def __enter__(self) -> LauncherProcess:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(timeout=30)


def descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                kids[int(fields[1])].append(int(d.name))
    out, stack = [], [root]
    while stack:
        for c in kids.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def proc_state(pid: int) -> str | None:
    """'R', 'S', 'Z', ... or None when the pid is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append(int(d.name))
    return out


class ProbeRecorder:
    """Polls /livez and /readyz every ``period`` seconds (the kubelet's view) until ``stop()``."""

    def __init__(self, url: str, period: float = 0.5) -> None:
        self.url, self.period = url, period
        self.samples: list[tuple[float, str, int, str]] = []  # (time, path, code, body)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=3) as client:
            while not self._stop.is_set():
                for path in ("/livez", "/readyz"):
                    try:
                        r = client.get(self.url + path)
                        self.samples.append((time.time(), path, r.status_code, r.text.strip()))
                    except httpx.HTTPError as exc:
                        self.samples.append((time.time(), path, 0, type(exc).__name__))
                self._stop.wait(self.period)

    def start(self) -> ProbeRecorder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def wait_first(self, timeout: float = 10) -> ProbeRecorder:
        """Until both probes have been sampled once (so the record starts before what a test does next)."""
        deadline = time.monotonic() + timeout
        while {p for _, p, _, _ in self.samples} != {"/livez", "/readyz"}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no probe sample from {self.url} in {timeout:g}s")
            time.sleep(0.02)
        return self

    def codes(self, path: str) -> list[int]:
        return [code for _, p, code, _ in self.samples if p == path]

    def liveness_held(self, *, period: float = 10, failure_threshold: int = 6) -> tuple[bool, str]:
        """Whether a kubelet probing /livez with the component's settings (periodSeconds 10,
        failureThreshold 6: tuner/kube/injecting.py) would have kept the container: /livez
        answered 200, and no run of failed probes — an answer other than 200, or none (a timeout on a loaded
        box) — lasted as long as the kubelet's ``failure_threshold`` periods. (held, what was seen): the
        failed samples are named either way."""
        samples = [(t, code, body) for t, p, code, body in self.samples if p == "/livez"]
        if not any(code == 200 for _, code, _ in samples):
            return False, "/livez never answered 200"
        longest, since = 0.0, None
        for t, code, _ in samples:
            if code != 200:
                since = t if since is None else since
                longest = max(longest, t - since + self.period)
            else:
                since = None
        failed = [(code, body) for _, code, body in samples if code != 200]
        seen = (f"{len(failed)} of {len(samples)} samples failed (first: {failed[:3]}), at most {longest:.1f} s "
                "in a row")
        return longest < period * failure_threshold, seen

    def transitions(self, path: str) -> list[int]:
        """The /readyz (or /livez) codes with repeats collapsed, unanswered samples left out (a loaded box
        may time a probe out): e.g. [503, 200, 503, 200]."""
        out: list[int] = []
        for code in self.codes(path):
            if code == 0:
                continue
            if not out or out[-1] != code:
                out.append(code)
        return out
