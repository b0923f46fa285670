"""``recommend`` and ``replay`` on the real captures, through their argparse wiring."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from tests.scenarios.support import KV_CAP_ON_TEXT, REPO, scenario_dir
from tuner.cli import deciding
from tuner.errors import ConfigError


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="vllm-tuner")
    deciding.register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    rc = ns.func(ns)
    return rc, capsys.readouterr().out


def files(name, count=None):
    """``--engine-metrics`` for the capture's first ``count`` files (all by default)."""
    d = scenario_dir(name)
    out = []
    for p in sorted(d.glob("*.prom"))[:count]:
        out += ["--engine-metrics", str(p)]
    return out


# queue-bound 000-008 and kv-bound 000-010: the scrapes under load (the last file of each is scraped after
# the benchmark finished, when nothing arrives any more)
QUEUE_LOADED, KV_LOADED = 9, 11


def evidence(tmp_path, seconds, extra=""):
    """A decisions file with restart_evidence_seconds (the captures hold 44-55 s of load, a restart needs 60 s
    of evidence by default)."""
    path = tmp_path / f"evidence-{seconds}.yaml"
    path.write_text(f"safety: {{restart_evidence_seconds: {seconds}{extra}}}\n")
    return str(path)


def test_recommend_json_on_the_queue_bound_capture(capsys, tmp_path):
    args = ["--args", "--max-model-len 2048 --max-num-seqs 4", "--format", "json"]
    rc, out = run(["recommend", *files("queue-bound", 11), *args], capsys)
    assert rc == 0
    data = json.loads(out)  # 000-010: 55 s of load, the restart's 60 s of evidence not reached
    assert data["recommendations"] == [] and data["restart_needed"] is False
    # the value the law moves to, and when (issue 25): not "HELD" with no value. The last file's queue drains
    # (the 96 prompts run out): the answer is the last step that sized a change
    later = {"rule": "queue-slot-bound", "guard": "sustained",
             "reason": "after 17s more of sustained evidence (a restart needs 1m; true for 44s so far)",
             "would": {"flag": "--max-num-seqs", "from": "4", "to": "424"}}
    assert data["later"] == [later] and data["held"] == [later]
    rc, out = run(["recommend", *files("queue-bound", QUEUE_LOADED), *args, "--decisions", evidence(tmp_path, 30)],
                  capsys)
    data = json.loads(out)
    (rec,) = data["recommendations"]
    assert {k: rec[k] for k in ("flag", "from", "to", "rule")} == {
        "flag": "--max-num-seqs", "from": "4", "to": "424", "rule": "queue-slot-bound"}
    # the demand (32 clients inside ÷ 0.8 → 40), then on to the TPOT frontier: a restart is sized for the cooldown
    assert "queue_time_mean_s" in rec["reason"] and "the queue is stable" in rec["reason"]
    assert "→ 40; a restart goes to the TPOT SLO frontier" in rec["reason"]
    assert data["held"] == [] and data["restart_needed"] is True
    assert data["signals"]["requests_running_max"] == 4
    assert data["args_after"] == ["--max-model-len", "2048", "--max-num-seqs", "424"]


def test_recommend_table_explains_each_decision(capsys, tmp_path):
    argv = ["recommend", *files("kv-bound", KV_LOADED), "--platform", "cpu",
            "--gpu-readings", str(REPO / "tests/fixtures/nvml/h200-matmul.json"), "--gpu-sample", "40"]
    rc, out = run(argv, capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("recommend (vllm): ") and " snapshots over " in lines[0]
    # the shipped rules: more KV memory, later; kv-preemption-cap ships off (docs/evidence.md#kv-preemption-cap)
    assert ("  LATER   --gpu-memory-utilization 0.92 → 0.94 (kv-more-memory) [sustained]: after 17s more of "
            "sustained evidence (a restart needs 1m; true for 44s so far)") in lines
    assert "kv-preemption-cap" not in out and "restart needed: no" in out
    # turned on (a rule file of the user's)
    rules = tmp_path / "rules.yaml"
    rules.write_text(KV_CAP_ON_TEXT)
    argv += ["--rules", str(rules)]
    rc, out = run(argv, capsys)
    lines = out.splitlines()
    assert ("  LATER   --max-num-seqs 128 → 10 (kv-preemption-cap) [sustained]: after 17s more of sustained "
            "evidence (a restart needs 1m; true for 44s so far)") in lines
    assert "restart needed: no" in out
    rc, out = run([*argv, "--decisions", evidence(tmp_path, 0)], capsys)
    lines = out.splitlines()
    assert any(line.startswith("  CHANGE  --max-num-seqs ") and "kv-preemption-cap" in line for line in lines)
    # 2 % more memory for a restart does not pay back (guards.payback); it would go out alone anyway
    assert any(line.startswith("  HELD    --gpu-memory-utilization 0.92 → 0.94 (kv-more-memory) [payback]: a restart "
                               "does not pay back") for line in lines)
    assert "restart needed: yes" in out
    # a power-capped H200 reading freezes nothing
    assert "[thermal]" not in out


def test_recommend_with_a_throttling_gpu_holds_load_adding_changes(capsys, tmp_path):
    reading = {"index": 0, "source": "nvml", "read_at": 0, "gpu_temp_c": 87, "slowdown_temp_c": 89,
               "clocks_event_reasons": 0x20 | 0x4}
    (tmp_path / "gpu.json").write_text(json.dumps([reading]))
    _, out = run(["recommend", *files("queue-bound", QUEUE_LOADED), "--gpu-readings", str(tmp_path / "gpu.json"),
                  "--decisions", evidence(tmp_path, 30), "--format", "json"], capsys)
    data = json.loads(out)
    assert data["recommendations"] == []
    (held,) = data["held"]
    assert held["rule"] == "queue-slot-bound" and held["guard"] == "thermal"
    assert "thermal throttling" in held["reason"] and "2 °C below" in held["reason"]


def test_recommend_needs_two_snapshots(capsys):
    with pytest.raises(ConfigError, match="give --engine-metrics once per file"):  # exit 2, one error: line
        run(["recommend", "--engine-metrics", str(scenario_dir("idle") / "000.prom")], capsys)


def test_replay_prints_the_timeline(capsys, tmp_path):
    rc, out = run(["replay", str(scenario_dir("queue-bound"))], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("replay ") and "--max-num-seqs 4" in lines[0]
    # 003-008 held for the restart's evidence (each a summary line and a "later" line with the value); from 009
    # the clients' 96 prompts run out and the queue drains: 4 slots serve the rest within the backlog horizon
    assert sum("more of sustained evidence (a restart needs 1m" in line for line in lines) == 6
    assert sum("[sustained]: after" in line and "s more of sustained evidence" in line for line in lines) == 6
    # the frontier each window's TPOT allows (419-428): a restart goes on to it
    assert sum(re.search(r"later: --max-num-seqs 4→4[12]\d \(queue-slot-bound\)", line) is not None
               for line in lines) == 7  # 002-008 (001's window, one interval of the fill, says 440)
    assert sum("the queue drains" in line for line in lines) == 3
    assert lines[-1].endswith("--max-num-seqs 4")
    rc, out = run(["replay", str(scenario_dir("queue-bound")), "--decisions", evidence(tmp_path, 30)], capsys)
    lines = out.splitlines()
    assert sum("--max-num-seqs 4→424 (queue-slot-bound); restart needed" in line for line in lines) == 1
    assert lines[-1].endswith("--max-num-seqs 424")


def test_replay_json_and_verbose(capsys):
    rc, out = run(["replay", str(scenario_dir("idle")), "--format", "json"], capsys)
    data = json.loads(out)
    assert [c["held"][0]["guard"] for c in data["cycles"]] == ["window", "idle", "idle"]
    rc, out = run(["replay", str(scenario_dir("latency-bound")), "-v", "--rules",
                   str(REPO / "rules" / "seed-h100.yaml")], capsys)
    assert rc == 0 and "UNKNOWN" in out


def test_replay_unix_second_file_names(tmp_path, capsys):
    src = scenario_dir("queue-bound")
    times = json.loads((src / "meta.json").read_text())["scraped_at"]
    for i, t in enumerate(times):
        (tmp_path / f"{t:.3f}.prom").write_text((src / f"{i:03d}.prom").read_text())
    rc, out = run(["replay", str(tmp_path), "--args", "--max-num-seqs 4 --max-model-len 2048",
                   "--decisions", evidence(tmp_path, 30)], capsys)
    assert rc == 0 and "--max-num-seqs 4→424" in out


def test_decisions_file_and_defaults(tmp_path, capsys):
    (tmp_path / "d.yaml").write_text("decisions:\n  safety: {max_restarts_per_hour: 0, restart_evidence_seconds: 0}\n")
    _, out = run(["recommend", *files("queue-bound", QUEUE_LOADED), "--decisions", str(tmp_path / "d.yaml"),
                   "--args", "--max-model-len 2048", "--default=--max-num-seqs=4", "--format", "json"], capsys)
    data = json.loads(out)
    assert data["recommendations"] == [] and data["held"][0]["guard"] == "budget"
    (tmp_path / "bad.yaml").write_text("thermal: {nope: 1}\n")
    with pytest.raises(ConfigError):
        run(["recommend", *files("queue-bound"), "--decisions", str(tmp_path / "bad.yaml")], capsys)


def test_bad_inputs(tmp_path, capsys):
    with pytest.raises(ConfigError, match="not a directory"):
        run(["replay", str(tmp_path / "nope")], capsys)
    with pytest.raises(ConfigError, match=r"no \*\.prom files"):
        run(["replay", str(tmp_path)], capsys)
    (tmp_path / "g.json").write_text("{}")
    with pytest.raises(ConfigError, match="GPU readings"):
        run(["recommend", *files("idle"), "--gpu-readings", str(tmp_path / "g.json")], capsys)
    (tmp_path / "r.yaml").write_text("rules: [{id: X}]")
    with pytest.raises(ConfigError, match=r"r\.yaml"):
        run(["recommend", *files("idle"), "--rules", str(tmp_path / "r.yaml")], capsys)


def test_recommend_with_a_dcgm_file(capsys):
    dcgm = REPO / "tests" / "fixtures" / "dcgm" / "h100x8-vllm-k8s-grep.prom"
    rc, out = run(["recommend", *files("queue-bound"), "--dcgm-metrics", str(dcgm), "--slowdown-temp-c", "87",
                   "--format", "json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["signals"]["gpu_temp_c"] is not None
    rc, out = run(["recommend", *files("queue-bound"), "--dcgm-metrics", str(scenario_dir("idle") / "000.prom"),
                   "--format", "json"], capsys)
    assert "no DCGM GPU series" in json.loads(out)["reasons"]["gpu_temp_c"]
