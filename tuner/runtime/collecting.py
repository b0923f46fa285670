"""Collecting one target's inputs for a cycle: engine snapshot, engine info, GPU readings — all through
the one engine client (``sources.engines.EngineClient``), NVML excepted."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from tuner import config
from tuner.errors import ConfigError
from tuner.model import dcgm, dialects, live, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.portable import untrusted
from tuner.sources import engines, live_knobs, scraping


def http_settings(scrape: config.ScrapeSettings, *, config_dir: Path | None = None) -> scraping.HttpSettings:
    """The engine client's settings from ``scrape:``; an unreadable bearer-token file is a ConfigError."""
    token = None
    if scrape.bearer_token_file:
        path = Path(scrape.bearer_token_file)
        if config_dir is not None and not path.is_absolute():
            path = config_dir / path
        token = read_token(path)
    verify: bool | str = scrape.tls.ca_file or scrape.tls.verify
    return scraping.HttpSettings(
        connect_timeout_seconds=scrape.connect_timeout_seconds,
        read_timeout_seconds=scrape.read_timeout_seconds,
        max_body_bytes=scrape.max_body_bytes,
        bearer_token=token,
        verify=verify,
        client_cert=scrape.tls.client_cert_file,
    )


TOKEN_MAX_BYTES = 16 * 1024
_TOKEN = re.compile(r"[\x21-\x7e]+")  # one HTTP header value: printable ASCII, no spaces, no line breaks


def read_token(path: Path) -> str:
    """The bearer token in ``path``: one line of printable characters (blank space around it allowed). A
    file that is not that — two lines, a space, a control byte, a FIFO, too large — is a ConfigError that
    describes it and never shows a line of it (``check-config`` and ``run`` read it through here)."""
    where = "scrape.bearer_token_file"
    try:  # a Kubernetes Secret's files are symbolic links into ..data: followed, and still a regular file
        raw = untrusted.read_bytes(path, max_bytes=TOKEN_MAX_BYTES, follow_symlinks=True)
    except (OSError, untrusted.Untrusted) as exc:
        why = exc.reason if isinstance(exc, untrusted.Untrusted) else exc.strerror or type(exc).__name__
        raise ConfigError(str(path), [(where, (
            f"cannot read the token: {why}; expected a readable file holding the engines' token (vLLM "
            "--api-key), e.g. /etc/vllm-tuner/engine-token"))]) from None
    text = raw.decode("latin-1")
    token = text.strip(" \t\r\n")  # surrounding blank space is not part of it
    if not token:
        raise ConfigError(str(path), [(where, "the token file is empty; expected the engines' token "
                                              "(vLLM --api-key) on one line")])
    if not _TOKEN.fullmatch(token):
        lines = len(token.splitlines())
        shape = f"{lines} lines" if lines > 1 else "a space or a control character"
        raise ConfigError(str(path), [(where, (
            f"the token file holds {shape} ({len(raw)} bytes; not shown); expected the token alone on one "
            "line, e.g. printf %s \"$TOKEN\" > FILE"))])
    return token


def base_url(target: config.Target) -> str:
    """Where ``/health``, ``/v1/models`` and ``/version`` live."""
    return target.base_url or scraping.base_url(target.metrics_url)


def collector_for(target: config.Target, settings: config.TunerSettings, *, client: engines.EngineClient,
                  live: Callable[[str], live_knobs.Channel] | None = None,
                  stamp: Callable[[], float] = time.time) -> Collector:
    """One target's collector as ``vllm-tuner run`` and the Kubernetes leader both build it: GET /load with
    sleep mode, the slow reads every ``scrape.gpu_interval_seconds``, and with ``live.enabled`` the live
    knobs through ``live(name)`` (the target's control directory by default)."""
    channel = None
    if settings.live.enabled:
        channel = live(target.name) if live is not None else live_knobs.Files(settings.live.dir_for(target.name))
    return Collector(target, client=client, server_load=settings.decisions.idle.sleep_after_seconds is not None,
                     live=channel, slow_every_seconds=settings.scrape.gpu_interval_seconds, stamp=stamp)


class Collector:
    """Reads every source of one target. Owns no state across cycles except the NVML handle and, with
    ``slow_every_seconds``, the last GPU readings and engine info: the engine's /metrics is read every cycle,
    the GPUs' telemetry and ``/v1/models`` at most every ``slow_every_seconds`` (``scrape.gpu_interval_seconds``;
    a failed read is retried the next cycle). GPU signals judge staleness by each reading's own time."""

    def __init__(self, target: config.Target, *, client: engines.EngineClient, server_load: bool = False,
                 live: live_knobs.Channel | None = None, slow_every_seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, stamp: Callable[[], float] = time.time) -> None:
        self.target = target
        self.server_load = server_load  # read GET /load too (sleep mode's wake signal)
        self.client = client
        self.base_url = base_url(target)
        # live knobs on: where the engine's plugin is reached (its control directory, or its pod's agent); the
        # engine's own live API is probed first either way (``EngineClient.live_path``)
        self.live = live
        self._nvml: object | None = None
        self._slow_every = slow_every_seconds
        self._clock = clock
        self._stamp = stamp  # the time GPU readings are labelled with (the loop's clock in the daemon)
        self._gpus: tuple[float, GpuInputs] | None = None
        self._info: tuple[float, EngineInfo] | None = None

    def forget_cached(self) -> None:
        """Drop the readings kept between slow reads (the loop's clock was re-based: their times are not)."""
        self._gpus = self._info = None

    def _fresh(self, kept: tuple[float, object] | None) -> bool:
        return kept is not None and self._clock() - kept[0] < self._slow_every

    def read_live(self) -> live.LiveState:
        if self.live is None:
            return live.NONE
        return self.client.live_state(self.base_url, self.live, kind=self.target.kind)

    def scrape_engine(self) -> snapshots.Snapshot:
        return self.client.scrape(self.target.metrics_url,
                                  keep_prefixes=dialects.DIALECTS[self.target.kind].parse_prefixes())

    def engine_info(self) -> EngineInfo:
        if self._info is not None and self._fresh(self._info) and not self.server_load:
            return self._info[1]
        info = self.client.info(self.base_url, self.target.kind, server_load=self.server_load)
        self._info = None if info.error else (self._clock(), info)
        return info

    def read_gpus(self) -> GpuInputs:
        if self._gpus is not None and self._fresh(self._gpus):
            return self._gpus[1]
        gpus = self._read_gpus()
        self._gpus = None if gpus.unavailable else (self._clock(), gpus)
        return gpus

    def _read_gpus(self) -> GpuInputs:
        source = self.target.gpu
        if isinstance(source, config.DcgmSettings):
            snap = self.client.scrape(source.url, keep_prefixes=dcgm.dcgm_keep_prefixes())
            if not snap.ok:
                return GpuInputs(unavailable=f"dcgm-exporter: {snap.error}")
            readings = dcgm.readings_from_snapshot(
                snap, slowdown_temp_c=source.slowdown_temp_c, gpus=source.gpus, hostname=source.hostname)
            if source.sm_clock_max_mhz:
                readings = [dataclasses.replace(r, sm_clock_max_mhz=source.sm_clock_max_mhz) for r in readings]
            return GpuInputs(tuple(readings), None if readings else "dcgm-exporter reported no matching GPU")
        if isinstance(source, config.NvmlSettings):
            from tuner.sources import nvml

            if self._nvml is None:
                self._nvml = nvml.NvmlSource(source.devices, clock=self._stamp)
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
    collector that still does not return (an NVML call that hangs in the driver, a stuck socket, a
    future source). Each read runs on a fresh *daemon* thread: one that never returns can neither keep
    the process alive after SIGTERM (a pool's worker threads are joined at interpreter exit; daemon
    threads are not) nor blind its target — at the deadline the target counts as failed for this
    cycle, "stuck" for as long as the read has not returned, and the next cycle reads it again on a
    fresh thread. At most ``max_stuck`` reads of one target may hang at once (a source that hangs every
    time costs that many threads, not one per cycle); beyond that the target waits for one of them.
    ``stop`` (SIGTERM's event) ends a gathering at once: nothing is waited for once the daemon stops.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time, stop: threading.Event | None = None,
                 max_stuck: int = 3) -> None:
        self._stuck: dict[str, list[threading.Thread]] = {}
        self._clock = clock
        self._stop = stop or threading.Event()
        self.max_stuck = max_stuck

    def gather(self, collectors: Sequence[Collecting], *, deadline_seconds: float) -> list[Inputs]:
        done = threading.Condition()
        results: dict[str, Inputs] = {}
        started: dict[str, threading.Thread] = {}
        out: dict[str, Inputs] = {}
        for c in collectors:
            name = c.target.name
            stuck = [t for t in self._stuck.get(name, []) if t.is_alive()]
            self._stuck[name] = stuck
            if len(stuck) >= self.max_stuck:
                out[name] = _failed(self._clock(), f"{len(stuck)} earlier reads of this target are stuck (not "
                                                   "returned); it is read again once one of them returns")
                continue
            thread = threading.Thread(target=self._read, args=(c, results, done), daemon=True,
                                      name=f"tuner-collect-{name}")
            started[name] = thread
            thread.start()
        end = time.monotonic() + deadline_seconds
        with done:
            while not self._stop.is_set() and any(n not in results for n in started):
                left = end - time.monotonic()
                if left <= 0:
                    break
                done.wait(min(left, 0.1))
            finished = dict(results)
        for name, thread in started.items():
            if name in finished:
                out[name] = finished[name]
                continue
            self._stuck.setdefault(name, []).append(thread)
            why = ("the tuner is stopping: not waited for" if self._stop.is_set() else
                   f"reading this target is stuck: no answer within {deadline_seconds:g}s (the next cycle "
                   "reads it again on a fresh worker)")
            out[name] = _failed(self._clock(), why)
        return [out[c.target.name] for c in collectors]

    def _read(self, c: Collecting, results: dict[str, Inputs], done: threading.Condition) -> None:
        inputs = collect_one(c, clock=self._clock)
        with done:
            results[c.target.name] = inputs
            done.notify_all()

    def stuck(self) -> dict[str, int]:
        """Reads per target that have not returned (for tests and the cycle's account)."""
        return {n: k for n, ts in self._stuck.items() if (k := sum(t.is_alive() for t in ts))}

    def close(self) -> None:
        """Nothing to join: a read still running is a daemon thread, and ends with the process."""
        self._stop.set()


def _failed(at: float, why: str) -> Inputs:
    return Inputs(snapshots.Snapshot.failed(at, why), EngineInfo(error=f"not read: {why}"), GpuInputs(unavailable=why))
