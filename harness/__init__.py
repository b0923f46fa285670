"""The harness the tests and the benchmarks share: real engines, nginx, load, pools, ports.

``tests/`` and ``bench/`` both import it; it imports neither (tests/unit/test_architecture.py holds
that), so a benchmark change cannot break a test by accident, nor a test helper a benchmark.
It is not part of the installed package.
"""
