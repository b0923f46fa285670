"""The journal: durable append, torn tails, replay through the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.rollout import journal, machine
from tuner.rollout.machine import Event as E

OLD = ("--max-num-seqs", "8", "--arg with space", "it's")
NEW = ("--max-num-seqs", "32", "--arg with space", "it's")


def started(j: journal.Journal, now: float = 0.0, names: tuple[str, ...] = ("a", "b")) -> machine.Rollout:
    r = machine.new("r1", replicas=names, changes=dict.fromkeys(names, (OLD, NEW)),
                    limits=machine.Limits(verify_seconds=5), now=now, measured_start_seconds=40.0)
    j.append("rollout", at=now, **journal.rollout_fields(r))
    return r


def step(j: journal.Journal, r: machine.Rollout, name: str, event: E, at: float, reason: str = "") -> machine.Rollout:
    after = machine.handle(r, name, event, now=at, reason=reason)
    j.append("event", at=at, **journal.event_fields(r, after, name, event, reason))
    return after


def test_records_survive_reopening_with_increasing_seq(tmp_path: Path) -> None:
    path = tmp_path / "state" / "journal.jsonl"
    with journal.Journal(path) as j:
        j.append("decision", at=1.0, rule="kv-pressure", outcome="apply")
        j.append("decision", at=2.0, rule="idle", outcome="cooldown", reason="4m left")
    with journal.Journal(path) as j:
        assert [r["seq"] for r in j.records] == [1, 2]
        assert journal.decisions(j.records)[1]["reason"] == "4m left"
        j.append("decision", at=3.0)
        assert j.records[-1]["seq"] == 3
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["v"] == journal.VERSION for line in lines)


def test_a_torn_last_record_is_dropped_and_the_file_stays_appendable(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with journal.Journal(path) as j:
        j.append("decision", at=1.0)
    good = path.read_bytes()
    path.write_bytes(good + b'{"v":1,"seq":2,"kind":"dec')
    with journal.Journal(path) as j:
        assert len(j.records) == 1
        assert j.dropped_tail.startswith(b'{"v":1')
        j.append("decision", at=2.0)
    assert [json.loads(x)["seq"] for x in path.read_text().splitlines()] == [1, 2]
    # A torn record that happens to end in a newline is dropped too, when it is the last line.
    path.write_bytes(path.read_bytes() + b'{"v":1,"se\n')
    with journal.Journal(path) as j:
        assert len(j.records) == 2


def test_a_bad_line_in_the_middle_is_corruption_not_a_guess(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text('{"v":1,"seq":1,"at":0,"kind":"decision"}\nnot json\n{"v":1,"seq":3,"at":0,"kind":"decision"}\n')
    with pytest.raises(journal.JournalError, match=r"j.jsonl:2: unreadable record.*move the file aside"):
        journal.Journal(path)


def test_replay_rebuilds_exactly_the_rollout_the_driver_held(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with journal.Journal(path) as j:
        r = started(j)
        for i, event in enumerate((E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED), 1):
            r = step(j, r, "a", event, at=float(i))
        r = step(j, r, "a", E.CRASHED, at=99.0, reason="exited with status 1")
    with journal.Journal(path) as j:
        records = j.records
    assert journal.replay(records) == {"r1": r}
    assert journal.unfinished(records) == r
    assert journal.bad_argv(records) == [("a", NEW, "exited with status 1")]
    last = records[-1]
    assert (last["from"], last["to"], last["leg"]) == ("waiting_healthy", "rolling_back", "back")


def test_finished_rollouts_are_not_resumed_and_their_start_times_size_the_next_wait(tmp_path: Path) -> None:
    with journal.Journal(tmp_path / "j.jsonl") as j:
        r = started(j, names=("a",))
        r = machine.abort(r, "maintenance window closed")
        j.append("abort", at=1.0, rollout_id=r.id, reason="maintenance window closed")
        assert machine.outcome(r) is machine.Outcome.ABORTED
        assert journal.unfinished(j.records) is None
        r2 = machine.new("r2", replicas=["a", "b"], changes={"a": (OLD, NEW)}, limits=machine.Limits(), now=10)
        j.append("rollout", at=10, **journal.rollout_fields(r2))
        for i, event in enumerate((E.GO, E.DRAINED, E.IDLE, E.STOPPED, E.STARTED), 11):
            r2 = step(j, r2, "a", event, at=float(i))
        r2 = step(j, r2, "a", E.HEALTHY, at=15.0 + 170)
        assert journal.measured_start_seconds(j.records) == 170
        assert journal.unfinished(j.records) == r2


_WRITER = """
import sys
from tuner.rollout import journal
j = journal.Journal(sys.argv[1])
i = 0
while True:
    i += 1
    j.append("decision", at=float(i), payload="x" * 2000)
    print(i, flush=True)
"""


def test_sigkill_mid_write_loses_no_acknowledged_record(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = 0
    deadline = time.monotonic() + 20
    while acked < 200 and time.monotonic() < deadline:
        acked = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    with journal.Journal(path) as j:
        seqs = [r["seq"] for r in j.records]
    assert acked >= 200
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) >= acked
