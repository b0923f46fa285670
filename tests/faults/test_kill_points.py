"""SIGKILL at every journal record boundary of a rollout, on simulated replicas.

A full rollout of two replicas (``vllm-tuner run``, process actuator running ``python -m tuner.sim.engine``,
an http drain hook, one rule that doubles ``--max-num-seqs`` once) is run once to count its journal
records, N. Then, for every k in 1..N, a fresh pool is started with the tuner SIGKILLed by
``hook/sitecustomize.py`` the moment record k is durable (after its fsync, before ``append`` returns: the
step it guards was not taken), the tuner is started again, and once the rollout has finished and a few
more cycles have run it is stopped with SIGTERM and the promises are checked (``support.check_invariants``):
nothing acknowledged lost, one rollout, no double-booked restart, the pool on verified arguments, nothing
left drained.

The kill points run four at a time (``FAULTS_PARALLEL``): each is mostly waiting.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.faults import support
from tuner.rollout import machine

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 3

PARALLEL = int(os.environ.get("FAULTS_PARALLEL", "4"))


def run_to_the_end(pool: support.SimPool, tuner: support.Tuner) -> machine.Rollout:
    """Wait for the rollout to finish, let a few cycles pass (a lost booking would start a second
    rollout), stop the tuner with SIGTERM."""
    support.wait_for(pool.finished_rollout, 180, "the rollout to finish", poll=0.2, detail=pool.diagnostics)
    pool.wait_cycles(4)
    assert tuner.terminate() == 0, tuner.tail()
    rollout = pool.finished_rollout()
    assert rollout is not None
    return rollout


def kill_at(work: Path, k: int) -> str:
    """One kill point: the outcome, or an AssertionError saying which promise broke."""
    with support.sim_pool(work) as pool:
        first = pool.start_tuner(kill_at=k)
        rc = first.wait(180)
        assert rc == -9, f"k={k}: the tuner exited {rc} before record {k} was written\n{first.tail()}"
        before = pool.journal_path.read_bytes()
        written = before.count(b"\n")
        assert written == k, f"k={k}: killed with {written} records"
        second = pool.start_tuner()
        run_to_the_end(pool, second)
        rollout = support.check_invariants(pool, before_kill=before)
        return machine.outcome(rollout).value


def test_a_tuner_killed_at_every_record_boundary_of_a_rollout_keeps_every_promise(tmp_path: Path) -> None:
    with support.sim_pool(tmp_path / "reference") as pool:
        tuner = pool.start_tuner()
        reference = run_to_the_end(pool, tuner)
        support.check_invariants(pool)
        n = len(pool.records())
    assert machine.outcome(reference) is machine.Outcome.DONE, machine.describe(reference)
    assert n >= 22  # decision, rollout, 10 transitions per replica

    outcomes = support.every_kill_point(n, lambda k: kill_at(tmp_path / f"k{k:02d}", k), parallel=PARALLEL)
    print(f"kill points survived: {n} of {n} ({dict(outcomes)})")
