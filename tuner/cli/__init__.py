"""Command line: ``vllm-tuner inspect | recommend | replay | run | agent | check-config | config-schema | demo``.

Exit codes, for every subcommand:

- 0: it did its job;
- 1: it ran but could not read what it needed (every target failed to answer, no input file held a
  readable /metrics body), or a bug (``error: internal error: …``; ``VLLM_TUNER_DEBUG=1`` shows the
  traceback);
- 2: a usage or configuration error, a bad input file, or a start-up that cannot proceed;
- 130: interrupted.

Each failure is one ``error: …`` line per problem on stderr, never a traceback (tests/unit/test_cli_contract.py
holds it over every subcommand and bad paths, URLs, numbers and files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence

import pydantic
import yaml

from tuner import __version__, config
from tuner.cli import agent, arguments, deciding, demo, injecting, inspecting, operating
from tuner.errors import ConfigError, SourceError, TunerError


def cmd_run(args: argparse.Namespace) -> int:
    from tuner.daemon import preflight, running
    from tuner.runtime import logs

    settings = config.load(args.config)
    preflight.check(settings, args.config, serving=not args.once)  # check-config's checks, before anything is touched
    logs.configure(json_logs=settings.daemon.json_logs or args.json_logs)
    try:
        return running.build_and_run(args.config, once=args.once)
    except OSError as exc:  # at start-up: a port or a file taken between the checks and now
        where = f" ({exc.filename})" if exc.filename else ""
        raise StartError(f"{args.config}: cannot start: {exc.strerror or exc}{where}") from exc


def cmd_check_config(args: argparse.Namespace) -> int:
    from tuner.daemon import preflight

    settings = config.load(args.file)
    unchecked: list[str] = []
    preflight.check(settings, args.file, unchecked=unchecked)
    print(f"# {args.file}: valid, and every check `run` makes at start-up that could be made here passes"
          + (":" if unchecked else "."))
    for what in unchecked:  # said, not passed over: what `run` may still meet
        print(f"# not checked here: {what}")
    print("# Effective configuration (defaults filled in, secrets masked):")
    print(yaml.safe_dump(settings.redacted_dump(), sort_keys=False), end="")
    return 0


class StartError(TunerError):
    """``run`` could not start for a reason outside the configuration's text (exit code 2)."""


def cmd_config_schema(args: argparse.Namespace) -> int:
    print(json.dumps(config.schema(), indent=2))
    return 0


def cmd_launcher_zipapp(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tuner.launcher import packaging

    try:
        packaging.build_zipapp(Path(args.out))
    except OSError as exc:
        raise StartError(f"{args.out}: cannot write the launcher there: {exc.strerror or exc}") from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = arguments.Parser(prog="vllm-tuner", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--version", action="version", version=f"vllm-tuner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    inspecting.register(sub)

    p = sub.add_parser("run", help="the tuner daemon: a cycle every scrape.interval_seconds (observe | recommend | apply)")
    p.add_argument("--config", required=True, help="the tuner's YAML configuration")
    p.add_argument("--once", action="store_true", help="run one cycle, print its summary line and exit")
    p.add_argument("--json-logs", action="store_true", help="one JSON object per log line")
    p.set_defaults(func=cmd_run)

    deciding.register(sub)
    demo.register(sub)
    agent.register(sub)
    injecting.register(sub)
    operating.register(sub)

    sub.add_parser("launch", help="the in-pod engine launcher: launch [options] -- vllm serve ... "
                                  "(docs/kubernetes.md; `launch --help` lists its options)")
    p = sub.add_parser("launcher-zipapp", help="write the launcher as a zipapp (the agent copies it into the pod)")
    p.add_argument("out", help="where to write launcher.pyz")
    p.set_defaults(func=cmd_launcher_zipapp)

    p = sub.add_parser("check-config", help="validate a config file, run every start-up check `run` makes (touching "
                       "nothing) and print the effective config, secrets masked")
    p.add_argument("file")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("config-schema", help="print the config file's JSON schema")
    p.set_defaults(func=cmd_config_schema)
    return parser


def error_lines(exc: TunerError) -> list[str]:
    """One line per problem: ``error: FILE: WHERE: WHAT`` (a configuration error), else ``error: WHAT``."""
    if isinstance(exc, ConfigError):
        return [f"error: {exc.file}: {where + ': ' if where else ''}{' '.join(what.split())}"
                for where, what in exc.problems] or [f"error: {exc.file}: invalid"]
    return [f"error: {' '.join(str(exc).split())}"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # its own parser: everything after `--` is the engine's command
        from tuner.launcher.__main__ import main as launch

        return launch(argv[1:])
    try:
        args = build_parser().parse_args(operating.flag_as_positional(argv))
        return int(args.func(args))
    except SourceError as exc:  # it ran, and nothing it needed could be read (every target, every file)
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except TunerError as exc:  # every expected failure: one line per problem, no traceback
        for line in error_lines(exc):
            print(line, file=sys.stderr)
        return 2
    except pydantic.ValidationError as exc:  # a value from the command line that a setting refuses
        for e in exc.errors():
            where = ".".join(str(p) for p in e["loc"])
            print(f"error: {where + ': ' if where else ''}{e['msg']} (got {e.get('input')!r})", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`vllm-tuner replay DIR -v | head`): stop quietly, as `cat` would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:  # an input path that cannot be read: the file named, and why
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 — a bug: still one line (the traceback on request), never a wall of text
        if os.environ.get("VLLM_TUNER_DEBUG"):
            traceback.print_exc()
        print(f"error: internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]} (a bug: please "
              "report it; VLLM_TUNER_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
