"""Static facts about an engine that /metrics does not carry (from /v1/models and /version)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str | None = None
    max_model_len: int | None = None
    version: str | None = None
    server_load: int | None = None  # vLLM GET /load: in-flight generation requests (--enable-server-load-tracking)
    error: str | None = None  # why some of the above is unknown
