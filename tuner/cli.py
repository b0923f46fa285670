"""Command line: ``vllm-tuner inspect | check-config | config-schema | ...``.

Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tuner import __version__, cli_decide, cli_demo, config
from tuner.errors import ConfigError
from tuner.model import dialects, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuReading
from tuner.signals import engine as engine_signals
from tuner.signals import gpu as gpu_signals
from tuner.signals import reports


def _read_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, [("", f"cannot read metrics file: {exc}")]) from exc


def _file_snapshots(paths: Sequence[str], spacing: float, kind: str) -> list[snapshots.Snapshot]:
    keep = dialects.DIALECTS[kind].parse_prefixes()
    return [snapshots.parse(_read_file(p), i * spacing, source=p, keep_prefixes=keep)
            for i, p in enumerate(paths)]


def _emit(result: dict[str, Any], signals: dict[str, Any], fmt: str, title: str) -> str:
    if fmt == "json":
        return json.dumps(result, indent=2, sort_keys=False)
    return reports.table(signals, title=title)


def cmd_inspect(args: argparse.Namespace) -> int:
    kind = args.kind
    info = EngineInfo(max_model_len=args.max_model_len) if args.max_model_len else None
    readings: list[GpuReading] = []
    gpu_unavailable: str | None = "no GPU source given (--dcgm-url, --dcgm-metrics or --nvml)"
    windows: list[tuple[str, str, list[snapshots.Snapshot], EngineInfo | None, list[GpuReading], str | None]] = []

    if args.dcgm_metrics:
        readings, gpu_unavailable = cli_decide.dcgm_file_readings(Path(args.dcgm_metrics),
                                                                   slowdown_temp_c=args.slowdown_temp_c)
    elif args.nvml and args.engine_metrics:
        from tuner.sources import nvml

        source = nvml.NvmlSource()
        readings = source.read()
        gpu_unavailable = None if readings else f"NVML unavailable: {source.unavailable_reason or 'no devices'}"

    if args.engine_metrics:
        snaps = _file_snapshots(args.engine_metrics, args.window_seconds, kind)
        windows.append(("files", kind, snaps, info, readings, gpu_unavailable))
    else:
        from tuner.daemon import collecting
        from tuner.sources import scraping

        if args.config:
            settings = config.load(args.config)
            targets = settings.targets
            http = collecting.http_settings(settings.scrape, config_dir=Path(args.config).parent)
        elif args.engine_url:
            gpu: Any = config.NoGpuSource(kind="none")
            if args.dcgm_url:
                gpu = config.DcgmSource(kind="dcgm", url=args.dcgm_url, slowdown_temp_c=args.slowdown_temp_c)
            elif args.nvml:
                gpu = config.NvmlSource(kind="nvml")
            targets = [config.Target(name=f"engine-{i}", kind=kind, metrics_url=u, gpu=gpu)
                       for i, u in enumerate(args.engine_url)]
            http = scraping.HttpSettings()
        else:
            print("inspect: give --engine-metrics FILE..., --engine-url URL... or --config FILE", file=sys.stderr)
            return 2
        with scraping.make_client(http) as client:
            collectors = [collecting.Collector(t, client=client, max_body_bytes=http.max_body_bytes)
                          for t in targets]
            series: list[list[snapshots.Snapshot]] = [[] for _ in collectors]
            for n in range(args.samples):
                if n:
                    time.sleep(args.window_seconds)
                for i, c in enumerate(collectors):
                    series[i].append(c.scrape_engine())
            for c, snaps in zip(collectors, series, strict=True):
                live_info = c.engine_info()
                if info is not None and live_info.max_model_len is None:
                    live_info = dataclasses.replace(live_info, max_model_len=info.max_model_len)
                gpu_inputs = c.read_gpus()
                if args.dcgm_metrics:
                    windows.append((c.target.name, c.target.kind, snaps, live_info, readings, gpu_unavailable))
                else:
                    windows.append((c.target.name, c.target.kind, snaps, live_info, list(gpu_inputs.readings),
                                    gpu_inputs.unavailable))

    results: dict[str, Any] = {}
    outputs = []
    for name, wkind, snaps, winfo, wreadings, why in windows:
        dialect = dialects.DIALECTS[wkind]
        signals = engine_signals.compute(snaps, dialect=dialect, info=winfo)
        signals.update(gpu_signals.compute(wreadings, unavailable=why))
        invalid = [f"{s.source or s.scraped_at}: {s.error}" for s in snaps if not s.ok]
        extra = {"window": {"snapshots": len(snaps), "invalid": invalid}}
        results[name] = reports.report(signals, info=winfo, readings=wreadings, extra=extra)
        title = f"== {name}" + (f"  ({len(invalid)} invalid scrape(s): {'; '.join(invalid)})" if invalid else "")
        outputs.append(_emit(results[name], signals, "table", title))
    if args.format == "json":
        payload = results[next(iter(results))] if len(results) == 1 else {"targets": results}
        print(json.dumps(payload, indent=2))
    else:
        print("\n\n".join(outputs))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tuner.daemon import running

    settings = config.load(args.config)
    running.configure_logging(json_logs=settings.daemon.json_logs or args.json_logs)
    return running.build_and_run(args.config, once=args.once)


def cmd_check_config(args: argparse.Namespace) -> int:
    settings = config.load(args.file)
    print(f"# {args.file}: valid. Effective configuration (defaults filled in):")
    print(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    print(json.dumps(config.schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-tuner", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"vllm-tuner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="compute signals from live targets or saved /metrics files")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="a tuner config file: inspect each of its targets live")
    src.add_argument("--engine-url", action="append", metavar="URL", help="an engine's /metrics URL (repeatable)")
    src.add_argument("--engine-metrics", action="append", metavar="FILE",
                     help="a saved /metrics body; several are consecutive snapshots, --window-seconds apart")
    p.add_argument("--kind", choices=sorted(dialects.DIALECTS), default="vllm", help="engine kind (default vllm)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--dcgm-url", help="dcgm-exporter /metrics URL")
    gpu.add_argument("--dcgm-metrics", metavar="FILE", help="a saved dcgm-exporter /metrics body")
    gpu.add_argument("--nvml", action="store_true", help="read this host's GPUs through NVML")
    p.add_argument("--slowdown-temp-c", type=float, help="GPU slowdown temperature for DCGM data (NVML knows it)")
    p.add_argument("--max-model-len", type=int, help="the engine's max_model_len (files do not carry it)")
    p.add_argument("--window-seconds", type=float, default=15.0,
                   help="seconds between consecutive snapshots (files) or scrapes (live); default 15")
    p.add_argument("--samples", type=int, default=2, help="live scrapes per target (default 2)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("run", help="the tuner daemon: a cycle every scrape.interval_seconds (observe | recommend | apply)")
    p.add_argument("--config", required=True, help="the tuner's YAML configuration")
    p.add_argument("--once", action="store_true", help="run one cycle, print its summary line and exit")
    p.add_argument("--json-logs", action="store_true", help="one JSON object per log line")
    p.set_defaults(func=cmd_run)

    cli_decide.register(sub)
    cli_demo.register(sub)

    p = sub.add_parser("check-config", help="validate a config file and print the effective config")
    p.add_argument("file")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("config-schema", help="print the config file's JSON schema")
    p.set_defaults(func=cmd_config_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
