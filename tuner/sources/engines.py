"""Engine static info over HTTP: vLLM ``/v1/models`` + ``/version``, SGLang ``/get_model_info``."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tuner.errors import SourceError
from tuner.model.engines import EngineInfo
from tuner.sources import scraping


def _get_json(client: httpx.Client, url: str) -> Any:
    text = scraping.fetch_text(client, url, max_body_bytes=1024 * 1024)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SourceError(url, f"not JSON: {text[:80]!r}") from exc


def engine_info(client: httpx.Client, base: str, kind: str, *, server_load: bool = False) -> EngineInfo:
    """Never raises; what could not be read is None and ``error`` says why. ``server_load``: also read
    vLLM's ``GET /load`` (only sleep mode needs it)."""
    errors: list[str] = []
    model = version = None
    max_model_len = None
    load_value = None
    if kind == "vllm":
        try:
            data = _get_json(client, f"{base}/v1/models")
            first = (data.get("data") or [{}])[0]
            model = first.get("id")
            mml = first.get("max_model_len")
            max_model_len = int(mml) if mml is not None else None
        except (SourceError, AttributeError, TypeError, ValueError) as exc:
            errors.append(f"/v1/models: {exc}")
        try:
            version = str(_get_json(client, f"{base}/version").get("version"))
        except (SourceError, AttributeError) as exc:
            errors.append(f"/version: {exc}")
        if server_load:  # counted even while the engine sleeps, when its own gauges stand still (H200, vLLM 0.26)
            try:
                load = _get_json(client, f"{base}/load").get("server_load")
                load_value = int(load) if load is not None else None
            except (SourceError, AttributeError, TypeError, ValueError) as exc:
                errors.append(f"/load: {exc}")
    else:
        try:
            data = _get_json(client, f"{base}/get_model_info")
            model = data.get("model_path")
        except (SourceError, AttributeError) as exc:
            errors.append(f"/get_model_info: {exc}")
        try:
            data = _get_json(client, f"{base}/get_server_info")
            ctx = data.get("context_length")
            max_model_len = int(ctx) if ctx is not None else None
            version = data.get("version")
        except (SourceError, AttributeError, TypeError, ValueError) as exc:
            errors.append(f"/get_server_info: {exc}")
    return EngineInfo(model=model, max_model_len=max_model_len, version=version, server_load=load_value,
                      error="; ".join(errors) or None)
