"""The journal: durable append, torn tails, replay through the machine."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.actuators import children
from tuner.errors import TunerError
from tuner.rollout import journal, locks, machine
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
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    with children.stopped(writer, timeout_seconds=0, signal_first=None) as proc:  # SIGKILL mid-write, reaped
        assert proc.stdout is not None
        acked = 0
        deadline = time.monotonic() + 20
        while acked < 200 and time.monotonic() < deadline:
            acked = int(proc.stdout.readline())
    with journal.Journal(path) as j:
        seqs = [r["seq"] for r in j.records]
    assert acked >= 200
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) >= acked


# --- failed writes: nothing acknowledged that is not durable ------------------------------------------


def _only_on(fd: int, fake, real):  # type: ignore[no-untyped-def]
    """An ``os.write``/``os.fsync`` stand-in that misbehaves only on the journal's own descriptor."""
    return lambda f, *a: fake(f, *a) if f == fd else real(f, *a)


def test_a_short_write_is_completed_before_the_record_is_acknowledged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "j.jsonl"
    real_write = os.write
    with journal.Journal(path, fsync=False) as j:
        j.append("decision", at=1.0)
        # The kernel may take fewer bytes than asked (a signal, a nearly full disk): 7 at a time here.
        monkeypatch.setattr(os, "write", _only_on(j._fd, lambda f, data: real_write(f, bytes(data)[:7]), real_write))
        j.append("decision", at=2.0, payload="x" * 100)
        monkeypatch.undo()
    with journal.Journal(path) as j:
        assert [r["seq"] for r in j.records] == [1, 2] and j.records[1]["payload"] == "x" * 100
        assert j.dropped_tail == b""


def test_a_write_that_cannot_complete_is_undone_raised_and_the_journal_stays_appendable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "j.jsonl"
    real_write = os.write
    with journal.Journal(path, fsync=False) as j:
        j.append("decision", at=1.0)
        good = path.read_bytes()
        calls = []

        def disk_fills(f: int, data: bytes) -> int:  # half the record fits, then the disk is full
            calls.append(len(data))
            if len(calls) == 1:
                return real_write(f, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", _only_on(j._fd, disk_fills, real_write))
        with pytest.raises(journal.JournalWriteError) as err:
            j.append("decision", at=2.0, payload="y" * 300)
        monkeypatch.undo()
        assert err.value.errno == errno.ENOSPC and err.value.path == str(path)
        assert str(path) in str(err.value) and "No space left on device" in str(err.value)
        assert len(calls) == 2  # the short write was retried before giving up
        assert path.read_bytes() == good  # half a record is not left behind to glue the next one to
        assert [r["seq"] for r in j.records] == [1]
        j.append("decision", at=3.0)  # space is back
    with journal.Journal(path) as j:
        assert [(r["seq"], r["at"]) for r in j.records] == [(1, 1.0), (2, 3.0)]
        assert j.dropped_tail == b""
        j.append("decision", at=4.0)
    with journal.Journal(path) as j:
        assert [r["seq"] for r in j.records] == [1, 2, 3]


def test_a_write_that_takes_nothing_does_not_loop_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "j.jsonl"
    with journal.Journal(path, fsync=False) as j:
        monkeypatch.setattr(os, "write", _only_on(j._fd, lambda f, data: 0, os.write))
        with pytest.raises(journal.JournalWriteError, match="0 of"):
            j.append("decision", at=1.0)
    assert path.read_bytes() == b""


def test_a_failed_fsync_undoes_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "j.jsonl"
    real_fsync = os.fsync
    with journal.Journal(path) as j:
        j.append("decision", at=1.0)
        good = path.read_bytes()

        def eio(f: int) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "fsync", _only_on(j._fd, eio, real_fsync))
        with pytest.raises(journal.JournalWriteError) as err:
            j.append("decision", at=2.0)
        monkeypatch.undo()
        assert err.value.errno == errno.EIO
        assert path.read_bytes() == good and len(j.records) == 1


_FULL_DISK = r"""
import errno, json, os, sys
from tuner.rollout import journal
mnt = sys.argv[1]
path = os.path.join(mnt, "j.jsonl")
out = {}
j = journal.Journal(path)
j.append("decision", at=1.0, payload="a" * 100)
good = os.path.getsize(path)
fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fd, b"f" * 512)
except OSError as exc:
    out["filler_errno"] = exc.errno
os.close(fd)
try:
    j.append("decision", at=2.0, payload="b" * 20000)  # a page and more: the disk fills mid-record
    out["acknowledged"] = True
except journal.JournalWriteError as exc:
    out["error"] = [exc.errno, str(exc)]
out["size_after_failure"], out["good"] = os.path.getsize(path), good
os.unlink(os.path.join(mnt, "filler"))  # space comes back
j.append("decision", at=3.0, payload="c" * 20000)
j.close()
with journal.Journal(path) as j2:
    out["seqs"] = [r["seq"] for r in j2.records]
    out["payloads"] = [r["payload"][0] for r in j2.records]
    out["dropped"] = j2.dropped_tail.decode()
print(json.dumps(out))
"""


def test_a_full_disk_on_a_real_tmpfs_acknowledges_nothing_and_recovers_when_space_returns(tmp_path: Path) -> None:
    """A 64 KiB tmpfs in a private mount namespace (root only): the mount dies with the process."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    wrapper = 'mount -t tmpfs -o size=64k tmpfs "$1" && exec "$2" -c "$3" "$1"'
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", wrapper, "sh", str(mnt),
                           sys.executable, _FULL_DISK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["filler_errno"] == errno.ENOSPC
    assert "acknowledged" not in out, "a record that did not fit was reported durable"
    assert out["error"][0] == errno.ENOSPC and "j.jsonl" in out["error"][1]
    assert out["size_after_failure"] == out["good"]
    assert out["seqs"] == [1, 2] and out["payloads"] == ["a", "c"] and out["dropped"] == ""


# --- one tuner per journal -------------------------------------------------------------------------------

_HOLDER = """
import sys
from tuner.rollout import journal
j = journal.Journal(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_second_process_on_the_same_journal_is_refused_naming_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(locks.LockedError) as err:
            journal.Journal(path)
        assert err.value.pid == holder.pid
        assert f"pid {holder.pid}" in str(err.value) and "\n" not in str(err.value)
        assert isinstance(err.value, TunerError)
        # reading the journal (a status tool, a test) needs no lock and changes nothing
        assert journal.read_records(path) == []
    finally:
        holder.stdin.close()  # it exits at the end of its input; SIGKILL if not within 30 s
        children.stop(holder, timeout_seconds=30, signal_first=None, kill_timeout_seconds=30)
        holder.stdout.close()
    with journal.Journal(path) as j:  # the holder exited: its lock went with it
        j.append("decision", at=1.0)


def test_the_lock_is_released_at_close_and_taken_per_open(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = journal.Journal(path)
    with pytest.raises(locks.LockedError, match=f"pid {os.getpid()}"):
        journal.Journal(path)  # flock is per open file: the same process cannot open it twice either
    j.close()
    journal.Journal(path).close()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    path = tmp_path / "state.json.lock"
    code = "import sys, time\nfrom tuner.rollout import locks\nl = locks.acquire(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(locks.LockedError, match=f"held by another vllm-tuner \\(pid {holder.pid}\\)"):
            locks.acquire(path)
    finally:
        children.stop(holder, timeout_seconds=0, signal_first=None, kill_timeout_seconds=30)  # SIGKILL, reaped
        holder.stdout.close()
    with locks.acquire(path) as lock:
        assert lock.path == path and path.read_text().strip() == str(os.getpid())


def test_a_journal_with_a_redactor_holds_no_secret_and_a_replayed_rollout_gets_it_back(tmp_path: Path) -> None:
    from tuner.model import secrets

    key = "sk-journal-5e7d21"
    old, new = ("--api-key", key, "--max-num-seqs", "8"), ("--api-key", key, "--max-num-seqs", "32")
    redactor = secrets.DEFAULT.learn(argvs=[old])
    path = tmp_path / "journal.jsonl"
    with journal.Journal(path, redactor=redactor) as j:
        r = machine.new("r1", replicas=["a"], changes={"a": (old, new)}, limits=machine.Limits(), now=0.0)
        j.append("rollout", at=0.0, **journal.rollout_fields(r))
        r = step(j, r, "a", E.GO, 1.0)
        step(j, r, "a", E.DRAINED, 2.0, reason=f"the process runs {' '.join(new)}")
        assert key not in json.dumps(list(j.records))  # what it holds in memory is what the file holds
    assert key not in path.read_text()
    replayed = journal.unfinished(journal.read_records(path))
    assert replayed is not None and replayed.new_argv["a"] == ("--api-key", "***", "--max-num-seqs", "32")
    back = journal.restored(replayed, lambda name, argv: redactor.restore(argv, list(old)))
    assert (back.old_argv["a"], back.new_argv["a"]) == (old, new)
    assert back.of("a").state is replayed.of("a").state
