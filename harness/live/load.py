"""Load: vLLM's own benchmark client (``vllm.benchmarks.serve``) as a closed loop of ``concurrency`` clients
through the load balancer, running until ``stop()``; its own JSON result (``completed``, ``failed``) is what
the tests assert on.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from harness import bench_client_fix, vllm
from harness.live.config import SERVED_NAME
from harness.waiting import wait_for
from tuner.actuators import children

# vLLM's benchmark client, unchanged but for the stream fix (bench_client_fix.py) and two wrappers: requests are handed out as a closed loop
# of CONCURRENCY clients (the next one only when one finished), and no new request starts once
# STOP_FILE exists. The client then finishes what is in flight and reports on exactly the requests
# it sent, with its own metrics code (completed, failed, latencies) and --save-result JSON.
_LOAD_SCRIPT = vllm.CLIENT_FIX_PRELUDE + r"""
import asyncio, os, sys
import vllm.benchmarks.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser

stop_file, concurrency = sys.argv[1], int(sys.argv[2])
counts = {"sent": 0, "done": 0}
_get_request = serve.get_request

async def get_request(*args, **kwargs):
    async for item in _get_request(*args, **kwargs):
        while counts["sent"] - counts["done"] >= concurrency:
            await asyncio.sleep(0.005)
        if os.path.exists(stop_file):
            return
        counts["sent"] += 1
        yield item

serve.get_request = get_request
for key, func in list(serve.ASYNC_REQUEST_FUNCS.items()):
    async def counted(*args, _func=func, **kwargs):
        try:
            return await _func(*args, **kwargs)
        finally:
            counts["done"] += 1
    serve.ASYNC_REQUEST_FUNCS[key] = counted

parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[3:]))
"""


class LoadError(RuntimeError):
    pass


class LiveLoad:
    """``concurrency`` closed-loop clients of vLLM's benchmark client against ``base_url`` until ``stop()``.

    ``stop()`` returns the client's own result JSON, ``vllm.summarised`` (``completed``, ``failed``,
    ``errors``, ...); a client that dies raises ``LoadError`` with its output's tail.
    """

    def __init__(self, base_url: str, model_dir: str | os.PathLike[str], work: Path, *, concurrency: int = 16,
                 input_len: int = 64, output_len: int = 32, max_prompts: int = 20000, seed: int = 0,
                 name: str = "load", api_key: str | None = None, reuse_connections: bool = False) -> None:
        self.work = work
        self.reuse_connections = reuse_connections  # keep the client's connection pool (bench_client_fix.py)
        self.api_key = api_key  # sent as Authorization: Bearer (vLLM's benchmark client reads OPENAI_API_KEY)
        self.stop_file = work / f"{name}.stop"
        self.result_file = work / f"{name}.json"
        self.log_path = work / f"{name}.log"
        for p in (self.stop_file, self.result_file):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        argv = vllm.benchmark_argv(base_url, SERVED_NAME, num_prompts=max_prompts, max_concurrency=concurrency,
                                   input_len=input_len, output_len=output_len, tokenizer=str(model_dir),
                                   result_file=self.result_file, seed=seed)
        assert argv[1] == "-c" and argv[3].endswith("bench_client_fix.py")
        self.argv = [argv[0], "-c", _LOAD_SCRIPT, argv[3], str(self.stop_file), str(concurrency), *argv[4:]]
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.sending_at: float | None = None  # when wait_sending() saw the first real request go out

    def start(self) -> LiveLoad:
        env = {**os.environ, **{k: vllm.DEFAULT_ENV[k] for k in (
            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")}}
        if self.api_key:
            env["OPENAI_API_KEY"] = self.api_key
        if self.reuse_connections:
            env[bench_client_fix.KEEP_CONNECTIONS] = "1"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.work), start_new_session=True)
        self.started_at = time.time()
        return self

    def sending(self) -> bool:
        """The client got past its start-up (imports, dataset, one test request) and is sending."""
        with contextlib.suppress(OSError):
            return "Starting main benchmark run" in self.log_path.read_text(errors="replace")
        return False

    def wait_sending(self, timeout: float = 180) -> None:
        wait_for(lambda: self.sending() or not self.alive(), timeout, "the benchmark client to start sending",
                 detail=self.log_tail)
        if not self.alive() and not self.sending():
            raise LoadError(f"the benchmark client exited before sending:\n{self.log_tail()}")
        self.sending_at = time.time()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 300) -> dict[str, Any]:
        """Stop sending, let in-flight requests finish, return the client's JSON."""
        assert self.proc is not None
        self.stop_file.touch()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise LoadError(f"the benchmark client did not finish within {timeout:g}s:\n{self.log_tail()}") from None
        if self.proc.returncode != 0 or not self.result_file.exists():
            raise LoadError(f"the benchmark client failed (rc={self.proc.returncode}):\n{self.log_tail()}")
        return vllm.summarised(json.loads(self.result_file.read_text()))

    def kill(self) -> None:
        if self.proc is not None:
            children.stop(self.proc, timeout_seconds=0, signal_first=None, group=True, kill_timeout_seconds=30)

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            return b"".join(collections.deque(f, maxlen=n)).decode("utf-8", "replace")
        return "<no log>"
