"""The shipped alert rules (deploy/prometheus/alerts.yaml), evaluated by Prometheus' own rule engine:
``promtool check rules`` and ``promtool test rules`` (Debian's prometheus package) on series that make
each alert fire and series beside them that must not; and every series they read is one the tuner exports."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from harness import required
from tests.integration.test_deploy import metric_names
from tuner.kube import reporting
from tuner.runtime import selfmetrics

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
TESTS = REPO / "tests" / "fixtures" / "prometheus" / "alerts-test.yaml"
EXPECTED = {"VllmTunerDown", "VllmTunerDegraded", "VllmTunerRolloutStuck", "VllmTunerRestartBudgetSpent",
            "VllmTunerEngineUnscrapeable", "VllmTunerReplicaLeftDrained"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    required.need(None if shutil.which("promtool") else "promtool is not installed (apt-get install prometheus)",
                  "promtool")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=TESTS.parent,
                          check=False)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_the_rules_are_valid_prometheus_rules() -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(EXPECTED)} rules found" in done.stdout


def test_each_alert_fires_on_its_cause_and_not_beside_it() -> None:
    done = promtool("test", "rules", TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = {t["alertname"] for case in yaml.safe_load(TESTS.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in rules()} == EXPECTED
    for case in yaml.safe_load(TESTS.read_text())["tests"]:  # each alert: a time it is quiet, and one it fires
        assert [bool(t["exp_alerts"]) for t in case["alert_rule_test"]] == [False, True], case["name"]


def test_a_broken_rule_fails_its_test(tmp_path: Path) -> None:
    """The test can fail: the same cases against rules whose thresholds were loosened report the difference."""
    broken = ALERTS.read_text().replace("> 0.5", "> 0.05").replace("for: 5m", "for: 1m")
    (tmp_path / "alerts.yaml").write_text(broken)
    cases = yaml.safe_load(TESTS.read_text())
    cases["rule_files"] = [str(tmp_path / "alerts.yaml")]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(cases))
    done = promtool("test", "rules", str(tmp_path / "t.yaml"))
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


def test_every_series_an_alert_reads_is_exported() -> None:
    metrics = selfmetrics.TunerMetrics()
    reporting.AgentMetrics(metrics.registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "info": ("_info",)}
    known = {"up"} | {f.name + s for f in metrics.registry.collect() for s in suffixes.get(f.type, ("",))}
    for rule in rules():
        names = metric_names(" ".join(rule["expr"].split()))
        assert names and names <= known, (rule["alert"], names - known)
