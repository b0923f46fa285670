"""Real components a test needs (systemd, nginx, a vLLM interpreter): skip with how to enable it when
missing — unless ``VLLM_TUNER_REQUIRE_E2E=1`` (set by ``make test`` and CI), where a real-component test
that cannot run is a failure, never a skip.

pytest is imported when a test calls ``need``, not at import: bench/evaluate.py uses the support modules
that import this one on machines that have vLLM's packages but no pytest."""

from __future__ import annotations

import os


def is_required() -> bool:
    return os.environ.get("VLLM_TUNER_REQUIRE_E2E") == "1"


def need(reason: str | None, what: str) -> None:
    """``reason``: why ``what`` cannot run here (None: it can)."""
    if reason is None:
        return
    import pytest

    if is_required():
        pytest.fail(f"{what} is required here (VLLM_TUNER_REQUIRE_E2E=1), but: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")
