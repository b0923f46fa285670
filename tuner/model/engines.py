"""Static facts about an engine that /metrics does not carry (from /v1/models and /version)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str | None = None
    max_model_len: int | None = None
    version: str | None = None
    error: str | None = None  # why some of the above is unknown
