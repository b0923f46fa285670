"""The live tests' journal oracle (``harness.live.journal``) against the rollout machine's own states: a
replica is finished exactly where the machine says it is terminal (``left`` included: a replica gone for
good), whatever the pool's other replicas did."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from harness.live import journal
from tuner.rollout import machine

STATES = [s.value for s in machine.State]


def records(last: dict[str, str], *, aborted: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"kind": "rollout", "at": 0.0, "rollout": {"id": "r", "order": list(last)}}]
    for i, (name, state) in enumerate(last.items()):
        if state != "pending":
            out.append({"kind": "event", "rollout_id": "r", "replica": name, "to": state, "leg": "forward",
                        "at": float(i + 1)})
    if aborted:
        out.append({"kind": "abort", "rollout_id": "r", "at": 99.0})
    return out


def test_the_oracles_terminal_states_are_the_machines() -> None:
    assert {s.value for s in machine.TERMINAL} == journal.TERMINAL
    assert "left" in journal.TERMINAL


@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(STATES), min_size=1), st.booleans())
def test_a_rollout_is_finished_when_every_replica_is_terminal_or_never_started_after_a_halt(
        last: dict[str, str], aborted: bool) -> None:
    halted = aborted or any(s in journal.HALTING for s in last.values())
    expected = all(s in journal.TERMINAL or (s == "pending" and halted) for s in last.values())
    assert journal.finished(records(last, aborted=aborted), "r") == expected
    if all(s in {"done", "left"} for s in last.values()):
        assert journal.finished(records(last), "r")  # a replica that left is not waited for


def test_a_replica_that_left_beside_one_done_makes_the_rollout_done() -> None:
    timing = journal.timeline(records({"a": "done", "b": "left"}), "r")
    assert timing.outcome == "done" and timing.trigger_to_done == 1.0
    assert journal.timeline(records({"a": "done", "b": "verifying"}), "r").outcome == "running"
    assert journal.timeline(records({"a": "failed_serving", "b": "pending"}), "r").outcome == "failed"
