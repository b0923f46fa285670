"""Collecting one target's inputs for a cycle: engine snapshot, engine info, GPU readings."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tuner import config
from tuner.model import dcgm, dialects, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuReading
from tuner.sources import engines, scraping


@dataclass(frozen=True)
class GpuInputs:
    readings: tuple[GpuReading, ...] = ()
    unavailable: str | None = None  # why there are no readings


def http_settings(scrape: config.ScrapeSettings, *, config_dir: Path | None = None) -> scraping.HttpSettings:
    token = None
    if scrape.bearer_token_file:
        path = Path(scrape.bearer_token_file)
        if config_dir is not None and not path.is_absolute():
            path = config_dir / path
        token = path.read_text(encoding="utf-8").strip()
    verify: bool | str = scrape.tls.ca_file or scrape.tls.verify
    return scraping.HttpSettings(
        connect_timeout_seconds=scrape.connect_timeout_seconds,
        read_timeout_seconds=scrape.read_timeout_seconds,
        max_body_bytes=scrape.max_body_bytes,
        bearer_token=token,
        verify=verify,
        client_cert=scrape.tls.client_cert_file,
    )


class Collector:
    """Reads every source of one target. Owns no state across cycles except the NVML handle."""

    def __init__(self, target: config.Target, *, client: httpx.Client, max_body_bytes: int,
                 clock: Callable[[], float] = time.time, server_load: bool = False) -> None:
        self.target = target
        self.server_load = server_load  # read GET /load too (sleep mode's wake signal)
        self.client = client
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self.dialect = dialects.DIALECTS[target.kind]
        self.base_url = target.base_url or scraping.base_url(target.metrics_url)
        self._nvml: object | None = None

    def scrape_engine(self) -> snapshots.Snapshot:
        return scraping.scrape(self.client, self.target.metrics_url, max_body_bytes=self.max_body_bytes,
                               keep_prefixes=self.dialect.parse_prefixes(), clock=self.clock)

    def engine_info(self) -> EngineInfo:
        return engines.engine_info(self.client, self.base_url, self.target.kind, server_load=self.server_load)

    def read_gpus(self) -> GpuInputs:
        source = self.target.gpu
        if isinstance(source, config.DcgmSource):
            snap = scraping.scrape(self.client, source.url, max_body_bytes=self.max_body_bytes,
                                   keep_prefixes=dcgm.dcgm_keep_prefixes(), clock=self.clock)
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
                self._nvml = nvml.NvmlSource(source.devices, clock=self.clock)
            src = self._nvml
            assert isinstance(src, nvml.NvmlSource)
            readings = src.read()
            return GpuInputs(tuple(readings), None if readings else
                             f"NVML unavailable: {src.unavailable_reason or 'no devices'}")
        return GpuInputs(unavailable="no GPU source configured for this target")
