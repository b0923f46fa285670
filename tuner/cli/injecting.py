"""``vllm-tuner inject``: adopt the annotated workloads of a rendered manifest stream (stdin → stdout).

A Helm post-renderer (deploy/helm/plugins/vllm-tuner-inject), a step after ``kubectl kustomize``, or by
hand; ``tuner.kube.injecting`` says what it does. A workload that cannot be adopted fails the whole
render (exit 2, one line: which object, what is wrong, what would be accepted).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tuner.cli import arguments


def cmd_inject(args: argparse.Namespace) -> int:
    import yaml

    from tuner.kube import injecting

    image = args.image or os.environ.get("VLLM_TUNER_IMAGE")
    if not image:
        print("error: inject: say which agent image to add: --image REGISTRY/vllm-tuner:TAG (or $VLLM_TUNER_IMAGE), "
              "e.g. --image ghcr.io/example/vllm-tuner:0.3.1", file=sys.stderr)
        return 2
    if args.file in (None, "-"):
        text = sys.stdin.read()
    else:
        from pathlib import Path

        from tuner.cli import inputs

        text = inputs.read_text(Path(args.file), what="manifests")
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        print(f"error: inject: the input is not YAML: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    settings = injecting.Settings(image=image, wait_seconds=args.wait)
    try:
        out, adopted = injecting.inject(docs, settings)
    except injecting.AdoptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for a in adopted:
        print(a.line(), file=sys.stderr)
    if not adopted:
        nothing = f'no workload asks for the tuner (annotation {injecting.INJECT}: "true"): nothing adopted'
        if args.require:  # a post-renderer that adopts nothing is a mistake, never a silent success
            print(f"error: inject: {nothing} (--require)", file=sys.stderr)
            return 2
        print(f"inject: {nothing}", file=sys.stderr)
    sys.stdout.write(dump_all(out))
    return 0


def dump_all(docs: list[Any]) -> str:
    """Block YAML; multi-line strings (the wrapper's and the probe's programs) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=1 << 16)


def register(sub: Any) -> None:
    p = sub.add_parser("inject", help="adopt the workloads annotated vllm-tuner.io/inject in a manifest stream "
                                      "(a Helm post-renderer; docs/kubernetes.md, \"Adoption\")")
    p.add_argument("-f", "--file", help="the manifests (default: stdin)")
    p.add_argument("--image", help="the agent's image (default $VLLM_TUNER_IMAGE)")
    p.add_argument("--wait", type=arguments.non_negative_float, default=30.0, metavar="SECONDS",
                   help="how long the engine waits for the agent before it starts on its own (default 30)")
    p.add_argument("--require", action="store_true", help="exit 2 when no workload was adopted")
    p.set_defaults(func=cmd_inject)
