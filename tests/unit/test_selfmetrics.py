"""The tuner's own series, asserted on a fresh registry per test (never the global REGISTRY)."""

from __future__ import annotations

import platform

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tuner import __version__
from tuner.runtime import results, selfmetrics, views
from tuner.signals import VOCABULARY, Signal, missing


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
    assert v("tuner_signal_requests", {"target": "engine-0", "signal": "requests_waiting"}) == 112.0
    assert v("tuner_signal_ratio", {"target": "engine-0", "signal": "kv_cache_usage"}) == 0.0  # a real zero stays
    assert v("tuner_signal_seconds", {"target": "engine-0", "signal": "ttft_p95_s"}) is None  # unknown: absent
    m.set_signals("engine-0", {"requests_waiting": missing("scrape failed"), "kv_cache_usage": Signal(0.5)})
    assert v("tuner_signal_requests", {"target": "engine-0", "signal": "requests_waiting"}) is None
    assert v("tuner_signal_ratio", {"target": "engine-0", "signal": "kv_cache_usage"}) == 0.5


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
    assert families["tuner_signal_seconds"] == "gauge"
    assert families["tuner_build_info"] == "gauge"  # an Info, as the 0.0.4 text format has it
    assert families["tuner_engine_arg_info"] == "gauge"
    assert REGISTRY.get_sample_value("tuner_decisions_total", {"rule": "r", "outcome": "held",
                                                               "reason": "cooldown"}) is None
    # two instances never collide (a shared registry would raise "Duplicated timeseries")
    selfmetrics.TunerMetrics()


@given(st.dictionaries(st.sampled_from(sorted(VOCABULARY)), st.floats(0, 1e6), min_size=1))
def test_every_signal_lands_in_the_one_gauge_of_its_unit(values: dict[str, float]) -> None:
    """One unit per metric name: every signal of a gauge shares that gauge's unit, and no signal is lost."""
    m = selfmetrics.TunerMetrics()
    m.set_signals("e", {name: Signal(value) for name, value in values.items()})
    units: dict[str, set[str]] = {}
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            if family.name.startswith("tuner_signal_"):
                units.setdefault(family.name, set()).add(VOCABULARY[sample.labels["signal"]].unit.replace(
                    " (signed)", ""))
                seen[sample.labels["signal"]] = sample.value
    assert all(len(u) == 1 for u in units.values()), units
    assert seen == values


def test_no_created_series_and_a_build_info() -> None:
    m = selfmetrics.TunerMetrics()
    m.count_decision(rule="r", outcome="held", reason="cooldown")
    m.observe_cycle(0.1, finished_at=1.0)
    text = m.render().decode()
    assert "_created" not in text
    assert m.registry.get_sample_value("tuner_build_info", {"version": __version__,
                                                            "python": platform.python_version()}) == 1


def test_a_decision_repeated_by_the_next_cycles_counts_once_and_again_when_it_changes() -> None:
    m = selfmetrics.TunerMetrics()
    v = m.registry.get_sample_value
    rec = ("queue-pressure", "recommended", "fired", "--max-num-seqs=16")
    held = ("kv-pressure", "held", "cooldown", "")
    for _ in range(5):
        m.count_decisions("engine-0", {rec, held})
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "recommended", "reason": "fired"}) == 1
    assert v("tuner_decisions_total", {"rule": "kv-pressure", "outcome": "held", "reason": "cooldown"}) == 1
    m.count_decisions("engine-0", {("queue-pressure", "recommended", "fired", "--max-num-seqs=32")})
    assert v("tuner_decisions_total", {"rule": "queue-pressure", "outcome": "recommended", "reason": "fired"}) == 2
    m.count_decisions("engine-0", set())
    m.count_decisions("engine-0", {held})  # gone, then back: a new decision
    assert v("tuner_decisions_total", {"rule": "kv-pressure", "outcome": "held", "reason": "cooldown"}) == 2
    m.count_decisions("engine-1", {held})  # another target's decision is its own
    assert v("tuner_decisions_total", {"rule": "kv-pressure", "outcome": "held", "reason": "cooldown"}) == 3


def test_live_changes_are_counted_apart_from_restarts() -> None:
    m = selfmetrics.TunerMetrics()
    views.count_finished(m, results.RolloutOutcome(results={"a": "ok", "b": "ok"}, state={"kind": "live"}))
    views.count_finished(m, results.RolloutOutcome(results={"a": "rolled_back"}, state={"kind": "restart"}))
    v = m.registry.get_sample_value
    assert v("tuner_live_changes_total", {"target": "a", "result": "ok"}) == 1
    assert v("tuner_restarts_total", {"target": "a", "result": "ok"}) is None
    assert v("tuner_restarts_total", {"target": "a", "result": "rolled_back"}) == 1


def test_pause_and_pins_are_gauges() -> None:
    m = selfmetrics.TunerMetrics()
    v = m.registry.get_sample_value
    m.set_control(paused=True, pins={"--max-num-seqs", "--max-model-len"})
    assert v("tuner_paused") == 1 and v("tuner_pinned", {"flag": "--max-num-seqs"}) == 1
    m.set_control(paused=False, pins={"--max-model-len"})
    assert v("tuner_paused") == 0 and v("tuner_pinned", {"flag": "--max-num-seqs"}) is None


def test_the_rollout_in_flight_and_since_when() -> None:
    m = selfmetrics.TunerMetrics()
    v = m.registry.get_sample_value
    assert v("tuner_rollout_in_flight") == 0
    m.set_rollout(started_at=1234.5)
    assert v("tuner_rollout_in_flight") == 1 and v("tuner_rollout_started_timestamp_seconds") == 1234.5
    m.set_rollout(started_at=None)
    assert v("tuner_rollout_in_flight") == 0 and v("tuner_rollout_started_timestamp_seconds") == 0
