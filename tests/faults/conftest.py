"""The fault-injection tier: every test here runs real processes for tens of seconds (marked ``slow``)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/faults/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.slow)
