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
live knobs    ``/trimtab/knobs`` (PR 55018),     ``/set_internal_state`` +
              ``/v1/runtime_config`` (PR 54816)  ``/get_server_info`` (PR 37661's keys)
              (dev mode), else the plugin
============  =================================  ===================================

Live knobs go through one interface whatever the path (``live_state``, ``set_live``): the client probes which
path an engine offers (``live_path``, in ``live_paths.ORDER``), keeps it per engine and probes again after a
restart; ``sources.live_paths`` holds each API's requests and readings.

Reading methods never raise: a failure is an invalid snapshot, an ``EngineInfo.error``, ``False`` or
``None``, each with its reason where there is room for one. Acting methods (warm, sleep, wake) return
None on success, else why not.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from tuner.errors import SourceError
from tuner.model import dialects, live, snapshots
from tuner.model.engines import EngineInfo
from tuner.portable import untrusted
from tuner.signals import engine as engine_signals
from tuner.sources import live_knobs, live_paths, scraping
from tuner.sources.transport import DeadlineTransport, deadline

_JSON_LIMIT = 1024 * 1024
_GONE = (403, 404, 405)  # a route that is not there (dev mode off, no such pull request) or a proxy that hides it


@dataclass
class _LiveRecord:
    """What the client keeps of one engine's live path (``EngineClient.live_path``)."""

    kind: str
    via: str | None  # ``live_paths`` path, None: none found
    probed_at: float
    why_not: str | None = None
    seq: int | None = None  # the last request handed to the engine's API
    refused: str | None = None  # why the engine refused it, or reported other values after it


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
        live_reprobe_seconds: float = 60.0,
    ) -> None:
        self.settings = settings or scraping.HttpSettings()
        self.live_reprobe_seconds = live_reprobe_seconds
        self.deadline_seconds = deadline_seconds
        self.warm_timeout_seconds = warm_timeout_seconds
        self.sleep_timeout_seconds = sleep_timeout_seconds
        self._clock = clock
        if transport is None:
            transport = DeadlineTransport(verify=self.settings.verify, cert=self.settings.client_cert)
        self._client = scraping.make_client(self.settings, transport=transport)
        self._live_lock = threading.Lock()
        self._live: dict[str, _LiveRecord] = {}  # base URL → its live path (``live_path``)
        self._live_startup: dict[str, dict[str, int]] = {}  # base URL → startup values its API reported

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
                healthy = self._client.get(base_url + "/health").status_code == 200
            except httpx.HTTPError:
                healthy = False
            healthy = healthy and self._model(base_url, kind) is not None
        if not healthy:  # down or restarting: its live path is probed again when it is back
            self.forget_live_path(base_url)
        return healthy

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
    # One interface whatever the path: ``live_state`` reads, ``set_live`` asks, each through the path the engine
    # offers (``live_path``: probed once, kept per engine; ``sources.live_paths`` has the APIs and their order).

    def runtime_config(self, base_url: str) -> dict[str, Any] | None:
        """vLLM's ``GET /v1/runtime_config`` (pull request 54816: a live admission cap behind dev mode), when the
        engine has it and reports the cap and its capacity; None otherwise."""
        status, doc, _ = self._live_call("GET", base_url + live_paths.READ[live_paths.RUNTIME_CONFIG])
        return dict(doc) if status == 200 and live_paths.read_runtime_config(doc) is not None else None

    def live_path(self, base_url: str, kind: str = "vllm", plugin: live_knobs.Channel | None = None) -> str | None:
        """Which live path this engine offers (``live_paths.ORDER``: its own API first, the plugin last), None
        where it offers none (``live_state`` says why). Probed at the first call and kept for this engine until it
        stops answering on that path — a refused connection, a route that answers 404 where it answered before,
        an unhealthy engine (``is_healthy``): what a restart looks like — then probed again; a plugin or no path
        at all is probed again every ``live_reprobe_seconds`` too (an engine restarted with dev mode, say)."""
        return self._path(base_url, kind, plugin).via

    def forget_live_path(self, base_url: str) -> None:
        """Probe this engine's live path again at the next call (it restarted, or stopped answering)."""
        with self._live_lock:
            self._live.pop(base_url.rstrip("/"), None)

    def live_state(self, base_url: str, plugin: live_knobs.Channel | None, *, kind: str = "vllm") -> live.LiveState:
        """What the engine can change live and runs now, through its live path (``live_path``); ``plugin``: where
        its engine-side plugin is reached (``sources.live_knobs``), None: nowhere. Never raises."""
        for attempt in (0, 1):  # a path that vanished (a restart without it) is probed again at once
            record = self._path(base_url, kind, plugin)
            if record.via is None:
                return live.LiveState(why_not=record.why_not or "no live path on this engine")
            if record.via == live_paths.PLUGIN:
                return plugin.read() if plugin is not None else live.LiveState(why_not="no plugin channel")
            reading, why, gone = self._read_live(base_url, record)
            if reading is not None:
                with self._live_lock:  # the pair set_live wrote together, read together
                    seq, refused = record.seq, record.refused
                return dataclasses.replace(reading.state, seq=seq, refused=refused)
            if not gone or attempt:
                return live.LiveState(why_not=why, via=record.via)
        raise AssertionError("unreachable")

    def set_live(self, base_url: str, plugin: live_knobs.Channel | None, *, seq: int, values: Mapping[str, int | None],
                 kind: str = "vllm") -> str | None:
        """Ask for these live values (tuner knob → value, None: the engine's startup value) as request ``seq``.
        None when the request was handed over: the plugin acknowledges it later; an engine API answers at once,
        and what it refused, or what it reports instead after the set (read-back verification), is kept as
        ``live_state``'s ``refused`` for ``seq``. Else why it could not be handed over."""
        record = self._path(base_url, kind, plugin)
        if record.via is None:
            return record.why_not or "no live path on this engine"
        if record.via == live_paths.PLUGIN:
            return plugin.request(seq, values) if plugin is not None else "no control directory for this engine"
        reading, why, _ = self._read_live(base_url, record)  # fresh: a None is sent as the startup value it reports
        if reading is None:
            return why
        body = live_paths.REQUESTS[record.via](values, reading)
        if isinstance(body, str):
            return body
        method, route = live_paths.WRITE[record.via]
        status, doc, error = self._live_call(method, base_url + route, body=body)
        refused: str | None = None
        if error is not None or status in _GONE:
            self.forget_live_path(base_url)
            return f"{method} {route} failed: {error}" if error else f"{method} {route} {self._status_why(status, record.via)}"
        if record.via == live_paths.TRIMTAB and status == 400:
            refused = live_paths.trimtab_refusal(doc)
        elif record.via == live_paths.TRIMTAB and not (status == 200 and isinstance(doc, dict) and doc.get("ok") is True):
            return f"{method} {route} {self._status_why(status, record.via)}"
        elif status in (400, 422) and record.via != live_paths.TRIMTAB:
            refused = live_paths.detail(doc)
        elif status == 501:
            self.forget_live_path(base_url)
            return f"{method} {route} answered 501: the engine's scheduler has no live cap"
        elif status != 200:
            return f"{method} {route} {self._status_why(status, record.via)}"
        elif record.via == live_paths.SET_INTERNAL_STATE:
            refused = live_paths.sglang_refusal(doc)
        after = live_paths.read_runtime_config(doc) if record.via == live_paths.RUNTIME_CONFIG and refused is None \
            else None  # PATCH answers with the new config: that is the read-back
        if after is None:
            after, _, _ = self._read_live(base_url, record)
        if after is not None and refused is None:
            refused = live_paths.mismatch(values, after.state)
        elif after is not None and refused is not None:  # an API may apply the valid part of a refused request
            took = live_paths.taken(values, after.state)
            refused += f" (applied all the same: {took})" if took else ""
        with self._live_lock:
            record.seq, record.refused = seq, refused
        return None

    def _path(self, base_url: str, kind: str, plugin: live_knobs.Channel | None) -> _LiveRecord:
        key = base_url.rstrip("/")
        with self._live_lock:
            record = self._live.get(key)
        fresh = record is not None and (record.via not in (None, live_paths.PLUGIN)
                                        or self._clock() - record.probed_at < self.live_reprobe_seconds)
        if record is not None and record.kind == kind and fresh:
            return record
        record, keep = self._probe(key, kind, plugin)
        if keep:
            with self._live_lock:
                self._live[key] = record
        return record

    def _probe(self, base: str, kind: str, plugin: live_knobs.Channel | None) -> tuple[_LiveRecord, bool]:
        """(the first path in ``live_paths.ORDER`` the engine answers on, whether to keep it). An engine that
        cannot be reached says nothing of its API: its other routes are not tried (one deadline, not one per
        route), the plugin still answers through its files, and nothing is kept — the next call probes again."""
        tried: list[str] = []
        reached = True
        for via in live_paths.ORDER.get(kind, ()):
            if via == live_paths.PLUGIN:
                if plugin is not None:
                    return _LiveRecord(kind=kind, via=via, probed_at=self._clock()), reached
                tried.append("no plugin channel (live.control_dir)")
                continue
            if not reached:
                continue
            route = live_paths.READ[via]
            status, doc, error = self._live_call("GET", base + route)
            if error is not None:
                reached = False
                tried.append(f"the engine cannot be reached: GET {route} failed: {error}")
                continue
            reading = self._reader(via, base)(doc) if status == 200 else None
            if reading is not None and reading.state.available:
                self._remember(base, reading)
                return _LiveRecord(kind=kind, via=via, probed_at=self._clock()), True
            if reading is not None:
                tried.append(reading.state.why_not or f"GET {route}: nothing live")
            elif status == 200:
                tried.append(f"GET {route} answered 200 without the fields of {live_paths.WHERE[via]}")
            else:
                tried.append(f"GET {route} {self._status_why(status, via)}")
        return _LiveRecord(kind=kind, via=None, why_not="; ".join(tried) or f"no live path for {kind}",
                           probed_at=self._clock()), reached

    def _read_live(self, base_url: str, record: _LiveRecord) -> tuple[live_paths.Reading | None, str, bool]:
        """(what the engine's API reports, why not where nothing, whether the path is gone: forgotten)."""
        assert record.via is not None
        base = base_url.rstrip("/")
        route = live_paths.READ[record.via]
        status, doc, error = self._live_call("GET", base + route)
        if error is not None or status in _GONE or status == 501:
            self.forget_live_path(base)
            return None, f"GET {route} failed: {error}" if error else f"GET {route} {self._status_why(status, record.via)}", True
        reading = self._reader(record.via, base)(doc) if status == 200 else None
        if reading is None:
            return None, f"GET {route} answered HTTP {status}" + (" with a body it cannot read" if status == 200 else ""), False
        self._remember(base, reading)
        return reading, "", False

    def _reader(self, via: str, base: str) -> Callable[[Any], live_paths.Reading | None]:
        with self._live_lock:
            remembered = dict(self._live_startup.get(base, {}))
        return lambda doc: live_paths.READERS[via](doc, remembered)

    def _remember(self, base: str, reading: live_paths.Reading) -> None:
        with self._live_lock:  # kept across forgets: a restarted engine reports its own startup values again
            self._live_startup[base] = dict(reading.startup)

    @staticmethod
    def _status_why(status: int | None, via: str) -> str:
        if status == 401:  # SGLang's /set_internal_state wants its --admin-api-key where it has one
            return "answered 401: the engine wants another bearer token (scrape.bearer_token_file)"
        if status in _GONE:
            return f"answered {status}: needs {live_paths.WHERE[via]}"
        return f"answered HTTP {status}"

    def _live_call(self, method: str, url: str, *, body: Any = None) -> tuple[int | None, Any, str | None]:
        """(status, the JSON body read by ``untrusted`` — None where there is none or it does not read —, why
        the call failed: None when an answer came)."""
        with deadline(self.deadline_seconds):
            try:
                with self._client.stream(method, url, json=body) as response:
                    raw = bytearray()
                    for chunk in response.iter_bytes():
                        raw += chunk
                        if len(raw) > _JSON_LIMIT:
                            return response.status_code, None, None
                    status = response.status_code
            except httpx.HTTPError as exc:
                return None, None, f"{type(exc).__name__}" + (f": {exc}" if str(exc) else "")
        try:
            return status, untrusted.loads(bytes(raw), what="the body", max_bytes=_JSON_LIMIT) if raw.strip() else None, None
        except untrusted.Untrusted:
            return status, None, None

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
