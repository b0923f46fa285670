"""Import the engine-side plugin (``plugin/src/vllm_tuner_plugin``, stdlib only) into the tests.

The plugin is its own distribution that runs in vLLM's environment; the tuner never imports it. The tests
put its source directory on ``sys.path`` so that the fast tier can drive it against fake schedulers and
the contract test can run it against the tuner's side of the file protocol.
"""

from __future__ import annotations

import sys
from pathlib import Path

PLUGIN_SRC = Path(__file__).resolve().parents[2] / "plugin" / "src"
if str(PLUGIN_SRC) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SRC))

import vllm_tuner_plugin  # noqa: E402
from vllm_tuner_plugin import engines, live, protocol  # noqa: E402

__all__ = ["PLUGIN_SRC", "engines", "live", "protocol", "vllm_tuner_plugin"]
