"""SIGKILL at every journal record boundary of a live change (machine Rule 5), on simulated replicas.

The pool of ``test_kill_points`` with live knobs on: the engines start with ``--max-num-seqs 16`` and their
admission cap at 8, so the queue rule's step (8 → 16) moves live — a live rollout, no drain, no restart.
It is run once to count its journal records, N; then, for every k in 1..N, a fresh pool's tuner is
SIGKILLed the moment record k is durable (``hook/sitecustomize.py``), started again, and once the live
rollout has finished and a few more cycles have run it is stopped and the promises are checked
(``support.check_live_invariants``): nothing acknowledged lost, one rollout, nothing restarted, the pool
on the values the rollout ended with, nothing drained.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.faults import support
from tests.faults.test_kill_points import run_to_the_end
from tuner.rollout import machine

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 2

PARALLEL = int(os.environ.get("FAULTS_PARALLEL", "4"))


def live_pool(work: Path) -> support.SimPool:
    return support.SimPool(work, max_num_seqs=16, live_cap=8)


def engine_pids(pool: support.SimPool) -> dict[str, int]:
    def pids() -> dict[str, int] | None:
        got = {n: (pool.pidfile(n) or {}).get("pid") for n in pool.names}
        return got if all(got.values()) and all(pool.live_cap_of(n) for n in pool.names) else None  # type: ignore[return-value]

    return support.wait_for(pids, 60, "the engines to start and acknowledge their control directory", poll=0.1,
                            detail=pool.diagnostics)


def kill_at(work: Path, k: int) -> str:
    pool = live_pool(work)
    try:
        first = pool.start_tuner(kill_at=k)
        rc = first.wait(180)
        assert rc == -9, f"k={k}: the tuner exited {rc} before record {k} was written\n{first.tail()}"
        pids = engine_pids(pool)  # the engines outlive the tuner
        before = pool.journal_path.read_bytes()
        written = before.count(b"\n")
        assert written == k, f"k={k}: killed with {written} records"
        second = pool.start_tuner()
        run_to_the_end(pool, second)
        rollout = support.check_live_invariants(pool, pids=pids, before_kill=before)
        return machine.outcome(rollout).value
    finally:
        pool.close()


def test_a_tuner_killed_at_every_record_boundary_of_a_live_change_keeps_every_promise(tmp_path: Path) -> None:
    pool = live_pool(tmp_path / "reference")
    try:
        tuner = pool.start_tuner()
        pids = engine_pids(pool)
        reference = run_to_the_end(pool, tuner)
        support.check_live_invariants(pool, pids=pids)
        n = len(pool.records())
    finally:
        pool.close()
    assert machine.outcome(reference) is machine.Outcome.DONE, machine.describe(reference)
    assert n >= 2 + 3 * len(pool.names)  # decision, rollout, go / acknowledged / verified per replica

    outcomes = support.every_kill_point(n, lambda k: kill_at(tmp_path / f"k{k:02d}", k), parallel=PARALLEL)
    print(f"live kill points survived: {n} of {n} ({dict(outcomes)})")
