"""Start one engine with its own live-knob control directory, for engines the tuner launches itself.

The tuner's ``process`` actuator gives every replica the same environment, but each replica needs its own
``VLLM_TUNER_CONTROL_DIR`` (the plugin names its acknowledgement by data-parallel rank, 0 in each
replica). This wrapper is the actuator's ``command``::

    command: [PYTHON, bench/evaluation/launch.py, --control-root, ROOT, --]

It reads ``--port P`` from the engine arguments, sets ``VLLM_TUNER_CONTROL_DIR=ROOT/P`` (created 0700)
and replaces itself (``execv``, same pid) with ``PYTHON -m vllm.entrypoints.openai.api_server ARGS``.
Standard library only; no shell.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--control-root" or "--" not in argv:
        print("usage: launch.py --control-root DIR -- ENGINE-ARGS...", file=sys.stderr)
        return 2
    root = Path(argv[1])
    engine_args = argv[argv.index("--") + 1:]
    if "--port" not in engine_args[:-1]:
        print("launch.py: the engine arguments carry no --port", file=sys.stderr)
        return 2
    port = engine_args[engine_args.index("--port") + 1]
    control = root / port
    control.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["VLLM_TUNER_CONTROL_DIR"] = str(control)
    os.execv(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
