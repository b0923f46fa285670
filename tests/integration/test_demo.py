"""`make demo` as a newcomer runs it: the recorded real scenarios, then the live loop on simulated replicas."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 8

ROOT = Path(__file__).resolve().parents[2]


def test_demo_recorded_part_shows_decisions_with_reasons():
    proc = subprocess.run([sys.executable, "-m", "tuner", "demo", "--recorded-only"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # 32 clients ÷ 0.8 → 40, and a restart goes on to the TPOT frontier (docs/rules.md#restart-sizing)
    step = re.search(r"CHANGE  --max-num-seqs 4 → (\d+) \(queue-slot-bound\)", out)
    assert step is not None and int(step[1]) > 40, out
    assert "→ 40; a restart goes to the TPOT SLO frontier" in out
    assert "queue_time_mean_s" in out
    # the KV-bound engine is NOT given more slots; more KV memory would need a restart that does not pay back
    # here (kv-preemption-cap, which capped its slots, is off by default: docs/evidence.md#kv-preemption-cap)
    kv = out.split("kv-bound")[1]
    assert "queue-slot-bound" not in kv.split("result")[0]
    assert "kv-more-memory: a restart does not pay back" in kv
    assert "result (dry run): no change" in kv


@pytest.mark.slow
def test_demo_live_part_rolls_simulated_replicas_to_better_flags():
    """The real daemon (`vllm-tuner run`, apply mode, process actuator) on two simulated replicas."""
    proc = subprocess.run([sys.executable, "-m", "tuner", "demo", "--seconds", "170"], capture_output=True,
                          text=True, cwd=ROOT, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    live = out.split("part 2")[1]
    # one step, not doublings: 64 simulated users ÷ 0.8 utilisation → 80, and on to the TPOT frontier (a restart)
    step = re.search(r"--max-num-seqs 8→(\d+)", live)
    assert step is not None and int(step[1]) >= 80, live
    # one replica at a time: b is only drained after a is done
    a_done = live.index("sim-a verifying → done")
    b_drain = live.index("sim-b pending → draining")
    assert a_done < b_drain
    assert "done: sim-a=done sim-b=done" in live
    # each replica was judged against its own signals before the change (rules/default.yaml verify:)
    for name in ("sim-a", "sim-b"):
        assert re.search(name + r" verifying → done \(verified: tpot_p50_s \(queue-slot-bound\) "
                         r"[\d.]+ ≤ 0.1: ok, tpot_p50_s must stay ≤ the SLO tpot_p99_s", live), live
    now = re.search(r"--max-num-seqs (\d+)", live.split("sim-a now runs: ")[1].splitlines()[0])
    assert now is not None and int(now[1]) >= 80, live
