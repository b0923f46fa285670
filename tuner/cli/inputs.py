"""Reading the CLI's inputs: saved /metrics files and their times, meta.json, GPU readings, rule and
decision files, engine arguments. Every failure is a ``ConfigError`` naming the file (exit code 2)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tuner.errors import ConfigError
from tuner.model import dcgm, dialects, knobs, snapshots
from tuner.model.gpus import GpuInputs, GpuReading
from tuner.planning import planner
from tuner.portable import untrusted
from tuner.rules import loading

DEFAULT_SPACING_SECONDS = 15.0


def meta(directory: Path) -> dict[str, Any]:
    """``meta.json`` next to recorded snapshots ({} if there is none)."""
    path = directory / "meta.json"
    if not path.exists():
        return {}
    try:
        data = untrusted.read_json(path, max_bytes=64 * 1024 * 1024, follow_symlinks=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(path), [("", f"cannot read: {getattr(exc, 'reason', None) or exc}")]) from exc
    if not isinstance(data, dict):
        raise ConfigError(str(path), [("", f"expected a JSON object, got {type(data).__name__}")])
    scraped = data.get("scraped_at")
    if scraped is not None and (not isinstance(scraped, list)
                                or not all(isinstance(t, int | float) and not isinstance(t, bool) for t in scraped)):
        raise ConfigError(str(path), [("scraped_at", "expected a list of numbers (seconds, one per NNN.prom file)")])
    argv = data.get("engine_args")
    if argv is not None and (not isinstance(argv, list) or not all(isinstance(a, str) for a in argv)):
        raise ConfigError(str(path), [("engine_args", "expected a list of strings (the engine's argv)")])
    return data


def times(paths: Sequence[Path], spacing: float | None) -> list[float]:
    """Scrape time of each file: ``meta.json`` scraped_at[NNN], ``<unix-seconds>.prom``, or i × spacing."""
    if spacing is not None:
        return [i * spacing for i in range(len(paths))]
    out: list[float] = []
    for p in paths:
        scraped = meta(p.parent).get("scraped_at")
        if re.fullmatch(r"\d{1,5}", p.stem) and isinstance(scraped, list) and int(p.stem) < len(scraped):
            out.append(float(scraped[int(p.stem)]))
        elif re.fullmatch(r"\d{6,}(\.\d+)?", p.stem):
            out.append(float(p.stem))
        else:
            return [i * DEFAULT_SPACING_SECONDS for i in range(len(paths))]
    return out


MAX_FILE_BYTES = 64 * 1024 * 1024  # a /metrics body is at most scrape.max_body_bytes (16 MiB by default)


def read_text(path: Path, *, what: str = "metrics file") -> str:
    """A saved body's text: a regular file (a FIFO or a directory is refused, never waited on), at most
    ``MAX_FILE_BYTES``, UTF-8."""
    try:
        return untrusted.read_bytes(path, max_bytes=MAX_FILE_BYTES, follow_symlinks=True).decode("utf-8")
    except (OSError, untrusted.Untrusted, UnicodeDecodeError) as exc:
        why = (exc.reason if isinstance(exc, untrusted.Untrusted) else exc.strerror if isinstance(exc, OSError)
               else f"not UTF-8 text ({exc.reason} at byte {exc.start})")
        raise ConfigError(str(path), [("", f"cannot read the {what}: {why}")]) from None


def metrics_files(paths: Sequence[Path], at: Sequence[float], kind: str) -> list[snapshots.Snapshot]:
    """Saved /metrics bodies as snapshots, oldest first. A body that cannot be parsed becomes an
    invalid snapshot with its reason, as a failed scrape would."""
    keep = dialects.DIALECTS[kind].parse_prefixes()
    snaps = [snapshots.parse(read_text(p), t, source=str(p), keep_prefixes=keep)
             for p, t in zip(paths, at, strict=True)]
    return sorted(snaps, key=lambda s: s.scraped_at)


def replay_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ConfigError(str(directory), [("", "not a directory")])
    files = sorted(directory.glob("*.prom"))
    if not files:
        what = "no *.prom files (expected NNN.prom + meta.json, or <unix-seconds>.prom)"
        raise ConfigError(str(directory), [("", what)])
    return files


def recorded(directory: Path, *, kind: str, spacing: float | None = None) -> list[snapshots.Snapshot]:
    """A directory of recorded snapshots (``NNN.prom`` + ``meta.json``, or ``<unix-seconds>.prom``)."""
    paths = replay_files(directory)
    return metrics_files(paths, times(paths, spacing), kind)


def gpu_readings(path: str, sample: int) -> list[GpuReading]:
    """GpuReadings from a JSON file: a bench/record_nvml.py recording (``samples[sample].readings``) or a
    list of reading objects."""
    try:
        data = untrusted.read_json(path, max_bytes=64 * 1024 * 1024, follow_symlinks=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(path, [("", f"cannot read GPU readings: {getattr(exc, 'reason', None) or exc}")]) from exc
    if isinstance(data, dict) and "samples" in data:
        try:
            data = data["samples"][sample]["readings"]
        except (IndexError, KeyError, TypeError) as exc:
            raise ConfigError(path, [(f"samples[{sample}].readings", "not found")]) from exc
    if not isinstance(data, list):
        raise ConfigError(path, [("", "expected a list of GPU readings or a record_nvml.py recording")])
    names = {f.name for f in dataclasses.fields(GpuReading)}
    try:
        return [GpuReading(**{k: v for k, v in d.items() if k in names}) for d in data]
    except (TypeError, AttributeError) as exc:
        raise ConfigError(path, [("", f"not a GPU reading: {exc}")]) from exc


def dcgm_file_readings(path: Path, *, slowdown_temp_c: float | None) -> GpuInputs:
    """GPU readings from a saved dcgm-exporter body, or why there are none."""
    snap = snapshots.parse(read_text(path, what="dcgm-exporter metrics file"), 0.0, source=str(path),
                           keep_prefixes=dcgm.dcgm_keep_prefixes())
    if not snap.ok:  # given on the command line to be read: saying "GPU unknown" would hide the mistake
        raise ConfigError(str(path), [("", f"not a dcgm-exporter /metrics body: {snap.error}")])
    readings = dcgm.readings_from_snapshot(snap, slowdown_temp_c=slowdown_temp_c)
    return GpuInputs(tuple(readings), None if readings else f"{path}: no DCGM GPU series")


def gpus(ns: argparse.Namespace) -> GpuInputs:
    """The GPU inputs given on the command line (a file's readings apply to every cycle)."""
    if getattr(ns, "dcgm_metrics", None):
        return dcgm_file_readings(Path(ns.dcgm_metrics), slowdown_temp_c=ns.slowdown_temp_c)
    if getattr(ns, "gpu_readings", None):
        return GpuInputs(tuple(gpu_readings(ns.gpu_readings, ns.gpu_sample)))
    return GpuInputs(unavailable="no GPU source given (--dcgm-metrics or --gpu-readings)")


def rules(paths: Sequence[str] | None) -> loading.RuleSet:
    return loading.load_all(paths or [loading.default_rules_path()])


def decision_settings(ns: argparse.Namespace) -> planner.DecisionSettings:
    """The ``decisions:`` section from ``--decisions FILE``, with ``--platform``, ``--gpu-memory-gib`` and
    ``--default`` on top."""
    data: dict[str, Any] = {}
    if ns.decisions:
        loaded = loading.read_yaml(ns.decisions, what="decisions file") or {}  # bounded, as the config
        if not isinstance(loaded, dict):
            raise ConfigError(ns.decisions, [("", "expected a mapping (the decisions: section)")])
        data = dict(loaded.get("decisions", loaded))
    engine = dict(data.get("engine", {}))
    if ns.platform:
        engine["platform"] = ns.platform
    if ns.gpu_memory_gib:
        engine["gpu_memory_gib"] = ns.gpu_memory_gib
    if ns.default:
        defaults = dict(engine.get("defaults", {}))
        for pair in ns.default:
            key, _, value = pair.partition("=")
            defaults[key.strip()] = value.strip()
        engine["defaults"] = defaults
    data["engine"] = engine
    try:
        return planner.DecisionSettings.model_validate(data)
    except ValidationError as exc:
        where = ns.decisions or "command line"
        raise ConfigError(where, [(".".join(str(p) for p in e["loc"]), str(e["msg"])) for e in exc.errors()]
                          ) from exc


def engine_args(text: str | None, recorded_meta: dict[str, Any]) -> knobs.EngineArgs:
    """``--args`` text, else meta.json's ``engine_args``, else none."""
    if text is not None:
        try:
            return knobs.EngineArgs.from_string(text)
        except ValueError as exc:
            raise ConfigError("--args", [("", f"cannot split {text!r}: {exc}")]) from exc
    argv = recorded_meta.get("engine_args")
    return knobs.EngineArgs.parse(argv) if isinstance(argv, list) else knobs.EngineArgs()


def max_model_len(given: int | None, args: knobs.EngineArgs, kind: knobs.EngineKind) -> int | None:
    """``--max-model-len``, else the one on the command line (the engine's own report is live only)."""
    if given:
        return given
    try:
        value = knobs.explicit(args, "max_model_len", kind)
    except ValueError:
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
