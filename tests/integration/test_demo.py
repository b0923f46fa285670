import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_recorded_part_shows_decisions_with_reasons():
    proc = subprocess.run([sys.executable, "-m", "tuner", "demo", "--recorded-only"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "CHANGE  --max-num-seqs 4 → 8 (queue-slot-bound)" in out
    assert "queue_time_mean_s" in out
    # the KV-bound engine is NOT given more slots; its slots are capped to what the cache holds
    kv = out.split("kv-bound")[1]
    assert "--max-num-seqs 128 → 10 (kv-preemption-cap)" in kv
    assert "queue-slot-bound" not in kv.split("result")[0].replace("kv-preemption-cap", "")
