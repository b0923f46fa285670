"""Prove the engine client's sleep mode calls (``tuner.sources.engines.EngineClient``) against REAL vLLM on a REAL GPU.

Run on a GPU machine with vLLM importable (e.g. unpacked into /tmp/site with PYTHONPATH set), from the repo root:

    PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m bench.gpu_sleep_wake OUT.json

It starts vLLM with ``VLLM_SERVER_DEV_MODE=1 ... --enable-sleep-mode`` and, using ``EngineClient`` for
every sleep / wake / is_sleeping call and NVML (read-only) for memory, records: the awake state, a level-1
sleep, one completion sent while asleep (queued, failed or hung? which /metrics series move? GET /load),
the wake, a level-2 sleep + wake, and what a level-1 sleep does to a request that is in flight. Everything
goes to OUT.json (the recorded run: tests/fixtures/gpu/h200-vllm026-sleep-wake.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pynvml

from tuner.actuators import children
from tuner.sources.engines import EngineClient

MODEL = os.environ.get("MODEL", "/tmp/parts/model")
PORT = 8000
BASE = f"http://127.0.0.1:{PORT}"
GIB = 1024**3
DEADLINE = time.time() + float(os.environ.get("BUDGET_S", "540"))  # stay inside one 10-minute call

CMD = [
    sys.executable,
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    MODEL,
    "--served-model-name",
    "m8b",
    "--load-format",
    "dummy",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "4096",
    "--gpu-memory-utilization",
    "0.85",
    "--port",
    str(PORT),
    "--enable-sleep-mode",
    "--enable-server-load-tracking",
]

pynvml.nvmlInit()
NV = pynvml.nvmlDeviceGetHandleByIndex(0)
http = httpx.Client(timeout=30)
out: dict = {"events": []}


def now() -> float:
    return round(time.time(), 3)


def mem() -> dict:
    used = pynvml.nvmlDeviceGetMemoryInfo(NV).used
    return {"t": now(), "nvml_used_bytes": used, "nvml_used_gib": round(used / GIB, 3)}


def event(name: str, **kw) -> dict:
    e = {"t": now(), "event": name, **kw}
    out["events"].append(e)
    print(json.dumps(e), flush=True)
    return e


def metrics() -> dict:
    """The /metrics lines about sleep, plus the running/waiting gauges."""
    try:
        text = http.get(BASE + "/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return {"t": now(), "error": repr(exc)}
    sleep_lines = [ln for ln in text.splitlines() if "sleep" in ln]
    gauges = {}
    for ln in text.splitlines():
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
            if ln.startswith(name + "{") or ln.startswith(name + " "):
                gauges[name] = float(ln.rsplit(" ", 1)[1])
    return {"t": now(), "sleep_lines": sleep_lines, **gauges}


def metric_samples() -> dict[str, str]:
    """Every sample line of /metrics (no comments, no *_created), keyed by series."""
    try:
        text = http.get(BASE + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    res = {}
    for ln in text.splitlines():
        if ln and not ln.startswith("#") and "_created" not in ln:
            k, _, v = ln.rpartition(" ")
            res[k] = v
    return res


def server_load() -> int | str | None:
    """GET /load (needs --enable-server-load-tracking): requests in flight at the API server."""
    try:
        return http.get(BASE + "/load", timeout=10).json().get("server_load")
    except (httpx.HTTPError, ValueError) as exc:
        return repr(exc)


def health() -> int | str:
    try:
        return http.get(BASE + "/health", timeout=10).status_code
    except httpx.HTTPError as exc:
        return repr(exc)


def complete(max_tokens: int = 16, timeout: float = 60, ignore_eos: bool = False) -> dict:
    t0 = time.time()
    body = {"model": "m8b", "prompt": "the quick brown fox", "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    r: dict = {"sent_t": round(t0, 3)}
    try:
        resp = httpx.post(BASE + "/v1/completions", json=body, timeout=timeout)
        r["status"] = resp.status_code
        try:
            j = resp.json()
            ch = (j.get("choices") or [{}])[0]
            r["finish_reason"] = ch.get("finish_reason")
            r["completion_tokens"] = (j.get("usage") or {}).get("completion_tokens")
            if resp.status_code != 200:
                r["body"] = resp.text[:300]
        except ValueError:
            r["body"] = resp.text[:300]
    except httpx.HTTPError as exc:
        r["error"] = repr(exc)
    r["latency_s"] = round(time.time() - t0, 3)
    return r


def timed(fn, *a, **kw):
    t0 = time.time()
    v = fn(*a, **kw)
    return v, round(time.time() - t0, 3)


def in_background(fn, *a, **kw) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        box.update(fn(*a, **kw))
        box["done_t"] = now()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def main() -> None:
    dest = Path(sys.argv[1])
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    out["command"] = "VLLM_SERVER_DEV_MODE=1 VLLM_USE_FLASHINFER_SAMPLER=0 " + " ".join(["python3", *CMD[1:]])
    out["gpu"] = {
        "name": pynvml.nvmlDeviceGetName(NV),
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "total_bytes": pynvml.nvmlDeviceGetMemoryInfo(NV).total,
    }
    out["before_server"] = mem()
    log = open("/tmp/vllm_sleep_server.log", "w")
    t_start = time.time()
    proc = subprocess.Popen(CMD, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise SystemExit(f"server exited rc={proc.returncode}")
            if health() == 200:
                break
            time.sleep(1)
        else:
            raise SystemExit("server not healthy in 300 s")
        out["startup_s"] = round(time.time() - t_start, 1)
        event("healthy", startup_s=out["startup_s"])
        try:
            import vllm

            out["vllm_version"] = vllm.__version__
        except Exception as exc:
            out["vllm_version"] = repr(exc)
        with EngineClient(sleep_timeout_seconds=300) as client:
            run_steps(client)
    finally:
        children.stop(proc, timeout_seconds=60)  # SIGTERM, SIGKILL after 60 s, reaped
        log.close()
        text = Path("/tmp/vllm_sleep_server.log").read_text(errors="replace").splitlines()
        keys = ("sleep", "wake", "freed", "SECURITY", "Sleep", "Wake", "abort", "Error", "error")
        out["server_log_sleep_lines"] = [ln for ln in text if any(k in ln for k in keys)][-80:]
        out["server_log_tail"] = text[-30:]
        dest.write_text(json.dumps(out, indent=1))
        print("wrote", dest, flush=True)


def run_steps(sc: EngineClient) -> None:
    rep = BASE

    # 1. awake
    s1: dict = {"memory": mem(), "metrics": metrics(), "health": health()}
    s1["is_sleeping"], s1["is_sleeping_call_s"] = timed(sc.is_sleeping, rep)
    s1["completions"] = [complete() for _ in range(3)]
    out["1_awake"] = s1
    event("awake", mem_gib=s1["memory"]["nvml_used_gib"], is_sleeping=s1["is_sleeping"])

    # 2. sleep(level=1)
    s2: dict = {"started_t": now()}
    s2["return"], s2["duration_s"] = timed(sc.sleep, rep, level=1)
    s2["memory_after"] = mem()
    s2["metrics_after"] = metrics()
    s2["is_sleeping"] = sc.is_sleeping(rep)
    s2["health_while_asleep"] = health()
    try:
        s2["v1_models_while_asleep"] = http.get(BASE + "/v1/models", timeout=10).status_code
    except httpx.HTTPError as exc:
        s2["v1_models_while_asleep"] = repr(exc)
    out["2_sleep_level1"] = s2
    event("slept", ret=s2["return"], dur=s2["duration_s"], mem_gib=s2["memory_after"]["nvml_used_gib"])

    # 3. one request while asleep, /metrics every 1 s for ~10 s
    before = metric_samples()
    load_before = server_load()
    th, box = in_background(complete, 16, 120)
    samples = []
    for _ in range(10):
        time.sleep(1)
        m = metrics()
        samples.append(
            {k: m.get(k) for k in ("t", "vllm:num_requests_waiting", "vllm:num_requests_running")}
            | {"server_load": server_load(), "request_done": "done_t" in box}
        )
    after = metric_samples()
    changed = {
        k: [before.get(k), after.get(k)]
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    }
    out["3_request_while_asleep"] = {
        "samples": samples,
        "done_before_wake": "done_t" in box,
        "result_before_wake": dict(box),
        "server_load_before": load_before,
        "metrics_series_changed_while_request_pending": changed,
    }
    event(
        "asleep_samples",
        waiting=[s.get("vllm:num_requests_waiting") for s in samples],
        done=("done_t" in box),
    )

    # 4. wake
    s4: dict = {"started_t": now()}
    s4["return"], s4["duration_s"] = timed(sc.wake, rep)
    s4["memory_after"] = mem()
    s4["metrics_after"] = metrics()
    s4["is_sleeping"] = sc.is_sleeping(rep)
    th.join(120)
    s4["background_request"] = dict(box)
    s4["background_request_completed_after_wake_s"] = (
        round(box["done_t"] - s4["started_t"], 3) if "done_t" in box else None
    )
    s4["completions_after"] = [complete() for _ in range(3)]
    out["4_wake"] = s4
    event("woke", ret=s4["return"], dur=s4["duration_s"], mem_gib=s4["memory_after"]["nvml_used_gib"], bg=box)

    # 5. sleep(level=2) + wake
    if time.time() < DEADLINE - 120:
        s5: dict = {}
        s5["sleep_return"], s5["sleep_duration_s"] = timed(sc.sleep, rep, level=2)
        s5["memory_after_sleep"] = mem()
        s5["metrics_after_sleep"] = metrics()
        s5["is_sleeping_after_sleep"] = sc.is_sleeping(rep)
        s5["wake_return"], s5["wake_duration_s"] = timed(sc.wake, rep)
        s5["memory_after_wake"] = mem()
        s5["metrics_after_wake"] = metrics()
        s5["is_sleeping_after_wake"] = sc.is_sleeping(rep)
        s5["completion_after_wake_note"] = "level 2 discards the (dummy) weights: output is meaningless"
        s5["completion_after_wake"] = complete(timeout=60)
        out["5_sleep_level2"] = s5
        event(
            "level2",
            s=s5["sleep_duration_s"],
            w=s5["wake_duration_s"],
            mem=(s5["memory_after_sleep"]["nvml_used_gib"], s5["memory_after_wake"]["nvml_used_gib"]),
        )

    # 6. (extra) level-1 sleep while a long request is in flight: vLLM's default pause mode is "abort"
    if time.time() < DEADLINE - 90:
        s6: dict = {
            "note": "what the sleep does to a request already running (see sleepcontrol_requests "
            "for the mode the engine client sent)"
        }
        th2, box2 = in_background(complete, 1500, 120, True)
        time.sleep(2.0)
        s6["metrics_before_sleep"] = metrics()
        s6["sleep_return"], s6["sleep_duration_s"] = timed(sc.sleep, rep, level=1)
        s6["memory_after_sleep"] = mem()
        s6["metrics_after_sleep"] = {k: v for k, v in metrics().items() if k != "sleep_lines"}
        s6["server_load_after_sleep"] = server_load()
        th2.join(20)
        s6["inflight_request"] = dict(box2)
        s6["wake_return"], s6["wake_duration_s"] = timed(sc.wake, rep)
        s6["is_sleeping_after_wake"] = sc.is_sleeping(rep)
        th2.join(60)
        s6["inflight_request_final"] = dict(box2)
        s6["completion_after_wake"] = complete()
        out["6_sleep_with_request_in_flight"] = s6
        event("inflight", req=box2, ret=s6["sleep_return"])
    out["final_memory"] = mem()


if __name__ == "__main__":
    main()
