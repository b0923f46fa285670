"""A full disk and a read-only state directory, at start, mid-rollout and mid-cycle, on simulated replicas.

The journal and the state file live on a small file system this test mounts (a tmpfs; for the full
journal an ext2 image with 1 KiB blocks on a loop device — it needs root; without it the
tests skip, or fail under VLLM_TUNER_REQUIRE_E2E=1). The tuner is frozen (SIGSTOP, by the test hook) the
moment a chosen journal record is durable, the disk is filled (or made read-only) while it is frozen,
and it is let go (SIGCONT): the very next write fails.

- at start: one line on stderr, exit 2, nothing started (covered inside the mid-cycle scenarios: the
  tuner is restarted while the disk is still full or read-only);
- mid-rollout: a journal append fails — the rollout stops on its last durable step, a drained replica that
  still runs the old arguments is put back in the pool, the journal holds nothing more than before, /status
  claims nothing the journal does not hold, the daemon keeps cycling with /healthz 200; once the disk
  takes writes again the same process resumes the rollout and every promise holds;
- mid-cycle: the state file cannot be saved after a rollout (its booking) — logged, the daemon keeps
  cycling, state.json is untouched; a SIGTERM then exits 1 (the state could not be persisted), a restart
  on the still-broken disk exits 2, and a restart once it is fixed books the rollout, once.

A tmpfs cannot be remounted read-only while the journal is open for writing (the kernel answers EBUSY;
a real file system gets there through errors=remount-ro after an I/O error): for the journal's read-only
case the hook makes the journal's writes fail with EROFS instead (``hook/sitecustomize.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import required
from tests.faults import support
from tuner.rollout import journal as journaling
from tuner.rollout import machine

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 9


@pytest.fixture(scope="module", autouse=True)
def can_mount() -> None:
    required.need(support.mount_reason(), "small file systems for the tuner's state (root, mount)")


def stopped_at(pool: support.SimPool, k: int) -> tuple[support.Tuner, bytes]:
    tuner = pool.start_tuner(stop_at=k, erofs_flag=pool.work / "erofs")
    tuner.wait_stopped()
    before = pool.journal_path.read_bytes()
    assert before.count(b"\n") == k
    return tuner, before


def status_agrees_with_the_journal(pool: support.SimPool) -> None:
    """/status shows no replica further along than the journal has it."""
    status = pool.status()
    assert status is not None
    shown = (status.get("rollout") or {}).get("replicas", {})
    rollout = list(pool.rollouts().values())[-1]
    assert shown == {p.name: p.state.value for p in rollout.progress}, (shown, machine.describe(rollout))


def error_lines(tuner: support.Tuner) -> list[str]:
    return [line for line in tuner.log.read_text().splitlines() if line.startswith("error:")]


def nothing_left_drained_that_serves(pool: support.SimPool) -> None:
    """A replica out of the balancer is one whose engine cannot serve now (down, starting, unconfirmed)."""
    rollout = list(pool.rollouts().values())[-1]
    for p in rollout.progress:
        if p.name in pool.balancer.drained:
            assert p.state in machine.IN_FLIGHT and p.state not in machine.MAY_SERVE[p.leg], (
                f"{p.name} left drained at {p.state.value} ({p.leg.value} leg)")


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_journal_append_that_fails_mid_rollout_stops_it_safely_and_it_resumes_once_writes_work(
        tmp_path: Path, fault: str) -> None:
    """Full: filled while sim-a waits for idle; the journal's last block still has room for a few records
    (every file system allocates whole blocks; this one 1 KiB blocks, less than the rest of the rollout
    needs), so the append that fails is the first that does not fit — a real short write, cut back.
    Read-only: exactly the next append (sim-a's stop) fails."""
    with support.small_fs(tmp_path / "state", size_kib=512, block_kib=1 if fault == "full" else None) as state_dir, \
            support.sim_pool(tmp_path / "work", state_dir=state_dir) as pool:
        tuner, at_stop = stopped_at(pool, 4)  # record 4: sim-a drained, waiting for idle
        filler = support.fill(state_dir) if fault == "full" else None
        if fault == "read-only":
            (pool.work / "erofs").touch()
        tuner.resume()
        expected = "No space left on device" if fault == "full" else "Read-only file system"
        support.wait_for(lambda: "not journaled" in tuner.tail(300), 120, "the failed append to be logged",
                         detail=tuner.tail)
        durable = pool.journal_path.read_bytes()
        assert durable.startswith(at_stop) and durable.endswith(b"\n")
        pool.wait_cycles(3)
        assert tuner.alive() and pool.healthz() == 200
        assert pool.journal_path.read_bytes() == durable  # nothing more acknowledged, no torn record
        log = tuner.log.read_text()
        assert expected in log and "not resumed yet" in log and "Traceback" not in log
        status_agrees_with_the_journal(pool)
        nothing_left_drained_that_serves(pool)
        stopped = list(pool.rollouts().values())[-1]
        in_flight = set(stopped.in_flight)
        if fault == "read-only":  # sim-a still runs the old arguments: back in the pool, never stopped
            assert stopped.of("sim-a").state is machine.State.WAITING_IDLE, machine.describe(stopped)
            assert pool.live_argv("sim-a") == list(stopped.old_argv["sim-a"])
            assert "sim-a" not in pool.balancer.drained
        # the disk takes writes again: the same process resumes the rollout
        if filler is not None:
            filler.unlink()
        else:
            (pool.work / "erofs").unlink()
        support.wait_for(pool.finished_rollout, 120, "the resumed rollout to finish", poll=0.2,
                         detail=pool.diagnostics)
        pool.wait_cycles(3)
        assert tuner.terminate() == 0, tuner.tail()
        rollout = support.check_invariants(pool, before_kill=durable)
        resumed = [r["replica"] for r in pool.records()[durable.count(b"\n"):]
                   if r.get("event") in ("interrupted", "found_down")]
        assert sorted(resumed) == sorted(in_flight), (resumed, machine.describe(stopped))
        assert machine.outcome(rollout) is machine.Outcome.DONE, machine.describe(rollout)


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_state_file_that_cannot_be_saved_mid_cycle_is_logged_and_the_rollout_booked_once_later(
        tmp_path: Path, fault: str) -> None:
    # read-only: state.json on its own tmpfs (not held open, so it can really be remounted read-only)
    journal_dir = tmp_path / "work" if fault == "read-only" else None
    with support.small_fs(tmp_path / "state", size_kib=512) as state_dir, \
            support.sim_pool(tmp_path / "work", state_dir=state_dir) as pool:
        if journal_dir is not None:
            pool.journal_dir = journal_dir
        n = support.forward_records(pool)
        tuner, before = stopped_at(pool, n)  # the last record: sim-b done; the booking comes next
        saved = pool.state_path.read_bytes()
        filler = support.fill(state_dir) if fault == "full" else None
        if fault == "read-only":
            support.remount(state_dir, read_only=True)
        tuner.resume()
        support.wait_for(lambda: "state was not saved" in tuner.tail(200), 60, "the failed save to be logged",
                         detail=tuner.tail)
        pool.wait_cycles(3)
        assert tuner.alive() and pool.healthz() == 200
        assert pool.state_path.read_bytes() == saved  # the old state, whole: nothing half-written
        assert len(journaling.read_records(pool.journal_path)) == n  # no second rollout
        assert "Traceback" not in tuner.log.read_text()
        assert tuner.terminate() == 1, tuner.tail()  # the state could not be persisted on the way out
        # at start, on the still-broken disk: one line, exit 2, nothing done
        engines = {n: pool.pidfile(n) for n in pool.names}
        again = pool.start_tuner()
        assert again.wait(60) == 2, again.tail()
        lines = error_lines(again)
        assert lines and "daemon.state_file" in lines[0], again.tail()  # the journal beside it: a line too
        assert "Traceback" not in again.tail(200)
        assert {n: pool.pidfile(n) for n in pool.names} == engines  # no engine touched
        # the disk is fixed: the restarted tuner books the rollout the journal holds, once
        if filler is not None:
            filler.unlink()
        else:
            support.remount(state_dir, read_only=False)
        third = pool.start_tuner()
        support.wait_for(lambda: "which finished before the tuner stopped" in third.tail(200), 60,
                         "the unbooked rollout to be booked", detail=third.tail)
        pool.wait_cycles(3)
        assert third.terminate() == 0, third.tail()
        support.check_invariants(pool, before_kill=before)
        assert json.loads(pool.state_path.read_text())["booked_rollout"] == list(pool.rollouts())[-1]
