"""``vllm-tuner agent --config FILE``: the Kubernetes agent (docs/kubernetes.md, "The agent")."""

from __future__ import annotations

import argparse
from typing import Any

from tuner.cli import arguments


def cmd_agent(args: argparse.Namespace) -> int:
    from tuner import config
    from tuner.errors import TunerError
    from tuner.kube import running
    from tuner.runtime import logs

    try:
        json_logs = config.load(args.config).daemon.json_logs
    except TunerError:  # the agent fails open: it says why in its log, on /metrics and in an Event
        json_logs = False
    logs.configure(json_logs=json_logs or args.json_logs)
    return running.run_agent(args.config, state_dir=args.state_dir, pod=args.pod,
                             startup_timeout=args.startup_timeout, prepare_only=args.prepare_only)


def register(sub: Any) -> None:
    p = sub.add_parser("agent", help="the Kubernetes agent: a native sidecar in every pod of a vLLM Deployment "
                                     "(docs/kubernetes.md)")
    p.add_argument("--config", required=True, help="the tuner's YAML configuration, with a `kubernetes:` section")
    p.add_argument("--state-dir", help="the directory shared with the launcher (default kubernetes.state_dir)")
    p.add_argument("--pod", help="this pod's name (default $POD_NAME)")
    p.add_argument("--startup-timeout", type=arguments.non_negative_float, default=15.0, metavar="SECONDS",
                   help="how long to wait for the pool's ConfigMap before the engine starts on its own command "
                        "line (default 15; at once when the API server says no: 401, 403, 404)")
    p.add_argument("--prepare-only", action="store_true",
                   help="only the start-up (launcher.pyz and desired.json in the state directory), then exit: an "
                        "init container's job where native sidecars are not available")
    p.add_argument("--json-logs", action="store_true", help="one JSON object per log line")
    p.set_defaults(func=cmd_agent)
