"""A stand-in for the ``helm`` binary, for kustomize's ``helmCharts:`` (``kubectl kustomize --enable-helm
--helm-command``): the two commands kustomize runs, ``helm version --short`` and ``helm template NAME CHART
--namespace NS -f VALUES…``, answered by Helm 4's own renderer through helm-python-sdk (no helm binary
can be installed here). Anything else (``pull``: the chart must already be in chartHome) fails loudly,
so a test never passes on a command this shim does not really carry out."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path


def template(argv: list[str]) -> str:
    import helm_python
    import yaml

    name, chart, rest = argv[0], argv[1], argv[2:]
    namespace, values = "default", {}
    i = 0
    while i < len(rest):
        flag = rest[i]
        if flag == "--namespace":
            namespace, i = rest[i + 1], i + 2
        elif flag in ("-f", "--values"):
            values = _merge(values, yaml.safe_load(Path(rest[i + 1]).read_text()) or {})
            i += 2
        else:
            raise SystemExit(f"helm_shim: template: {flag} is not supported")
    with helm_python.Chart.load(chart) as c:
        rendered = c.render(values, name=name, namespace=namespace, is_install=True)
    return "".join(f"---\n# Source: {path}\n{text.strip()}\n" for path, text in sorted(rendered.items())
                   if path.endswith((".yaml", ".yml")) and text.strip())


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main(argv: list[str]) -> int:
    log = os.environ.get("HELM_SHIM_LOG")
    if log:
        with open(log, "a") as f:
            f.write(" ".join(argv) + "\n")
    if argv[:1] == ["version"]:
        print("v4.1.0+helm-python-sdk")
        return 0
    if argv[:1] == ["template"]:
        sys.stdout.write(template(argv[1:]))
        return 0
    print(f"helm_shim: {' '.join(argv)}: not supported (only version and template)", file=sys.stderr)
    return 1


def install(directory: Path) -> Path:
    """An executable ``helm`` in ``directory`` that runs this module under the project's Python."""
    path = Path(directory) / "helm"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
