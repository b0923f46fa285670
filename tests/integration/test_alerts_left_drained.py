"""deploy/prometheus/alerts.yaml with the real promtool: the rules load, and the alert on a replica a failed
rollout left drained fires on the series the tuner exports — rendered by its own registry, not typed here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import required
from tuner.runtime import selfmetrics

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    required.need(None if path else "promtool is not on PATH (apt-get install prometheus, or the release tarball)",
                  "promtool")
    assert path is not None
    return path


def test_the_rules_load(promtool: str) -> None:
    done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_replica_left_drained_fires_the_alert_and_one_back_in_the_pool_does_not(promtool: str, tmp_path: Path) -> None:
    metrics = selfmetrics.TunerMetrics()
    metrics.set_left_drained({"b": 300.0, "c": 5.0})
    metrics.set_left_drained({"b": 300.0})  # c went back in the pool: its series is gone
    exported = [line for line in metrics.render().decode().splitlines()
                if line.startswith("tuner_replica_left_drained_seconds{")]
    assert exported == ['tuner_replica_left_drained_seconds{replica="b"} 300.0']
    series = exported[0].split(" ")[0]
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": series, "values": "300+60x10"}],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "VllmTunerReplicaLeftDrained", "exp_alerts": []},
                {"eval_time": "5m", "alertname": "VllmTunerReplicaLeftDrained", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "replica": "b"},
                    "exp_annotations": {
                        "summary": "vllm-tuner left replica b out of the pool after a failed rollout",
                        "description": "b has been drained for 10m 0s: a rollout could not bring it back. Check "
                                       "the engine (GET /status on the tuner, key left_drained, says why), then put "
                                       "it back in the load balancer; the next rollout that includes it does so as "
                                       "well."},
                }]},
            ],
        }],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    done = subprocess.run([promtool, "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
