"""vllm-tuner: a self-tuning sidecar for LLM inference engines.

Layers, outermost first (held by import-linter, see pyproject.toml and docs/architecture.md):
``cli → daemon → actuators | sources → planning → rules → signals → model``.
Only ``sources`` and ``actuators`` (and the daemon that wires them) perform I/O.
"""

__version__ = "0.4.0"
