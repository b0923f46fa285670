"""The tuner's own endpoint over real HTTP: /metrics, /healthz, /status, /recommendations."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_cycle import Harness
from tuner.runtime import httpserver


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


Setup = tuple[Harness, httpserver.TunerHttpServer, Clock, dict[str, bool]]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as client:  # one client: building an SSL context per request is slow
        yield client


@pytest.fixture
def setup() -> Iterator[Setup]:
    h = Harness("recommend")
    clock = Clock(h.now)
    flags = {"alive": True, "busy": False}
    server = httpserver.TunerHttpServer(metrics=h.metrics, state=h.state, max_age_seconds=90,
                                        is_alive=lambda: flags["alive"], is_busy=lambda: flags["busy"], port=0,
                                        clock=clock)
    with server:
        yield h, server, clock, flags


def test_binds_loopback_by_default(http: httpx.Client) -> None:
    assert httpserver.DEFAULT_HOST == "127.0.0.1"
    h = Harness()
    with httpserver.TunerHttpServer(metrics=h.metrics, state=h.state, max_age_seconds=90, port=0) as server:
        assert server.host == "127.0.0.1"
        assert server.url.startswith("http://127.0.0.1:")


def test_healthz_before_during_and_after(http: httpx.Client, setup: Setup) -> None:
    h, server, clock, flags = setup
    r = http.get(f"{server.url}/healthz")
    assert r.status_code == 200 and r.json()["reason"] == "starting: no cycle finished yet"
    first = h.run()
    clock.now = first.finished_at + 30
    r = http.get(f"{server.url}/healthz")
    assert r.status_code == 200 and r.json()["last_cycle"] == 1
    clock.now += 120  # no cycle for 150 s: the loop is wedged
    r = http.get(f"{server.url}/healthz")
    assert r.status_code == 503
    assert "the last cycle finished 150s ago (limit 90s)" in r.json()["reason"]
    flags["busy"] = True  # …unless a cycle is running (a rolling restart takes minutes)
    r = http.get(f"{server.url}/healthz")
    assert r.status_code == 200 and r.json()["cycle_running"] is True
    clock.now -= 120
    flags["alive"] = False  # stopping, stuck, or the scheduler died
    assert http.get(f"{server.url}/healthz").status_code == 503


def test_no_cycle_for_too_long_after_start_is_unhealthy(
        http: httpx.Client, setup: tuple[Harness, httpserver.TunerHttpServer, Clock, list[bool]]) -> None:
    h, server, clock, _ = setup
    clock.now = h.state.started_at + 91
    assert http.get(f"{server.url}/healthz").status_code == 503


def test_metrics_is_the_own_registry(http: httpx.Client, setup: Setup) -> None:
    h, server, _, _ = setup
    h.run()
    r = http.get(f"{server.url}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert families["tuner_cycle_duration_seconds"].type == "histogram"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in families["tuner_signal_requests"].samples}
    assert samples[("tuner_signal_requests", (("signal", "requests_waiting"), ("target", "engine-0")))] == 112
    assert not [n for n in r.text.split() if n.endswith("_created") or "_created{" in n]  # disable_created_metrics
    assert "python_gc_objects_collected_total" not in r.text  # not the global registry


def test_status_and_recommendations(http: httpx.Client, setup: Setup) -> None:
    h, server, _, _ = setup
    empty = http.get(f"{server.url}/status").json()
    assert empty["cycle"] is None and empty["targets"] == {}
    assert http.get(f"{server.url}/recommendations").json()["recommendations"] == []
    h.run()
    h.run()
    status = http.get(f"{server.url}/status").json()
    assert status["cycle"] == 2
    assert status["mode"] == "recommend"
    target = status["targets"]["engine-0"]
    assert target["signals"]["requests_waiting"] == 112
    assert target["signals"]["request_rate"] > 0
    assert target["engine"]["max_model_len"] == 4096
    assert target["plan"]["recommendations"][0]["to"] == "16"
    assert status["pending"] is None
    recs = http.get(f"{server.url}/recommendations").json()
    assert recs["recommendations"][0]["flag"] == "--max-num-seqs"
    assert recs["recommendations"][0]["target"] == "engine-0"


def test_unknown_paths_are_404_with_a_list(http: httpx.Client, setup: Setup) -> None:
    _, server, _, _ = setup
    r = http.get(f"{server.url}/nope")
    assert r.status_code == 404
    assert "/recommendations" in json.loads(r.text)["endpoints"]
    assert http.head(f"{server.url}/healthz").status_code == 200


def test_no_endpoint_shows_a_secret_of_the_engines_arguments(http: httpx.Client) -> None:
    """``--api-key`` in targets[].args: /metrics (tuner_engine_arg_info), /status (current and plan args) and
    /recommendations show it masked, never its value — with the state as the daemon builds it and as
    anything else builds it (the known secret flags are masked without being told the value)."""
    from tuner import config
    from tuner.runtime.state import TunerState

    key = "sk-http-4c1d9e2b"
    for build in ("daemon", "plain"):
        h = Harness("recommend")
        h.settings = config.parse({**h.settings.model_dump(mode="json"), "targets": [
            {"name": "engine-0", "metrics_url": "http://127.0.0.1:1/engine-0/metrics",
             "args": ["--max-num-seqs", "8", "--api-key", key]}]})
        h.state = (TunerState.fresh(h.settings.targets, redactor=h.settings.redactor()) if build == "daemon"
                   else TunerState.fresh(h.settings.targets))
        with httpserver.TunerHttpServer(metrics=h.metrics, state=h.state, max_age_seconds=90, port=0) as server:
            h.run()
            h.run()
            bodies = {p: http.get(f"{server.url}{p}").text for p in ("/metrics", "/status", "/recommendations")}
        status = json.loads(bodies["/status"])
        assert status["targets"]["engine-0"]["plan"]["recommendations"][0]["to"] == "16"  # a plan was made
        for path, body in bodies.items():
            assert key not in body, (build, path)
        assert status["targets"]["engine-0"]["current_args"]["--api-key"] == "***"
        plan_args = status["targets"]["engine-0"]["plan"]["args"]
        assert plan_args[plan_args.index("--api-key") + 1] == "***"
        assert 'flag="--api-key",kind="current",target="engine-0",value="***"' in bodies["/metrics"]


def non_loopback_address() -> str | None:
    """This host's own address on its default route (no packet is sent), if it has one."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if httpserver.is_loopback(address) else address


@pytest.mark.parametrize("from_network", [False, True])
def test_status_answers_loopback_only_unless_asked(http: httpx.Client, from_network: bool) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    h = Harness("recommend")
    h.run()
    with httpserver.TunerHttpServer(metrics=h.metrics, state=h.state, max_age_seconds=90, host="0.0.0.0", port=0,
                                    status_from_network=from_network) as server:
        for path in ("/status", "/recommendations"):
            assert http.get(f"http://127.0.0.1:{server.port}{path}").status_code == 200
            remote = http.get(f"http://{address}:{server.port}{path}")
            if from_network:
                assert remote.status_code == 200
            else:
                assert remote.status_code == 403 and "daemon.status_from_network" in remote.json()["error"]
        assert http.get(f"http://{address}:{server.port}/metrics").status_code == 200  # Prometheus's, on the pod IP
        assert http.get(f"http://{address}:{server.port}/healthz").status_code in (200, 503)  # answered, not refused


def test_is_loopback() -> None:
    assert all(httpserver.is_loopback(a) for a in ("127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"))
    assert not any(httpserver.is_loopback(a) for a in ("10.0.0.1", "::ffff:10.0.0.1", "fe80::1%eth0", "", "x"))


def test_an_unbounded_max_age_stays_healthy(http: httpx.Client) -> None:
    """A degraded agent's endpoint (tuner/kube/running.py ``degraded``): no cycle ever finishes, and its
    liveness probe must not restart it in a loop for that."""
    h = Harness()
    clock = Clock(h.now)
    with httpserver.TunerHttpServer(metrics=h.metrics, state=h.state, max_age_seconds=float("inf"), port=0,
                                    clock=clock) as server:
        clock.now += 86_400
        r = http.get(f"{server.url}/healthz")
        assert r.status_code == 200 and r.json()["last_cycle"] is None


def test_status_names_a_replica_a_failed_rollout_left_drained(http: httpx.Client, setup: Setup) -> None:
    h, server, _, _ = setup
    assert http.get(f"{server.url}/status").json()["left_drained"] == {}
    h.state.left_drained = {"engine-0": {"rollout": "r7", "since": 1.0, "seconds": 20.0, "person_asked": False,
                                         "reason": "the engine serves max_model_len 2048, expected 4096",
                                         "ask_after_seconds": 900.0}}
    assert http.get(f"{server.url}/status").json()["left_drained"]["engine-0"]["rollout"] == "r7"
    h.run()
    assert http.get(f"{server.url}/status").json()["left_drained"]["engine-0"]["reason"].startswith("the engine")
