"""A tiny engine for the launcher's fast tests: stdlib only, so it runs under any python3.

``python fake_engine.py --port P [options]`` serves ``GET /health`` (200) and ``GET /argv``
(``{"argv": [...], "pid": N, "children": [...]}``). Options, each one behaviour the launcher must handle:

- ``--start-seconds S``   sleep before listening (an engine loading its weights)
- ``--max-model-len N``   N > 4096 exits 1 at start with a vLLM-like ValueError (a candidate that fails)
- ``--exit-code C``       exit with C right after start-up, never listening
- ``--crash-after S``     exit with code 3, S seconds after it started listening (an unplanned exit)
- ``--children N``        N child processes in the engine's process group (like vLLM's engine core)
- ``--stubborn-child``    one more child that ignores SIGTERM (only the launcher's SIGKILL ends it)
- ``--orphan``            a child that starts a grandchild and exits at once: the grandchild, re-parented to
                          the launcher (PID 1 or subreaper), exits 0.5 s later and must be reaped there
- ``--term-delay S``      on SIGTERM, keep serving S more seconds (draining), then exit 0
- ``--unhealthy``         /health answers 503
- ``--health-file F``     /health follows F's content, read at every request: ``ok`` (or no file) 200,
                          ``503`` 503, ``hang`` accepts and never answers (a wedged engine), ``flap`` 503 on
                          every other request
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHILD = ("import os, signal, sys, time\n"
         "def on_term(signum, frame):\n"
         "    print('fake-engine child: SIGTERM', flush=True)\n"
         "    os._exit(0)\n"
         "signal.signal(signal.SIGTERM, on_term)\n"
         "{ignore}\nwhile True: time.sleep(1)\n")
ORPHAN = ("import os, subprocess, sys\n"
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.5)'])\n"
          "os._exit(0)\n")


def opt(argv: list[str], name: str, default: str | None = None) -> str | None:
    value = default
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def main(argv: list[str]) -> int:
    port = int(opt(argv, "--port", "8000") or 8000)
    print(f"fake-engine: pid={os.getpid()} argv={json.dumps(argv)}", flush=True)
    time.sleep(float(opt(argv, "--start-seconds", "0") or 0))
    if int(opt(argv, "--max-model-len", "2048") or 2048) > 4096:
        print("fake-engine: ValueError: User-specified max_model_len is greater than the derived max_model_len",
              file=sys.stderr, flush=True)
        return 1
    if opt(argv, "--exit-code") is not None:
        return int(opt(argv, "--exit-code") or 0)
    children = [subprocess.Popen([sys.executable, "-c", CHILD.format(ignore="")])
                for _ in range(int(opt(argv, "--children", "0") or 0))]
    if "--stubborn-child" in argv:
        children.append(subprocess.Popen([sys.executable, "-c", CHILD.format(
            ignore="signal.signal(signal.SIGTERM, signal.SIG_IGN)")]))
    if "--orphan" in argv:
        subprocess.run([sys.executable, "-c", ORPHAN], check=True)
    healthy = "--unhealthy" not in argv
    health_file = opt(argv, "--health-file")
    flaps = [0]

    def health_mode() -> str:
        if health_file is None:
            return "ok"
        try:
            with open(health_file) as f:
                return f.read().strip() or "ok"
        except OSError:
            return "ok"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/health":
                mode = health_mode()
                if mode == "hang":
                    time.sleep(3600)
                flaps[0] += 1
                failing = not healthy or mode == "503" or (mode == "flap" and flaps[0] % 2 == 0)
                code, body = (503, b"unhealthy") if failing else (200, b"")
            elif self.path == "/argv":
                code, body = 200, json.dumps({"argv": argv, "pid": os.getpid(),
                                              "children": [c.pid for c in children]}).encode()
            else:
                code, body = 404, b"not found"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((opt(argv, "--host", "127.0.0.1") or "127.0.0.1", port), Handler)
    server.daemon_threads = True
    term_delay = float(opt(argv, "--term-delay", "0") or 0)

    def on_term(signum: int, frame: object) -> None:
        print("fake-engine: SIGTERM", flush=True)
        timer = threading.Timer(term_delay, server.shutdown)
        timer.daemon = True  # a SIGINT (KeyboardInterrupt) ends the engine at once, as it ends vLLM's server
        timer.start()

    signal.signal(signal.SIGTERM, on_term)
    crash_after = opt(argv, "--crash-after")
    if crash_after is not None:
        threading.Timer(float(crash_after), lambda: os._exit(3)).start()
    print(f"fake-engine: serving on {port}", flush=True)
    server.serve_forever(poll_interval=0.05)
    print("fake-engine: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
