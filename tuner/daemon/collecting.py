"""Collecting one target's inputs for a cycle: engine snapshot, engine info, GPU readings — all through
the one engine client (``sources.engines.EngineClient``), NVML excepted."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from tuner import config
from tuner.errors import ConfigError
from tuner.model import dcgm, dialects, live, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.sources import engines, scraping


def http_settings(scrape: config.ScrapeSettings, *, config_dir: Path | None = None) -> scraping.HttpSettings:
    """The engine client's settings from ``scrape:``; an unreadable bearer-token file is a ConfigError."""
    token = None
    if scrape.bearer_token_file:
        path = Path(scrape.bearer_token_file)
        if config_dir is not None and not path.is_absolute():
            path = config_dir / path
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(str(path), [("scrape.bearer_token_file", (
                f"cannot read the token: {getattr(exc, 'strerror', None) or exc}; expected a readable file holding "
                "the engines' token (vLLM --api-key), e.g. /etc/vllm-tuner/engine-token"))]) from exc
        if not token:
            raise ConfigError(str(path), [("scrape.bearer_token_file", "the token file is empty; expected the engines' "
                                                                      "token (vLLM --api-key) on one line")])
    verify: bool | str = scrape.tls.ca_file or scrape.tls.verify
    return scraping.HttpSettings(
        connect_timeout_seconds=scrape.connect_timeout_seconds,
        read_timeout_seconds=scrape.read_timeout_seconds,
        max_body_bytes=scrape.max_body_bytes,
        bearer_token=token,
        verify=verify,
        client_cert=scrape.tls.client_cert_file,
    )


def base_url(target: config.Target) -> str:
    """Where ``/health``, ``/v1/models`` and ``/version`` live."""
    return target.base_url or scraping.base_url(target.metrics_url)


class Collector:
    """Reads every source of one target. Owns no state across cycles except the NVML handle."""

    def __init__(self, target: config.Target, *, client: engines.EngineClient, server_load: bool = False,
                 live_dir: str | None = None, live_knobs: bool | None = None) -> None:
        self.target = target
        self.server_load = server_load  # read GET /load too (sleep mode's wake signal)
        self.client = client
        self.base_url = base_url(target)
        self.live_dir = live_dir  # live knobs on: the engine's control directory
        # read the live knobs (default: where a control directory is given; without one, only vLLM's
        # runtime_config can answer — on Kubernetes the leader has no access to a pod's files)
        self.live_knobs = live_dir is not None if live_knobs is None else live_knobs
        self._nvml: object | None = None

    def read_live(self) -> live.LiveState:
        if not self.live_knobs:
            return live.NONE
        return self.client.live_state(self.base_url, self.live_dir)

    def scrape_engine(self) -> snapshots.Snapshot:
        return self.client.scrape(self.target.metrics_url,
                                  keep_prefixes=dialects.DIALECTS[self.target.kind].parse_prefixes())

    def engine_info(self) -> EngineInfo:
        return self.client.info(self.base_url, self.target.kind, server_load=self.server_load)

    def read_gpus(self) -> GpuInputs:
        source = self.target.gpu
        if isinstance(source, config.DcgmSource):
            snap = self.client.scrape(source.url, keep_prefixes=dcgm.dcgm_keep_prefixes())
            if not snap.ok:
                return GpuInputs(unavailable=f"dcgm-exporter: {snap.error}")
            readings = dcgm.readings_from_snapshot(
                snap, slowdown_temp_c=source.slowdown_temp_c, gpus=source.gpus, hostname=source.hostname)
            if source.sm_clock_max_mhz:
                readings = [dataclasses.replace(r, sm_clock_max_mhz=source.sm_clock_max_mhz) for r in readings]
            return GpuInputs(tuple(readings), None if readings else "dcgm-exporter reported no matching GPU")
        if isinstance(source, config.NvmlSource):
            from tuner.sources import nvml

            if self._nvml is None:
                self._nvml = nvml.NvmlSource(source.devices)
            src = self._nvml
            assert isinstance(src, nvml.NvmlSource)
            readings = src.read()
            return GpuInputs(tuple(readings), None if readings else
                             f"NVML unavailable: {src.unavailable_reason or 'no devices'}")
        return GpuInputs(unavailable="no GPU source configured for this target")


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One target's inputs for one cycle."""

    snapshot: snapshots.Snapshot
    info: EngineInfo
    gpus: GpuInputs
    live: live.LiveState = live.NONE


class Collecting(Protocol):
    """What the cycle needs from a collector (``Collector``; a fake in tests)."""

    @property
    def target(self) -> config.Target: ...

    def scrape_engine(self) -> snapshots.Snapshot: ...

    def engine_info(self) -> EngineInfo: ...

    def read_gpus(self) -> GpuInputs: ...

    def read_live(self) -> live.LiveState: ...


def collect_one(c: Collecting, *, clock: Callable[[], float] = time.time) -> Inputs:
    """Every source of one target; a failing one is reported in the inputs, never raised."""
    try:
        snap = c.scrape_engine()
    except Exception as exc:  # noqa: BLE001 - the client never raises; a fake or a future source might
        snap = snapshots.Snapshot.failed(clock(), f"{type(exc).__name__}: {exc}")
    if snap.ok:
        try:
            info = c.engine_info()
        except Exception as exc:  # noqa: BLE001 - one target's failure is reported, not raised
            info = EngineInfo(error=f"{type(exc).__name__}: {exc}")
    else:
        info = EngineInfo(error="not read: the /metrics scrape failed")
    try:
        gpus = c.read_gpus()
    except Exception as exc:  # noqa: BLE001 - one target's failure is reported, not raised
        gpus = GpuInputs(unavailable=f"{type(exc).__name__}: {exc}")
    try:
        state = c.read_live() if snap.ok else live.LiveState(why_not="not read: the /metrics scrape failed")
    except Exception as exc:  # noqa: BLE001 - one target's failure is reported, not raised
        state = live.LiveState(why_not=f"{type(exc).__name__}: {exc}")
    return Inputs(snap, info, gpus, state)


class Gatherer:
    """Collects every target in parallel, bounded by a deadline for the whole gathering.

    The engine client bounds each call already (``transport.deadline``); this is the backstop for a
    collector that still does not return (an NVML call that hangs in the driver, a future source): at
    the deadline its target counts as failed for this cycle, and while its call is still running the
    target is not collected again (no pile-up of stuck threads), the cycle says so instead.
    """

    def __init__(self, *, max_workers: int = 8, clock: Callable[[], float] = time.time) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                           thread_name_prefix="tuner-collect")
        self._stuck: dict[str, concurrent.futures.Future[Inputs]] = {}
        self._clock = clock

    def gather(self, collectors: Sequence[Collecting], *, deadline_seconds: float) -> list[Inputs]:
        futures: dict[str, concurrent.futures.Future[Inputs]] = {}
        out: dict[str, Inputs] = {}
        for c in collectors:
            name = c.target.name
            stuck = self._stuck.get(name)
            if stuck is not None and not stuck.done():
                out[name] = _failed(self._clock(), "the previous cycle's read of this target has not returned yet")
                continue
            self._stuck.pop(name, None)
            futures[name] = self._pool.submit(collect_one, c, clock=self._clock)
        concurrent.futures.wait(futures.values(), timeout=deadline_seconds)
        for name, future in futures.items():
            if future.done():
                out[name] = future.result()
            else:
                self._stuck[name] = future
                out[name] = _failed(self._clock(), f"reading this target took longer than {deadline_seconds:g}s")
        return [out[c.target.name] for c in collectors]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _failed(at: float, why: str) -> Inputs:
    return Inputs(snapshots.Snapshot.failed(at, why), EngineInfo(error=f"not read: {why}"), GpuInputs(unavailable=why))
