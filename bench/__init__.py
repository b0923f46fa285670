"""Benchmarks, capture and evaluation scripts. Run each as a module from the repository root, e.g.
``.venv/bin/python -m bench.evaluate --help``; they import ``tuner`` and ``tests.support`` normally."""
