"""The tuner's own series, asserted on a fresh registry per test (never the global REGISTRY)."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tuner.daemon import selfmetrics
from tuner.signals import Signal, missing


def test_cycle_and_step_durations() -> None:
    m = selfmetrics.TunerMetrics()
    m.observe_cycle(0.2, finished_at=1000.0)
    m.observe_step("collect", 0.15)
    m.observe_step("plan", 0.01)
    v = m.registry.get_sample_value
    assert v("tuner_cycle_duration_seconds_count") == 1
    assert v("tuner_cycle_duration_seconds_sum") == 0.2
    assert v("tuner_cycle_duration_seconds_bucket", {"le": "0.25"}) == 1
    assert v("tuner_cycle_step_duration_seconds_count", {"step": "collect"}) == 1
    assert v("tuner_cycle_step_duration_seconds_sum", {"step": "plan"}) == 0.01
    assert v("tuner_last_cycle_timestamp_seconds") == 1000.0


def test_counters_by_label() -> None:
    m = selfmetrics.TunerMetrics()
    m.count_decision(rule="queue-pressure", outcome="recommended", reason="queueing")
    m.count_decision(rule="queue-pressure", outcome="recommended", reason="queueing")
    m.count_decision(rule="kv-pressure", outcome="held", reason="cooldown")
    m.count_restart(target="engine-0", result="ok")
    m.count_scrape_error(target="engine-1", source="engine")
    v = m.registry.get_sample_value
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "recommended", "reason": "queueing"}) == 2
    assert v("tuner_decisions_total", {"rule": "kv-pressure", "outcome": "held", "reason": "cooldown"}) == 1
    assert v("tuner_restarts_total", {"target": "engine-0", "result": "ok"}) == 1
    assert v("tuner_scrape_errors_total", {"target": "engine-1", "source": "engine"}) == 1


def test_signal_gauges_hold_only_known_values_and_drop_ones_that_became_unknown() -> None:
    m = selfmetrics.TunerMetrics()
    m.set_signals("engine-0", {"requests_waiting": Signal(112.0), "ttft_p95_s": missing("too few snapshots"),
                               "kv_cache_usage": Signal(0.0)})
    v = m.registry.get_sample_value
    assert v("tuner_signal", {"target": "engine-0", "signal": "requests_waiting"}) == 112.0
    assert v("tuner_signal", {"target": "engine-0", "signal": "kv_cache_usage"}) == 0.0  # a real zero stays
    assert v("tuner_signal", {"target": "engine-0", "signal": "ttft_p95_s"}) is None  # unknown: absent, not 0
    m.set_signals("engine-0", {"requests_waiting": missing("scrape failed"), "kv_cache_usage": Signal(0.5)})
    assert v("tuner_signal", {"target": "engine-0", "signal": "requests_waiting"}) is None
    assert v("tuner_signal", {"target": "engine-0", "signal": "kv_cache_usage"}) == 0.5


def test_engine_arg_info_replaces_old_values() -> None:
    m = selfmetrics.TunerMetrics()
    m.set_engine_args("engine-0", current={"--max-num-seqs": "8"}, recommended={"--max-num-seqs": "16"})
    v = m.registry.get_sample_value
    labels = {"target": "engine-0", "flag": "--max-num-seqs"}
    assert v("tuner_engine_arg_info", {**labels, "value": "8", "kind": "current"}) == 1
    assert v("tuner_engine_arg_info", {**labels, "value": "16", "kind": "recommended"}) == 1
    m.set_engine_args("engine-0", current={"--max-num-seqs": "16"}, recommended={})
    assert v("tuner_engine_arg_info", {**labels, "value": "8", "kind": "current"}) is None
    assert v("tuner_engine_arg_info", {**labels, "value": "16", "kind": "recommended"}) is None
    assert v("tuner_engine_arg_info", {**labels, "value": "16", "kind": "current"}) == 1
    m.forget_target("engine-0")
    assert v("tuner_engine_arg_info", {**labels, "value": "16", "kind": "current"}) is None


def test_own_registry_renders_valid_exposition_and_leaves_the_global_one_alone() -> None:
    m = selfmetrics.TunerMetrics()
    m.count_decision(rule="r", outcome="held", reason="cooldown")
    text = m.render().decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["tuner_cycle_duration_seconds"] == "histogram"
    assert families["tuner_decisions"] == "counter"
    assert families["tuner_signal"] == "gauge"
    assert families["tuner_engine_arg_info"] == "gauge"
    assert REGISTRY.get_sample_value("tuner_decisions_total", {"rule": "r", "outcome": "held",
                                                               "reason": "cooldown"}) is None
    # two instances never collide (a shared registry would raise "Duplicated timeseries")
    selfmetrics.TunerMetrics()
