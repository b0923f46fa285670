"""``vllm-tuner inspect``: the signals of live targets or saved /metrics files, as a table or JSON.

The signals come from the daemon's own step (``planning.stepping.step`` with ``decide=False``) over the
snapshots given — live scrapes ``--window-seconds`` apart, or files taken as that far apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tuner import config
from tuner.cli import arguments, inputs, progress
from tuner.errors import SourceError
from tuner.model import dialects, knobs, secrets, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import planner, stepping
from tuner.signals import reports


@dataclasses.dataclass(frozen=True)
class _Series:
    name: str
    kind: knobs.EngineKind
    snaps: list[snapshots.Snapshot]
    info: EngineInfo
    gpus: GpuInputs


def _signals(series: _Series, ns: argparse.Namespace) -> dict[str, Any]:
    window = stepping.WindowSettings(window_seconds=max(ns.window_seconds * len(series.snaps) + 1, 1.0),
                                     min_snapshots=ns.min_snapshots)
    *_, last = stepping.replay(series.snaps, target=series.name, kind=series.kind, args=knobs.EngineArgs(),
                                 rules=(), settings=planner.DecisionSettings(), window=window,
                                 info=series.info, gpus=series.gpus, decide=False)
    return dict(last.signals)


def _live(ns: argparse.Namespace, gpus_given: GpuInputs | None, info: EngineInfo | None) -> list[_Series] | None:
    from tuner.runtime import collecting
    from tuner.sources import engines

    if ns.config:
        settings = config.load(ns.config, runnable=False)
        targets = settings.targets
        http = collecting.http_settings(settings.scrape, config_dir=Path(ns.config).resolve().parent)
    elif ns.engine_url:
        gpu: Any = config.NoGpuSettings(kind="none")
        if ns.dcgm_url:
            gpu = config.DcgmSettings(kind="dcgm", url=ns.dcgm_url, slowdown_temp_c=ns.slowdown_temp_c)
        elif ns.nvml:
            gpu = config.NvmlSettings(kind="nvml")
        targets = [config.Target(name=f"engine-{i}", kind=ns.kind, metrics_url=u, gpu=gpu)
                   for i, u in enumerate(ns.engine_url)]
        http = collecting.http_settings(config.ScrapeSettings())
    else:
        return None
    out: list[_Series] = []
    with engines.EngineClient(http) as client:
        collectors = [collecting.Collector(t, client=client) for t in targets]
        series: list[list[snapshots.Snapshot]] = [[] for _ in collectors]
        waiting = progress.Sampling(f"inspect: {len(collectors)} target(s)", samples=ns.samples,
                                    spacing_seconds=ns.window_seconds)
        try:
            for n in range(ns.samples):
                if n:
                    waiting.wait()
                for i, c in enumerate(collectors):
                    series[i].append(c.scrape_engine())
                waiting.scraped()
        finally:
            waiting.close()
        for c, snaps in zip(collectors, series, strict=True):
            live_info = c.engine_info()
            if info is not None and live_info.max_model_len is None:
                live_info = dataclasses.replace(live_info, max_model_len=info.max_model_len)
            out.append(_Series(c.target.name, c.target.kind, snaps, live_info, gpus_given or c.read_gpus()))
    return out


def cmd_inspect(ns: argparse.Namespace) -> int:
    info = EngineInfo(max_model_len=ns.max_model_len) if ns.max_model_len else None
    gpus_given: GpuInputs | None = None
    if ns.dcgm_metrics:
        gpus_given = inputs.dcgm_file_readings(Path(ns.dcgm_metrics), slowdown_temp_c=ns.slowdown_temp_c)
    elif ns.nvml and ns.engine_metrics:
        from tuner.sources import nvml

        source = nvml.NvmlSource()
        readings = source.read()
        gpus_given = GpuInputs(tuple(readings), None if readings else
                               f"NVML unavailable: {source.unavailable_reason or 'no devices'}")
    if ns.engine_metrics:
        paths = [Path(p) for p in ns.engine_metrics]
        snaps = inputs.metrics_files(paths, [i * ns.window_seconds for i in range(len(paths))], ns.kind)
        all_series = [_Series("files", ns.kind, snaps, info or EngineInfo(),
                              gpus_given or GpuInputs(unavailable="no GPU source given (--dcgm-metrics or --nvml)"))]
    else:
        live = _live(ns, gpus_given, info)
        if live is None:
            print("error: inspect: say what to inspect: --engine-metrics FILE..., --engine-url URL... or --config FILE",
                  file=sys.stderr)
            return 2
        all_series = live

    results: dict[str, Any] = {}
    outputs = []
    for s in all_series:
        signals = _signals(s, ns)
        invalid = [f"{x.source or x.scraped_at}: {x.error}" for x in s.snaps if not x.ok]
        extra = {"window": {"snapshots": len(s.snaps), "invalid": invalid}}
        results[s.name] = reports.report(signals, info=s.info, readings=s.gpus.readings, extra=extra)
        title = f"== {s.name}" + (f"  ({len(invalid)} invalid scrape(s): {'; '.join(invalid)})" if invalid else "")
        outputs.append(reports.table(signals, title=title))
    redactor = _redactor(ns)  # a password in a URL is shown nowhere (the scrape errors name the URL)
    if ns.format == "json":
        print(json.dumps(redactor.data(results[next(iter(results))] if len(results) == 1 else {"targets": results}),
                         indent=2))
    else:
        print(redactor.text("\n\n".join(outputs)))
    try:
        nothing_read(all_series)
    except SourceError as exc:
        raise SourceError(exc.source, redactor.text(exc.reason)) from None
    return 0


def _redactor(ns: argparse.Namespace) -> secrets.Redactor:
    if ns.config:
        return config.load(ns.config, runnable=False).redactor()
    return secrets.DEFAULT.learn(urls=[*(ns.engine_url or []), *([ns.dcgm_url] if ns.dcgm_url else [])])


def nothing_read(all_series: list[_Series]) -> None:
    """SourceError (exit 1) when not one snapshot of any target or file could be read: the table above
    is all "unknown", and saying so in the exit code lets a script tell that from an answer."""
    if any(s.ok for series in all_series for s in series.snaps):
        return
    first = next((s for series in all_series for s in series.snaps), None)
    why = f"{first.source or 'scrape'}: {first.error}" if first is not None else "nothing given"
    raise SourceError("inspect", f"nothing could be read ({why})")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="compute signals from live targets or saved /metrics files")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="a tuner config file: inspect each of its targets live")
    src.add_argument("--engine-url", action="append", metavar="URL", type=arguments.http_url, help="an engine's /metrics URL (repeatable)")
    src.add_argument("--engine-metrics", action="append", metavar="FILE",
                     help="a saved /metrics body; several are consecutive snapshots, --window-seconds apart")
    p.add_argument("--kind", choices=sorted(dialects.DIALECTS), default="vllm", help="engine kind (default vllm)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--dcgm-url", type=arguments.http_url, help="dcgm-exporter /metrics URL")
    gpu.add_argument("--dcgm-metrics", metavar="FILE", help="a saved dcgm-exporter /metrics body")
    gpu.add_argument("--nvml", action="store_true", help="read this host's GPUs through NVML")
    p.add_argument("--slowdown-temp-c", type=arguments.finite_float, help="GPU slowdown temperature for DCGM data (NVML knows it)")
    p.add_argument("--max-model-len", type=arguments.at_least(1), help="the engine's max_model_len (files do not carry it)")
    p.add_argument("--window-seconds", type=arguments.positive_float, default=15.0,
                   help="seconds between consecutive snapshots (files) or scrapes (live); default 15")
    p.add_argument("--samples", type=arguments.at_least(1), default=2, help="live scrapes per target (default 2)")
    p.add_argument("--min-snapshots", type=arguments.at_least(1), default=2,
                   help="fewest snapshots for window signals (default 2: a rate needs two; the daemon decides "
                        "with scrape.min_snapshots, 3 by default)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_inspect)
