"""``python3 launcher.pyz [options] -- vllm serve MODEL ...`` (or ``python -m tuner.launcher``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..portable import pod_protocol as protocol
from . import launching, packaging

DEFAULT_STATE_DIR = "/var/run/vllm-tuner"


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a count >= 1: {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launcher.pyz",
        description="vllm-tuner's in-pod engine launcher: PID 1 of the engine container. It runs the engine "
                    "command given after --, plus the overrides the agent writes to STATE_DIR/desired.json, "
                    "relaunches it in place on request, and answers the kubelet's probes.",
        epilog="example: python3 /var/run/vllm-tuner/launcher.pyz --probe-host 0.0.0.0 -- vllm serve MODEL --port 8000")
    p.add_argument("--state-dir", default=os.environ.get("VLLM_TUNER_STATE_DIR", DEFAULT_STATE_DIR),
                   help=f"the directory shared with the agent (default $VLLM_TUNER_STATE_DIR or {DEFAULT_STATE_DIR})")
    p.add_argument("--probe-host", default="127.0.0.1",
                   help="address of /livez /readyz /status (default 127.0.0.1; the manifests use 0.0.0.0 so the "
                        "kubelet can reach them on the pod IP)")
    p.add_argument("--probe-port", type=_port, default=8081, help="default 8081")
    p.add_argument("--health-url", help="the engine's health URL (default http://127.0.0.1:<its --port>/health)")
    # the durations, in seconds: (flag, default, what it bounds; "0" allowed where 0 means never)
    durations = (
        ("--start-timeout", 1200.0, "an engine not healthy by then failed (default 1200)"),
        ("--stop-timeout", 60.0, "SIGTERM → SIGKILL for the engine's process group (default 60; above its "
                                 "--shutdown-timeout)"),
        ("--kill-timeout", 15.0, "how long processes may outlive SIGKILL before liveness says so (default 15)"),
        ("--force-after", 10.0, "a planned relaunch: SIGINT to the engine this long after its SIGTERM, so vLLM "
                                "stops waiting for attached keep-alive connections (default 10; 0: never; never for "
                                "the kubelet's SIGTERM)"),
        ("--poll", 0.5, "how often desired.json and the engine's /health are read (default 0.5)"),
        ("--health-period", 2.0, "how often the engine's /health is read once it serves (default 2; while it "
                                 "starts: --poll)"),
        ("--wedge-seconds", 30.0, "/livez fails when the launcher's loop stalls this long (default 30)"),
        ("--desired-wait", 30.0, "no desired.json at start: wait this long for the agent to write it, then start "
                                 "the engine on its own command line (default 30; 0: at once)"),
        ("--liveness-engine-health", 60.0, "/livez fails when a serving engine's /health has failed without a "
                                           "break this long: a wedged engine gets its container restarted; never "
                                           "while it starts or relaunches (default 60; 0: off, liveness is the "
                                           "launcher's loop only)"),
    )
    zero_allowed = ("--force-after", "--desired-wait", "--liveness-engine-health")
    for flag, default, what in durations:
        p.add_argument(flag, type=_non_negative if flag in zero_allowed else _positive, default=default,
                       metavar="SECONDS", help=what)
    p.add_argument("--unready-after", type=_count, default=3, metavar="N",
                   help="readiness goes away after N failed /health answers in a row (default 3)")
    p.add_argument("--ready-after", type=_count, default=2, metavar="N",
                   help="... and comes back after N good ones (default 2)")
    p.add_argument("--build-zipapp", metavar="OUT.pyz",
                   help="write the launcher as a zipapp to OUT.pyz and exit (no engine command needed)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the engine's command line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.build_zipapp:
        try:
            packaging.build_zipapp(Path(args.build_zipapp))
        except OSError as exc:
            print(f"launcher: cannot write {args.build_zipapp}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        return 0
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("give the engine's command after --, e.g. -- vllm serve MODEL --port 8000")
    state_dir = Path(args.state_dir)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        probe = state_dir / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        print(f"launcher: the state directory {state_dir} is not writable: {exc.strerror or exc}", file=sys.stderr)
        return 2
    settings = launching.Settings(
        state_dir=state_dir, probe_host=args.probe_host, probe_port=args.probe_port, health_url=args.health_url,
        start_timeout_seconds=args.start_timeout, stop_timeout_seconds=args.stop_timeout,
        kill_timeout_seconds=args.kill_timeout, force_after_seconds=args.force_after or None,
        poll_seconds=args.poll, health_period_seconds=args.health_period,
        wedge_seconds=args.wedge_seconds, desired_wait_seconds=args.desired_wait,
        unready_after=args.unready_after, ready_after=args.ready_after,
        liveness_engine_seconds=args.liveness_engine_health or None)
    launcher = launching.Launcher(settings, command)
    try:
        launcher.listen()
    except OSError as exc:
        print(f"launcher: cannot listen on {args.probe_host}:{args.probe_port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    launcher.install_signals()
    return launcher.run()


__all__ = ["main", "protocol"]

if __name__ == "__main__":
    sys.exit(main())
