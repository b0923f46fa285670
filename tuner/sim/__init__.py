"""SIMULATED engines for demos and tests — not real inference engines.

``tuner.sim.engine`` is a simulated vLLM 0.32 replica: it speaks vLLM's HTTP surface (``/metrics`` with
vLLM's names, types, labels and buckets; ``/health``, ``/v1/models``, ``/version``, completions) and
accepts vLLM's tuning flags, but behind them runs a small queueing model of a GPU-bound engine, not a
model. Everything it serves says so: the model id starts with ``SIMULATED-``, every response carries
``X-Simulated-Engine``, ``/version`` has a ``simulated`` key and the log's first line says it.

It imports nothing from the tuner: the tuner reads it exactly as it reads a real vLLM.
"""
