"""The agent's pure pieces: overrides from a command line, journal compaction, the `kubernetes:` section,
Rule 4 of the rollout machine (a replica gone for good)."""

from __future__ import annotations

from typing import Any

import pytest

from tuner import config
from tuner.errors import ConfigError
from tuner.kube import acting, podside, store
from tuner.planning import guards
from tuner.portable import argv as argvs
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rules import schema

BASE = ["vllm", "serve", "m", "--port", "8000", "--max-num-seqs=8", "--enable-prefix-caching", "--api-key", "<redacted>"]


@pytest.mark.parametrize(("target", "overrides"), [
    (BASE, []),
    (["vllm", "serve", "m", "--port", "8000", "--max-num-seqs=16", "--enable-prefix-caching", "--api-key", "<redacted>"],
     [("--max-num-seqs", "16")]),
    ([*BASE, "--max-model-len", "4096"], [("--max-model-len", "4096")]),
    (["vllm", "serve", "m", "--port", "8000", "--max-num-seqs=8", "--no-enable-prefix-caching", "--api-key", "<redacted>"],
     [("--enable-prefix-caching", False)]),
    (["vllm", "serve", "m", "--port", "8000", "--max-num-seqs=8", "--api-key", "<redacted>"],
     [("--enable-prefix-caching", None)]),
    ([*BASE, "--enforce-eager"], [("--enforce-eager", True)]),
])
def test_a_command_line_as_overrides_of_the_base(target: list[str], overrides: list[tuple[str, Any]]) -> None:
    got = acting.overrides_for(BASE, target)
    assert got == overrides
    assert argvs.apply(BASE, got) == target  # what the launcher will run


def test_a_command_line_that_moves_a_positional_is_not_an_override() -> None:
    with pytest.raises(ValueError, match="not the base command line"):
        acting.overrides_for(BASE, ["vllm", "serve", "other-model", *BASE[3:]])


def _rollout_records(rid: str, *, done: bool, at: float) -> list[dict[str, Any]]:
    r = machine.new(rid, replicas=["a"], changes={"a": (["--x", "1"], ["--x", "2"])}, limits=machine.Limits(), now=at)
    records: list[dict[str, Any]] = [{"kind": "decision", "rollout": rid, "at": at},
                                     {"kind": "rollout", "at": at, **journaling.rollout_fields(r)}]
    if done:
        for event in ("go", "drained", "idle", "stopped", "started", "healthy", "confirmed", "warmed", "undrained",
                      "verified"):
            after = machine.handle(r, "a", machine.Event(event), now=at)
            records.append({"kind": "event", "at": at, **journaling.event_fields(r, after, "a", machine.Event(event))})
            r = after
    return records


def test_compaction_keeps_the_unfinished_rollout_and_the_last_finished_ones() -> None:
    records = [rec for i in range(8) for rec in _rollout_records(f"r{i}", done=True, at=float(i))]
    records += [{"kind": "decision", "at": 9.0, "target": "a", "action": {"kind": "sleep"}} for _ in range(60)]
    records += _rollout_records("r9", done=False, at=10.0)
    kept = store.compact(records, keep_rollouts=3, keep_decisions=10)
    rollouts = journaling.replay(kept)
    assert list(rollouts) == ["r5", "r6", "r7", "r9"]
    assert journaling.unfinished(kept) is not None and journaling.unfinished(kept).id == "r9"  # type: ignore[union-attr]
    assert machine.outcome(rollouts["r7"]) is machine.Outcome.DONE
    assert sum(1 for r in kept if r["kind"] == "decision" and "action" in r) == 10
    assert [r for r in kept if r.get("rollout") == "r6" and r["kind"] == "decision"]  # a kept rollout keeps its decision


def test_the_report_leaves_out_log_lines_and_timestamps() -> None:
    status = {"state": "serving", "ready": True, "generation": 3, "running_generation": 3, "argv": ["x"],
              "log_tail": ["secret line"], "updated_at": 1.0, "candidate_failure": {"generation": 2, "reason": "r",
                                                                                      "exit_code": 1, "log_tail": ["x"]}}
    report = podside.condensed(status)
    assert report["launcher_generation"] == 3 and report["candidate_failure"] == {"generation": 2, "reason": "r",
                                                                                   "exit_code": 1}
    assert "log_tail" not in report and "updated_at" not in report


# --- the allow-list the agent writes for its launcher ------------------------------------------------------


def _rule(rid: str, then: dict[str, Any], **extra: Any) -> schema.Rule:
    return schema.Rule.model_validate({"id": rid, "when": {"all": [{"signal": "requests_waiting_max", "op": ">=",
                                                                   "value": 1}]}, "then": then, **extra})


def test_the_allow_list_is_the_rules_flags_with_their_widest_bounds() -> None:
    rules = [_rule("up", {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "min": 8, "max": 512}),
             _rule("down", {"flag": "--max_num_seqs", "op": "scale", "factor": 0.5, "min": 4, "max": 256}),
             _rule("mem", {"flag": "--gpu-memory-utilization", "op": "set", "value": 0.9}),
             _rule("chunk", {"flag": "--enable-chunked-prefill", "op": "toggle"}),
             _rule("off", {"flag": "--max-model-len", "op": "set", "value": 4096}, enabled=False),
             _rule("sg", {"flag": "--block-size", "op": "set", "value": 32}, engines=["sglang"])]
    allowed = podside.allow_list(rules, kind="vllm")
    assert allowed.describe() == {"--max-num-seqs": "[4, 512]", "--gpu-memory-utilization": "(0, 1]",
                                  "--device-memory-utilization": "(0, 1]", "--enable-chunked-prefill": "true|false"}
    assert allowed.refusal([("--max-num-seqs", "600")]) is not None  # above every rule's max
    assert allowed.refusal([("--max-model-len", "4096")]) is not None  # a disabled rule changes nothing
    assert allowed.refusal([("--gpu-memory-utilization", "0")]) is not None  # the hard range is (0, 1]
    # a rule without a bound reaches the knob's hard range; the thermal step-down counts as a rule
    open_ended = podside.allow_list([_rule("up", {"flag": "--max-num-seqs", "op": "scale", "factor": 2})], kind="vllm")
    assert open_ended.describe()["--max-num-seqs"] == "[1, 65536]"
    hot = guards.ThermalSettings(step_down=True, step_down_min=2)
    assert podside.allow_list([], kind="vllm", thermal=hot).describe() == {"--max-num-seqs": "[2, 65536]"}
    assert podside.allow_list([], kind="vllm").flags == {}  # no rules: no override passes


def test_the_allow_list_for_sglang_takes_its_spellings_and_chunking_switch() -> None:
    rules = [_rule("seqs", {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 256}),
             _rule("chunk", {"flag": "--enable-chunked-prefill", "op": "toggle", "value": False})]
    allowed = podside.allow_list(rules, kind="sglang")
    assert allowed.describe() == {"--max-running-requests": "[1, 256]", "--chunked-prefill-size": "-1 | null"}
    assert allowed.refusal([("--chunked-prefill-size", "-1")]) is None
    assert allowed.refusal([("--chunked-prefill-size", None)]) is None
    assert allowed.refusal([("--chunked-prefill-size", "4096")]) is not None  # no rule sets the budget


# --- the kubernetes: section ------------------------------------------------------------------------------

K8S = {"pool": "vllm", "selector": {"matchLabels": {"vllm-tuner.io/pool": "vllm"}}, "lease": "vllm-tuner-vllm",
       "journal_configmap": "vllm-tuner-journal-vllm"}


def test_a_kubernetes_pool_needs_no_targets_actuator_or_drain() -> None:
    s = config.parse({"mode": "apply", "kubernetes": K8S})
    assert s.kubernetes is not None and s.targets == [] and s.kind == "vllm" and s.apply_problems() == []
    assert s.kubernetes.selector.match_labels == {"vllm-tuner.io/pool": "vllm"}


@pytest.mark.parametrize(("extra", "where", "what"), [
    ({"targets": [{"name": "a", "metrics_url": "http://127.0.0.1:8000/metrics"}]}, "", "remove targets"),
    ({"actuator": {"kind": "process", "command": ["vllm", "serve"]}}, "", "remove actuator"),
    ({"kubernetes": {**K8S, "selector": {}}}, "kubernetes.selector", "empty selector"),
    ({"kubernetes": {**K8S, "selector": {"matchLabels": {"bad key!": "x"}}}}, "kubernetes.selector", "pattern"),
    ({"kubernetes": {**K8S, "selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}},
     "kubernetes.selector.matchExpressions[0]", "needs values"),
    ({"kubernetes": {**K8S, "lease": "Not_A_Name"}}, "kubernetes.lease", "pattern"),
    ({"kubernetes": {**K8S, "renew_deadline_seconds": 20}}, "kubernetes", "renew_deadline_seconds <"),
    ({"kubernetes": {**K8S, "namespaces": "llm"}}, "kubernetes.namespaces", "unknown field"),
])
def test_the_kubernetes_section_is_strict(extra: dict[str, Any], where: str, what: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.parse({"kubernetes": K8S, **extra})
    assert any(w.startswith(where) and what in msg for w, msg in info.value.problems), info.value.problems


def test_without_kubernetes_targets_are_required() -> None:
    with pytest.raises(ConfigError, match="at least one target"):
        config.parse({"mode": "observe"})


# --- Rule 4: a replica gone for good -------------------------------------------------------------------------


def _three() -> machine.Rollout:
    return machine.new("r", replicas=["a", "b", "c"], limits=machine.Limits(), now=0.0,
                       changes={n: (["--x", "1"], ["--x", "2"]) for n in "abc"})


def test_a_replica_that_left_ends_its_path_and_stops_counting() -> None:
    r = machine.handle(_three(), "a", machine.Event.GO, now=1.0)
    r = machine.handle(r, "a", machine.Event.DRAINED, now=2.0)
    r = machine.handle(r, "a", machine.Event.LEFT, now=3.0, reason="its pod was deleted")
    assert r.of("a").state is machine.State.LEFT and not r.of("a").bad_args
    # b is admitted: a no longer counts as unavailable, and c still serves
    actions = machine.next_actions(r, now=4.0, healthy=frozenset({"b", "c"}))
    assert [a.step for a in actions] == [machine.Step.ADMIT]
    for name in "bc":
        for event in ("go", "drained", "idle", "stopped", "started", "healthy", "confirmed", "warmed", "undrained",
                      "verified"):
            r = machine.handle(r, name, machine.Event(event), now=5.0)
    assert machine.outcome(r) is machine.Outcome.DONE


def test_a_rollout_every_replica_of_which_left_is_aborted_not_done() -> None:
    r = _three()
    for name in "abc":
        r = machine.handle(r, name, machine.Event.LEFT, now=1.0)
    assert machine.outcome(r) is machine.Outcome.ABORTED


def test_left_is_allowed_from_the_back_leg_and_nowhere_terminal() -> None:
    r = machine.handle(_three(), "a", machine.Event.GO, now=1.0)
    r = machine.handle(r, "a", machine.Event.FAILED, now=2.0)
    assert r.of("a").state is machine.State.ROLLING_BACK
    assert machine.handle(r, "a", machine.Event.LEFT, now=3.0).of("a").state is machine.State.LEFT
    done = machine.handle(machine.handle(r, "a", machine.Event.LEFT, now=3.0), "b", machine.Event.LEFT, now=4.0)
    with pytest.raises(machine.RolloutError):
        machine.handle(done, "a", machine.Event.LEFT, now=5.0)


# --- the live knobs, relayed by a pod's agent ------------------------------------------------------------


def test_a_relayed_live_state_roundtrips_and_garbage_is_not_believed() -> None:
    from tuner.model import live

    state = live.LiveState(available=True, envelope={"max_num_seqs": 256}, values={"max_num_seqs": 80},
                           not_live={"max_num_batched_tokens": "not live here"}, seq=7, pids=(11, 12))
    assert live.LiveState.from_dict(state.as_dict()) == state
    hostile = {"available": "yes", "envelope": {"max_num_seqs": 10**12, "trust_remote_code": 1},
               "values": {"max_num_seqs": True}, "not_live": {"x": "y"}, "seq": -1, "pids": ["1", 2],
               "why_not": "x" * 10_000, "via": "anything"}
    got = live.LiveState.from_dict(hostile)
    assert not got.available and got.envelope == {} and got.values == {} and got.not_live == {}
    assert got.seq is None and got.pids == (2,) and len(got.why_not or "") == 300 and got.via == "plugin"
    assert live.LiveState.from_dict(None).why_not == "no live state reported"
