import re
import typing
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from tuner.errors import ConfigError
from tuner.model.knobs import EngineArgs
from tuner.rules import evaluation, loading, models, schema
from tuner.rules.schema import Rule
from tuner.signals import Signal, missing

REPO = Path(__file__).resolve().parents[2]


def sig(**values):
    return {k: v if isinstance(v, Signal) else (missing("absent") if v is None else Signal(float(v)))
            for k, v in values.items()}


def ctx(signals=None, args="", **kw):
    return evaluation.Context(signals=sig(**(signals or {})), args=EngineArgs.from_string(args), **kw)


def rule(text: str) -> Rule:
    return loading.parse({"rules": [yaml.safe_load(text)]}).rules[0]


def problems(data, file="rules/mine.yaml"):
    with pytest.raises(ConfigError) as info:
        loading.parse(data, file=file)
    assert info.value.file == file
    return info.value.problems


# --- the shipped files -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["default.yaml", "seed-h100.yaml"])
def test_shipped_rule_files_are_valid(name):
    rs = loading.load(REPO / "rules" / name)
    assert len(rs) >= 4
    assert all(r.evidence and r.evidence.startswith("docs/evidence.md#") for r in rs)
    assert rs.file_of(rs.rules[0].id) == str(REPO / "rules" / name)


@pytest.mark.parametrize("name", ["default.yaml", "seed-h100.yaml"])
def test_every_evidence_anchor_is_a_section_of_evidence_md(name):
    doc = (REPO / "docs" / "evidence.md").read_text()
    headings = {line.lstrip("#").strip().strip("`") for line in doc.splitlines() if line.startswith("## ")}
    for r in loading.load(REPO / "rules" / name):
        path, _, anchor = r.evidence.partition("#")
        assert path == "docs/evidence.md" and anchor in headings, (r.id, r.evidence)


def test_every_evidence_section_states_a_measured_conclusion():
    """No placeholder ever lands again: each default rule's section has a conclusion and a table or a
    reason why the CPU engine cannot show it."""
    doc = (REPO / "docs" / "evidence.md").read_text()
    assert "TODO" not in doc
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", doc, flags=re.S | re.M))
    for r in loading.load(REPO / "rules" / "default.yaml"):
        body = sections[r.evidence.partition("#")[2]]
        assert "**Conclusion" in body or "Not measurable" in body or "cannot" in body, r.id
        assert "|---|" in body or "cannot" in body, r.id


def test_default_decode_rules_read_the_p99():
    """The p95 hides vLLM's prefill stalls (docs/rules.md); the queue rule's gate is the price it is verified
    on, the per-request TPOT p99 inside its SLO (issue 25: the ITL gate stopped a climb the queue needed)."""
    by_id = {r.id: r for r in loading.load(REPO / "rules" / "default.yaml")}
    for rid in ("decode-latency-chunked-prefill", "decode-latency-batched-tokens"):
        (itl,) = [c for c in by_id[rid].when.all if getattr(c, "signal", None) == "itl_p99_s"]
        assert (itl.op, itl.value, itl.slo, itl.max_resolution) == (">", 1.5, "itl_p99_s", 0.05)  # 1.5 × SLO
    (gate,) = [c for c in by_id["queue-slot-bound"].when.all if "tpot_p99_s" in str(c)]
    # the price inside its SLO; or, while the queue breaks the TTFT, the median request's (what the raise is
    # verified on then); or, nothing finished yet, the median token gap; or the median request misses its TTFT
    # (the queue has cost most requests their SLO: the price guards too few to hold the raise that drains it)
    head, queued, unseen, old = gate.any
    assert (head.signal, head.op, head.factor, head.slo) == ("tpot_p99_s", "<", 1.0, "tpot_p99_s")
    assert [(c.signal, c.op, c.factor, c.slo) for c in queued.all] == [("ttft_p99_s", ">", 1.0, "ttft_p99_s"),
                                                                        ("tpot_p50_s", "<", 0.5, "tpot_p99_s")]
    assert [(c.signal, c.op, c.slo or c.value) for c in unseen.all] == [
        ("request_rate", "<=", 0), ("itl_p50_s", "<", "tpot_p99_s")]
    assert (old.signal, old.op, old.factor, old.slo) == ("ttft_p50_s", ">", 1.0, "ttft_p99_s")
    assert not [c for c in by_id["queue-slot-bound"].when.all if getattr(c, "signal", None) == "itl_p99_s"]
    # both sides of the trade are breach rules: the lowering fires on a broken TPOT, the raise on a TTFT the
    # queue breaks, and neither waits out the other's hysteresis (docs/rules.md#live-sizing: live-034 of seed 7)
    assert by_id["slots-over-tpot-slo"].breach and by_id["queue-slot-bound"].breach
    assert not by_id["slots-past-frontier"].breach
    assert not any("itl_p95_s" in str(r.when) for r in by_id.values())


def test_every_slo_is_a_valid_slo_reference_and_the_queue_rule_is_verified_on_tpot():
    assert typing.get_args(schema.SloName) == models.SLO_NAMES == ("ttft_p99_s", "itl_p99_s", "tpot_p99_s")
    assert models.SloSettings().tpot_p99_s == 0.1
    r = rule("""
        id: fast-requests
        verify: {signal: tpot_p99_s, expect: at-most, slo: tpot_p99_s}
        when: {all: [{signal: tpot_p99_s, op: "<", value: 0.5, slo: tpot_p99_s}]}
        then: {flag: --max-num-seqs, op: scale, factor: 2}
    """)
    assert (r.verify[0].slo, r.when.all[0].slo) == ("tpot_p99_s", "tpot_p99_s")
    assert any(w == "rules[0] (id: ok).verify[0].slo" for w, _ in problems(
        {"rules": [with_(verify={"signal": "tpot_p99_s", "expect": "at-most", "slo": "tpot_p50_s"})]}))
    by_id = {r.id: r for r in loading.load(REPO / "rules" / "default.yaml")}
    # the raise is judged on what each request saw — the median request, since a live raise goes past the p99
    # frontier (docs/rules.md#live-sizing) — the stalls stay the decode rules' trigger (rules/default.yaml)
    # ...and waived while the TTFT tail still misses: the cap is still short of the demand, and putting it back
    # would move the misses from the TPOT to the TTFT (the goodput counts both)
    assert [v.as_dict() for v in by_id["queue-slot-bound"].verify] == [
        {"signal": "tpot_p50_s", "expect": "at-most", "slo": "tpot_p99_s",
         "unless_above": {"signal": "ttft_p99_s", "slo": "ttft_p99_s"}}]
    assert any(w == "rules[0] (id: ok).verify[0]" for w, _ in problems(
        {"rules": [with_(verify={"signal": "tpot_p99_s", "expect": "no-increase",
                                 "unless_above": {"signal": "ttft_p99_s", "slo": "ttft_p99_s"}})]}))


def test_default_rules_shape():
    rs = loading.load(REPO / "rules" / "default.yaml")
    by_id = {r.id: r for r in rs}
    assert by_id["queue-slot-bound"].adds_load
    assert by_id["bandwidth-block-size"].experimental and by_id["bandwidth-block-size"].verify
    assert not by_id["shrink-context"].enabled  # frees no KV memory in vLLM V1
    assert "shrink-context" not in {r.id for r in rs.enabled}
    assert rs.get("nope") is None


def test_seed_rules_keep_the_seed_thresholds():
    by_id = {r.id: r for r in loading.load(REPO / "rules" / "seed-h100.yaml")}
    assert by_id["seed-queue-max-num-seqs"].when.all[0].value == 0.2
    assert by_id["seed-queue-max-num-seqs"].then.max == 512
    assert by_id["seed-kv-halve-context"].then.min == 16384
    assert by_id["seed-tpot-chunked-prefill"].when.all[0].value == 0.018
    assert by_id["seed-hbm-block-size"].then.max == 64


# --- validation errors name file, rule and field -------------------------------------------------------

GOOD = {"id": "ok", "when": {"all": [{"signal": "kv_cache_usage", "op": ">", "value": 0.9}]},
        "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2}}


def with_(**changes):
    out = yaml.safe_load(yaml.safe_dump(GOOD))
    for path, value in changes.items():
        node = out
        *head, last = path.split("__")
        for part in head:
            node = node[int(part)] if part.isdigit() else node[part]
        node[last] = value
    return out


def test_unknown_signal_names_rule_and_field():
    bad = with_(when={"all": [{"signal": "queue_ms", "op": ">", "value": 1}]})
    (where, what), = problems({"rules": [GOOD | {"id": "first"}, bad]})
    assert where == "rules[1] (id: ok).when.all[0].signal"
    assert "unknown signal 'queue_ms'" in what


def test_unknown_signal_in_nested_any_and_times():
    bad = with_(when={"for": 2, "all": [{"any": [{"signal": "kv_cache_usage", "op": ">", "value": 1,
                                                   "times": "--max-num-seqz"}]}]})
    (where, what), = problems({"rules": [bad]})
    assert where == "rules[0] (id: ok).when.all[0].any[0].times"
    assert "unknown flag '--max-num-seqz'" in what and "--max-num-seqs" in what


def test_unknown_flag():
    (where, what), = problems({"rules": [with_(then__flag="--max-seqs")]})
    assert where == "rules[0] (id: ok).then.flag" and "unknown flag" in what


@pytest.mark.parametrize(("data", "where", "needle"), [
    (with_(id="Bad_Id"), "rules[0] (id: Bad_Id).id", "pattern"),
    (with_(surprise=1), "rules[0] (id: ok).surprise", "unknown field"),
    (with_(when={"for": 0, "all": [GOOD["when"]["all"][0]]}), "rules[0] (id: ok).when.for", "greater than"),
    (with_(when={"all": [5]}), "rules[0] (id: ok).when.all[0]", "expected a condition"),
    (with_(when={"all": [{"op": ">", "value": 1}]}), "rules[0] (id: ok).when.all[0]", "exactly one of"),
    (with_(when={"all": [GOOD["when"]["all"][0]], "any": [GOOD["when"]["all"][0]]}), "rules[0] (id: ok).when",
     "exactly one of"),
    (with_(then={"flag": "--max-num-seqs", "op": "step"}), "rules[0] (id: ok).then", "values"),
    (with_(then={"flag": "--max-num-seqs", "op": "scale"}), "rules[0] (id: ok).then", "factor"),
    (with_(then={"flag": "--max-num-seqs", "op": "set"}), "rules[0] (id: ok).then", "exactly one of"),
    (with_(then={"flag": "--block-size", "op": "toggle"}), "rules[0] (id: ok).then", "boolean flag"),
    (with_(then={"flag": "--enable-chunked-prefill", "op": "set", "value": 1}), "rules[0] (id: ok).then",
     "use op toggle"),
    (with_(then={"flag": "--enable-chunked-prefill", "op": "toggle", "value": 3}), "rules[0] (id: ok).then",
     "true or false"),
    (with_(then={"flag": "--max-num-seqs", "op": "scale", "factor": 2, "min": 9, "max": 1}),
     "rules[0] (id: ok).then", "min 9 > max 1"),
    (with_(then={"flag": "--max-num-seqs", "op": "set", "value_from": {"signal": "x"}}),
     "rules[0] (id: ok).then.value_from.signal", "unknown signal"),
    (with_(then={"flag": "--max-num-seqs", "op": "set", "value_from": {"times": 2}}),
     "rules[0] (id: ok).then.value_from", "exactly one of"),
    (with_(then={"flag": "--max-num-seqs", "op": "set", "value_from": {"flag": "--nope"}}),
     "rules[0] (id: ok).then.value_from.flag", "unknown flag"),
    (with_(cooldown="5 min"), "rules[0] (id: ok).cooldown", "15m"),
    (with_(cooldown=True), "rules[0] (id: ok).cooldown", ""),
    (with_(experimental=True), "rules[0] (id: ok)", "verify"),
    (with_(experimental=True, verify={"signal": "nope", "expect": "decrease"}), "rules[0] (id: ok).verify[0].signal",
     "unknown signal"),
    (with_(verify=[{"signal": "itl_p99_s", "expect": "no-increase", "min_change": 0.1}]), "rules[0] (id: ok).verify[0]",
     "takes tolerance"),
    (with_(verify={"signal": "itl_p99_s", "expect": "better"}), "rules[0] (id: ok).verify[0].expect", "decrease"),
    (with_(engines=["tgi"]), "rules[0] (id: ok).engines[0]", "vllm"),
    (with_(when={"all": [{"flag": "--nope", "op": "==", "value": 1}]}), "rules[0] (id: ok).when.all[0].flag",
     "unknown flag"),
])
def test_validation_problems(data, where, needle):
    found = problems({"rules": [data]})
    assert any(w == where and needle in what for w, what in found), found


def test_duplicate_ids_in_one_file_and_across_files():
    assert "repeated: ok" in problems({"rules": [GOOD, GOOD]})[0][1]
    a = loading.parse({"rules": [GOOD]}, file="a.yaml")
    b = loading.parse([GOOD], file="b.yaml")  # a bare list is accepted
    with pytest.raises(ConfigError) as info:
        loading.combine([a, b])
    assert info.value.problems == [("rule ok", "already defined in a.yaml")]
    assert [r.id for r in loading.combine([a])] == ["ok"]


@pytest.mark.parametrize(("text", "needle"), [("", "empty"), ("- [", "not valid YAML"), ("42", "mapping")])
def test_bad_files(tmp_path, text, needle):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        loading.load(path)
    assert info.value.file == str(path) and needle in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        loading.load(tmp_path / "nope.yaml")


def test_load_all(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"rules": [GOOD]}))
    assert [r.id for r in loading.load_all([tmp_path / "a.yaml"])] == ["ok"]


@pytest.mark.parametrize(("given", "seconds"), [(90, 90), ("90s", 90), ("15m", 900), ("2h", 7200), ("1d", 86400),
                                                ("1.5m", 90), ("PT1M", 60)])
def test_durations(given, seconds):
    assert rule(yaml.safe_dump(with_(cooldown=given))).cooldown == timedelta(seconds=seconds)


# --- conditions -----------------------------------------------------------------------------------------

def cond(text):
    return rule(f"""
id: r
when: {{all: [{text}]}}
then: {{flag: --max-num-seqs, op: scale, factor: 2}}
""").when.condition


def test_comparison_quotes_values():
    t = evaluation.check(cond("{signal: queue_time_mean_s, op: '>', value: 0.2}"), ctx({"queue_time_mean_s": 4.1}))
    assert t == evaluation.Truth(True, "queue_time_mean_s 4.1 > 0.2")
    f = evaluation.check(cond("{signal: queue_time_mean_s, op: '>', value: 0.2}"), ctx({"queue_time_mean_s": 0.1}))
    assert f == evaluation.Truth(False, "queue_time_mean_s 0.1 ≤ 0.2")


@pytest.mark.parametrize(("op", "left", "expected"), [
    ("<", 1, True), ("<", 2, False), ("<=", 2, True), (">", 3, True), (">=", 2, True), ("==", 2, True),
    ("!=", 2, False), ("!=", 3, True),
])
def test_ops(op, left, expected):
    t = evaluation.check(cond(f"{{signal: requests_running, op: '{op}', value: 2}}"), ctx({"requests_running": left}))
    assert t.value is expected


def test_times_a_flag_and_a_signal():
    c = cond("{signal: requests_running_max, op: '>=', value: 0.9, times: --max-num-seqs}")
    t = evaluation.check(c, ctx({"requests_running_max": 4}, "--max-num-seqs 4"))
    assert t == evaluation.Truth(True, "requests_running_max 4 ≥ 3.6 (0.9×--max-num-seqs 4)")
    # the flag's value can come from a known default; SGLang spelling is used for SGLang
    t = evaluation.check(c, ctx({"requests_running_max": 4}, "", kind="sglang", defaults={"max_num_seqs": 8}))
    assert t.value is False and "0.9×--max-running-requests 8" in t.text
    unknown = evaluation.check(c, ctx({"requests_running_max": 4}))
    assert unknown.value is None and "--max-num-seqs unknown" in unknown.text
    c2 = cond("{signal: requests_running, op: '>', value: 1, times: kv_cache_max_concurrency}")
    assert evaluation.check(c2, ctx({"requests_running": 5, "kv_cache_max_concurrency": 4})).value is True
    assert evaluation.check(c2, ctx({"requests_running": 5})).value is None


def test_flag_condition():
    c = cond("{flag: --enable-chunked-prefill, op: '==', value: 0}")
    assert evaluation.check(c, ctx({}, "--no-enable-chunked-prefill")).value is True
    assert evaluation.check(c, ctx({}, "", defaults={"chunked_prefill": True})).value is False
    assert evaluation.check(c, ctx({})).value is None


def test_missing_signal_is_unknown_with_its_reason():
    t = evaluation.check(cond("{signal: queue_time_mean_s, op: '>', value: 0.2}"),
                         ctx({"queue_time_mean_s": missing("series absent")}))
    assert t == evaluation.Truth(None, "queue_time_mean_s unknown (series absent)")
    t = evaluation.check(cond("{signal: queue_time_mean_s, op: '>', value: 0.2}"), ctx({}))
    assert t.value is None and "not computed" in t.text


def q(value, lo, hi):
    return Signal(value, None, None if hi == float("inf") else hi - lo, (lo, hi))


def test_coarse_quantile_is_judged_on_its_whole_bucket():
    c = cond("{signal: queue_time_p95_s, op: '>', value: 0.2, max_resolution: 0.1}")
    # p95 somewhere in 0–0.3 s: cannot tell whether > 0.2
    t = evaluation.check(c, ctx({"queue_time_p95_s": q(0.25, 0, 0.3)}))
    assert t.value is None and "too coarse" in t.text and "0–0.3" in t.text
    # 0.3–0.5 is wholly above 0.2: true despite its width
    assert evaluation.check(c, ctx({"queue_time_p95_s": q(0.4, 0.3, 0.5)})).value is True
    # a fine bucket uses the interpolated value
    assert evaluation.check(c, ctx({"queue_time_p95_s": q(0.25, 0.2, 0.3)})).value is True
    # wholly below
    c2 = cond("{signal: queue_time_p95_s, op: '>', value: 0.5, max_resolution: 0.1}")
    assert evaluation.check(c2, ctx({"queue_time_p95_s": q(0.25, 0, 0.3)})).value is False
    # above the highest finite bucket: a lower bound, unbounded width
    c3 = cond("{signal: itl_p95_s, op: '>', value: 10, max_resolution: 1}")
    assert evaluation.check(c3, ctx({"itl_p95_s": q(80, 80, float("inf"))})).value is True
    c4 = cond("{signal: itl_p95_s, op: '<', value: 100, max_resolution: 1}")
    t4 = evaluation.check(c4, ctx({"itl_p95_s": q(80, 80, float("inf"))}))
    assert t4.value is None and "unbounded" in t4.text
    # without max_resolution the value is taken as is
    c5 = cond("{signal: queue_time_p95_s, op: '>', value: 0.2}")
    assert evaluation.check(c5, ctx({"queue_time_p95_s": q(0.25, 0, 0.3)})).value is True
    # == on a coarse bucket cannot be false by bounds
    c6 = cond("{signal: queue_time_p95_s, op: '==', value: 7, max_resolution: 0.1}")
    assert evaluation.check(c6, ctx({"queue_time_p95_s": q(0.25, 0, 0.3)})).value is None


def test_all_and_any_are_three_valued():
    true, false, unknown = ("{signal: a_, op: '>', value: 0}".replace("a_", "request_rate"),
                            "{signal: request_rate, op: '<', value: 0}",
                            "{signal: ttft_mean_s, op: '>', value: 0}")
    c = ctx({"request_rate": 1})
    assert evaluation.check(cond(f"{true}, {unknown}"), c).value is None
    assert evaluation.check(cond(f"{false}, {unknown}"), c).value is False
    assert evaluation.check(cond(f"{{any: [{true}, {unknown}]}}"), c).value is True
    assert evaluation.check(cond(f"{{any: [{false}, {unknown}]}}"), c).value is None
    t = evaluation.check(cond(f"{{any: [{false}, {false}]}}"), c)
    assert t.value is False and " and " in t.text


# --- rules → outcomes ------------------------------------------------------------------------------------

RAISE = """
id: raise
adds_load: true
cooldown: 10m
when: {for: 2, all: [{signal: requests_waiting, op: '>', value: 0}]}
then: {flag: --max-num-seqs, op: scale, factor: 2, max: 1024, max_from: [{signal: kv_cache_max_concurrency}]}
"""


def test_sustain_then_fire():
    r = rule(RAISE)
    c = ctx({"requests_waiting": 5, "kv_cache_max_concurrency": 100}, "--max-num-seqs 8")
    first = evaluation.evaluate_rule(r, c)
    assert (first.status, first.streak) == ("sustaining", 1) and "1 of 2" in first.reason
    second = evaluation.evaluate_rule(r, c, streak_before=1)
    assert second.status == "fired" and second.streak == 2
    p = second.proposal
    assert (p.flag, p.from_value, p.to_value, p.direction, p.adds_load, p.cooldown_seconds) == (
        "--max-num-seqs", 8, 16, 1, True, 600)
    assert p.reason == "requests_waiting 5 > 0 (for 2 windows)"


def test_false_and_unknown_reset_the_streak():
    r = rule(RAISE)
    assert evaluation.evaluate_rule(r, ctx({"requests_waiting": 0}), streak_before=5).streak == 0
    o = evaluation.evaluate_rule(r, ctx({}), streak_before=5)
    assert (o.status, o.streak) == ("unknown", 0)
    outcomes = evaluation.evaluate([r], ctx({"requests_waiting": 1}, "--max-num-seqs 8"), streaks={"raise": 3})
    assert evaluation.next_streaks(outcomes) == {"raise": 4}


def test_disabled_and_other_engine():
    r = rule(RAISE + "enabled: false\n")
    assert evaluation.evaluate_rule(r, ctx({})).status == "disabled"
    r = rule(RAISE + "engines: [sglang]\n")
    assert evaluation.evaluate_rule(r, ctx({})).status == "not-applicable"


def test_dynamic_bound_caps_and_unknown_bound_blocks():
    r = rule(RAISE.replace("for: 2", "for: 1"))
    o = evaluation.evaluate_rule(r, ctx({"requests_waiting": 1, "kv_cache_max_concurrency": 12.7}, "--max-num-seqs 8"))
    assert o.proposal.to_value == 12 and "capped at 12 by kv_cache_max_concurrency = 12.7" in o.reason
    o = evaluation.evaluate_rule(r, ctx({"requests_waiting": 1, "kv_cache_max_concurrency": 8}, "--max-num-seqs 8"))
    assert o.status == "no-op" and "upper bound 8" in o.reason
    o = evaluation.evaluate_rule(r, ctx({"requests_waiting": 1, "kv_cache_max_concurrency": 4}, "--max-num-seqs 8"))
    assert o.status == "no-op" and "only would raise" in o.reason  # a raise rule never lowers
    o = evaluation.evaluate_rule(r, ctx({"requests_waiting": 1}, "--max-num-seqs 8"))
    assert o.status == "blocked" and "kv_cache_max_concurrency unknown" in o.reason
    o = evaluation.evaluate_rule(r, ctx({"requests_waiting": 1, "kv_cache_max_concurrency": 5000}, "--max-num-seqs 800"))
    assert o.proposal.to_value == 1024 and "max 1024" in o.reason


def test_unknown_current_value_blocks():
    r = rule(RAISE.replace("for: 2", "for: 1"))
    o = evaluation.evaluate_rule(r, ctx({"requests_waiting": 1, "kv_cache_max_concurrency": 50}))
    assert o.status == "blocked" and "current value of --max-num-seqs is unknown" in o.reason


def test_scale_moves_ints_by_at_least_one():
    up = rule("""
id: up
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --max-num-seqs, op: scale, factor: 1.01}
""")
    assert evaluation.evaluate_rule(up, ctx({"request_rate": 1}, "--max-num-seqs 4")).proposal.to_value == 5
    down = rule("""
id: down
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --max-num-batched-tokens, op: scale, factor: 0.99, min: 1, min_from: [{flag: --max-num-seqs}]}
""")
    o = evaluation.evaluate_rule(down, ctx({"request_rate": 1}, "--max-num-batched-tokens 4 --max-num-seqs 2"))
    assert o.proposal.to_value == 3 and o.proposal.direction == -1
    o = evaluation.evaluate_rule(down, ctx({"request_rate": 1}, "--max-num-batched-tokens 4 --max-num-seqs 4"))
    assert o.status == "no-op" and "lower bound 4" in o.reason
    o = evaluation.evaluate_rule(down, ctx({"request_rate": 1}, "--max-num-batched-tokens 8 --max-num-seqs 6"))
    assert o.proposal.to_value == 7
    bad_bounds = rule("""
id: bad
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --max-num-seqs, op: scale, factor: 2, max: 10, min_from: [{signal: kv_cache_max_concurrency}]}
""")
    o = evaluation.evaluate_rule(bad_bounds, ctx({"request_rate": 1, "kv_cache_max_concurrency": 20}, "--max-num-seqs 4"))
    assert o.status == "blocked" and "lower bound 20" in o.reason


def test_scale_float_knob_rounds():
    r = rule("""
id: mem
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --gpu-memory-utilization, op: set, value_from: {flag: --gpu-memory-utilization, plus: 0.02}, max: 0.95}
""")
    o = evaluation.evaluate_rule(r, ctx({"request_rate": 1}, "", defaults={"gpu_memory_utilization": 0.92}))
    assert o.proposal.to_value == 0.94
    o = evaluation.evaluate_rule(r, ctx({"request_rate": 1}, "--gpu-memory-utilization 0.94"))
    assert o.proposal.to_value == 0.95 and "capped" in o.reason


def test_set_from_a_signal_and_constant():
    r = rule("""
id: cap
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --max-num-seqs, op: set, value_from: {signal: requests_running_max}, min: 1}
""")
    o = evaluation.evaluate_rule(r, ctx({"request_rate": 1, "requests_running_max": 37}, "--max-num-seqs 256"))
    assert (o.proposal.to_value, o.proposal.direction) == (37, -1)
    o = evaluation.evaluate_rule(r, ctx({"request_rate": 1}, "--max-num-seqs 256"))
    assert o.status == "blocked" and "requests_running_max unknown" in o.reason
    o = evaluation.evaluate_rule(r, ctx({"request_rate": 1, "requests_running_max": 256}, "--max-num-seqs 256"))
    assert o.status == "no-op" and "already 256" in o.reason
    const = rule("""
id: seed
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --max-num-seqs, op: set, value: 512}
""")
    assert evaluation.evaluate_rule(const, ctx({"request_rate": 1}, "--max-num-seqs 256")).proposal.to_value == 512


def test_step_through_platform_valid_values():
    r = rule("""
id: block
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --block-size, op: step, direction: up, values: [16, 24, 32, 64, 128]}
""")
    c = ctx({"request_rate": 1}, "--block-size 16", platform="cuda-flashinfer")
    assert evaluation.evaluate_rule(r, c).proposal.to_value == 32  # 24 is no multiple of 16; 128 not FlashInfer
    c = ctx({"request_rate": 1}, "--block-size 64", platform="cuda-flashinfer")
    o = evaluation.evaluate_rule(r, c)
    assert o.status == "no-op" and "no upward step" in o.reason
    c = ctx({"request_rate": 1}, "", platform="cpu", defaults={"block_size": 16})
    assert evaluation.evaluate_rule(r, c).proposal.to_value == 24
    down = rule("""
id: block
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --block-size, op: step, direction: down, values: [16, 32, 64]}
""")
    assert evaluation.evaluate_rule(down, ctx({"request_rate": 1}, "--block-size 64")).proposal.to_value == 32


def test_toggle():
    on = rule("""
id: turn-on
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --enable-chunked-prefill, op: toggle, value: true}
""")
    o = evaluation.evaluate_rule(on, ctx({"request_rate": 1}, "--no-enable-chunked-prefill"))
    assert (o.proposal.from_value, o.proposal.to_value, o.proposal.direction) == (False, True, 1)
    o = evaluation.evaluate_rule(on, ctx({"request_rate": 1}, "--enable-chunked-prefill"))
    assert o.status == "no-op" and "already on" in o.reason
    flip = rule("""
id: flip
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --enable-chunked-prefill, op: toggle}
""")
    assert evaluation.evaluate_rule(flip, ctx({"request_rate": 1}, "--enable-chunked-prefill")).proposal.to_value is False


def test_fmt():
    assert evaluation.fmt(None) == "unknown"
    assert evaluation.fmt(float("inf")) == "∞"
    assert evaluation.fmt(-float("inf")) == "-∞"
    assert evaluation.fmt(0.0123456) == "0.01235"
    assert evaluation.fmt(False) == "off"


# --- a rule file cannot leave a knob's hard range ---------------------------------------------------

@pytest.mark.parametrize(("then", "where", "needle"), [
    ({"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 4e9}, "then.max", "65536"),
    ({"flag": "--max-num-seqs", "op": "scale", "factor": 2, "min": 0}, "then.min", "--max-num-seqs"),
    ({"flag": "--max-num-seqs", "op": "set", "value": 4_000_000_000}, "then.value", "outside"),
    ({"flag": "--gpu-memory-utilization", "op": "set", "value": 1.5}, "then.value", "(0, 1]"),
    ({"flag": "--block-size", "op": "step", "values": [16, 4096], "direction": "up"}, "then.values", "4096"),
    ({"flag": "--max-num-seqs", "op": "scale", "factor": 1e9}, "then.factor", "65536"),
    ({"flag": "--max-num-seqs", "op": "scale", "factor": 1e-9}, "then.factor", "65536"),
    ({"flag": "--max-num-seqs", "op": "scale", "factor": float("inf")}, "then.factor", "finite"),
    ({"flag": "--max-num-seqs", "op": "set", "value": float("nan")}, "then.value", "finite"),
    ({"flag": "--max-num-seqs", "op": "set", "value_from": {"signal": "kv_cache_max_concurrency",
                                                             "times": float("inf")}}, "then.value_from.times", "finite"),
])
def test_a_rule_outside_the_knobs_hard_range_is_refused(then, where, needle):
    found = problems({"rules": [with_(then=then)]})
    assert any(w == f"rules[0] (id: ok).{where}" and needle in what for w, what in found), found


def test_a_condition_on_nan_is_refused():
    found = problems({"rules": [with_(when={"all": [{"signal": "kv_cache_usage", "op": ">", "value": float("nan")}]})]})
    assert any("finite" in what for _, what in found), found


def test_rules_inside_the_ranges_load():
    loading.parse({"rules": [with_(then={"flag": "--max-num-seqs", "op": "scale", "factor": 1000, "max": 65536,
                                         "min": 1})]})


def test_a_huge_dynamic_target_is_blocked_not_an_overflow():
    # value_from can still reach past any float: signal × times overflows to inf
    r = rule("""
id: huge
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --max-num-seqs, op: set, value_from: {signal: kv_cache_max_concurrency, times: 1e300}}
""")
    c = ctx({"request_rate": 1, "kv_cache_max_concurrency": 1e300}, "--max-num-seqs 8")
    o = evaluation.evaluate_rule(r, c)
    assert o.status == "blocked" and "finite" in o.reason
    r = rule("""
id: huge-bound
when: {all: [{signal: request_rate, op: '>', value: 0}]}
then: {flag: --max-num-seqs, op: scale, factor: 2, max_from: [{signal: kv_cache_max_concurrency, times: 1e300}]}
""")
    o = evaluation.evaluate_rule(r, c)
    assert o.status == "blocked" and "finite" in o.reason


@pytest.mark.parametrize("given", [86_400_000_000_000.0, "99999999999d", -5, float("nan"), "11000d", 10**400])
def test_absurd_cooldowns_are_refused_not_an_overflow(given):
    # found by tests/fuzz: timedelta(seconds=8.64e13), and float(10**400), raised OverflowError out of the loader
    found = problems({"rules": [with_(cooldown=given)]})
    assert any(w == "rules[0] (id: ok).cooldown" and "duration" in what for w, what in found), found


@pytest.mark.parametrize(("tpot_p99", "tpot_p50", "ttft_p99", "finished", "itl_p50", "expect"), [
    (0.05, 0.02, 0.3, 5.0, 0.02, True),     # the price inside its SLO
    (0.19, 0.02, 4.9, 40.0, 0.02, True),    # the tail is the last regime's, the queue breaks the TTFT
    (0.19, 0.02, 0.3, 40.0, 0.02, False),   # the tail misses and nothing else does: no raise
    (0.19, 0.12, 4.9, 40.0, 0.02, False),   # the median request misses too: past the frontier, not this rule's
    (0.15, 0.066, 1.8, 7.0, 0.02, False),   # the median has no room for a tenfold batch (live-189 of seed 7)
    (None, None, None, 0.0, 0.01, True),    # nothing finished yet: the median token gap
    (None, None, None, 0.0, 0.12, False),
])
def test_the_queue_rules_price_gate(tpot_p99, tpot_p50, ttft_p99, finished, itl_p50, expect):
    """live-141 of seed 13: a closed loop of 768 clients after a phase of 2,269-token prompts at a cap of 149; the
    TPOT p99 of the window read the last phase's requests (0.19 s, their prefill stalls) while the median
    request streamed at 0.02 s and the queue broke the TTFT (4.9 s): the raise waited 18 s for that tail to
    roll out of the window (0.77 × the best static; 0.98 × gated on the median while the TTFT misses). The median
    must have room for a tenfold batch (half the SLO: TPOT ∝ batch^0.3, 10^0.3 ≈ 2): on live-189 of seed 7 it
    read 0.066 s with the TTFT tail at 1.8 s, and a raise there cost 0.6 % against staying at 8."""
    (r,) = [x for x in loading.load(REPO / "rules" / "default.yaml") if x.id == "queue-slot-bound"]
    (gate,) = [c for c in r.when.all if "tpot_p99_s" in str(c)]
    c = ctx({"tpot_p99_s": tpot_p99, "tpot_p50_s": tpot_p50, "ttft_p99_s": ttft_p99, "request_rate": finished,
             "itl_p50_s": itl_p50})
    assert (evaluation.check(gate, c).value is True) is expect
