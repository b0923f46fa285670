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

from tuner.launcher import untrusted


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
        try:
            text = untrusted.read_bytes(args.file, max_bytes=64 * 1024 * 1024, follow_symlinks=True).decode("utf-8")
        except (OSError, ValueError) as exc:  # Untrusted is a ValueError; so is a bad UTF-8 byte
            why = exc.reason if isinstance(exc, untrusted.Untrusted) else getattr(exc, "strerror", None) or str(exc)
            print(f"error: inject: cannot read {args.file}: {why}; expected a YAML file of Kubernetes objects",
                  file=sys.stderr)
            return 2
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
        print(f'inject: no workload asks for the tuner (annotation {injecting.INJECT}: "true"): nothing adopted',
              file=sys.stderr)
        if args.require:
            return 2
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
    p.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                   help="how long the engine waits for the agent before it starts on its own (default 30)")
    p.add_argument("--require", action="store_true", help="exit 2 when no workload was adopted")
    p.set_defaults(func=cmd_inject)
