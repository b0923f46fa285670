"""recommend --format production-stack: the plan as a diff of production-stack's Helm values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tuner.cli import stackvalues
from tuner.model import knobs

ROOT = Path(__file__).resolve().parents[2]


def test_a_vllm_config_key_and_the_extra_args_list() -> None:
    before = knobs.EngineArgs.parse(["--model", "m", "--max-num-seqs", "8", "--max-num-batched-tokens", "16384",
                                     "--enforce-eager"])
    after = before.with_value("--max-num-seqs", 80).with_value("--max-num-batched-tokens", 2048)
    lines = stackvalues.values_diff([("--max-num-seqs", 8, 80), ("--max-num-batched-tokens", 16384, 2048)],
                                    model="llama", before=before, after=after)
    assert lines[0].startswith("# servingEngineSpec.modelSpec[name=llama].vllmConfig")
    assert "-  maxNumSeqs: 8" in lines and "+  maxNumSeqs: 80" in lines
    assert '-  extraArgs: ["--max-num-batched-tokens=16384"]' in lines
    assert '+  extraArgs: ["--max-num-batched-tokens=2048"]' in lines
    assert not any("enforce" in line for line in lines)  # only what the plan changes


def test_a_flag_that_was_absent_and_a_boolean() -> None:
    before = knobs.EngineArgs.parse(["--model", "m"])
    after = before.with_value("--gpu-memory-utilization", 0.95).with_value("--enable-chunked-prefill", True)
    lines = stackvalues.values_diff([("--gpu-memory-utilization", None, 0.95), ("--enable-chunked-prefill", None, True)],
                                    model="m", before=before, after=after)
    assert "+  gpuMemoryUtilization: 0.95" in lines and "+  enableChunkedPrefill: true" in lines
    assert not any(line.startswith("-  ") for line in lines)  # nothing to take out


def test_no_change() -> None:
    args = knobs.EngineArgs.parse(["--model", "m"])
    assert stackvalues.values_diff([], model="m", before=args, after=args) == [
        "# servingEngineSpec.modelSpec[name=m]: no change"]


def test_recommend_prints_the_one_step_of_the_recorded_h200_bad_start_as_a_values_diff(tmp_path: Path) -> None:
    captures = ROOT / "tests" / "fixtures" / "vllm" / "h200-queue-bound"
    # The capture holds three loaded scrapes (10 s): a restart waits for `for: 3` windows of the new regime and
    # 60 s of sustained evidence (tests/scenarios say so); this test is about the format of the step, so the
    # shipped rule fires at once here and the evidence guard is off.
    rules = yaml.safe_load((ROOT / "rules" / "default.yaml").read_text())
    (queue,) = [r for r in rules["rules"] if r["id"] == "queue-slot-bound"]
    queue["when"]["for"] = 1
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [queue]}))
    (tmp_path / "decisions.yaml").write_text("safety: {restart_evidence_seconds: 0}\n")
    argv = [sys.executable, "-m", "tuner", "recommend", "--platform", "cuda", "--gpu-memory-gib", "139",
            "--format", "production-stack", "--model-name", "llama-8b", "--decisions", str(tmp_path / "decisions.yaml"),
            "--rules", str(tmp_path / "rules.yaml")]
    for f in sorted(captures.glob("*.prom")):
        argv += ["--engine-metrics", str(f)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert out[0] == ("# servingEngineSpec.modelSpec[name=llama-8b].vllmConfig — apply by hand or in review; "
                      "Helm then")
    # the 64 clients inside ÷ 0.8 → 80, then on to the TPOT frontier (a restart is sized for the cooldown)
    assert out[2:] == ["-  maxNumSeqs: 8", "+  maxNumSeqs: 533"]
