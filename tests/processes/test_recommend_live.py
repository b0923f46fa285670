"""`vllm-tuner recommend --config` scrapes live targets and never touches them (a simulated engine here)."""

import json
import subprocess
import sys
from pathlib import Path

from tuner.sim import engine as sim

ROOT = Path(__file__).resolve().parents[2]


def test_recommend_live_on_a_slot_bound_engine(tmp_path):
    server = sim.start(["--max-num-seqs", "8", "--sim-concurrency", "64"])
    try:
        cfg = tmp_path / "tuner.yaml"
        cfg.write_text(json.dumps({
            "mode": "recommend",
            "targets": [{"name": "sim", "metrics_url": f"{server.base_url}/metrics",
                         "args": ["--max-num-seqs", "8"]}],
            # 12 s of scrapes: the restart's sustained-evidence guard (60 s by default) is not what this tests
            "decisions": {"safety": {"restart_evidence_seconds": 0}},
        }))
        # 8 scrapes: 7 windows of ≥ 2 snapshots, more than queue-slot-bound's `for: 3` needs to fire
        proc = subprocess.run([sys.executable, "-m", "tuner", "recommend", "--config", str(cfg), "--samples", "8",
                               "--window-seconds", "1.5", "--min-snapshots", "2", "--format", "json"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        # 10.5 s of sampling: said on stderr, in one plain line (not a terminal), before the result
        assert proc.stderr.splitlines()[0] == ("recommend: 1 target(s): 8 scrapes 1.5 s apart, about 10 s; "
                                               "the result follows"), proc.stderr
        out = json.loads(proc.stdout)
        assert out["signals"]["requests_running_max"] == 8  # slots pinned (an instant may show 7)
        assert out["signals"]["requests_waiting_max"] > 0
        (rec,) = out["recommendations"]
        assert (rec["flag"], rec["from"], rec["rule"]) == ("--max-num-seqs", "8", "queue-slot-bound")
        # the 64 clients inside ÷ 0.8 → 80, and on to the TPOT frontier (a restart is sized for the cooldown)
        assert "→ 80; a restart goes to the TPOT SLO frontier" in rec["reason"] and int(rec["to"]) > 80
        assert out["held"] == [], out["held"]
        assert server.cfg.max_num_seqs == 8  # a dry run changed nothing
    finally:
        server.shutdown(timeout_seconds=5)
