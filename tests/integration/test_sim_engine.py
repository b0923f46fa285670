"""The SIMULATED vLLM engine, read by the real scraper and signals code, and run as a process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tuner import config
from tuner.actuators import children
from tuner.runtime import collecting
from tuner.signals import engine as engine_signals
from tuner.sim import engine as sim
from tuner.sim import metrics as sim_metrics
from tuner.sources.engines import EngineClient

VLLM_ARGS = ["--max-num-seqs", "8", "--max-model-len", "4096", "--gpu-memory-utilization", "0.85"]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def engines() -> Iterator[EngineClient]:
    with EngineClient() as client:
        yield client


@pytest.fixture(scope="module")
def queued() -> Iterator[sim.SimServer]:
    """Slot-bound, like docs/evidence-h200.md's --max-num-seqs 8 run: 32 users, 8 sequence slots."""
    with sim.start([*VLLM_ARGS, "--sim-concurrency", "32"], time_scale=4.0) as server:
        yield server


def collector(server: sim.SimServer, client: EngineClient) -> collecting.Collector:
    target = config.Target(name="sim-0", metrics_url=f"{server.base_url}/metrics")
    return collecting.Collector(target, client=client)


def test_the_real_scraper_and_signals_read_a_queue_bound_engine(queued: sim.SimServer,
                                                                engines: EngineClient) -> None:
    c = collector(queued, engines)
    time.sleep(1.0)  # a few simulated seconds of load: requests have finished
    window = []
    for _ in range(4):
        window.append(c.scrape_engine())
        time.sleep(0.4)
    info = c.engine_info()
    assert all(s.ok for s in window), [s.error for s in window]
    assert info.max_model_len == 4096 and info.version == "0.32.0" and info.model == "SIMULATED-llama-8b"
    assert info.server_load is None and info.error is None  # GET /load is read only for sleep mode
    target = config.Target(name="sim-0", metrics_url=f"{queued.base_url}/metrics")
    loaded = collecting.Collector(target, client=engines, server_load=True).engine_info()
    assert loaded.server_load == 0  # the sim counts nothing without --enable-server-load-tracking, like vLLM
    s = engine_signals.compute(window, info=info, min_snapshots=3)
    value: dict[str, Any] = {name: sig.value for name, sig in s.items()}
    # pinned at --max-num-seqs; right after a request finishes its slot is refilled in the next step
    assert value["requests_running_max"] == 8 and value["requests_running"] in (7, 8)
    assert value["requests_running"] + value["requests_waiting"] in (31, 32)  # 32 closed-loop users
    assert value["requests_waiting_max"] >= 23
    assert 0 < value["kv_cache_usage"] < 0.05  # slot-bound, not KV-bound
    assert value["request_rate"] > 0 and value["generation_tokens_per_s"] > 0
    assert value["prompt_tokens_per_s"] > 0
    assert value["preemptions_per_s"] == 0
    assert value["queue_time_mean_s"] > 0.3  # requests wait for a slot
    assert value["itl_mean_s"] == pytest.approx(0.0052, rel=0.25)  # ~5 ms at batch 8 (evidence: 5.05 ms)
    assert value["ttft_mean_s"] is not None
    assert value["max_model_len"] == 4096
    assert value["block_size"] == 16
    assert value["gpu_memory_utilization"] == 0.85
    assert value["kv_cache_size_tokens"] == queued.cfg.kv_cache_size_tokens == 857_376  # evidence: 857,376
    assert value["kv_cache_max_concurrency"] == pytest.approx(857_376 / 4096, abs=0.01)
    assert value["prompt_tokens_max"] == 2000  # 1024 ± 50 %: the 1000-2000 bucket
    assert value["max_tokens_max"] == 1000  # the load sends max_tokens 512
    assert s["idle_seconds"].value == 0


def test_exposition_speaks_vllm_0_32(queued: sim.SimServer, http: httpx.Client) -> None:
    text = http.get(f"{queued.base_url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    types = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:request_success": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter",
        "vllm:request_queue_time_seconds": "histogram", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram", "vllm:request_params_max_tokens": "histogram",
        "vllm:iteration_tokens_total": "histogram", "vllm:cache_config_info": "gauge",
        "http_requests": "counter", "process_start_time_seconds": "gauge",
    }
    for name, kind in types.items():
        assert families[name].type == kind, name
    for name in ("vllm:num_requests_running", "vllm:e2e_request_latency_seconds"):
        for sample in families[name].samples:
            assert {k: v for k, v in sample.labels.items() if k != "le"} == {
                "model_name": "SIMULATED-llama-8b", "engine": "0"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}

    def bounds(family: str) -> list[float]:
        return [float(s.labels["le"]) for s in families[family].samples if s.name == f"{family}_bucket"]

    assert bounds("vllm:e2e_request_latency_seconds")[:-1] == list(sim_metrics.REQUEST_LATENCY_BUCKETS)
    assert bounds("vllm:request_queue_time_seconds")[:-1] == list(sim_metrics.REQUEST_LATENCY_BUCKETS)
    assert bounds("vllm:time_to_first_token_seconds")[:-1] == list(sim_metrics.TIME_TO_FIRST_TOKEN_BUCKETS)
    assert bounds("vllm:inter_token_latency_seconds")[:-1] == list(sim_metrics.INTER_TOKEN_LATENCY_BUCKETS)
    # request-token buckets: 1-2-5 capped at --max-model-len (4096)
    assert bounds("vllm:request_prompt_tokens")[:-1] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert bounds("vllm:request_params_max_tokens")[:-1] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert sim_metrics.build_1_2_5_buckets(32768)[-1] == 20000  # engine-contract.md §1.2's example
    info = families["vllm:cache_config_info"].samples[0].labels
    assert set(info) == {*sim_metrics.CACHE_CONFIG_KEYS, "engine"}
    assert info["block_size"] == "16" and info["gpu_memory_utilization"] == "0.85"
    assert info["enable_prefix_caching"] == "True" and info["num_gpu_blocks"] == "53586"  # evidence: 53,586
    assert "vllm:gpu_cache_usage_perc" not in text  # removed in 0.32 (engine-contract.md §1.4)


def test_http_surface(queued: sim.SimServer, http: httpx.Client) -> None:
    base = queued.base_url
    health = http.get(f"{base}/health")
    assert health.status_code == 200 and health.content == b""
    assert health.headers[sim.SIM_HEADER]  # labelled a simulation
    assert http.get(f"{base}/version").json()["version"] == "0.32.0"
    model = http.get(f"{base}/v1/models").json()["data"][0]
    assert model["id"].startswith("SIMULATED-") and model["max_model_len"] == 4096
    too_long = http.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 8192})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["message"] == (
        "max_tokens=8192 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
        "(parameter=max_tokens, value=8192)")
    prompt = http.post(f"{base}/v1/completions", json={"prompt": list(range(5000)), "max_tokens": 1})
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "input_tokens"
    ok = http.post(f"{base}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 4})
    assert ok.status_code == 200
    assert ok.json()["usage"] == {"prompt_tokens": 100, "completion_tokens": ok.json()["usage"]["completion_tokens"],
                                  "total_tokens": 100 + ok.json()["usage"]["completion_tokens"]}
    text = http.get(f"{base}/metrics").text
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 2.0' in text
    assert 'http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 1.0' in text
    assert 'handler="/metrics"' not in text and 'handler="/health"' not in text


def test_raising_max_num_seqs_trades_latency_for_throughput() -> None:
    """The H200 evidence's shape (8 → 128 sequences: ~4× throughput, ~2× per-token latency), on the model."""
    results = {}
    for seqs in (8, 128):
        cfg = sim.config_from_args(["--max-num-seqs", str(seqs), "--max-model-len", "4096",
                                    "--gpu-memory-utilization", "0.85", "--sim-concurrency", "128"])
        engine = sim.SimEngine(cfg)
        engine.advance(20.0)
        m = engine.metrics
        itl_count = sum(m.itl.counts)
        results[seqs] = (m.generation_tokens.value / 20.0, m.itl.total / itl_count, len(engine.waiting))
    (tput8, itl8, waiting8), (tput128, itl128, waiting128) = results[8], results[128]
    assert 3.0 < tput128 / tput8 < 5.0
    assert 1.5 < itl128 / itl8 < 5.0
    assert waiting8 > 100 and waiting128 == 0


def test_a_kv_bound_engine_preempts() -> None:
    """docs/evidence-h200.md's KV-bound run: more slots than KV room → KV ~1, preemptions, running < slots."""
    cfg = sim.config_from_args(["--max-num-seqs", "256", "--max-model-len", "4096", "--gpu-memory-utilization",
                                "0.2", "--sim-concurrency", "128", "--sim-prompt-tokens", "3072",
                                "--sim-output-tokens", "512", "--sim-max-tokens", "1024"])
    assert cfg.kv_cache_size_tokens == pytest.approx(112_976, rel=0.01)  # evidence: 112,976
    engine = sim.SimEngine(cfg)
    engine.advance(30.0)
    assert engine.metrics.kv_usage.value > 0.9
    assert engine.metrics.preemptions.value > 0
    assert 20 < len(engine.running) < 60 and len(engine.waiting) > 50


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"],
     "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)"),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048", "--max-model-len", "4096"],
     "max_num_batched_tokens (2048) is smaller than max_model_len (4096)"),
    (["--block-size", "8"], "No valid attention backend found for block_size=8"),
    (["--num-gpu-blocks-override", "100", "--max-model-len", "4096"], "To serve at least one request"),
    (["--gpu-memory-utilization", "1.5"], "GPU memory utilization must be within (0, 1]"),
    (["--max-model-len", "65536"], "greater than the derived max_model_len"),
])
def test_start_up_refusals_match_vllm(argv: list[str], message: str) -> None:
    with pytest.raises(sim.StartupError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        sim.config_from_args(argv)


def test_vllm_defaults_for_an_h200_class_gpu() -> None:
    cfg = sim.config_from_args([])
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == (1024, 8192, 16)
    assert (cfg.gpu_memory_utilization, cfg.enable_chunked_prefill, cfg.max_model_len) == (0.92, True, 32768)
    assert sim.config_from_args(["--max-num-batched-tokens", "4K"]).max_num_batched_tokens == 4096
    assert sim.config_from_args(["--no-enable-chunked-prefill"]).max_num_batched_tokens == 32768
    with pytest.raises(SystemExit):
        sim.config_from_args(["--no-such-flag", "1"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(client: httpx.Client, url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        assert proc.poll() is None, "the simulated engine exited during start-up"
        try:
            if client.get(f"{url}/health").status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("the simulated engine never became healthy")


def _wait_running(http: httpx.Client, url: str, proc: subprocess.Popen[bytes], *, timeout: float) -> None:
    """Until the engine's own gauge shows a request running (or fail at the deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the simulated engine exited"
        for family in text_string_to_metric_families(http.get(f"{url}/metrics").text):
            if family.name == "vllm:num_requests_running" and any(s.value >= 1 for s in family.samples):
                return
        time.sleep(0.05)
    raise AssertionError(f"no request running after {timeout:g} s")


def _first_refusal(http: httpx.Client, url: str, *, timeout: float) -> httpx.Response:
    """New one-token requests until one is refused (the drain began), or the last answer at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        answer = http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        if answer.status_code != 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def test_as_a_process_it_starts_slowly_and_drains_on_sigterm(http: httpx.Client) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tuner.sim.engine", "--port", str(port), "--max-num-seqs", "2",
                             "--max-model-len", "4096", "--sim-startup-seconds", "1", "--shutdown-timeout", "20"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        started = _wait_healthy(http, url, proc, timeout=20)
        assert started >= 0.9  # the port is not even bound while "loading"
        answers: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: answers.append(http.post(
            f"{url}/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True})))
        slow.start()  # 1,000 tokens at ~5 ms each: ~5 s of decoding, in flight when SIGTERM comes
        # SIGTERM once the engine runs it, not after a fixed sleep: under `make test`'s load the request had not
        # reached the engine 0.3 s after the thread started, the engine had nothing to drain and exited at once
        # (the next request's connection was refused)
        _wait_running(http, url, proc, timeout=20)
        proc.send_signal(signal.SIGTERM)
        # draining: a new request is refused (503) once the signal is handled, until the one in flight is done
        refused = _first_refusal(http, url, timeout=20)
        assert refused.status_code == 503
        assert http.get(f"{url}/health").status_code == 200  # like vLLM, healthy while draining
        assert proc.wait(timeout=40) == 0
        slow.join(timeout=10)
        assert answers[0].status_code == 200
        assert answers[0].json()["choices"][0]["finish_reason"] == "length"
        assert answers[0].json()["usage"]["completion_tokens"] == 1000
    finally:
        children.stop(proc, timeout_seconds=0, signal_first=None)  # SIGKILL if it still runs, reaped
        err = proc.stderr.read().decode() if proc.stderr else ""
        if proc.stderr:
            proc.stderr.close()
    assert "SIMULATED" in err.splitlines()[0]


def test_as_a_process_bad_flags_exit_like_vllm() -> None:
    env = {**os.environ}
    bad = subprocess.run([sys.executable, "-m", "tuner.sim.engine", "--port", str(_free_port()),
                          "--max-num-seqs", "64", "--max-num-batched-tokens", "32", "--sim-startup-seconds", "0"],
                         check=False, capture_output=True, timeout=30, env=env)
    assert bad.returncode == 1
    assert b"must be greater than or equal to max_num_seqs" in bad.stderr
    unknown = subprocess.run([sys.executable, "-m", "tuner.sim.engine", "--max-num-sequences", "64"],
                             check=False, capture_output=True, timeout=30, env=env)
    assert unknown.returncode == 2
