"""The fault-injection tier: real processes under generated faults, every test ``slow`` (tests/conftest.py).
The in-process property tests of the same catalogue are in ``tests/properties/``."""
