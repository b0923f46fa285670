"""The bounds every number of the configuration keeps, whichever model holds it.

A duration accepted by ``check-config`` must be one ``run`` can schedule and wait for: APScheduler's
interval trigger builds a ``timedelta`` (it overflows near 8.6e13 s), ``threading`` waits refuse more
than ``threading.TIMEOUT_MAX`` (about 9.2e9 s on Linux), and ``time.monotonic() + d`` must still move.
So every field named ``*_seconds`` in every settings model (``Settings``, the base of the config's,
the guards', the planner's and the actuators' models) is at most ``MAX_DURATION_SECONDS`` — ten years,
the rule files' bound too — and no number anywhere is ``.inf`` or ``.nan``.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

MAX_DURATION_SECONDS = 10 * 365 * 86400.0
"""Ten years: longer is a typo, and far below what a timedelta or a thread's wait can hold."""


def check_duration(seconds: float, *, name: str = "a duration") -> float:
    if not (math.isfinite(seconds) and abs(seconds) <= MAX_DURATION_SECONDS):
        raise ValueError(f"{name} must be at most {MAX_DURATION_SECONDS:.0f} s (ten years); got {seconds:g} s")
    return seconds


class Settings(BaseModel):
    """A settings model: frozen, strict about keys, finite numbers, bounded durations."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_duration(cls, value: Any, info: ValidationInfo) -> Any:
        if (info.field_name or "").endswith("_seconds") and isinstance(value, int | float) \
                and not isinstance(value, bool):
            check_duration(float(value), name=info.field_name or "a duration")
        return value
