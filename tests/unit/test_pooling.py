"""The pool's decision (tuner.planning.pooling): one change for every replica, maintenance-window
admission, and booking a finished rollout. Pure functions, driven with real plans from the planner."""

from __future__ import annotations

from tuner.model import knobs
from tuner.planning import guards, planner, pooling
from tuner.planning.history import Change, History
from tuner.rules import loading
from tuner.signals import Signal

SETTINGS = planner.DecisionSettings(idle=guards.IdleSettings(min_requests_per_window=0))
BUSY = {"window_seconds": Signal(60.0), "request_rate": Signal(5.0), "requests_waiting_max": Signal(40.0),
        "itl_p99_s": Signal(0.4, bounds=(0.25, 0.5), resolution=0.25), "preemptions_per_s": Signal(0.0)}


def plan_for(rules: dict, args: knobs.EngineArgs, *, kind: knobs.EngineKind = "vllm", target: str = "a",
             now: float = 1000.0) -> planner.Plan:
    return planner.plan(target, BUSY, args, History(), SETTINGS, rules=loading.parse({"rules": [rules]}).rules,
                        kind=kind, now=now)


QUEUE = {"id": "q", "when": {"for": 1, "all": [{"signal": "requests_waiting_max", "op": ">=", "value": 1}]},
         "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 1024}}
CHUNKING = {"id": "chunk", "when": {"for": 1, "all": [{"signal": "itl_p99_s", "op": ">", "value": 0.15}]},
            "then": {"flag": "--enable-chunked-prefill", "op": "toggle", "value": True}}


def test_the_pool_takes_one_change_and_gives_every_replica_its_own_arguments() -> None:
    a = knobs.EngineArgs.parse(["--port", "8001", "--max-num-seqs", "8"])
    b = knobs.EngineArgs.parse(["--port=8002", "--max_num_seqs=8"])  # another spelling, kept
    p = plan_for(QUEUE, a)
    pool = pooling.choose({"a": p, "b": plan_for(QUEUE, b, target="b")}, {"a": a, "b": b}, kind="vllm",
                          settings=SETTINGS, signals={}, now=1000.0)
    assert pool.refused is None and pool.change is not None
    assert pool.change.leader == "a" and pool.change.id == "r1000"
    assert {n: x.argv() for n, x in pool.change.new_args.items()} == {
        "a": ["--port", "8001", "--max-num-seqs", "16"], "b": ["--port=8002", "--max_num_seqs=16"]}


def test_sglang_chunked_prefill_is_rolled_out_in_sglangs_own_spelling() -> None:
    """A rollout used to rebuild the new arguments with ``args.with_value(flag, True)``, writing
    ``--chunked-prefill-size true``, which knobs.validate refuses: the change was silently not rolled out.
    SGLang turns chunking on by dropping ``--chunked-prefill-size -1``."""
    args = knobs.EngineArgs.parse(["--model-path", "m", "--chunked-prefill-size", "-1"])
    p = plan_for(CHUNKING, args, kind="sglang")
    (change,) = p.changes
    assert (change.flag, change.to_value) == ("--chunked-prefill-size", True)
    broken = args.with_value(change.flag, change.to_value)  # what the old composition root did
    assert broken.get("--chunked-prefill-size") == "true" and knobs.validate(broken, "sglang", platform=None)
    pool = pooling.choose({"a": p}, {"a": args, "b": args}, kind="sglang", settings=SETTINGS, signals={},
                          now=5.0)
    assert pool.refused is None and pool.change is not None
    assert {n: x.argv() for n, x in pool.change.new_args.items()} == {"a": ["--model-path", "m"],
                                                                        "b": ["--model-path", "m"]}


def test_arguments_the_engine_would_refuse_are_not_rolled_out_and_say_why() -> None:
    a = knobs.EngineArgs.parse(["--max-num-seqs", "8", "--max-num-batched-tokens", "12"])
    pool = pooling.choose({"a": plan_for(QUEUE, knobs.EngineArgs.parse(["--max-num-seqs", "8"]))}, {"a": a},
                          kind="vllm", settings=SETTINGS, signals={}, now=1.0)
    assert pool.change is None
    assert pool.refused is not None and pool.refused.startswith("not rolled out: a: --max-num-batched-tokens 12")


def test_actions_per_replica_and_one_power_action_for_the_pool() -> None:
    warm = guards.Action("keep-warm", "idle")
    after = guards.Action("warm-up", "restart", after_restart=True)
    cap, restore = guards.Action("power-cap", "hot", requests=0), guards.Action("power-restore", "cool", requests=0)
    base = plan_for(QUEUE, knobs.EngineArgs())

    def with_actions(*acts: guards.Action) -> planner.Plan:
        from dataclasses import replace
        return replace(base, changes=(), actions=acts)

    pool = pooling.choose({"a": with_actions(warm, after, restore), "b": with_actions(cap)}, {}, kind="vllm",
                          settings=SETTINGS, signals={}, now=1.0)
    assert [(n, x.kind) for n, x in pool.actions] == [("a", "keep-warm"), ("b", "power-cap")]


def test_admission_defers_outside_windows_releases_inside_and_drops_what_no_longer_applies() -> None:
    args = {"a": knobs.EngineArgs.parse(["--max-num-seqs", "8"])}
    p = plan_for(QUEUE, args["a"])
    pool = pooling.choose({"a": p}, args, kind="vllm", settings=SETTINGS, signals={}, now=1.0)
    kw = {"args": args, "kind": "vllm", "settings": SETTINGS, "signals": {}, "closed_reason": "closed"}
    closed = pooling.admit(pool, None, window_open=False, stopping=False, now=1.0, **kw)
    assert closed.hand_over is None and closed.deferred_now and closed.pending is not None
    quiet = pooling.PoolPlan()
    still = pooling.admit(quiet, closed.pending, window_open=False, stopping=False, now=2.0, **kw)
    assert still.pending is closed.pending and still.hand_over is None
    stopping = pooling.admit(quiet, closed.pending, window_open=True, stopping=True, now=3.0, **kw)
    assert stopping.pending is closed.pending and stopping.hand_over is None
    released = pooling.admit(quiet, closed.pending, window_open=True, stopping=False, now=4.0, **kw)
    assert released.released and released.pending is None and released.hand_over is not None
    assert released.hand_over.new_args["a"].get("--max-num-seqs") == "16" and released.hand_over.id == "r4"
    bad = {"a": knobs.EngineArgs.parse(["--max-num-seqs", "8", "--max-num-batched-tokens", "12"])}
    dropped = pooling.admit(quiet, closed.pending, window_open=True, stopping=False, now=5.0,
                            **{**kw, "args": bad})
    assert dropped.hand_over is None and dropped.pending is None and "not rolled out" in (dropped.dropped or "")
    stop_fresh = pooling.admit(pool, None, window_open=None, stopping=True, now=6.0, **kw)
    assert stop_fresh.hand_over is None and stop_fresh.pending is not None
    assert stop_fresh.pending.reason == "the tuner was stopping"


def test_booking_a_rollout() -> None:
    old, new = knobs.EngineArgs.parse(["--max-num-seqs", "8"]), knobs.EngineArgs.parse(["--max-num-seqs", "16"])
    change = Change(flag="--max-num-seqs", knob="max_num_seqs", from_value=8, to_value=16, rule="q", reason="r",
                    direction=1)
    histories = {n: History() for n in "abc"}
    owned = dict.fromkeys("abc", old)
    h, args = pooling.book(histories, owned, changes=[change], outcomes={
        "a": pooling.ReplicaOutcome("ok", new),
        "b": pooling.ReplicaOutcome("rolled_back", new, reason="verification: worse"),
    }, pool_new_args=dict.fromkeys("abc", new), rolled_back=True, now=100.0, reject_seconds=60.0)
    assert args["a"] == new and args["b"] == old and args["c"] == old
    assert h["a"].changes["max_num_seqs"].to_value == "16" and h["a"].restarts == (100.0,)
    assert h["a"].own_restarts_until == 100.0 and h["a"].last_keep_warm == 100.0
    assert h["b"].restarts == (100.0,) and h["b"].is_bad(new, now=110.0) is not None
    assert h["b"].is_bad(new, now=170.0) is None  # rejected, not bad for good
    assert h["c"].restarts == () and h["c"].is_bad(new, now=110.0) == (
        "rolled back: rolled back on another replica; not retried for another 50s")
    crashed, _ = pooling.book(histories, owned, changes=[change], outcomes={
        "a": pooling.ReplicaOutcome("rolled_back", new, reason="exited", bad_args=True)},
        pool_new_args={"a": new}, rolled_back=True, now=100.0, reject_seconds=60.0)
    assert crashed["a"].is_bad(new, now=10**9) == "exited"  # the engine could not run them: for good
