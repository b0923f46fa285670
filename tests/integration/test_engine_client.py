"""The one engine client against stub engines over real HTTP: the bearer token on every call (vLLM's
``--api-key`` guards ``/v1/*``), SGLang's routes and gauges, and the deadline every call is bounded by."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port
from tuner.actuators import base, children, fake
from tuner.rollout import journal, machine
from tuner.runtime import driving, engineside
from tuner.sources.engines import EngineClient
from tuner.sources.scraping import HttpSettings

STUB = Path(__file__).resolve().parents[1] / "support" / "stub_engine.py"


def start_stub(*argv: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(port), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stub engine did not start"
            time.sleep(0.05)
    except BaseException:
        children.stop(proc, timeout_seconds=0, signal_first=None)  # SIGKILL, reaped
        raise


@pytest.fixture
def stub(request: pytest.FixtureRequest) -> Iterator[str]:
    proc, url = start_stub(*request.param)
    try:
        yield url
    finally:
        children.stop(proc, timeout_seconds=0, signal_first=None)  # SIGKILL, reaped


@pytest.mark.parametrize("stub", [("--api-key", "s3cret", "--model", "m")], indirect=True)
def test_a_token_protected_engine_is_healthy_and_warmed_only_with_the_token(stub: str) -> None:
    """The rollout's health probe and warm-up used a bare client without the token: every rollout of a
    token-protected engine failed at its health wait."""
    with EngineClient() as anonymous:
        assert anonymous.is_healthy(stub, "vllm") is False  # /health 200, /v1/models 401
        assert anonymous.warm(stub, "vllm", requests=1) == "the engine names no model"
    with EngineClient(HttpSettings(bearer_token="s3cret")) as client:
        assert client.is_healthy(stub, "vllm") is True
        assert client.warm(stub, "vllm", requests=2) is None
        assert client.info(stub, "vllm").model == "m"


@pytest.mark.parametrize("stub", [("--stub-kind", "sglang", "--stub-latency", "2.5", "--model", "s")],
                         indirect=True)
def test_sglang_wait_idle_waits_for_the_request_in_flight(stub: str, tmp_path: Path) -> None:
    """The old prober read the in-flight count with a vLLM-only regex: for SGLang it found nothing and
    the rollout took a busy engine for idle and stopped it under a request."""
    client = EngineClient()
    replica = base.Replica("a", stub)
    assert client.is_healthy(stub, "sglang") and client.load(stub, "sglang") == 0
    done: dict[str, float] = {}

    def request() -> None:
        assert client.warm(stub, "sglang", requests=1) is None
        done["at"] = time.time()

    t = threading.Thread(target=request)
    t.start()
    deadline = time.monotonic() + 10
    while client.load(stub, "sglang") != 1:
        assert time.monotonic() < deadline, "the request never showed in sglang:num_running_reqs"
        time.sleep(0.05)
    actuator = fake.FakeActuator([replica], running={"a": ("--x",)})
    j = journal.Journal(tmp_path / "j.jsonl")
    driver = driving.RolloutDriver(actuator=actuator, drainer=fake.FakeDrainer(),
                                   prober=engineside.EngineProber(client, kind="sglang"), journal=j, poll_seconds=0.1,
                                   idle_settle_seconds=0.3)
    r = driver.begin("r1", {"a": ("--y",)}, limits=machine.Limits(idle_timeout_seconds=30, verify_seconds=0,
                                                                      warmup_requests=0, allow_downtime=True))
    driver.run(r)
    t.join(10)
    idle = next(rec for rec in j.records if rec["kind"] == "event" and rec["event"] in ("idle", "idle_timeout"))
    assert idle["event"] == "idle"
    assert idle["at"] >= done["at"], "stopped while the SGLang request was still running"
    client.close()


def test_every_call_is_bounded_by_its_deadline() -> None:
    """A server that trickles a byte every 0.5 s never trips a 5 s read timeout; the call's deadline cuts it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not stop.is_set():
            try:
                conn.sendall(b"1\r\n#\r\n")
            except OSError:
                break
            stop.wait(0.5)
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    got: list = []
    with EngineClient(HttpSettings(read_timeout_seconds=5), deadline_seconds=1.5) as client:
        caller = threading.Thread(target=lambda: got.append(client.scrape(f"http://127.0.0.1:{port}/metrics")))
        caller.start()
        caller.join(60)  # the server never stops sending: only the deadline can end the call
        stop.set()
    listener.close()
    assert not caller.is_alive(), "the scrape of a trickling server never returned"
    (snap,) = got
    assert not snap.ok and "timed out (ReadTimeout)" in (snap.error or "")
