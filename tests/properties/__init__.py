"""The fault catalogue's in-process property tests (docs/reliability.md): no process, no clock, so they run in
``make check``; the fault tests that run real processes are in ``tests/faults/``, which is slow."""
