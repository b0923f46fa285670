"""What the fault-injection tests share: a pool of simulated replicas run by ``vllm-tuner run`` as a
subprocess, a load balancer that remembers who is drained, the kill hook, and the invariants.

- ``Balancer``: a tiny HTTP "load balancer" living in the test process (so it outlives every tuner
  process, as nginx does): the tuner's http drainer calls ``POST /drain?name=…&url=…`` and
  ``/undrain``; it records the drained set and forwards the call to the simulated engine's
  ``/sim/drain`` (the demo's drain hook: the engine's own load generator pauses), best effort.
- ``SimPool``: a work directory, two (or more) simulated vLLM replicas that the tuner launches itself
  (process actuator running ``python -m tuner.sim.engine``, as ``tuner/cli/demo.py::live_config``), a
  rule that doubles ``--max-num-seqs`` 8 → 16 once, every timing short.
- ``Tuner``: ``vllm-tuner run --config FILE`` in its own process group; ``kill_at`` / ``stop_at`` /
  ``erofs_flag`` load ``hook/sitecustomize.py``, which SIGKILLs (SIGSTOPs) the tuner the moment a given
  journal record is durable, or fails the journal's writes with EROFS.
- ``check_invariants``: the promises, checked from the outside (journal, state.json, /proc, the engines,
  the balancer).

Every wait has a deadline; nothing asserts on wall-clock time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness import waiting
from harness.ports import free_port
from tuner.actuators import children
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.sources import live_knobs

ROOT = Path(__file__).resolve().parents[2]
HOOK_DIR = Path(__file__).resolve().parent / "hook"
SIM_COMMAND = [sys.executable, "-m", "tuner.sim.engine"]

# rules/default.yaml's queue-slot-bound, fast: one window, capped at 16 so one rollout is all there is.
QUEUE_RULE: dict[str, Any] = {
    "id": "faults-queue-slot-bound",
    "description": "queue-slot-bound for the fault tests: one window, 8 → 16 once",
    "priority": 50,
    "adds_load": True,
    "cooldown": "1h",
    "verify": [{"signal": "itl_mean_s", "expect": "no-increase", "tolerance": 1.0}],
    "when": {"for": 1, "all": [
        {"signal": "requests_waiting_max", "op": ">=", "value": 1},
        {"signal": "requests_running_max", "op": ">=", "value": 0.9, "times": "--max-num-seqs"},
    ]},
    "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 16},
}


# the harness's one wait, failing as an assertion here, polled often (simulated engines are quick)
wait_for = functools.partial(waiting.wait_for, poll=0.05, error=AssertionError)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# --- the load balancer ------------------------------------------------------------------------------


class Balancer:
    """Remembers which replicas are drained, across tuner restarts (it lives in the test process)."""

    def __init__(self) -> None:
        self.drained: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        balancer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                name, engine = query.get("name", ""), query.get("url", "")
                if url.path not in ("/drain", "/undrain") or not name:
                    self.send_response(404)
                    self.end_headers()
                    return
                with balancer.lock:
                    balancer.calls.append((url.path[1:], name))
                    (balancer.drained.add if url.path == "/drain" else balancer.drained.discard)(name)
                with contextlib.suppress(OSError):  # the engine may be down: the balancer's state is what counts
                    urllib.request.urlopen(urllib.request.Request(f"{engine}/sim{url.path}", method="POST"),
                                           timeout=2).close()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def drain_settings(self) -> dict[str, Any]:
        return {"kind": "http", "drain_url": self.url + "/drain?name={name}&url={url}",
                "undrain_url": self.url + "/undrain?name={name}&url={url}", "timeout_seconds": 5}

    def start(self) -> Balancer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- the tuner --------------------------------------------------------------------------------------


def hook_env(journal: Path, *, kill_at: int | str | None = None, stop_at: int | str | None = None,
             erofs_flag: Path | None = None) -> dict[str, str]:
    """The environment that loads ``hook/sitecustomize.py`` into a tuner (empty: no fault). ``kill_at`` /
    ``stop_at``: a record count, or ``"replica=a,to=starting"`` (the last record's fields)."""
    if kill_at is None and stop_at is None and erofs_flag is None:
        return {}
    env = {"PYTHONPATH": os.pathsep.join([str(HOOK_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "FAULTS_JOURNAL": str(journal)}
    if kill_at is not None or stop_at is not None:
        env["FAULTS_AT"] = str(kill_at if kill_at is not None else stop_at)
        env["FAULTS_SIGNAL"] = "KILL" if kill_at is not None else "STOP"
    if erofs_flag is not None:
        env["FAULTS_EROFS_FLAG"] = str(erofs_flag)
    return env


class Tuner:
    """``vllm-tuner run`` as a subprocess in its own process group, output appended to ``log``."""

    def __init__(self, config: Path, log: Path, *, journal: Path, kill_at: int | str | None = None,
                 stop_at: int | str | None = None, erofs_flag: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}),
                **hook_env(journal, kill_at=kill_at, stop_at=stop_at, erofs_flag=erofs_flag)}
        self.log = log
        with open(log, "ab") as out:
            out.write(f"=== test: tuner start at {time.time():.3f} (kill_at={kill_at}, stop_at={stop_at})\n".encode())
            out.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "tuner", "run", "--config", str(config)],
                                         cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=full, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def is_stopped(self) -> bool:
        """Frozen by SIGSTOP (the hook's ``stop_at``)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] == "T"

    def wait_stopped(self, timeout: float = 180) -> None:
        wait_for(lambda: self.is_stopped() or not self.alive(), timeout, "the tuner to reach its stop point",
                 detail=self.tail)
        assert self.is_stopped(), f"the tuner exited ({self.proc.returncode}) before its stop point\n{self.tail()}"

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the tuner did not exit within {timeout:g}s\n{self.tail()}") from None

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM to the tuner alone (as systemd's KillMode=mixed would); SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
                os.kill(self.proc.pid, signal.SIGCONT)  # in case it was frozen
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the tuner did not stop within {timeout:g}s of SIGTERM\n{self.tail()}") from None
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL to its group (a frozen tuner too), reaped."""
        children.stop(self.proc, timeout_seconds=0, signal_first=None, group=True)

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return "<no log>"


# --- a pool of simulated replicas --------------------------------------------------------------------


@dataclass
class Timings:
    interval_seconds: float = 0.5
    verify_seconds: float = 1.0
    poll_seconds: float = 0.1
    start_timeout_seconds: float = 30.0
    sim_startup_seconds: float = 0.3


@dataclass
class SimPool:
    """Simulated replicas the tuner launches itself, behind ``balancer``. Nothing runs until a tuner starts."""

    work: Path
    names: Sequence[str] = ("sim-a", "sim-b")
    timings: Timings = field(default_factory=Timings)
    rules: Sequence[Mapping[str, Any]] = (QUEUE_RULE,)
    max_num_seqs: int = 8
    users: int = 48
    ports: dict[str, int] = field(default_factory=dict)
    tuner: Tuner | None = None
    listen_port: int = 0
    state_dir: Path | None = None  # where state.json (and the journal) live (default: work; a test may mount one)
    journal_dir: Path | None = None  # where the journal lives (default: state_dir)
    upstream_file: Path | None = None  # drained through real nginx (this include file) instead of the balancer
    live_cap: int | None = None  # live knobs on: the engines start with their admission cap at this, inside max_num_seqs

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.ports = {n: free_port() for n in self.names}
        self.listen_port = free_port()
        self.state_dir = self.state_dir or self.work
        self.balancer = Balancer().start()

    # -- paths ------------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.work / "tuner.yaml"

    @property
    def journal_path(self) -> Path:
        return (self.journal_dir or self.state_dir) / "journal.jsonl"

    @property
    def state_path(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def engines_dir(self) -> Path:
        return self.work / "engines"

    def live_dir(self, name: str) -> Path:
        return self.work / "live" / name

    def live_cap_of(self, name: str) -> int | None:
        """The admission cap every engine core of ``name`` acknowledged last (None: no acknowledgement)."""
        acks = live_knobs.read_acks(self.live_dir(name))
        caps = {a.effective.get("max_num_active_seqs") for a in acks}
        return caps.pop() if len(caps) == 1 else None

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def args(self, name: str) -> list[str]:
        return ["--port", str(self.ports[name]), "--max-num-seqs", str(self.max_num_seqs),
                "--sim-concurrency", str(self.users), "--sim-startup-seconds", str(self.timings.sim_startup_seconds),
                "--sim-time-scale", "4", "--sim-prompt-tokens", "256", "--sim-output-tokens", "32",
                "--sim-max-tokens", "64", "--shutdown-timeout", "5", "--enable-server-load-tracking"]

    # -- configuration ----------------------------------------------------------------------------
    def config(self, **overrides: Any) -> dict[str, Any]:
        t = self.timings
        rules = self.work / "rules.yaml"
        rules.write_text(yaml.safe_dump({"version": 1, "rules": [dict(r) for r in self.rules]}, sort_keys=False))
        cfg: dict[str, Any] = {
            "mode": "apply",
            "targets": [{"name": n, "metrics_url": f"{self.url(n)}/metrics", "args": self.args(n)} for n in self.names],
            "scrape": {"interval_seconds": t.interval_seconds, "window_seconds": 4 * t.interval_seconds,
                       "min_snapshots": 2, "deadline_seconds": 2},
            "rule_files": [str(rules)],
            "decisions": {"safety": {"cooldown_seconds": 0, "max_restarts_per_hour": 20,
                                     "restart_evidence_seconds": 0},
                          "idle": {"keep_warm_after_seconds": None, "warm_up_after_restart": False,
                                   "min_requests_per_window": 0}},
            "actuator": {"kind": "process", "command": SIM_COMMAND, "state_dir": str(self.engines_dir),
                         "log_dir": str(self.work / "logs")},
            "drain": self.balancer.drain_settings(),
            "rollout": {"verify_seconds": t.verify_seconds, "poll_seconds": t.poll_seconds,
                        "idle_settle_seconds": 0.1, "idle_timeout_seconds": 10, "stop_timeout_seconds": 15,
                        "force_after_seconds": 5, "start_timeout_seconds": t.start_timeout_seconds,
                        "start_margin_seconds": 5, "warmup_requests": 1, "hold_timeout_seconds": 60,
                        "journal_file": str(self.journal_path)},
            "daemon": {"listen_port": self.listen_port, "state_file": str(self.state_path)},
        }
        if self.live_cap is not None:
            cfg["live"] = {"enabled": True, "control_dir": str(self.work / "live" / "{name}"),
                           "ack_timeout_seconds": 10}
        for dotted, value in overrides.items():
            *path, last = dotted.split(".")
            node = cfg
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        return cfg

    def write_config(self, **overrides: Any) -> Path:
        self.config_path.write_text(json.dumps(self.config(**overrides), indent=1))
        if self.live_cap is not None:  # the bad start: the cap below what the engine was started with
            for name in self.names:
                live_knobs.write_request(live_knobs.prepare_control_dir(self.live_dir(name)), 1,
                                         max_num_active_seqs=self.live_cap)
        return self.config_path

    # -- running ----------------------------------------------------------------------------------
    def start_tuner(self, *, kill_at: int | str | None = None, stop_at: int | str | None = None,
                    erofs_flag: Path | None = None, env: Mapping[str, str] | None = None) -> Tuner:
        if self.tuner is not None and self.tuner.alive():
            raise RuntimeError("a tuner is already running")
        if not self.config_path.exists():
            self.write_config()
        self.tuner = Tuner(self.config_path, self.work / "tuner.log", journal=self.journal_path, kill_at=kill_at,
                           stop_at=stop_at, erofs_flag=erofs_flag, env=env)
        return self.tuner

    def status(self) -> dict[str, Any] | None:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.listen_port}/status", timeout=2)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def healthz(self) -> int | None:
        try:
            return httpx.get(f"http://127.0.0.1:{self.listen_port}/healthz", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def cycle(self) -> int:
        s = self.status()
        return int((s or {}).get("cycle") or 0)

    def wait_cycles(self, n: int, timeout: float = 60) -> int:
        """Wait until the running tuner has finished ``n`` more cycles than now."""
        start = self.cycle()
        return int(wait_for(lambda: self.cycle() >= start + n and self.cycle(), timeout, f"{n} more cycles",
                            poll=0.1, detail=self.diagnostics))

    def records(self) -> list[dict[str, Any]]:
        return [dict(r) for r in journaling.read_records(self.journal_path)]

    def rollouts(self) -> dict[str, machine.Rollout]:
        return journaling.replay(self.records())

    def finished_rollout(self) -> machine.Rollout | None:
        """The last rollout, once it has finished."""
        rollouts = list(self.rollouts().values())
        if rollouts and machine.outcome(rollouts[-1]) is not machine.Outcome.RUNNING:
            return rollouts[-1]
        return None

    def pidfile(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.engines_dir / f"{name}.json").read_text()))
        except (OSError, ValueError):
            return None

    def live_argv(self, name: str) -> list[str] | None:
        """The arguments the engine process runs with, from /proc (after the actuator's command)."""
        data = self.pidfile(name)
        if data is None:
            return None
        try:
            raw = Path(f"/proc/{data['pid']}/cmdline").read_bytes()
        except OSError:
            return None
        argv = [a.decode() for a in raw.split(b"\0")[:-1]]
        return argv[len(SIM_COMMAND):] if argv[:len(SIM_COMMAND)] == SIM_COMMAND else None

    def engine_state(self, name: str) -> dict[str, Any] | None:
        try:
            r = httpx.get(f"{self.url(name)}/sim/state", timeout=2)
        except httpx.HTTPError:
            return None
        return dict(r.json()) if r.status_code == 200 else None

    def state(self) -> dict[str, Any]:
        return dict(json.loads(self.state_path.read_text()))

    def diagnostics(self) -> str:
        parts = [f"--- tuner log ---\n{self.tuner.tail(60) if self.tuner else ''}"]
        parts.append("--- journal ---\n" + "\n".join(json.dumps(r)[:300] for r in self.records()[-30:]))
        return "\n".join(parts)

    def drained(self) -> set[str]:
        """Who the load balancer has out of service now."""
        if self.upstream_file is None:
            with self.balancer.lock:
                return set(self.balancer.drained)
        return {line.rsplit("# ", 1)[1].strip() for line in self.upstream_file.read_text().splitlines()
                if line.startswith("server ") and " down;" in line}

    def stop_engines(self) -> None:
        """The engines run in their own sessions and outlive the tuner: stop them (pid files, then ports)."""
        for name in self.names:
            data = self.pidfile(name)
            if data is not None and self.live_argv(name) is not None:  # still our engine (not a reused pid)
                with contextlib.suppress(OSError):
                    os.killpg(int(data["pid"]), signal.SIGKILL)
        for name in self.names:  # an engine whose pid file was never written (killed mid-start)
            for pid in pids_with_port(self.ports[name]):
                with contextlib.suppress(OSError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)

    def close(self) -> None:
        if self.tuner is not None:
            self.tuner.kill()
        self.stop_engines()
        self.balancer.stop()


def forward_records(pool: SimPool) -> int:
    """Journal records of a rollout of every replica that goes through without a fault: the decision,
    the rollout, ten transitions per replica (go … verified)."""
    return 2 + 10 * len(pool.names)


def pids_with_port(port: int) -> list[int]:
    """Processes whose command line carries ``--port PORT`` (this test's own engines: it chose the port)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = d.joinpath("cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for i, a in enumerate(argv[:-1]):
            if a == b"--port" and argv[i + 1] == str(port).encode():
                found.append(int(d.name))
    return found


@contextlib.contextmanager
def sim_pool(work: Path, **kwargs: Any) -> Iterator[SimPool]:
    pool = SimPool(work, **kwargs)
    try:
        yield pool
    finally:
        pool.close()


# --- the invariants ----------------------------------------------------------------------------------


def the_one_rollout(pool: SimPool, *, before_kill: bytes = b"") -> machine.Rollout:
    """Acknowledged = durable (the journal still begins with every byte it held at the kill); one rollout
    began and finished; no decision was lost (each one began it or was the last record before the kill)."""
    data = pool.journal_path.read_bytes()
    assert data.startswith(before_kill), "the journal lost or changed acknowledged records across the kill"
    records = pool.records()
    begun = [r for r in records if r["kind"] == "rollout"]
    assert len(begun) == 1, f"expected exactly one rollout, the journal has {len(begun)}\n{pool.diagnostics()}"
    rollout = journaling.replay(records)[begun[0]["rollout"]["id"]]
    outcome = machine.outcome(rollout)
    assert outcome in (machine.Outcome.DONE, machine.Outcome.ROLLED_BACK), machine.describe(rollout)
    killed_last = json.loads(before_kill.splitlines()[-1]) if before_kill else None
    for d in (r for r in records if r["kind"] == "decision"):
        assert d["rollout"] == rollout.id or d == killed_last, f"decision {d['rollout']} neither began nor was cut"
    return rollout


def every_kill_point(n: int, kill_at: Callable[[int], str], *, parallel: int) -> Counter[str]:
    """``kill_at(k)`` for every k in 1..n, ``parallel`` at a time (each is mostly waiting); the outcomes.
    Every broken kill point is collected and reported, not just the first."""
    outcomes: Counter[str] = Counter()
    failures: dict[int, str] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as runs:
        futures = {runs.submit(kill_at, k): k for k in range(1, n + 1)}
        for future in concurrent.futures.as_completed(futures):
            k = futures[future]
            try:
                outcomes[future.result()] += 1
            except Exception as exc:
                failures[k] = "".join(traceback.format_exception_only(exc)).strip()[:3000]
    report = "\n\n".join(f"k={k}: {why}" for k, why in sorted(failures.items()))
    assert not failures, f"{len(failures)} of {n} kill points broke a promise:\n{report}"
    assert sum(outcomes.values()) == n and set(outcomes) <= {"done", "rolled_back"}, outcomes
    return outcomes


def check_invariants(pool: SimPool, *, before_kill: bytes = b"") -> machine.Rollout:
    """The promises after a fault, checked from the outside; the rollout (finished) they hold for.

    - acknowledged = durable: the journal still begins with every byte it held at the kill;
    - one rollout: at most one began, and it finished; no decision was lost (each one either began its
      rollout or was the last record before the kill);
    - no double booking: each replica's restart history holds one restart per rollout leg it went
      through (one for a replica that was restarted, none for one never admitted);
    - the pool runs verified arguments: every engine's live argv (/proc) is what state.json says the
      tuner owns: the new arguments where the rollout ended done, the old ones where it rolled back;
    - nothing left drained: the balancer has every replica in service, every engine answers /health.
    """
    rollout = the_one_rollout(pool, before_kill=before_kill)
    assert rollout.kind is machine.Kind.RESTART, machine.describe(rollout)
    state = pool.state()["targets"]
    for p in rollout.progress:
        name = p.name
        live = pool.live_argv(name)
        owned = state[name]["args"]
        assert live == owned, f"{name} runs {live}, the tuner's state says {owned}\n{pool.diagnostics()}"
        expected = rollout.new_argv[name] if p.state is machine.State.DONE else rollout.old_argv[name]
        assert tuple(owned) == tuple(expected), f"{name} ({p.state.value}) owns {owned}, expected {expected}"
        restarts = state[name]["history"].get("restarts", [])
        admitted = p.state is not machine.State.PENDING
        assert len(restarts) == (1 if admitted else 0), (
            f"{name}: {len(restarts)} restarts booked for one rollout ({p.state.value}): {restarts}")
    drained = pool.drained()
    assert not drained, f"left drained in the load balancer: {sorted(drained)}"
    for name in pool.names:
        st = pool.engine_state(name)
        assert st is not None and not st["drained"], f"{name}: engine state {st}"
    return rollout


def check_live_invariants(pool: SimPool, *, pids: Mapping[str, int], before_kill: bytes = b"") -> machine.Rollout:
    """The promises after a fault in a live change (machine Rule 5); the rollout (finished) they hold for.

    - acknowledged = durable, one rollout (a live one) that finished, no decision lost (as above);
    - nothing restarted: every engine is the process it was before the fault (``pids``), on the command
      line the tuner owns, which the live change left untouched, and no restart is booked;
    - the pool runs what the rollout says: every engine core's acknowledged cap is the new value where
      the rollout ended done, the old one where it went back (the pool goes back together);
    - nothing drained.
    """
    rollout = the_one_rollout(pool, before_kill=before_kill)
    assert rollout.kind is machine.Kind.LIVE, machine.describe(rollout)
    state = pool.state()["targets"]
    for p in rollout.progress:
        name = p.name
        assert (pool.pidfile(name) or {}).get("pid") == pids[name], f"{name} was restarted\n{pool.diagnostics()}"
        owned = state[name]["args"]
        assert pool.live_argv(name) == owned and tuple(owned) == rollout.old_argv[name], (
            f"{name} runs {pool.live_argv(name)}, owns {owned}: a live change leaves the command line as it is")
        assert state[name]["history"].get("restarts", []) == [], f"{name}: a restart booked for a live change"
        values = rollout.new_values if p.state is machine.State.DONE else rollout.old_values
        assert pool.live_cap_of(name) == values[name]["max_num_seqs"], (
            f"{name} ({p.state.value}) runs cap {pool.live_cap_of(name)}, expected {values[name]}\n{pool.diagnostics()}")
    drained = pool.drained()
    assert not drained, f"left drained in the load balancer: {sorted(drained)}"
    return rollout


# --- a small file system for the journal and the state file ---------------------------------------------


def mount_reason() -> str | None:
    """Why this test cannot mount a tmpfs and a small ext2 image here (None: it can)."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    if shutil.which("mkfs.ext2") is None:
        return "mkfs.ext2 is missing (apt-get install e2fsprogs)"
    probe = Path(f"/tmp/vllm-tuner-faults-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(probe)], capture_output=True,
                              text=True, timeout=30, check=False)
        if done.returncode != 0:
            return f"mount -t tmpfs failed: {done.stderr.strip()}"
        subprocess.run(["umount", str(probe)], capture_output=True, timeout=30, check=False)
        return None
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


@contextlib.contextmanager
def small_fs(path: Path, *, size_kib: int, block_kib: int | None = None) -> Iterator[Path]:
    """A file system of ``size_kib`` mounted at ``path`` (a directory this test owns), unmounted on the way
    out: a tmpfs, or with ``block_kib`` an ext2 image with blocks that small on a loop device. A file's last
    block is where a full disk still takes appends: a tmpfs's 4 KiB page can hold a whole rollout's
    remaining records, a 1 KiB block cannot."""
    path.mkdir(parents=True, exist_ok=True)
    image = path.parent / f"{path.name}.ext2"
    if block_kib is None:
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0755", "tmpfs", str(path)]
    else:
        with open(image, "wb") as f:
            f.truncate(size_kib * 1024)
        subprocess.run(["mkfs.ext2", "-q", "-F", "-b", str(block_kib * 1024), "-m", "0", str(image)], check=True,
                       capture_output=True, timeout=60)
        mount = ["mount", "-o", "loop", str(image), str(path)]
    subprocess.run(mount, check=True, capture_output=True, timeout=60)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)
        image.unlink(missing_ok=True)


def remount(path: Path, *, read_only: bool) -> None:
    subprocess.run(["mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(path)], check=True,
                   capture_output=True, timeout=30)


def fill(path: Path) -> Path:
    """Take every free byte of ``path``'s file system with one file (removed to give the space back)."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size) > 0:
                    pass
    finally:
        os.close(fd)
    return filler
