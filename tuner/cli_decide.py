"""``vllm-tuner recommend`` and ``vllm-tuner replay``: the decision core on recorded /metrics files.

Both run the daemon's path — signals → rules → guards → plan — over a time series of snapshots, one
cycle per snapshot, each cycle's window being the snapshots of the last ``--span`` seconds:

- ``recommend`` never applies anything (a true dry run): streaks build up over the files and the last
  cycle's plan is printed — recommendations, held rules with the guard and reason, and the signals.
- ``replay DIR`` assumes every planned change is applied when planned (cooldowns, hysteresis and the
  restart budget then bite) and prints the decision timeline. DIR holds ``NNN.prom`` files plus a
  ``meta.json`` with ``"scraped_at": [...]`` (tests/fixtures/vllm/<scenario>/), or ``<unix-seconds>.prom``
  files.

The lead wires it in with ``cli_decide.register(sub)`` from tuner/cli.py. Live ``recommend --config`` is
the daemon's ``mode: recommend``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tuner.errors import ConfigError
from tuner.model import dcgm, dialects, knobs, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuReading
from tuner.planning import history as history_mod
from tuner.planning import planner
from tuner.rules import loading
from tuner.signals import Signal, reports
from tuner.signals import engine as engine_signals
from tuner.signals import gpu as gpu_signals

DEFAULT_SPAN_SECONDS = 300.0


def default_rules_path() -> Path:
    """``rules/default.yaml`` in the working directory, else the one next to the package (checkout)."""
    here = Path("rules/default.yaml")
    if here.exists():
        return here
    return Path(__file__).resolve().parents[1] / "rules" / "default.yaml"


# --- inputs -----------------------------------------------------------------------------------------------


def _meta(directory: Path) -> dict[str, Any]:
    path = directory / "meta.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(str(path), [("", f"cannot read: {exc}")]) from exc
    return data if isinstance(data, dict) else {}


def _times(paths: Sequence[Path], spacing: float | None) -> list[float]:
    """Scrape time of each file: ``meta.json`` scraped_at[NNN], ``<unix-seconds>.prom``, or i × spacing."""
    if spacing is not None:
        return [i * spacing for i in range(len(paths))]
    out: list[float] = []
    for p in paths:
        meta = _meta(p.parent)
        scraped = meta.get("scraped_at")
        if re.fullmatch(r"\d{1,5}", p.stem) and isinstance(scraped, list) and int(p.stem) < len(scraped):
            out.append(float(scraped[int(p.stem)]))
        elif re.fullmatch(r"\d{6,}(\.\d+)?", p.stem):
            out.append(float(p.stem))
        else:
            return [i * 15.0 for i in range(len(paths))]
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), [("", f"cannot read metrics file: {exc}")]) from exc


def _snapshots(paths: Sequence[Path], times: Sequence[float], kind: str) -> list[snapshots.Snapshot]:
    keep = dialects.DIALECTS[kind].parse_prefixes()
    snaps = [snapshots.parse(_read(p), t, source=str(p), keep_prefixes=keep)
             for p, t in zip(paths, times, strict=True)]
    return sorted(snaps, key=lambda s: s.scraped_at)


def _gpu_readings(path: str, sample: int) -> list[GpuReading]:
    """GpuReadings from a JSON file: a bench/record_nvml.py recording (``samples[sample].readings``) or a
    list of reading objects."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(path, [("", f"cannot read GPU readings: {exc}")]) from exc
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


def _rules(paths: Sequence[str] | None) -> loading.RuleSet:
    return loading.load_all(paths or [default_rules_path()])


def _settings(args: argparse.Namespace) -> planner.DecisionSettings:
    data: dict[str, Any] = {}
    if args.decisions:
        try:
            loaded = yaml.safe_load(Path(args.decisions).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(args.decisions, [("", f"cannot read: {exc}")]) from exc
        data = dict(loaded.get("decisions", loaded)) if isinstance(loaded, dict) else {}
    engine = dict(data.get("engine", {}))
    if args.platform:
        engine["platform"] = args.platform
    if args.gpu_memory_gib:
        engine["gpu_memory_gib"] = args.gpu_memory_gib
    if args.default:
        defaults = dict(engine.get("defaults", {}))
        for pair in args.default:
            key, _, value = pair.partition("=")
            defaults[key.strip()] = value.strip()
        engine["defaults"] = defaults
    data["engine"] = engine
    try:
        return planner.DecisionSettings.model_validate(data)
    except ValidationError as exc:
        where = args.decisions or "command line"
        raise ConfigError(where, [(".".join(str(p) for p in e["loc"]), str(e["msg"])) for e in exc.errors()]
                          ) from exc


def _engine_args(text: str | None, meta: dict[str, Any]) -> knobs.EngineArgs:
    if text is not None:
        return knobs.EngineArgs.from_string(text)
    argv = meta.get("engine_args")
    if isinstance(argv, list):
        return knobs.EngineArgs.parse([str(a) for a in argv])
    return knobs.EngineArgs()


def _max_model_len(given: int | None, args: knobs.EngineArgs, kind: knobs.EngineKind) -> int | None:
    if given:
        return given
    try:
        value = knobs.explicit(args, "max_model_len", kind)
    except ValueError:
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


# --- the timeline ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cycle:
    plan: planner.Plan
    signals: dict[str, Signal]
    window: int  # snapshots in the window


def timeline(
    snaps: Sequence[snapshots.Snapshot],
    *,
    args: knobs.EngineArgs,
    rules: loading.RuleSet,
    settings: planner.DecisionSettings,
    kind: knobs.EngineKind = "vllm",
    readings: Sequence[GpuReading] = (),
    gpu_unavailable: str | None = None,
    max_model_len: int | None = None,
    span_seconds: float = DEFAULT_SPAN_SECONDS,
    min_snapshots: int = 2,
    apply: bool = False,
    target: str = "engine",
) -> Iterator[Cycle]:
    """One cycle per snapshot from the second on. ``apply``: planned changes take effect at once."""
    dialect = dialects.DIALECTS[kind]
    history = history_mod.History()
    previous_start: float | None = None
    for i in range(len(snaps)):
        now = snaps[i].scraped_at
        start = engine_signals.gauge(snaps[i], dialect, "process_start") if snaps[i].ok else None
        restarted_at = start if previous_start is not None and start is not None and start != previous_start \
            else None
        previous_start = start if start is not None else previous_start
        if i == 0:
            continue
        window = [s for s in snaps[: i + 1] if now - s.scraped_at <= span_seconds]
        mml = _max_model_len(None, args, kind) or max_model_len
        signals = engine_signals.compute(window, dialect=dialect, info=EngineInfo(max_model_len=mml),
                                         min_snapshots=min_snapshots)
        signals.update(gpu_signals.compute(list(readings), unavailable=gpu_unavailable))
        plan = planner.plan(target, signals, args, history, settings, rules=rules, kind=kind, now=now,
                            restarted_at=restarted_at)
        history = plan.history
        if apply and plan.changes:
            history = history_mod.applied(history, plan.changes, now=now)
            args = plan.args_after
        yield Cycle(plan, signals, len(window))


# --- output ---------------------------------------------------------------------------------------------


def _line(kind: str, head: str, reason: str) -> str:
    return f"  {kind:<7} {head}: {reason}"


def decision_lines(plan: planner.Plan, *, sustain: bool = True, unknown: bool = False) -> list[str]:
    """One line per decision: CHANGE, HELD (with the guard), ACTION, and optionally UNKNOWN (rules whose
    condition could not be evaluated, with the missing value's reason)."""
    lines = []
    for c in plan.changes:
        tag = " [experimental]" if c.experimental else ""
        lines.append(_line("CHANGE", f"{c.flag} {knobs.format_value(c.from_value)} → "
                                     f"{knobs.format_value(c.to_value)} ({c.rule}{tag})", c.reason))
        if c.verify:
            keep = "kept only if" if c.experimental else "rolled back unless"
            lines.append(_line("VERIFY", f"after the rollout, {keep}", "; ".join(v.describe() for v in c.verify)))
    for h in plan.held:
        if h.guard == "sustain" and not sustain:
            continue
        lines.append(_line("HELD", f"{h.rule} [{h.guard}]", h.reason))
    for a in plan.actions:
        lines.append(_line("ACTION", a.label(), a.reason))
    if unknown:
        lines += [_line("UNKNOWN", o.rule, o.reason) for o in plan.outcomes if o.status == "unknown"]
    return lines


def recommendation_json(plan: planner.Plan, signals: dict[str, Signal]) -> dict[str, Any]:
    rep = reports.report(signals)
    return {
        "recommendations": [c.as_dict() for c in plan.changes],
        "held": [h.as_dict() for h in plan.held],
        "actions": [a.as_dict() for a in plan.actions],
        "restart_needed": plan.restart_needed,
        "args_before": plan.args_before.argv(),
        "args_after": plan.args_after.argv(),
        "summary": plan.summary(),
        "signals": rep["signals"],
        "reasons": rep["reasons"],
    }


# --- commands -------------------------------------------------------------------------------------------


def cmd_recommend_live(ns: argparse.Namespace) -> int:
    """``recommend --config``: a few live scrapes per target, then the same dry-run path as for files."""
    import time

    from tuner import config
    from tuner.daemon import collecting, running
    from tuner.sources import scraping

    settings = config.load(ns.config, runnable=False)
    config_dir = Path(ns.config).resolve().parent
    rules = _rules(ns.rules) if ns.rules else loading.load_all(running.rule_paths(settings, config_dir))
    decisions = _settings(ns) if ns.decisions else settings.decisions
    http = collecting.http_settings(settings.scrape, config_dir=config_dir)
    spacing = ns.window_seconds or 10.0
    results: dict[str, Any] = {}
    lines: list[str] = []
    with scraping.make_client(http) as client:
        collectors = [collecting.Collector(t, client=client, max_body_bytes=http.max_body_bytes)
                      for t in settings.targets]
        series: dict[str, list[snapshots.Snapshot]] = {c.target.name: [] for c in collectors}
        for i in range(max(2, ns.samples, ns.min_snapshots)):
            if i:
                time.sleep(spacing)
            for c in collectors:
                series[c.target.name].append(c.scrape_engine())
        for c in collectors:
            t = c.target
            info, gpus = c.engine_info(), c.read_gpus()
            args = knobs.EngineArgs.from_string(ns.args) if ns.args else knobs.EngineArgs.parse(t.args or [])
            cycles = list(timeline(series[t.name], args=args, rules=rules, settings=decisions, kind=t.kind,
                                   readings=gpus.readings, gpu_unavailable=gpus.unavailable,
                                   max_model_len=info.max_model_len, span_seconds=settings.scrape.window_seconds,
                                   min_snapshots=ns.min_snapshots, apply=False, target=t.name))
            last = cycles[-1]
            results[t.name] = recommendation_json(last.plan, last.signals)
            lines.append(f"== {t.name} ({t.kind}): {len(series[t.name])} live scrapes {spacing:g}s apart; args: {args}")
            lines += decision_lines(last.plan, unknown=True) or ["  no rule matched"]
    if ns.format == "json":
        print(json.dumps(results[next(iter(results))] if len(results) == 1 else {"targets": results}, indent=2))
    else:
        print("\n".join(lines))
    return 0


def cmd_recommend(ns: argparse.Namespace) -> int:
    if ns.config:
        return cmd_recommend_live(ns)
    paths = [Path(p) for p in ns.engine_metrics]
    meta = _meta(paths[0].parent) if paths else {}
    snaps = _snapshots(paths, _times(paths, ns.window_seconds), ns.kind)
    readings, unavailable = _gpus(ns)
    args = _engine_args(ns.args, meta)
    cycles = list(timeline(
        snaps, args=args, rules=_rules(ns.rules), settings=_settings(ns), kind=ns.kind, readings=readings,
        gpu_unavailable=unavailable, max_model_len=ns.max_model_len, span_seconds=ns.span,
        min_snapshots=ns.min_snapshots, apply=False,
    ))
    if not cycles:
        print("recommend: need at least two snapshots (give --engine-metrics more than once)")
        return 2
    last = cycles[-1]
    if ns.format == "json":
        print(json.dumps(recommendation_json(last.plan, last.signals), indent=2))
        return 0
    span = snaps[-1].scraped_at - snaps[0].scraped_at
    print(f"recommend ({ns.kind}): {len(snaps)} snapshots over {span:.0f}s, {len(cycles)} cycles; "
          f"args: {args}")
    lines = decision_lines(last.plan, unknown=True)
    print("\n".join(lines) if lines else "  no rule matched")
    print(f"  restart needed: {'yes' if last.plan.restart_needed else 'no'}")
    if last.plan.changes:
        print(f"  args after: {last.plan.args_after}")
    return 0


def dcgm_file_readings(path: Path, *, slowdown_temp_c: float | None) -> tuple[list[GpuReading], str | None]:
    """GPU readings from a saved dcgm-exporter body, or why there are none."""
    snap = snapshots.parse(_read(path), 0.0, source=str(path), keep_prefixes=dcgm.dcgm_keep_prefixes())
    if not snap.ok:
        return [], f"dcgm metrics file {path}: {snap.error}"
    readings = dcgm.readings_from_snapshot(snap, slowdown_temp_c=slowdown_temp_c)
    return readings, None if readings else f"{path}: no DCGM GPU series"


def _gpus(ns: argparse.Namespace) -> tuple[list[GpuReading], str | None]:
    if ns.dcgm_metrics:
        return dcgm_file_readings(Path(ns.dcgm_metrics), slowdown_temp_c=ns.slowdown_temp_c)
    if ns.gpu_readings:
        return _gpu_readings(ns.gpu_readings, ns.gpu_sample), None
    return [], "no GPU source given (--dcgm-metrics or --gpu-readings)"


def _replay_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise ConfigError(str(directory), [("", "not a directory")])
    files = sorted(directory.glob("*.prom"))
    if not files:
        what = "no *.prom files (expected NNN.prom + meta.json, or <unix-seconds>.prom)"
        raise ConfigError(str(directory), [("", what)])
    return files


def cmd_replay(ns: argparse.Namespace) -> int:
    directory = Path(ns.dir)
    paths = _replay_files(directory)
    meta = _meta(directory)
    snaps = _snapshots(paths, _times(paths, ns.window_seconds), ns.kind)
    readings, unavailable = _gpus(ns)
    args = _engine_args(ns.args, meta)
    cycles = list(timeline(
        snaps, args=args, rules=_rules(ns.rules), settings=_settings(ns), kind=ns.kind, readings=readings,
        gpu_unavailable=unavailable, max_model_len=ns.max_model_len, span_seconds=ns.span,
        min_snapshots=ns.min_snapshots, apply=True,
    ))
    if ns.format == "json":
        out = [dict(c.plan.as_dict(), window_snapshots=c.window) for c in cycles]
        print(json.dumps({"dir": str(directory), "args": args.argv(), "cycles": out}, indent=2))
        return 0
    t0 = snaps[0].scraped_at if snaps else 0.0
    print(f"replay {directory} ({ns.kind}): {len(snaps)} snapshots, args: {args}")
    for c in cycles:
        print(f"t+{c.plan.at - t0:5.0f}s  {c.plan.summary()}")
        if ns.verbose:
            for line in decision_lines(c.plan, unknown=True):
                print("       " + line)
        else:
            for ch in c.plan.changes:
                print(f"         {ch.flag}: {ch.reason}")
    final = cycles[-1].plan.args_after if cycles else args
    print(f"final args: {final}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--args", metavar="TEXT",
                   help='the current engine arguments, e.g. --args="--max-num-seqs 256 --max-model-len 8k" '
                        "(default: engine_args from meta.json next to the files, else none)")
    p.add_argument("--rules", action="append", metavar="FILE",
                   help="rule file (repeatable; default rules/default.yaml)")
    p.add_argument("--kind", choices=sorted(dialects.DIALECTS), default="vllm", help="engine kind (default vllm)")
    p.add_argument("--max-model-len", type=int, help="the served max_model_len (default: from --args)")
    p.add_argument("--window-seconds", type=float, default=None,
                   help="seconds between consecutive files (default: meta.json scraped_at or file names, "
                        "else 15)")
    p.add_argument("--span", type=float, default=DEFAULT_SPAN_SECONDS,
                   help=f"window length per cycle in seconds (default {DEFAULT_SPAN_SECONDS:g})")
    p.add_argument("--min-snapshots", type=int, default=2, help="fewest snapshots per window (default 2)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--dcgm-metrics", metavar="FILE", help="a saved dcgm-exporter /metrics body")
    gpu.add_argument("--gpu-readings", metavar="FILE",
                     help="GPU readings as JSON (a bench/record_nvml.py recording or a list of readings)")
    p.add_argument("--gpu-sample", type=int, default=-1, help="which recording sample (default: the last)")
    p.add_argument("--slowdown-temp-c", type=float, help="GPU slowdown temperature for DCGM data")
    p.add_argument("--platform", choices=knobs.PLATFORMS,
                   help="attention platform, for block-size validity and vLLM's defaults")
    p.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (vLLM's CUDA defaults depend on it)")
    p.add_argument("--default", action="append", metavar="FLAG=VALUE",
                   help="a known value of a flag absent from --args (repeatable), e.g. --default=--max-num-seqs=1024 "
                        "or --default max_num_seqs=1024")
    p.add_argument("--decisions", metavar="FILE", help="YAML with guard/planner settings (the decisions: section)")
    p.add_argument("--format", choices=["table", "json"], default="table")


def register(subparsers: Any) -> None:
    """Add ``recommend`` and ``replay`` to the main parser's subcommands."""
    p = subparsers.add_parser("recommend", help="dry run: what would the tuner change, and why (live or files)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-metrics", action="append", metavar="FILE",
                     help="a saved /metrics body; several are consecutive snapshots")
    src.add_argument("--config", metavar="FILE",
                     help="a tuner config: scrape its targets live (--samples scrapes, --window-seconds apart; "
                          "default 3 scrapes 10 s apart) and recommend for each; never touches an engine")
    p.add_argument("--samples", type=int, default=3, help="live scrapes per target with --config (default 3)")
    _common(p)
    p.set_defaults(func=cmd_recommend)

    p = subparsers.add_parser("replay", help="run a directory of timestamped snapshots through the planner")
    p.add_argument("dir", help="NNN.prom + meta.json (scraped_at), or <unix-seconds>.prom files")
    p.add_argument("-v", "--verbose", action="store_true", help="show every held rule and action per cycle")
    _common(p)
    p.set_defaults(func=cmd_replay)
