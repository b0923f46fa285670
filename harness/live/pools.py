"""A pool of replicas that the tuner launches itself (process actuator) behind a real nginx, torn down in
order; the processes around it (engines found by the ``--port`` this run chose, never by name, and the
last-resort cleanup of them) and a busy neighbour (``cpu_hog``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from harness import required
from harness.live.config import (
    ENGINE_ENV,
    Timing,
    engine_args,
    engine_command,
    rules_file,
    tuner_config,
    write_config,
)
from harness.live.journal import finished, journal_records, rollout_ids
from harness.live.load import LiveLoad
from harness.live.tuner_process import TunerProcess
from harness.waiting import wait_for
from tuner.actuators import children

# --- prerequisites ------------------------------------------------------------------------------------


def require_nginx() -> None:
    """Skip without nginx — or fail, under VLLM_TUNER_REQUIRE_E2E=1 (``make test``, CI), where a
    missing load balancer must not pass silently."""

    from harness import nginx as nginx_support

    required.need(nginx_support.skip_reason(), "real nginx (the live rollout tests)")


# --- waiting, processes ---------------------------------------------------------------------------------


def metric(base_url: str, name: str) -> float | None:
    """The sum of a metric's samples in an engine's /metrics (None if unreadable or absent)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + "{", name + " "))]
    return sum(values) if values else None


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def proc_argv(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]]


def listening_pids(port: int) -> list[int]:
    """PIDs of processes whose command line carries ``--port PORT`` (the engines of this run)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        argv = proc_argv(int(d.name))
        if argv and "--port" in argv[:-1] and argv[argv.index("--port") + 1] == str(port):
            found.append(int(d.name))
    return found


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` (last occurrence, as argparse reads it)."""
    value = None
    for i, a in enumerate(argv[:-1]):
        if a == flag:
            value = argv[i + 1]
    return value


def kill_engines_on_ports(ports: Iterable[int], *, grace_seconds: float = 20) -> list[int]:
    """SIGTERM, then SIGKILL, the process groups of engines started with one of ``ports`` (ports this
    run picked itself, so nobody else's processes). Returns the PIDs it found."""
    pids = [pid for port in ports for pid in listening_pids(port)]
    groups = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, sig)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and _alive(p) for p in pids):
            time.sleep(0.2)
    return pids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# --- a pool of replicas launched by the tuner (process actuator) behind nginx ---------------------------


class ProcessPool:
    """Two (or more) replicas that ``vllm-tuner run`` launches itself (actuator ``process``), behind a
    real nginx (drain ``nginx``). Used by the evaluation's tuner arms and bench/rollout_bench.py.

    ``with ProcessPool(work, model, ["a", "b"], rules=[QUEUE_RULE]) as pool:`` starts nginx and the tuner
    and waits until both engines serve; leaving stops the tuner (SIGTERM), then the engines (the
    actuator's own stop, SIGKILL after 30 s), then nginx.
    """

    def __init__(self, work: Path, model: Path, names: Sequence[str], *, rules: Sequence[Mapping[str, Any]],
                 timing: Timing = Timing(), max_num_seqs: int = 4, start_timeout: float = 600,  # noqa: B008 (frozen)
                 client_keepalive_seconds: int = 0, api_key: str | None = None,
                 live_cap: int | None = None, nginx_binary: str | None = None,
                 nginx_worker_connections: int = 1024, nginx_read_timeout_seconds: float = 120) -> None:
        from harness import nginx as nginx_support

        self.work, self.model, self.names, self.timing = work, model, tuple(names), timing
        # A token-protected pool: the engines run with --api-key (vLLM guards /v1/*), the tuner reads the
        # token from scrape.bearer_token_file, the load sends it.
        self.api_key = api_key
        # Live knobs: the tuner starts the engines with VLLM_TUNER_CONTROL_DIR (vllm-tuner-plugin) and the
        # admission cap starts at ``live_cap`` inside the --max-num-seqs envelope.
        self.live_cap = live_cap
        self.max_num_seqs = max_num_seqs
        self.start_timeout = start_timeout
        self.ports = {n: nginx_support.free_port() for n in self.names}
        self.listen_port = nginx_support.free_port()
        # Client keep-alive off (the default, see harness/nginx.py): every drain reloads nginx, and
        # a reload closes idle keep-alive connections under a client about to reuse them.
        self.client_keepalive_seconds = client_keepalive_seconds
        self.lb = nginx_support.NginxBalancer({n: f"127.0.0.1:{p}" for n, p in self.ports.items()},
                                              client_keepalive_seconds=client_keepalive_seconds,
                                              binary=nginx_binary, worker_connections=nginx_worker_connections,
                                              read_timeout_seconds=nginx_read_timeout_seconds)
        self.tuner: TunerProcess | None = None
        self._rules = list(rules)
        self._tag = 0

    # -- paths and views --------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.work / "config.yaml"

    @property
    def journal_path(self) -> Path:
        return self.work / "journal.jsonl"

    @property
    def state_dir(self) -> Path:
        return self.work / "engines"

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def args(self, name: str, max_num_seqs: int | None = None) -> list[str]:
        extra = ("--api-key", self.api_key) if self.api_key else ()
        return engine_args(self.model, self.ports[name], max_num_seqs=max_num_seqs or self.max_num_seqs, extra=extra)

    def records(self) -> list[dict[str, Any]]:
        return journal_records(self.journal_path)

    def pidfile(self, name: str) -> dict[str, Any]:
        return dict(json.loads((self.state_dir / f"{name}.json").read_text()))

    def live_argv(self, name: str) -> list[str]:
        """The running engine's arguments from /proc/<pid>/cmdline (after the actuator's command)."""
        argv = proc_argv(int(self.pidfile(name)["pid"]))
        prefix = engine_command()
        if argv is None or argv[:len(prefix)] != prefix:
            raise AssertionError(f"{name}: pid {self.pidfile(name)['pid']} runs {argv}")
        return argv[len(prefix):]

    def state(self) -> dict[str, Any]:
        return dict(json.loads((self.work / "state.json").read_text()))

    def state_args(self, name: str) -> list[str]:
        return list(self.state()["targets"][name]["args"])

    def history(self, name: str) -> dict[str, Any]:
        return dict(self.state()["targets"][name]["history"])

    def diagnostics(self) -> str:
        parts = [f"--- tuner log ---\n{self.tuner.log_tail(80) if self.tuner else ''}"]
        for n in self.names:
            log = self.state_dir / f"{n}.log"
            if log.exists():
                lines = log.read_text(errors="replace").splitlines(True)[-25:]
                parts.append(f"--- {n}.log ---\n" + "".join(lines))
        err = self.lb.dir / "error.log"
        if err.exists():
            parts.append("--- nginx error.log ---\n" + err.read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    # -- the tuner --------------------------------------------------------------------------------
    def configure(self, rules: Sequence[Mapping[str, Any]]) -> None:
        """(Re)write the config with these rules; the engine args stay those of the first config
        (the tuner keeps its own changes across restarts as long as ``targets[].args`` is unchanged)."""
        self._tag += 1
        rules_path = rules_file(self.work / f"rules-{self._tag}.yaml", rules)
        config = tuner_config(
            self.work, targets={n: self.args(n) for n in self.names}, ports=self.ports, rules=rules_path,
            listen_port=self.listen_port, timing=self.timing,
            actuator={"kind": "process", "command": engine_command(), "state_dir": str(self.state_dir),
                      "env": dict(ENGINE_ENV)},
            drain={"kind": "nginx", "upstream_file": str(self.lb.upstream_file), "nginx": self.lb.command,
                   "servers": {n: f"127.0.0.1:{p}" for n, p in self.ports.items()}, "parameters": "max_fails=0",
                   "settle_seconds": 1},
        )
        if self.live_cap is not None:
            from tuner.sources import live_knobs

            config["live"] = {"enabled": True, "control_dir": str(self.work / "live" / "{name}"),
                              "ack_timeout_seconds": 60, "verify_seconds": config["rollout"]["verify_seconds"]}
            for n in self.names:
                d = self.work / "live" / n
                if not (d / "control.json").exists():
                    live_knobs.write_request(live_knobs.prepare_control_dir(d), 1, max_num_active_seqs=self.live_cap)
        if self.api_key:
            token = self.work / "engine-token"
            token.write_text(self.api_key + "\n")
            token.chmod(0o600)
            config["scrape"]["bearer_token_file"] = str(token)
        write_config(self.config_path, config)

    def start_tuner(self) -> TunerProcess:
        if self.tuner is not None and self.tuner.alive():
            raise RuntimeError("the tuner is already running")
        self.tuner = TunerProcess(self.config_path, listen_port=self.listen_port,
                                  log_path=self.work / "tuner.log").start()
        return self.tuner

    def stop_tuner(self) -> int | None:
        return self.tuner.terminate() if self.tuner is not None else None

    def restart_tuner(self, rules: Sequence[Mapping[str, Any]]) -> None:
        """SIGTERM the tuner (it finishes its step and saves its state; the engines keep running) and
        start it again with other rules: it re-adopts the engines from their pid files."""
        rc = self.stop_tuner()
        if rc not in (0, None):
            raise RuntimeError(f"the tuner exited {rc} on SIGTERM:\n{self.tuner.log_tail() if self.tuner else ''}")
        self.configure(rules)
        self.start_tuner()

    def status(self) -> dict[str, Any] | None:
        return self.tuner.status() if self.tuner is not None else None

    def wait_status_args(self, flag: str, value: str, timeout: float = 60) -> dict[str, Any]:
        """/status once a cycle shows ``flag value`` in every target's current_args."""
        def check() -> dict[str, Any] | None:
            s = self.status()
            if s and s.get("cycle") and all(s["targets"][n]["current_args"].get(flag) == value for n in self.names):
                return s
            return None
        result: dict[str, Any] = wait_for(check, timeout, f"/status to show {flag} {value} on every target",
                                          detail=self.diagnostics)
        return result

    # -- rollouts ---------------------------------------------------------------------------------
    def wait_rollout(self, known: Iterable[str], timeout: float = 240) -> str:
        """The id of the first rollout the tuner begins that is not in ``known``."""
        known = set(known)

        def new_id() -> str | None:
            return next((i for i in rollout_ids(self.records()) if i not in known), None)

        return str(wait_for(new_id, timeout, "the tuner to decide and begin a rollout", poll=2,
                            detail=self.diagnostics))

    def wait_finished(self, rollout_id: str, timeout: float = 2400) -> None:
        wait_for(lambda: finished(self.records(), rollout_id), timeout, f"rollout {rollout_id} to finish", poll=2,
                 detail=self.diagnostics)

    def load(self, *, concurrency: int, name: str, seed: int = 0) -> LiveLoad:
        # With nginx's client keep-alive on, the point is to measure clients that keep their connections.
        return LiveLoad(self.lb.url, self.model, self.work, concurrency=concurrency, name=name, seed=seed,
                        api_key=self.api_key, reuse_connections=self.client_keepalive_seconds > 0)

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> ProcessPool:
        try:
            self.lb.start()
            self.configure(self._rules)
            self.start_tuner()  # launches the engines (process actuator)
            wait_for(lambda: all(healthy(self.url(n)) for n in self.names), self.start_timeout,
                     "every engine started by the tuner to serve", poll=2, detail=self.diagnostics)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        from tuner.actuators import base, process

        try:
            if self.tuner is not None:
                self.tuner.terminate(timeout=90)
            with_pidfiles = [n for n in self.names if (self.state_dir / f"{n}.json").exists()]
            if with_pidfiles:
                actuator = process.ProcessActuator([base.Replica(n, self.url(n)) for n in self.names],
                                                   command=engine_command(), state_dir=self.state_dir)
                for n in with_pidfiles:
                    with contextlib.suppress(Exception):
                        actuator.stop(n, timeout_seconds=30)
        finally:
            kill_engines_on_ports(self.ports.values())
            self.lb.stop()


class CpuHog:
    """A process spinning on one core (``cpu_hog()``); ``cpu_seconds``: the CPU time it got."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.cpu_seconds = 0.0

    def __enter__(self) -> CpuHog:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            self.cpu_seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        children.stop(self.proc, timeout_seconds=0, signal_first=None, kill_timeout_seconds=30)  # SIGKILL


def cpu_hog() -> CpuHog:
    """A busy neighbour for the length of a ``with``: one process spinning at normal priority (on a
    2-core box, half the machine), as a batch job beside the engines would."""
    return CpuHog()
