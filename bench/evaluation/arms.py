"""Running the arms against real engines behind real nginx; raw data into the results directory.

Three kinds of pool, all behind ``harness.nginx.NginxBalancer``:

- ``StaticPool``: the harness starts the replicas itself (``harness.vllm.VllmServer``), with fixed
  flags; with ``plugin=True`` every replica gets its own live-knob control directory, so that one
  wide-envelope start serves the bad start, the sweep and the defaults (``set_cap``).
- ``TunerPool``: ``vllm-tuner run`` launches the replicas itself (``harness.live.ProcessPool``:
  process actuator, nginx drain), with the arm's tuner settings composed into a full configuration.
  ``live=True`` starts them with the wide envelope and the plugin, the cap at the bad start.

Every arm: wait until every replica is idle, start the sampler (each replica's /metrics and plugin
acknowledgement every ``timings.sample_seconds``), play the trace through nginx (``player.py``, one or
more processes), stop the sampler, write ``meta.json``. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.evaluation import analysis, profiles
from harness import live as harness_live
from harness import nginx as nginx_support
from harness import vllm
from tuner.actuators import children
from tuner.model import snapshots
from tuner.sources import live_knobs, nvml

PLAYER = Path(__file__).resolve().parent / "player.py"
NAMES = "abcdefghijklmnop"
# An open-loop trace against a bad start keeps thousands of requests open (two connections each in nginx).
NGINX_CONNECTIONS = 8192


class HarnessError(RuntimeError):
    """An arm could not run; the message says why (one line, plus a log tail where there is one)."""


@dataclass
class Context:
    profile: profiles.Profile
    base: Path  # the profile's directory (relative paths)
    out: Path  # the results directory
    trace: dict[str, Any]
    trace_path: Path
    model: Path
    vocab_size: int
    engine_python: Path
    player_python: Path

    @property
    def names(self) -> list[str]:
        return list(NAMES[: self.profile.replicas])

    def engine_flags(self, max_num_seqs: int | None) -> list[str]:
        seqs = ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs is not None else []
        return [*self.profile.engine.args, *seqs]

    def engine_env(self) -> dict[str, str]:
        return {**vllm.DEFAULT_ENV, **self.profile.engine.env}

    def arm_dir(self, arm: str) -> Path:
        d = self.out / "arms" / arm
        if d.exists():
            shutil.rmtree(d)  # an arm run again replaces its earlier data
        d.mkdir(parents=True)
        return d


def _which(value: str, base: Path) -> Path:
    if "/" not in value:
        found = shutil.which(value)
        if found is None:
            raise HarnessError(f"{value!r} is not on PATH")
        return Path(found)
    return Path(value) if Path(value).is_absolute() else (base / value)


def prepare(profile: profiles.Profile, base: Path, out: Path) -> Context:
    """Resolve the interpreters and the model, write (or check) the results directory's trace."""
    if profile.engine.python:
        engine_py = _which(profile.engine.python, base)
        os.environ["VLLM_TUNER_VLLM_PYTHON"] = str(engine_py)  # harness.vllm starts engines with it
    py = vllm.vllm_python()
    if py is None:
        raise HarnessError(vllm.skip_reason() or "no engine interpreter")
    player_py = _which(profile.player.python, base) if profile.player.python else py
    if profile.nginx is None and nginx_support.skip_reason():
        raise HarnessError(nginx_support.skip_reason() or "no nginx")
    if profile.nginx is not None and not profile.path(profile.nginx, base).exists():
        raise HarnessError(f"nginx binary {profile.path(profile.nginx, base)} does not exist")
    model = profile.path(profile.engine.model, base) if profile.engine.model else vllm.build_tiny_model()
    if profile.engine.vocab_size:
        vocab = profile.engine.vocab_size
    else:
        try:
            vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError) as exc:
            raise HarnessError(f"cannot read vocab_size from {model / 'config.json'} ({exc}); set "
                               "engine.vocab_size in the profile") from exc
    out.mkdir(parents=True, exist_ok=True)
    trace = profile.trace.build()
    trace_path = out / "trace.json"
    if trace_path.exists():
        held = json.loads(trace_path.read_text())
        if held.get("digest") != trace["digest"]:
            raise HarnessError(f"{out} holds the results of another trace (digest {held.get('digest')}, this "
                               f"profile's is {trace['digest']}): use a new directory")
    else:
        trace_path.write_text(json.dumps(trace))
    return Context(profile=profile, base=base, out=out, trace=trace, trace_path=trace_path, model=model,
                   vocab_size=vocab, engine_python=py, player_python=player_py)


def write_run(ctx: Context, *, command: str) -> None:
    """``run.json``: what the report needs besides the arms (the profile's SLO, timings, commands)."""
    path = ctx.out / "run.json"
    run: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    p = ctx.profile
    commands = [c for c in run.get("commands", []) if c != command] + [command]
    run.update({"profile": p.name, "description": p.description, "replicas": p.replicas,
                "slo": p.slo.model_dump(), "timings": p.timings.model_dump(),
                "engine_args": ctx.engine_flags(None), "commands": commands,
                "trace_digest": ctx.trace["digest"]})
    run.setdefault("engine_version", None)  # filled in by the first pool that answers GET /version
    run["gpus"] = gpu_names() or run.get("gpus") or []
    path.write_text(json.dumps(run, indent=1))


def gpu_names() -> list[str]:
    """The GPUs this run measured on, by NVML's name (the tuner's one NVML reader, read-only calls), or [] where
    NVML is not there or a GPU did not answer. A profile's description names the GPU it was written for; the
    report says which one it ran on, so a profile written for an H200 and run on an H100 cannot pass for an
    H200 measurement."""
    source = nvml.NvmlSource()
    try:
        readings = source.read()
    finally:
        source.close()
    names = [r.name.decode() if isinstance(r.name, bytes) else r.name for r in readings if r.name]
    return names if len(names) == len(readings) else []


def record_engine_version(ctx: Context, base_url: str) -> None:
    path = ctx.out / "run.json"
    with contextlib.suppress(OSError, ValueError, httpx.HTTPError):
        version = httpx.get(base_url + "/version", timeout=5).json().get("version")
        run = json.loads(path.read_text())
        run["engine_version"] = f"vLLM {version}"
        path.write_text(json.dumps(run, indent=1))


# --- sampling the replicas -------------------------------------------------------------------------


def _total(snap: snapshots.Snapshot, name: str, **labels: str) -> float | None:
    found = [s.value for s in snap.samples(name) if all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(found) if found else None


def sample_replica(base_url: str, control_dir: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        text = httpx.get(base_url + "/metrics", timeout=3).text
        snap = snapshots.parse(text, time.time(), keep_prefixes=("vllm:",))
        out.update({
            "running": _total(snap, "vllm:num_requests_running"),
            "waiting": _total(snap, "vllm:num_requests_waiting"),
            "kv_usage": _total(snap, "vllm:kv_cache_usage_perc") or _total(snap, "vllm:gpu_cache_usage_perc"),
            "preemptions": _total(snap, "vllm:num_preemptions_total"),
            "finished": _total(snap, "vllm:request_success_total"),
            "errored": _total(snap, "vllm:request_success_total", finished_reason="error"),
            "aborted": _total(snap, "vllm:request_success_total", finished_reason="abort"),
        })
    except httpx.HTTPError as exc:
        out["scrape_error"] = type(exc).__name__
    if control_dir is not None:
        try:
            acks = live_knobs.read_acks(control_dir)
        except Exception as exc:  # a SourceError or an unreadable directory: recorded, not fatal
            acks = []
            out["ack_problem"] = str(exc)
        if acks:
            ack = acks[0]
            if ack.problem:
                out["ack_problem"] = ack.problem
            else:
                applied = ack.applied or {}
                out.update({"cap": applied.get("max_num_active_seqs"), "ack_seq": ack.seq,
                            "admission_cap": ack.effective.get("admission_cap"), "ack_pid": ack.pid,
                            "envelope": ack.envelope.get("max_num_seqs")})
    return out


GPU_FIELDS = ("sm_clock_mhz", "sm_clock_max_mhz", "power_w", "power_limit_w", "gpu_temp_c", "gpu_util",
              "clocks_event_reasons")


def sample_gpus(source: nvml.NvmlSource) -> list[dict[str, Any]]:
    """Each GPU's clock, power and temperature now (read-only NVML calls), one row per GPU; [] without NVML.
    Two leases of "an H200" are not always one machine: on draw 124 the same load ran its steps 15-38 % slower
    on one lease than on another at about the same running count (docs/evaluation.md), so every arm records what the
    card was doing."""
    return [{"gpu": r.index, **{k: getattr(r, k) for k in GPU_FIELDS}} for r in source.read() if r.error is None]


class Sampler:
    """A thread appending one JSON line per replica per tick to ``path`` until ``stop()``, and one per GPU to
    ``gpu_path`` (``gpu.jsonl`` beside it; nothing where NVML is not there)."""

    def __init__(self, path: Path, replicas: Mapping[str, str], control_dirs: Mapping[str, Path | None], *,
                 every: float) -> None:
        self.path, self.replicas, self.control_dirs, self.every = path, dict(replicas), dict(control_dirs), every
        self.gpu_path = path.with_name("gpu.jsonl")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        gpus = nvml.NvmlSource()
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                while not self._stop.is_set():
                    t0 = time.time()
                    for name, url in self.replicas.items():
                        row = {"t": time.time(), "replica": name, **sample_replica(url, self.control_dirs.get(name))}
                        f.write(json.dumps(row) + "\n")
                    f.flush()
                    rows = sample_gpus(gpus)
                    if rows:
                        with open(self.gpu_path, "a", encoding="utf-8") as g:
                            g.writelines(json.dumps({"t": time.time(), **r}) + "\n" for r in rows)
                    self._stop.wait(max(0.0, self.every - (time.time() - t0)))
        finally:
            gpus.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# --- small helpers against the replicas --------------------------------------------------------------


def poke(ctx: Context, base_url: str) -> None:
    """One one-token request straight to a replica: an idle engine runs no steps, so the plugin applies a
    new control file only with its next request."""
    body = {"model": ctx.profile.engine.served_name, "prompt": [ctx.vocab_size // 2] * 4, "max_tokens": 1}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def wait_idle(replicas: Mapping[str, str], timeout: float) -> None:
    def idle() -> bool:
        for url in replicas.values():
            s = sample_replica(url, None)
            if s.get("scrape_error") or (s.get("running") or 0) + (s.get("waiting") or 0) > 0:
                return False
        return True

    harness_live.wait_for(idle, timeout, "every replica to be idle (nothing running or waiting)", poll=1)


def upstream_names(replicas: Mapping[str, int]) -> dict[str, str]:
    return {f"127.0.0.1:{port}": name for name, port in replicas.items()}


# --- playing the trace --------------------------------------------------------------------------------


def play(ctx: Context, *, url: str, arm: str, arm_dir: Path, upstreams: Mapping[str, str]) -> dict[str, Any]:
    """Play the whole trace through ``url``; merge the players' records into ``requests.jsonl``."""
    p = ctx.profile.player
    n = p.processes
    start_at = time.time() + ctx.profile.timings.lead_in_seconds + 0.5 * n
    procs = []
    parts = []
    log = open(arm_dir / "player.log", "ab")
    try:
        for k in range(n):
            part = arm_dir / f"requests-{k}.jsonl"
            parts.append(part)
            procs.append(subprocess.Popen(
                [str(ctx.player_python), str(PLAYER), "--trace", str(ctx.trace_path), "--url", url,
                 "--model", ctx.profile.engine.served_name, "--vocab-size", str(ctx.vocab_size),
                 "--salt", arm, "--start-at", repr(start_at), "--shard", f"{k}/{n}",
                 "--timeout", str(p.request_timeout_seconds), "--out", str(part)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        deadline = start_at + float(ctx.trace["duration"]) + p.request_timeout_seconds + 120
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise HarnessError(f"the player did not finish by its deadline; see {arm_dir / 'player.log'}") from None
            if proc.returncode != 0:
                tail = (arm_dir / "player.log").read_text(errors="replace")[-3000:]
                raise HarnessError(f"the player exited {proc.returncode}:\n{tail}")
    finally:
        try:  # SIGKILL to the group of every player still running, each reaped
            children.stop_all(procs, timeout_seconds=0, signal_first=None, group=True, kill_timeout_seconds=30)
        finally:
            log.close()
    records = []
    for part in parts:
        for line in part.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                r["arm"] = arm
                r["replica"] = upstreams.get((r.get("upstream") or "").split(",")[-1].strip(), r.get("upstream"))
                records.append(r)
        part.unlink()
    records.sort(key=lambda r: r["index"])
    with open(arm_dir / "requests.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    if len(records) != len(ctx.trace["requests"]):
        raise HarnessError(f"{len(records)} request records for {len(ctx.trace['requests'])} requests of the trace")
    return {"start_at": start_at, "trace_end": start_at + float(ctx.trace["duration"]), "end": time.time(),
            "failed": sum(not r["ok"] for r in records), "requests": len(records)}


def write_meta(arm_dir: Path, meta: Mapping[str, Any]) -> None:
    (arm_dir / "meta.json").write_text(json.dumps(dict(meta), indent=1))


def _shown(path: Path) -> str:
    """A path as the report shows it: relative to the checkout when inside it."""
    try:
        return str(path.resolve().relative_to(vllm.REPO_ROOT))
    except ValueError:
        return str(path)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


def nginx_read_timeout(ctx: Context) -> float:
    """nginx's proxy_read_timeout (the longest silence of an upstream before nginx cuts the response) above
    the player's own request timeout: a request queued in an engine streams nothing until its first token,
    and only the client, as the profile sets it, decides when that is too long."""
    return ctx.profile.player.request_timeout_seconds + 60


# --- a pool the harness starts itself ------------------------------------------------------------------


class StaticPool:
    """``replicas`` engines with fixed flags behind nginx; ``plugin``: each with its own control dir."""

    def __init__(self, ctx: Context, label: str, *, max_num_seqs: int | None, plugin: bool) -> None:
        self.ctx, self.label, self.max_num_seqs, self.plugin = ctx, label, max_num_seqs, plugin
        self.dir = ctx.out / "run" / label
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.ports = {n: nginx_support.free_port() for n in ctx.names}
        nginx = ctx.profile.path(ctx.profile.nginx, ctx.base) if ctx.profile.nginx else None
        self.lb = nginx_support.NginxBalancer({n: f"127.0.0.1:{p}" for n, p in self.ports.items()},
                                              binary=str(nginx) if nginx else None,
                                              worker_connections=NGINX_CONNECTIONS,
                                              read_timeout_seconds=nginx_read_timeout(ctx))
        self.control: dict[str, Path | None] = {
            n: (live_knobs.prepare_control_dir(self.dir / f"control-{n}") if plugin else None) for n in ctx.names}
        self.servers: dict[str, vllm.VllmServer] = {}
        self._seq = itertools.count(1)
        self.envelope: int | None = None
        self.started_seconds: float | None = None

    @property
    def urls(self) -> dict[str, str]:
        return {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}

    def _server(self, name: str) -> vllm.VllmServer:
        env = self.ctx.engine_env()
        if self.control[name] is not None:
            env["VLLM_TUNER_CONTROL_DIR"] = str(self.control[name])
        return vllm.VllmServer(self.ctx.model, self.ctx.engine_flags(self.max_num_seqs), env=env,
                               port=self.ports[name], served_model_name=self.ctx.profile.engine.served_name,
                               startup_timeout=self.ctx.profile.engine.start_timeout_seconds,
                               log_path=self.dir / f"{name}.log")

    def start(self) -> StaticPool:
        t0 = time.monotonic()
        try:
            self.lb.start()
            self.servers = {n: self._server(n) for n in self.ctx.names}
            if self.ctx.profile.engine.start_in_parallel:
                errors: list[BaseException] = []

                def go(srv: vllm.VllmServer) -> None:
                    try:
                        srv.start()
                    except BaseException as exc:
                        errors.append(exc)

                threads = [threading.Thread(target=go, args=(s,)) for s in self.servers.values()]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise HarnessError(f"an engine of {self.label} did not start: {errors[0]}")
            else:
                for s in self.servers.values():
                    s.start()
        except BaseException:
            self.close()
            raise
        self.started_seconds = time.monotonic() - t0
        record_engine_version(self.ctx, next(iter(self.urls.values())))
        if self.plugin:
            self.set_cap(None)  # the startup acknowledgement: the plugin is live and its envelope known
        return self

    def set_cap(self, value: int | None, *, timeout: float = 300) -> None:
        """Hold the admission cap of every replica at ``value`` (None: the startup envelope) and wait until
        every replica acknowledged it."""
        seq = next(self._seq)
        for d in self.control.values():
            assert d is not None, "set_cap needs plugin=True"
            live_knobs.write_request(d, seq, max_num_active_seqs=value)
        for name, url in self.urls.items():
            d = self.control[name]
            assert d is not None
            deadline = time.monotonic() + timeout
            while True:
                poke(self.ctx, url)
                acks = live_knobs.read_acks(d)
                mine = [a for a in acks if a.answers(seq)]
                if mine:
                    ack = mine[0]
                    if not ack.live or ack.refused:
                        raise HarnessError(f"replica {name} refused the cap {value}: {ack.refused}")
                    self.envelope = ack.envelope.get("max_num_seqs") or self.envelope
                    break
                if not self.alive(name):
                    raise HarnessError(f"replica {name} died:\n{self.tail(name)}")
                if time.monotonic() > deadline:
                    raise HarnessError(f"replica {name} did not acknowledge cap {value} (seq {seq}) within "
                                       f"{timeout:g}s; acks: {acks}")
                time.sleep(0.5)

    def alive(self, name: str) -> bool:
        return self.servers[name].alive()

    def tail(self, name: str) -> str:
        return self.servers[name].log_tail()

    def close(self) -> None:
        for s in self.servers.values():
            with contextlib.suppress(Exception):
                s.stop()
        harness_live.kill_engines_on_ports(self.ports.values())
        self.lb.stop()

    def __enter__(self) -> StaticPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedPool(StaticPool):
    """The live tuner arm's engines, after its tuner stopped, as the plugin arms' pool (``share_engines``):
    the same wide-envelope flags, nginx and control directories; the tuner pool starts and stops them."""

    def __init__(self, ctx: Context, tuner_pool: TunerPool) -> None:
        self.ctx, self.label, self.max_num_seqs, self.plugin = ctx, "shared with tuner-live", None, True
        self.tuner_pool = tuner_pool
        self.ports = dict(tuner_pool.ports)
        self.lb = tuner_pool.lb
        self.control = dict(tuner_pool.control)
        self.servers = {}
        # Above every seq the tuner wrote: an acknowledgement of one of its requests answers none of these.
        self._seq = itertools.count(1_000_000)
        self.envelope = None
        self.started_seconds = 0.0

    def start(self) -> SharedPool:
        self.set_cap(None)
        return self

    def alive(self, name: str) -> bool:
        return harness_live.healthy(self.urls[name])

    def tail(self, name: str) -> str:
        return self.tuner_pool.diagnostics()

    def close(self) -> None:
        pass  # the tuner pool's


def run_static(ctx: Context, pool: StaticPool, arm: str, *, cap: int | None, mode: str, how: str,
               flags_label: str) -> dict[str, Any]:
    """One static arm on a started pool: the cap held (plugin) or the pool's own flags (restart)."""
    arm_dir = ctx.arm_dir(arm)
    if pool.plugin:
        pool.set_cap(cap)
    wait_idle(pool.urls, ctx.profile.timings.idle_timeout_seconds)
    if pool.plugin:
        pool.set_cap(cap)  # again after the idle wait: the acks then carry this arm's cap from its start
    sampler = Sampler(arm_dir / "samples.jsonl", pool.urls, pool.control, every=ctx.profile.timings.sample_seconds)
    started = time.time()
    load_before = os.getloadavg()[0]
    sampler.start()
    try:
        played = play(ctx, url=pool.lb.url, arm=arm, arm_dir=arm_dir, upstreams=upstream_names(pool.ports))
    finally:
        sampler.stop()
    value = cap if pool.plugin else pool.max_num_seqs
    meta = {
        "arm": arm, "kind": "static", "mode": mode, "how": how, "flags_label": flags_label,
        "flags": {"max_num_seqs": value}, "initial_flags": dict.fromkeys(ctx.names, value),
        "envelope": pool.envelope, "replicas": pool.urls, "pool": pool.label,
        "engine_flags": ctx.engine_flags(pool.max_num_seqs), "started_iso": _iso(started),
        "how_long": f"{played['end'] - started:.0f} s,", "pool_start_seconds": pool.started_seconds,
        "host_load": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "trace_digest": ctx.trace["digest"], **played,
    }
    write_meta(arm_dir, meta)
    return meta


# --- the tuner arms ---------------------------------------------------------------------------------


class TunerPool(harness_live.ProcessPool):
    """``vllm-tuner run`` launching the replicas itself, configured from the arm's tuner settings.

    ``template``: a partial vllm-tuner configuration (anything but ``targets``, ``actuator``, ``drain``
    and ``mode``; ``rule_files`` relative to the template's directory). Its optional ``evaluation:``
    section is the harness's, removed before the tuner sees the file:

    - ``targets_extra``: fields added to every target, formatted with ``{name}``, ``{port}``, ``{url}``
      and ``{control_dir}`` (the replica's live-knob control directory; live arm only);
    - ``actuator_extra``: fields added to the process actuator's settings.

    That is the hook for settings a newer tuner adds (e.g. where each replica's control directory is).
    """

    def __init__(self, ctx: Context, work: Path, *, template: Path, live: bool) -> None:
        self.ctx, self.template, self.live = ctx, template, live
        nginx = ctx.profile.path(ctx.profile.nginx, ctx.base) if ctx.profile.nginx else None
        super().__init__(work, ctx.model, ctx.names, rules=[], max_num_seqs=ctx.profile.bad_start,
                         start_timeout=ctx.profile.engine.start_timeout_seconds,
                         nginx_binary=str(nginx) if nginx else None, nginx_worker_connections=NGINX_CONNECTIONS,
                         nginx_read_timeout_seconds=nginx_read_timeout(ctx))
        self.control_root = work / "control"
        self.control: dict[str, Path | None] = {n: (self.control_root / n if live else None) for n in self.names}

    def args(self, name: str, max_num_seqs: int | None = None) -> list[str]:
        seqs = None if self.live else (max_num_seqs or self.ctx.profile.bad_start)
        return ["--model", str(self.model), "--served-model-name", self.ctx.profile.engine.served_name,
                "--host", "127.0.0.1", "--port", str(self.ports[name]), *self.ctx.engine_flags(seqs)]

    def configure(self, rules: Sequence[Mapping[str, Any]]) -> None:
        del rules  # the arm's template carries the rules
        config = compose(self.template, pool=self)
        harness_live.write_config(self.config_path, config)

    def prepare_live(self) -> None:
        """Before the engines start: each replica's control directory, with the cap at the bad start."""
        for d in self.control.values():
            if d is not None:
                live_knobs.prepare_control_dir(d)
                live_knobs.write_request(d, 0, max_num_active_seqs=self.ctx.profile.bad_start)

    def __enter__(self) -> TunerPool:
        if self.live:
            self.prepare_live()
        super().__enter__()
        return self


def in_flight(pool: TunerPool) -> list[str]:
    """The rollouts of the journal that have not finished."""
    facts = analysis.journal_flags(pool.records(), start_at=0.0, initial={})[2]
    return list(facts["in_flight_at_end"])


def compose(template: Path, *, pool: TunerPool) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(template.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise HarnessError(f"{template}: cannot read the tuner settings ({exc})") from exc
    if not isinstance(raw, dict):
        raise HarnessError(f"{template}: expected a mapping (a partial vllm-tuner configuration)")
    owned = sorted({"targets", "actuator", "drain", "mode"} & raw.keys())
    if owned:
        raise HarnessError(f"{template}: {', '.join(owned)} are set by the harness; leave them out")
    extra = raw.pop("evaluation", None) or {}
    if raw.get("rule_files") is not None:
        raw["rule_files"] = [str(f if Path(f).is_absolute() else (template.parent / f).resolve())
                             for f in raw["rule_files"]]
    ctx = pool.ctx
    targets = []
    for n in pool.names:
        fields = {"name": n, "port": pool.ports[n], "url": pool.url(n),
                  "control_dir": str(pool.control[n]) if pool.control[n] is not None else ""}
        more = {k: (v.format(**fields) if isinstance(v, str) else v)
                for k, v in (extra.get("targets_extra") or {}).items()}
        targets.append({"name": n, "metrics_url": f"{pool.url(n)}/metrics", "args": pool.args(n), **more})
    if pool.live:  # the tuner's live knobs: each replica's control directory, VLLM_TUNER_CONTROL_DIR set by the tuner
        raw["live"] = {**(raw.get("live") or {}), "enabled": True, "control_dir": str(pool.control_root / "{name}")}
    command = [str(ctx.engine_python), "-m", "vllm.entrypoints.openai.api_server"]
    actuator = {"kind": "process", "command": command, "state_dir": str(pool.state_dir),
                "env": ctx.engine_env(), **(extra.get("actuator_extra") or {})}
    drain = {"kind": "nginx", "upstream_file": str(pool.lb.upstream_file), "nginx": pool.lb.command,
             "servers": {n: f"127.0.0.1:{p}" for n, p in pool.ports.items()}, "parameters": "max_fails=0",
             "settle_seconds": 1}
    daemon = {"json_logs": True, **(raw.pop("daemon", None) or {}), "listen_host": "127.0.0.1",
              "listen_port": pool.listen_port, "state_file": str(pool.work / "state.json")}
    rollout = {**(raw.pop("rollout", None) or {}), "journal_file": str(pool.journal_path)}
    return {"mode": "apply", "targets": targets, **raw, "daemon": daemon, "actuator": actuator, "drain": drain,
            "rollout": rollout}


def run_tuner(ctx: Context, arm: str, *, template: Path, live: bool,
              then: Callable[[TunerPool], None] | None = None) -> dict[str, Any]:
    """The tuner arm; ``then(pool)``, if given, runs once its tuner stopped and before its engines stop."""
    arm_dir = ctx.arm_dir(arm)
    work = arm_dir / "tuner"
    work.mkdir()
    shutil.copy(template, arm_dir / "tuner-settings.yaml")
    t_pool = time.monotonic()
    with TunerPool(ctx, work, template=template, live=live) as pool:
        pool_seconds = time.monotonic() - t_pool
        record_engine_version(ctx, pool.url(pool.names[0]))
        urls = {n: pool.url(n) for n in pool.names}
        envelope = None
        if live:
            for url in urls.values():  # the bad start is on file; an engine applies it with its first step
                poke(ctx, url)
            for n, d in pool.control.items():
                assert d is not None
                ack = harness_live.wait_for(lambda d=d: next((a for a in live_knobs.read_acks(d) if a.answers(0)),
                                                             None), 300, f"replica {n} to acknowledge the bad start",
                                            poll=0.5, detail=pool.diagnostics)
                if not ack.live or ack.refused:
                    raise HarnessError(f"replica {n} refused the bad start: {ack.refused}")
                envelope = ack.envelope.get("max_num_seqs")
        wait_idle(urls, ctx.profile.timings.idle_timeout_seconds)
        sampler = Sampler(arm_dir / "samples.jsonl", urls, pool.control, every=ctx.profile.timings.sample_seconds)
        started = time.time()
        load_before = os.getloadavg()[0]
        sampler.start()
        try:
            played = play(ctx, url=pool.lb.url, arm=arm, arm_dir=arm_dir, upstreams=upstream_names(pool.ports))
            deadline = time.monotonic() + ctx.profile.tuner.settle_seconds
            while in_flight(pool) and time.monotonic() < deadline and pool.tuner is not None and pool.tuner.alive():
                time.sleep(2)
        finally:
            sampler.stop()
        stopped_in_flight = in_flight(pool)
        rc = pool.stop_tuner()
        tuner_log_tail = pool.tuner.log_tail(40) if pool.tuner else ""
        meta = _tuner_meta(ctx, arm, live=live, template=template, urls=urls, envelope=envelope, rc=rc,
                           stopped_in_flight=stopped_in_flight, started=started, played=played,
                           pool_seconds=pool_seconds, load_before=load_before, tuner_log_tail=tuner_log_tail)
        write_meta(arm_dir, meta)
        if then is not None:
            then(pool)
    return meta


def _tuner_meta(ctx: Context, arm: str, *, live: bool, template: Path, urls: Mapping[str, str],
                envelope: int | None, rc: int | None, stopped_in_flight: list[str], started: float,
                played: Mapping[str, Any], pool_seconds: float, load_before: float,
                tuner_log_tail: str) -> dict[str, Any]:
    initial = None if live else ctx.profile.bad_start
    meta = {
        "arm": arm, "kind": "tuner", "mode": "live" if live else "restart",
        "how": "tuner, live cap (plugin)" if live else "tuner, restarts",
        "flags_label": f"from {ctx.profile.bad_start}", "flags": {"max_num_seqs": initial},
        "initial_flags": dict.fromkeys(ctx.names, ctx.profile.bad_start), "envelope": envelope,
        "replicas": urls, "tuner_config": _shown(template), "tuner_exit": rc,
        "tuner_stopped_at": time.time(), "in_flight_when_stopped": stopped_in_flight,
        "engine_flags": ctx.engine_flags(initial), "started_iso": _iso(started),
        "how_long": f"{played['end'] - started:.0f} s,", "pool_start_seconds": pool_seconds,
        "host_load": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "trace_digest": ctx.trace["digest"], **played,
    }
    if rc not in (0, None):
        meta["note"] = f"the tuner exited {rc} on SIGTERM: {tuner_log_tail[-500:]}"
    return meta
