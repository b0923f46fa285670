"""``vllm-tuner inject``: adopt the annotated workloads of a rendered manifest stream (stdin → stdout).

A Helm post-renderer (deploy/helm/plugins/vllm-tuner-inject), a step after ``kubectl kustomize``, or by
hand; ``tuner.kube.injecting`` says what it does. The input is read through the configuration's bounded
YAML reader (``tuner.rules.loading.parse_yaml``: size, depth and alias expansion bounded, so a hostile
manifest cannot hang a ``helm install``), the documents it does not adopt are written back as they came
(their aliases kept, not expanded). A workload that cannot be adopted fails the whole render (exit 2,
one line per problem: which object, what is wrong, what would be accepted); warnings (an unpinned
image, no ``--shutdown-timeout``) and the rewrites it made go to stderr with the adoption lines.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

MAX_WAIT_SECONDS = 3600.0


def cmd_inject(args: argparse.Namespace) -> int:
    from tuner.kube import injecting
    from tuner.portable import untrusted
    from tuner.rules import loading

    image = args.image or os.environ.get("VLLM_TUNER_IMAGE") or None
    if image is not None and (why := injecting.image_problem(image)) is not None:
        print(f"error: inject: --image: {why}, e.g. --image ghcr.io/example/vllm-tuner:0.4.0", file=sys.stderr)
        return 2
    if args.file in (None, "-"):
        raw, what = sys.stdin.buffer.read(loading.YAML_MAX_BYTES + 1), "<stdin>"
    else:
        what = args.file
        try:
            raw = untrusted.read_bytes(args.file, max_bytes=loading.YAML_MAX_BYTES, follow_symlinks=True)
        except FileNotFoundError:
            print(f"error: inject: -f {args.file}: cannot read the manifests: no such file", file=sys.stderr)
            return 2
        except untrusted.Untrusted as exc:
            print(f"error: inject: -f {exc.reason}", file=sys.stderr)
            return 2
    settings = injecting.Settings(image=image, wait_seconds=args.wait,
                                  entrypoint=tuple(args.entrypoint.split(",")) if args.entrypoint else None)
    code, out, lines = run(raw, what, settings, require=args.require)
    for line in lines:
        print(line, file=sys.stderr)
    sys.stdout.write(out)
    return code


def run(raw: bytes, what: str, settings: Any, *, require: bool = False) -> tuple[int, str, list[str]]:
    """The whole of ``inject`` but its I/O: the input's bytes → (exit code, the manifests to write, the
    lines for stderr). Never raises for any input (tests/fuzz/test_fuzz_inject.py)."""
    from tuner.cli import error_lines
    from tuner.errors import ConfigError
    from tuner.kube import injecting
    from tuner.rules import loading

    if len(raw) > loading.YAML_MAX_BYTES:
        return 2, "", [f"error: inject: {what}: larger than the limit of {loading.YAML_MAX_BYTES} bytes"]
    try:
        docs = loading.parse_yaml(raw.decode("utf-8"), what=what)
    except UnicodeDecodeError as exc:
        return 2, "", [f"error: inject: {what}: not UTF-8 (at byte {exc.start})"]
    except ConfigError as exc:
        return 2, "", [line.replace("error: ", "error: inject: ", 1) for line in error_lines(exc)]
    try:
        out, adopted = injecting.inject(docs, settings)
    except injecting.Refused as exc:
        return 2, "", [f"error: {' '.join(str(p).split())}" for p in exc.problems]
    lines = [line for a in adopted for line in a.lines()]
    if not adopted:
        nothing = f'no workload asks for the tuner (annotation {injecting.INJECT}: "true"): nothing adopted'
        if require:  # a post-renderer that adopts nothing is a mistake, never a silent success
            return 2, "", [*lines, f"error: inject: {nothing} (--require)"]
        lines.append(f"inject: {nothing}")
    return 0, dump_all(out), lines


def dump_all(docs: list[Any]) -> str:
    """Block YAML; multi-line strings (the wrapper's and the probe's programs) as literal blocks. An
    object that appears twice (a YAML alias in the input, left as it was) is written once, with an
    anchor and aliases: never expanded."""
    import yaml

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=1 << 16)


def wait_seconds(text: str) -> float:
    """``--wait``: a finite number of seconds in (0, MAX_WAIT_SECONDS]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, e.g. --wait 30") from None
    if not (math.isfinite(value) and 0 < value <= MAX_WAIT_SECONDS):
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds from 0 to {MAX_WAIT_SECONDS:g}, e.g. --wait 30")
    return value


def entrypoint(text: str) -> str:
    words = text.split(",")
    if not all(w and "\0" not in w and "\n" not in w for w in words):
        raise argparse.ArgumentTypeError(f"{text!r}: the ENTRYPOINT's words separated by commas, e.g. vllm,serve")
    return text


def register(sub: Any) -> None:
    p = sub.add_parser("inject", help="adopt the workloads annotated vllm-tuner.io/inject in a manifest stream "
                                      "(a Helm post-renderer; docs/kubernetes.md, \"Adoption\")")
    p.add_argument("-f", "--file", help="the manifests (default: stdin)")
    p.add_argument("--image", help="the agent's image (default $VLLM_TUNER_IMAGE, else the chart's image.* when "
                                   "the chart is rendered in the same stream)")
    p.add_argument("--wait", type=wait_seconds, default=30.0, metavar="SECONDS",
                   help="how long the engine waits for the agent before it starts on its own (default 30)")
    p.add_argument("--entrypoint", type=entrypoint, metavar="WORD,WORD",
                   help="the ENTRYPOINT of the engine's image, for a container that gives args only, e.g. "
                        "vllm,serve (known without it: vllm/vllm-openai by version)")
    p.add_argument("--require", action="store_true", help="exit 2 when no workload was adopted")
    p.set_defaults(func=cmd_inject)
