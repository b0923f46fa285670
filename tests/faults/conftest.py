"""The fault-injection tier. Which of its files are ``slow`` (real processes for tens of seconds) and which
run in ``make check`` (in-process property tests): ``FAST_FAULTS`` in tests/conftest.py."""
