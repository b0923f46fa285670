"""The engine client: everything the tuner says to an engine goes through one ``EngineClient``.

It carries what every request needs — the bearer token (vLLM ``--api-key`` guards ``/v1/*``), TLS
settings, connect/read timeouts — and bounds every call by an overall deadline (``transport.deadline``),
so an engine that trickles bytes cannot hold a cycle or a rollout. No other module opens an HTTP
connection to an engine (nor to dcgm-exporter): scraping, ``/v1/models`` and ``/version``, health,
the in-flight count, warm-up requests, sleep and wake all live here.

The two engine kinds differ only in their routes and metric names:

============  =================================  ===================================
what          vLLM                               SGLang
============  =================================  ===================================
health        ``GET /health`` + ``/v1/models``   ``GET /health`` + ``/get_model_info``
info          ``/v1/models``, ``/version``,      ``/get_model_info``,
              ``/load`` (sleep mode only)        ``/get_server_info``
in flight     running + waiting from ``/metrics`` through the dialect table (``model.dialects``)
warm-up       ``POST /v1/completions``           ``POST /generate``
sleep, wake   ``POST /sleep``, ``/wake_up``,     (none)
              ``GET /is_sleeping`` (dev mode)
============  =================================  ===================================

Reading methods never raise: a failure is an invalid snapshot, an ``EngineInfo.error``, ``False`` or
``None``, each with its reason where there is room for one. Acting methods (warm, sleep, wake) return
None on success, else why not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from tuner.errors import SourceError
from tuner.launcher import untrusted
from tuner.model import dialects, live, snapshots
from tuner.model.engines import EngineInfo
from tuner.signals import engine as engine_signals
from tuner.sources import live_knobs, scraping
from tuner.sources.transport import DeadlineTransport, deadline

_JSON_LIMIT = 1024 * 1024
_MAX_SEQS = 1 << 20  # no engine schedules a million sequences at once


class EngineClient:
    """One httpx client for every engine of a tuner (thread-safe: collectors share it)."""

    def __init__(
        self,
        settings: scraping.HttpSettings | None = None,
        *,
        deadline_seconds: float = 10.0,
        warm_timeout_seconds: float = 30.0,
        sleep_timeout_seconds: float = 300.0,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or scraping.HttpSettings()
        self.deadline_seconds = deadline_seconds
        self.warm_timeout_seconds = warm_timeout_seconds
        self.sleep_timeout_seconds = sleep_timeout_seconds
        self._clock = clock
        if transport is None:
            transport = DeadlineTransport(verify=self.settings.verify, cert=self.settings.client_cert)
        self._client = scraping.make_client(self.settings, transport=transport)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading -----------------------------------------------------------------------------------

    def scrape(self, url: str, *, keep_prefixes: tuple[str, ...] | None = None) -> snapshots.Snapshot:
        """One Prometheus scrape (an engine's or dcgm-exporter's ``/metrics``); never raises."""
        with deadline(self.deadline_seconds):
            return scraping.scrape(self._client, url, max_body_bytes=self.settings.max_body_bytes,
                                   keep_prefixes=keep_prefixes, clock=self._clock)

    def metrics(self, base_url: str, kind: str) -> snapshots.Snapshot:
        """The engine's own ``/metrics``, parsed for what its dialect reads."""
        return self.scrape(base_url + "/metrics", keep_prefixes=dialects.DIALECTS[kind].parse_prefixes())

    def info(self, base_url: str, kind: str, *, server_load: bool = False) -> EngineInfo:
        """Model, served max_model_len, version (and vLLM's ``GET /load`` with ``server_load``); never
        raises: what could not be read is None and ``error`` says why."""
        with deadline(self.deadline_seconds):
            return self._info(base_url, kind, server_load=server_load)

    def _info(self, base: str, kind: str, *, server_load: bool) -> EngineInfo:
        errors: list[str] = []
        model = version = None
        max_model_len = load_value = None
        if kind == "vllm":
            try:
                listed = untrusted.listing(self._get_json(f"{base}/v1/models").get("data") or [{}], what="data")
                first = untrusted.mapping(listed[0] if listed else {}, what="data[0]")
                model = untrusted.text(first["id"], what="data[0].id") if first.get("id") is not None else None
                mml = first.get("max_model_len")
                max_model_len = untrusted.integer(mml, what="max_model_len", lo=1) if mml is not None else None
            except (SourceError, ValueError) as exc:
                errors.append(f"/v1/models: {exc}")
            try:
                version = str(self._get_json(f"{base}/version").get("version"))
            except (SourceError, AttributeError) as exc:
                errors.append(f"/version: {exc}")
            if server_load:  # counted even while the engine sleeps and its own gauges stand still
                try:
                    load = self._get_json(f"{base}/load").get("server_load")
                    load_value = untrusted.integer(load, what="server_load") if load is not None else None
                except (SourceError, AttributeError, TypeError, ValueError) as exc:
                    errors.append(f"/load: {exc}")
        else:
            try:
                path = self._get_json(f"{base}/get_model_info").get("model_path")
                model = untrusted.text(path, what="model_path") if path is not None else None
            except (SourceError, ValueError) as exc:
                errors.append(f"/get_model_info: {exc}")
            try:
                data = self._get_json(f"{base}/get_server_info")
                ctx = data.get("context_length")
                max_model_len = untrusted.integer(ctx, what="context_length", lo=1) if ctx is not None else None
                raw_version = data.get("version")
                version = untrusted.text(raw_version, what="version") if raw_version is not None else None
            except (SourceError, AttributeError, TypeError, ValueError) as exc:
                errors.append(f"/get_server_info: {exc}")
        return EngineInfo(model=model, max_model_len=max_model_len, version=version, server_load=load_value,
                          error="; ".join(errors) or None)

    def is_healthy(self, base_url: str, kind: str) -> bool:
        """``/health`` answers 200 and the engine names its model (for vLLM through the guarded
        ``/v1/models``, so a wrong or missing token shows here, not at the first real request)."""
        with deadline(self.deadline_seconds):
            try:
                if self._client.get(base_url + "/health").status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
            return self._model(base_url, kind) is not None

    def load(self, base_url: str, kind: str, *, server_load: bool = False) -> int | None:
        """Requests in flight: running + waiting (the dialect's gauges); None if unreadable.

        The engine core's gauges do not see a request the HTTP server still holds — one being parsed
        and tokenized, or one whose last chunks are still being streamed after the engine finished it —
        so "0 running, 0 waiting" is not proof that stopping the engine cuts no response. With
        ``server_load`` (vLLM started with ``--enable-server-load-tracking``) the count is also at least
        vLLM's ``GET /load``, which counts a generation request from its handler's entry until its
        response, streamed or not, has been sent."""
        snap = self.metrics(base_url, kind)
        if not snap.ok:
            return None
        dialect = dialects.DIALECTS[kind]
        running = engine_signals.gauge(snap, dialect, "running")
        waiting = engine_signals.gauge(snap, dialect, "waiting")
        if running is None and waiting is None:
            return None
        in_flight = int((running or 0.0) + (waiting or 0.0))
        if server_load and kind == "vllm":
            held = self.info(base_url, kind, server_load=True).server_load
            if held is None:
                return None  # unreadable: not idle as far as we know
            in_flight = max(in_flight, held)
        return in_flight

    def served_max_model_len(self, base_url: str, kind: str) -> tuple[int | None, str | None]:
        """The max_model_len the engine serves, or (None, why it is unknown)."""
        info = self.info(base_url, kind)
        if info.max_model_len is None:
            return None, info.error or "the engine does not report it"
        return info.max_model_len, None

    # --- acting --------------------------------------------------------------------------------------

    def warm(self, base_url: str, kind: str, *, requests: int, max_tokens: int = 4,
             prompt: str = "Hello") -> str | None:
        """``requests`` small generations sent straight to the engine; None if all succeeded."""
        model = self._model(base_url, kind)
        if model is None:
            return "the engine names no model"
        for i in range(requests):
            if kind == "vllm":
                path, body = "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens}
            else:
                path, body = "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens}}
            with deadline(self.warm_timeout_seconds):
                try:
                    response = self._client.post(base_url + path, json=body, timeout=self.warm_timeout_seconds)
                except httpx.HTTPError as exc:
                    return f"warm-up request {i + 1}/{requests} failed: {type(exc).__name__}: {exc}"
            if response.status_code != 200:
                return f"warm-up request {i + 1}/{requests} answered HTTP {response.status_code}"
        return None

    def is_sleeping(self, base_url: str) -> bool | None:
        """vLLM ``GET /is_sleeping``; None when the route is missing (no dev mode) or unreadable."""
        try:
            value = self._get_json(base_url + "/is_sleeping").get("is_sleeping")
        except (SourceError, AttributeError):
            return None
        return value if isinstance(value, bool) else None

    def sleep(self, base_url: str, *, level: int = 1) -> str | None:
        """Put a vLLM engine to sleep; None when it sleeps afterwards, else why not. ``mode=keep``: a
        request that arrived between the idle decision and this call is paused and finished after the
        wake, never aborted (vLLM's default, ``abort``, would fail it)."""
        return self._sleep_call(base_url, "/sleep", {"level": str(level), "mode": "keep"}, want=True)

    def wake(self, base_url: str) -> str | None:
        """Wake a sleeping vLLM engine; None when it is awake afterwards, else why not."""
        return self._sleep_call(base_url, "/wake_up", {}, want=False)

    def _sleep_call(self, base: str, path: str, params: dict[str, str], *, want: bool) -> str | None:
        with deadline(self.sleep_timeout_seconds):
            try:
                response = self._client.post(base + path, params=params, timeout=self.sleep_timeout_seconds)
            except httpx.HTTPError as exc:
                return f"POST {path} failed: {type(exc).__name__}: {exc}"
        if response.status_code == 404:
            return (f"POST {path} answered 404: the engine needs --enable-sleep-mode and "
                    "VLLM_SERVER_DEV_MODE=1 for sleep mode")
        if response.status_code != 200:
            return f"POST {path} answered HTTP {response.status_code}"
        with deadline(self.deadline_seconds):
            state = self.is_sleeping(base)
        if state is None:
            return f"POST {path} answered 200 but /is_sleeping cannot be read"
        if state is not want:
            return f"POST {path} answered 200 but the engine is {'sleeping' if state else 'awake'}"
        return None

    # --- live knobs ----------------------------------------------------------------------------------

    def runtime_config(self, base_url: str) -> dict[str, Any] | None:
        """vLLM's ``GET /v1/runtime_config`` (pull request 54816: a live scheduler cap behind dev mode), when
        the engine has it and it carries the cap (``max_num_running_seqs``); None otherwise."""
        with deadline(self.deadline_seconds):
            try:
                data = self._get_json(base_url + "/v1/runtime_config")
            except SourceError:
                return None
        try:  # the caps are positive integers no engine could exceed; anything else is not believed
            untrusted.integer(data.get("max_num_running_seqs"), what="max_num_running_seqs", lo=1, hi=_MAX_SEQS)
            if data.get("max_num_seqs") is not None:
                untrusted.integer(data["max_num_seqs"], what="max_num_seqs", lo=1, hi=_MAX_SEQS)
        except untrusted.Untrusted:
            return None
        return data

    def live_state(self, base_url: str, plugin: live_knobs.Channel | None) -> live.LiveState:
        """What the engine can change live and runs now: vLLM's own endpoint where it exists (preferred),
        else the engine-side plugin's acknowledgements, through ``plugin`` (``sources.live_knobs``)."""
        upstream = self.runtime_config(base_url)
        if upstream is not None:
            envelope = {"max_num_seqs": int(upstream.get("max_num_seqs") or upstream["max_num_running_seqs"])}
            return live.LiveState(available=True, envelope=envelope,
                                  values={"max_num_seqs": int(upstream["max_num_running_seqs"])},
                                  not_live={"max_num_batched_tokens": "not in vLLM's runtime_config"},
                                  via="runtime_config")
        if plugin is None:
            return live.NONE
        return plugin.read()

    def set_live(self, base_url: str, plugin: live_knobs.Channel | None, *, seq: int, values: Mapping[str, int | None],
                 via: str = "plugin") -> str | None:
        """Ask for these live values (tuner knob → value, None: the startup value). None when the request
        was handed over (the acknowledgement tells whether it took effect), else why not."""
        if via == "runtime_config":
            cap = values.get("max_num_seqs")
            if cap is None:
                upstream = self.runtime_config(base_url)
                cap = int(upstream["max_num_seqs"]) if upstream and upstream.get("max_num_seqs") else None
            body = {"max_num_running_seqs": cap}
            with deadline(self.deadline_seconds):
                try:
                    response = self._client.patch(base_url + "/v1/runtime_config", json=body)
                except httpx.HTTPError as exc:
                    return f"PATCH /v1/runtime_config failed: {type(exc).__name__}"
            return None if response.status_code == 200 else f"PATCH /v1/runtime_config answered HTTP {response.status_code}"
        if plugin is None:
            return "no control directory for this engine (live.control_dir)"
        return plugin.request(seq, values)

    # --- helpers -------------------------------------------------------------------------------------

    def _model(self, base: str, kind: str) -> str | None:
        try:
            if kind == "vllm":
                data = self._get_json(base + "/v1/models").get("data") or []
                return str(data[0]["id"]) if data else None
            path = self._get_json(base + "/get_model_info").get("model_path")
            return str(path) if path else None
        except (SourceError, AttributeError, KeyError, IndexError, TypeError):
            return None

    def _get_json(self, url: str) -> dict[str, Any]:
        """A JSON object from the engine, read by ``untrusted`` (size, depth, finite numbers); anything
        else is a ``SourceError`` that describes the body, never quotes it."""
        text = scraping.fetch_text(self._client, url, max_body_bytes=_JSON_LIMIT)
        try:
            return untrusted.mapping(untrusted.loads(text, what="the body", max_bytes=_JSON_LIMIT), what="the body")
        except untrusted.Untrusted as exc:
            raise SourceError(url, f"{exc.reason} (the body is not copied here)") from None
