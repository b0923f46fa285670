"""Rolling restarts: the pure state machine (``machine``) and its append-only journal (``journal``).

The code that executes a rollout against real engines lives in ``tuner.runtime.driving``: this package
decides, it never acts, so it sits beside ``planning`` in the layers.
"""
