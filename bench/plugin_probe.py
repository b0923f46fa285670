"""Prove the live-knob plugin on a running engine (written for vLLM 0.26 on the GPU machine).

Standard library plus the plugin's own ``protocol`` module; talks to 127.0.0.1 only. Start the engine
with the plugin installed in its environment and the control directory set, e.g.::

    pip install ./plugin                      # into the engine's environment
    mkdir -m 0700 /tmp/vllm-ctl
    VLLM_TUNER_CONTROL_DIR=/tmp/vllm-ctl vllm serve MODEL --max-num-seqs 64 --port 8000

then, as the same user::

    python -m bench.plugin_probe --port 8000 --control-dir /tmp/vllm-ctl --caps 4,16,8 --hold 20

It keeps ``--concurrency`` requests in flight (its own stdlib client; 0 = bring your own load), sets each
cap in turn, waits for the engine's acknowledgement (and, after a lowering, for the drain-down to end),
then samples ``vllm:num_requests_running`` for ``--hold`` seconds and prints per phase: the ack, the
running maximum / mean, and whether the cap held and was reached. At the end it restores the startup
values and prints the request totals, the engine's error/abort/preemption counters and the EngineCore
pids seen in the acks (one pid = no restart). Exit status 0 when every phase passed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

try:
    from vllm_tuner_plugin import protocol
except ImportError:
    sys.exit("plugin_probe: the live-knob plugin is not installed in this interpreter "
             "(pip install ./plugin into the engine's environment)")

HOST = "127.0.0.1"
SAMPLE_S = 0.2


def http(port: int, path: str, body: dict | None = None, timeout: float = 30.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        lab = m.group(1) or ""
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(m.group(2))
    return total


def scrape(port: int) -> dict[str, float]:
    text = http(port, "/metrics", timeout=10).decode("utf-8", "replace")
    return {
        "running": metric(text, "vllm:num_requests_running"),
        "waiting": metric(text, "vllm:num_requests_waiting"),
        "errored": metric(text, "vllm:request_success_total", finished_reason="error"),
        "aborted": metric(text, "vllm:request_success_total", finished_reason="abort"),
        "preemptions": metric(text, "vllm:num_preemptions_total"),
    }


def read_acks(control_dir: Path) -> list[dict]:
    acks = []
    for path in sorted(control_dir.glob(f"{protocol.ACK_PREFIX}*{protocol.ACK_SUFFIX}")):
        try:
            acks.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            acks.append({"file": path.name, "problem": str(exc)})
    return acks


def write_request(control_dir: Path, seq: int, **knobs: int | None) -> None:
    protocol.write_json_atomically(str(control_dir / protocol.CONTROL_FILE), protocol.request_document(seq, **knobs))


class Load:
    """``n`` threads, each sending one completion after another until stopped."""

    def __init__(self, port: int, model: str, n: int, max_tokens: int, prompt_words: int) -> None:
        self.port, self.model, self.n, self.max_tokens = port, model, n, max_tokens
        words = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog")
        self.prompt = " ".join(itertools.islice(itertools.cycle(words), prompt_words))
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            body = {"model": self.model, "prompt": f"{i} {self.prompt}", "max_tokens": self.max_tokens,
                    "temperature": 0, "ignore_eos": True}
            try:
                http(self.port, "/v1/completions", body, timeout=600)
                with self._lock:
                    self.ok += 1
            except (urllib.error.URLError, OSError, ValueError) as exc:
                with self._lock:
                    self.failed += 1
                    if len(self.errors) < 5:
                        self.errors.append(str(exc))
                time.sleep(0.5)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=900)


def wait_ack(control_dir: Path, seq: int, deadline_s: float, predicate=lambda a: True) -> dict | None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        acks = [a for a in read_acks(control_dir) if a.get("seq") == seq]
        if acks and all(predicate(a) for a in acks):
            return acks[0]
        time.sleep(0.05)
    return None


def brief(ack: dict | None) -> str:
    if ack is None:
        return "no acknowledgement"
    eff = ack.get("effective") or {}
    state = f"REFUSED: {ack['refused']}" if ack.get("refused") else f"applied {ack.get('applied')}"
    return (f"seq {ack.get('seq')} {state}; effective cap {eff.get('max_num_active_seqs')} "
            f"(admission attribute {eff.get('admission_cap')}, running {eff.get('running')}, draining "
            f"{eff.get('draining')}); pid {ack.get('pid')} mode {ack.get('mode')} vLLM {ack.get('engine_version')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the engine's port on 127.0.0.1")
    parser.add_argument("--control-dir", type=Path, required=True, help="the engine's VLLM_TUNER_CONTROL_DIR")
    parser.add_argument("--caps", default="4,16,8", help="admission caps to set in turn (default 4,16,8)")
    parser.add_argument("--hold", type=float, default=20.0, help="seconds to sample each phase (default 20)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests kept in flight (0: none)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--ack-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        caps = [int(c) for c in args.caps.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--caps must be integers separated by commas, e.g. 4,16,8; got {args.caps!r}")
    control_dir = args.control_dir.resolve()
    try:
        model = json.loads(http(args.port, "/v1/models"))["data"][0]["id"]
        version = json.loads(http(args.port, "/version")).get("version")
        before = scrape(args.port)
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        print(f"cannot talk to an engine on {HOST}:{args.port}: {exc}", file=sys.stderr)
        return 2
    print(f"engine {HOST}:{args.port}: model {model}, vLLM {version}")
    startup = read_acks(control_dir)
    if not startup:
        print(f"no ack in {control_dir}: is vllm-tuner-plugin installed in the engine's environment and "
              f"VLLM_TUNER_CONTROL_DIR={control_dir} set for it?", file=sys.stderr)
        return 2
    for a in startup:
        print("startup ack:", brief(a), "| envelope", a.get("envelope"), "| not live", a.get("not_live"))
        if not a.get("live"):
            print(f"the plugin is off in this engine: {a.get('refused')}", file=sys.stderr)
            return 1
    seqs = itertools.count(max([a.get("seq") or 0 for a in startup]) + 1)

    load = Load(args.port, model, args.concurrency, args.max_tokens, args.prompt_words)
    load.start()
    results: list[tuple[int, float, float, bool]] = []
    pids = {a.get("pid") for a in startup}
    try:
        for cap in caps:
            seq = next(seqs)
            write_request(control_dir, seq, max_num_active_seqs=cap)
            t0 = time.monotonic()
            ack = wait_ack(control_dir, seq, args.ack_timeout)
            print(f"\n== cap {cap}: ack after {time.monotonic() - t0:.2f}s: {brief(ack)}")
            if ack is None or ack.get("refused"):
                results.append((cap, float("nan"), float("nan"), False))
                continue
            drained = wait_ack(control_dir, seq, args.ack_timeout, lambda a: a["effective"].get("draining") is False)
            print(f"   drain-down over after {time.monotonic() - t0:.2f}s: {brief(drained)}")
            time.sleep(1.0)  # /metrics trails the engine's steps a little
            samples = []
            end = time.monotonic() + args.hold
            while time.monotonic() < end:
                samples.append(scrape(args.port))
                time.sleep(SAMPLE_S)
            running = [s["running"] for s in samples]
            top, mean = max(running), sum(running) / len(running)
            reached = top == cap or args.concurrency < cap
            ok = top <= cap and reached
            results.append((cap, top, mean, ok))
            print(f"   vllm:num_requests_running over {len(samples)} samples: max {top:.0f}, mean {mean:.1f}, "
                  f"waiting max {max(s['waiting'] for s in samples):.0f} -> {'PASS' if ok else 'FAIL'}")
            pids |= {a.get("pid") for a in read_acks(control_dir)}
        seq = next(seqs)
        write_request(control_dir, seq)
        print(f"\n== restore startup values: {brief(wait_ack(control_dir, seq, args.ack_timeout))}")
    finally:
        load.stop()
    after = scrape(args.port)
    pids |= {a.get("pid") for a in read_acks(control_dir)}
    print(f"\nrequests: {load.ok} ok, {load.failed} failed {load.errors or ''}")
    print("engine counters (delta): " + ", ".join(f"{k} {after[k] - before[k]:+.0f}"
                                                 for k in ("errored", "aborted", "preemptions")))
    print(f"EngineCore pids in the acks: {sorted(p for p in pids if p is not None)} (pid of this probe {os.getpid()})")
    for cap, top, mean, ok in results:
        print(f"cap {cap:>4}: running max {top:.0f} mean {mean:.1f} {'PASS' if ok else 'FAIL'}")
    passed = all(r[3] for r in results) and load.failed == 0 and len(pids) == 1 and after["errored"] == before["errored"]
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
