"""The one poll-until-true of the test harness: every wait has a deadline and says what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, *, poll: float = 1.0,
             detail: Callable[[], str] | None = None, error: type[Exception] = TimeoutError) -> Any:
    """Poll ``predicate`` until truthy and return its value; at the deadline raise ``error`` naming ``what``
    (and ``detail()``, e.g. a log tail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise error(f"waited {timeout:g}s for {what}{extra}")
        time.sleep(poll)
