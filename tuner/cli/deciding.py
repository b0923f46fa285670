"""``vllm-tuner recommend`` and ``vllm-tuner replay``: the daemon's decision path on recorded snapshots.

Both feed a time series of snapshots, one at a time, to ``planning.stepping.step`` — the function the
daemon's cycle calls — with the window settings of a configuration (``scrape:`` defaults unless given):

- ``recommend`` never applies anything (a true dry run): streaks build up over the files and the last
  step's plan is printed — recommendations, held rules with the guard and reason, and the signals.
- ``replay DIR`` assumes each planned change went out when planned and books it as a finished rollout
  would (``planning.pooling``: cooldowns, hysteresis and the restart budget then bite), and prints the
  decision timeline. DIR holds ``NNN.prom`` files plus a ``meta.json`` with ``"scraped_at": [...]``, or
  ``<unix-seconds>.prom`` files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tuner import config
from tuner.cli import arguments, inputs, progress, stackvalues
from tuner.errors import ConfigError, SourceError
from tuner.model import dialects, knobs, secrets, snapshots
from tuner.model.engines import EngineInfo
from tuner.planning import planner, stepping
from tuner.rules import loading
from tuner.signals import reports

SCRAPE_DEFAULTS = config.ScrapeSettings()


def window_settings(ns: argparse.Namespace) -> stepping.WindowSettings:
    """The daemon's window settings (``scrape:`` defaults), with ``--span`` and ``--min-snapshots``."""
    return config.ScrapeSettings(window_seconds=ns.span, min_snapshots=ns.min_snapshots).window_settings()


def recorded_timeline(ns: argparse.Namespace, snaps: Sequence[snapshots.Snapshot], *, args: knobs.EngineArgs,
                      apply: bool) -> list[stepping.Decision]:
    info = EngineInfo(max_model_len=inputs.max_model_len(ns.max_model_len, args, ns.kind))
    return list(stepping.replay(snaps, target="engine", kind=ns.kind, args=args, rules=tuple(inputs.rules(ns.rules)),
                         settings=inputs.decision_settings(ns), window=window_settings(ns), info=info,
                         gpus=inputs.gpus(ns), apply=apply))


# --- output ---------------------------------------------------------------------------------------------


def _line(kind: str, head: str, reason: str) -> str:
    return f"  {kind:<7} {head}: {reason}"


def decision_lines(plan: planner.Plan, *, sustain: bool = True, unknown: bool = False) -> list[str]:
    """One line per decision: CHANGE (and its VERIFY), HELD (with the guard), ACTION, and optionally
    UNKNOWN (rules whose condition could not be evaluated, with the missing value's reason)."""
    lines = []
    for c in plan.changes:
        tag = " [experimental]" if c.experimental else ""
        lines.append(_line("CHANGE", f"{c.flag} {knobs.format_value(c.from_value)} → "
                                     f"{knobs.format_value(c.to_value)} ({c.rule}{tag})", c.reason))
        if c.verify:
            keep = "kept only if" if c.experimental else "rolled back unless"
            lines.append(_line("VERIFY", f"after the rollout, {keep}", "; ".join(v.describe() for v in c.verify)))
    for h in plan.held:
        if h.would is not None:  # the value the rule computed: LATER when only time holds it (TIME_GUARDS)
            flag, before, after = h.would
            lines.append(_line("LATER" if h.later else "HELD", f"{flag} {knobs.format_value(before)} → "
                               f"{knobs.format_value(after)} ({h.rule}) [{h.guard}]", h.reason))
            continue
        if h.guard == "sustain" and not sustain:
            continue
        lines.append(_line("HELD", f"{h.rule} [{h.guard}]", h.reason))
    for a in plan.actions:
        lines.append(_line("ACTION", a.label(), a.reason))
    if unknown:
        lines += [_line("UNKNOWN", o.rule, o.reason) for o in plan.outcomes if o.status == "unknown"]
    return lines


def recommendation_json(decision: stepping.Decision) -> dict[str, Any]:
    rep = reports.report(decision.signals)
    plan = decision.plan
    if plan is None:
        return {"recommendations": [], "held": [], "actions": [], "restart_needed": False,
                "skipped": decision.skipped, "signals": rep["signals"], "reasons": rep["reasons"]}
    return {
        "recommendations": [c.as_dict() for c in plan.changes],
        "later": [h.as_dict() for h in plan.held if h.later],
        "held": [h.as_dict() for h in plan.held],
        "actions": [a.as_dict() for a in plan.actions],
        "restart_needed": plan.restart_needed,
        "args_before": plan.args_before.argv(),
        "args_after": plan.args_after.argv(),
        "summary": plan.summary(),
        "signals": rep["signals"],
        "reasons": rep["reasons"],
    }


def _when(reason: str) -> str:
    """A time guard's reason up to its first clause: "after 39s more of sustained evidence"."""
    cuts = [i for i in (reason.find(": "), reason.find("; "), reason.find(" (")) if i > 0]
    return reason[:min(cuts)] if cuts else reason


def answering(decisions: Sequence[stepping.Decision]) -> stepping.Decision:
    """The step a dry run answers with: the last one at which a rule sized a change — made, or held for time or
    for a reason — so that a recording whose last scrapes catch the load ending (no rule matched, too few
    finished requests, a draining queue found enough) still answers for the load it recorded; else the last
    step."""
    for d in reversed(decisions):
        if d.plan is not None and (d.plan.changes or any(h.would is not None for h in d.plan.held)):
            return d
    return decisions[-1]


def _decision_text(decision: stepping.Decision) -> list[str]:
    if decision.plan is None:
        return [f"  SKIPPED {decision.skipped}"]
    return decision_lines(decision.plan, unknown=True) or ["  no rule matched"]


# --- commands -------------------------------------------------------------------------------------------


def cmd_recommend_live(ns: argparse.Namespace) -> int:
    """``recommend --config``: a few live scrapes per target, then the same dry-run path as for files."""
    from tuner.runtime import collecting
    from tuner.sources import engines

    settings = config.load(ns.config, runnable=False)
    config_dir = Path(ns.config).resolve().parent
    redactor = settings.redactor()
    rules = tuple(inputs.rules(ns.rules) if ns.rules else
                  loading.load_all(loading.rule_paths(settings.rule_files, base_dir=config_dir)))
    decisions = inputs.decision_settings(ns) if ns.decisions else settings.decisions
    window = settings.scrape.window_settings()
    if ns.min_snapshots != SCRAPE_DEFAULTS.min_snapshots:
        window = dataclasses.replace(window, min_snapshots=ns.min_snapshots)
    spacing = ns.window_seconds or 10.0
    results: dict[str, Any] = {}
    lasts: dict[str, stepping.Decision] = {}
    lines: list[str] = []
    http = collecting.http_settings(settings.scrape, config_dir=config_dir)
    with engines.EngineClient(http, deadline_seconds=settings.scrape.deadline_seconds) as client:
        collectors = [collecting.Collector(t, client=client) for t in settings.targets]
        series: dict[str, list[snapshots.Snapshot]] = {c.target.name: [] for c in collectors}
        samples = max(ns.samples, window.min_snapshots)
        waiting = progress.Sampling(f"recommend: {len(collectors)} target(s)", samples=samples,
                                    spacing_seconds=spacing)
        try:
            for i in range(samples):
                if i:
                    waiting.wait()
                for c in collectors:
                    series[c.target.name].append(c.scrape_engine())
                waiting.scraped()
        finally:
            waiting.close()
        for c in collectors:
            t = c.target
            args = inputs.engine_args(ns.args, {}) if ns.args else knobs.EngineArgs.parse(t.args or [])
            decisions_seen = list(stepping.replay(series[t.name], target=t.name, kind=t.kind, args=args, rules=rules,
                                           settings=decisions, window=window, info=c.engine_info(),
                                           gpus=c.read_gpus()))
            last = answering(decisions_seen)
            lasts[t.name] = last
            results[t.name] = recommendation_json(last)
            lines.append(f"== {t.name} ({t.kind}): {len(series[t.name])} live scrapes {spacing:g}s apart; "
                         f"args: {_shown(args, redactor)}")
            lines += _decision_text(last)
            if hint := needs(last, more=MORE_SCRAPES):
                lines.append(f"  NEEDS   {hint}")
    if ns.format == "production-stack":  # one modelSpec serves the pool: the first target's change
        t = settings.targets[0]
        print(redactor.text("\n".join(_stack_diff(lasts[t.name], knobs.EngineArgs.parse(t.args or []), ns.model_name))))
    elif ns.format == "json":
        print(json.dumps(redactor.data(results[next(iter(results))] if len(results) == 1 else {"targets": results}),
                         indent=2))
    else:
        print(redactor.text("\n".join(lines)))
    _nothing_read("recommend", [s for snaps in series.values() for s in snaps], redactor)
    return 0


def _nothing_read(command: str, snaps: Sequence[snapshots.Snapshot],
                  redactor: secrets.Redactor = secrets.DEFAULT) -> None:
    """SourceError (exit 1) when not one snapshot could be read: every target failed to answer, or no
    file held a /metrics body. What was printed above says "no decision" for each; the exit code says why."""
    if any(s.ok for s in snaps):
        return
    first = snaps[0] if snaps else None
    why = f"{first.source or 'scrape'}: {first.error}" if first is not None else "nothing given"
    raise SourceError(command, redactor.text(f"nothing could be read ({why})"))


_TOO_FEW = re.compile(r"too few snapshots: (\d+) spanning [^(]*\(need ≥ (\d+)")
_STREAK = re.compile(r"true in (\d+) of (\d+) consecutive windows")


MORE_FILES = ("more snapshots: --engine-metrics once per file (e.g. $(for f in DIR/*.prom; do echo --engine-metrics "
              "$f; done))")
MORE_SCRAPES = "more scrapes: --samples N"
MORE_IN_DIR = "more snapshots in the directory (a longer recording)"


def needs(decision: stepping.Decision, *, more: str) -> str | None:
    """When the last step could not decide for want of input: what it needs and the flag that gives it
    (``more``: how this command gets more snapshots), in one line; else None. Read off the reasons the
    decision path gives."""
    reasons = [decision.skipped or ""]
    if decision.plan is not None:
        reasons += [h.reason for h in decision.plan.held if h.guard in ("window", "idle", "sustain", "sustained")]
    for reason in reasons:
        if m := _TOO_FEW.search(reason):
            fewer = ", or --min-snapshots 2" if int(m.group(2)) > 2 else ""
            return f"at least {m.group(2)} snapshots in the window to decide, got {m.group(1)}: {more}{fewer}"
        if m := _STREAK.search(reason):
            return f"the evidence in {m.group(2)} consecutive windows to restart, got {m.group(1)}: {more}"
        if "more of sustained evidence" in reason:
            return (f"the evidence to hold longer than the recording: {more} (or a shorter "
                    "safety.restart_evidence_seconds: --decisions FILE)")
        if "requests finished in the" in reason:
            return "more finished requests in the window: a busier recording, or a longer window (--span SECONDS)"
    return None


def _shown(args: knobs.EngineArgs, redactor: secrets.Redactor = secrets.DEFAULT) -> str:
    """A command line as printed: secret values masked (``--api-key ***``)."""
    def word(a: str) -> str:
        head = a.removesuffix(secrets.MASK)
        return a if a.endswith(secrets.MASK) and shlex.quote(head or "x") == (head or "x") else shlex.quote(a)

    return " ".join(word(a) for a in redactor.argv(args.argv()))


def _stack_diff(decision: stepping.Decision, args: knobs.EngineArgs, model: str) -> list[str]:
    plan = decision.plan
    if plan is None:
        return [f"# servingEngineSpec.modelSpec[name={model}]: no plan ({decision.skipped or 'no decision'})"]
    # a dry run answers with the values the law moves to: the changes, and those held only for time (LATER)
    moves = [(c.flag, c.from_value, c.to_value) for c in plan.changes]
    after = plan.args_after
    for h in plan.held:
        if h.later and h.would is not None and all(m[0] != h.would[0] for m in moves):
            moves.append(h.would)
            after = after.with_value(h.would[0], h.would[2])
    return stackvalues.values_diff(moves, model=model, before=args, after=after)


def cmd_recommend(ns: argparse.Namespace) -> int:
    if ns.config:
        return cmd_recommend_live(ns)
    paths = [Path(p) for p in ns.engine_metrics]
    if len(paths) < 2:
        raise ConfigError("--engine-metrics", [("", f"one file is one snapshot, and a decision needs at least "
                                                    f"{ns.min_snapshots}: give --engine-metrics once per file")])
    meta = inputs.meta(paths[0].parent)
    snaps = inputs.metrics_files(paths, inputs.times(paths, ns.window_seconds), ns.kind)
    args = inputs.engine_args(ns.args, meta)
    decisions = recorded_timeline(ns, snaps, args=args, apply=False)
    last = answering(decisions)
    _nothing_read("recommend", snaps)
    hint = needs(last, more=MORE_FILES)
    if hint and ns.format != "table":
        arguments.say(f"recommend: {hint}")
    if ns.format == "production-stack":
        print("\n".join(_stack_diff(last, args, ns.model_name)))
        return 0
    if ns.format == "json":
        print(json.dumps(secrets.DEFAULT.data(recommendation_json(last)), indent=2))
        return 0
    span = snaps[-1].scraped_at - snaps[0].scraped_at
    print(f"recommend ({ns.kind}): {len(snaps)} snapshots over {span:.0f}s, {len(decisions)} steps; "
          f"args: {_shown(args)}")
    if last is not decisions[-1]:
        final = decisions[-1]
        said = final.plan.summary().split(": ", 1)[-1] if final.plan is not None else final.skipped
        after = sum(d.at > last.at for d in decisions)
        print(f"  as of t+{last.at - snaps[0].scraped_at:.0f}s, the last step that sized a change; the {after} "
              f"step{'s' if after != 1 else ''} after it: {said}")
    print("\n".join(_decision_text(last)))
    if last.plan is not None:
        print(f"  restart needed: {'yes' if last.plan.restart_needed else 'no'}")
        if last.plan.changes:
            print(f"  args after: {_shown(last.plan.args_after)}")
    if hint:
        print(f"  NEEDS   {hint}")
    return 0


def cmd_replay(ns: argparse.Namespace) -> int:
    directory = Path(ns.dir)
    meta = inputs.meta(directory)
    snaps = inputs.recorded(directory, kind=ns.kind, spacing=ns.window_seconds)
    args = inputs.engine_args(ns.args, meta)
    decisions = recorded_timeline(ns, snaps, args=args, apply=True)
    _nothing_read("replay", snaps)
    if ns.format == "json":
        out = [dict(d.plan.as_dict(), window_snapshots=len(d.state.window)) if d.plan is not None else
               {"at": d.at, "skipped": d.skipped, "window_snapshots": len(d.state.window)} for d in decisions]
        print(json.dumps(secrets.DEFAULT.data({"dir": str(directory), "args": args.argv(), "cycles": out}), indent=2))
        return 0
    t0 = snaps[0].scraped_at if snaps else 0.0
    print(f"replay {directory} ({ns.kind}): {len(snaps)} snapshots, args: {_shown(args)}")
    final = args
    for d in decisions:
        if d.plan is None:
            print(f"t+{d.at - t0:5.0f}s  no plan: {d.skipped}")
            continue
        print(f"t+{d.at - t0:5.0f}s  {d.plan.summary()}")
        if ns.verbose:
            for line in decision_lines(d.plan, unknown=True):
                print("       " + line)
        else:
            for ch in d.plan.changes:
                print(f"         {ch.flag}: {ch.reason}")
            for h in d.plan.held:
                if h.later and h.would is not None and not d.plan.changes:
                    flag, before, after = h.would
                    print(f"         later: {flag} {knobs.format_value(before)}→{knobs.format_value(after)} "
                          f"({h.rule}) [{h.guard}]: {_when(h.reason)}")
        if d.plan.changes:
            final = d.plan.args_after
    print(f"final args: {_shown(final)}")
    if not any(d.plan is not None and d.plan.changes for d in decisions) and (hint := needs(decisions[-1],
                                                                                           more=MORE_IN_DIR)):
        print(f"needs: {hint}")
    return 0


def add_decision_options(p: argparse.ArgumentParser, *, formats: Sequence[str]) -> None:
    p.add_argument("--args", metavar="TEXT",
                   help='the current engine arguments, e.g. --args="--max-num-seqs 256 --max-model-len 8k" '
                        "(default: engine_args from meta.json next to the files, else none)")
    p.add_argument("--rules", action="append", metavar="FILE",
                   help="rule file (repeatable; default: the shipped rules/default.yaml)")
    p.add_argument("--kind", choices=sorted(dialects.DIALECTS), default="vllm", help="engine kind (default vllm)")
    p.add_argument("--max-model-len", type=arguments.at_least(1), help="the served max_model_len (default: from --args)")
    p.add_argument("--window-seconds", type=arguments.positive_float, default=None,
                   help="seconds between consecutive files (default: meta.json scraped_at or file names, "
                        f"else {inputs.DEFAULT_SPACING_SECONDS:g})")
    p.add_argument("--span", type=arguments.positive_float, default=SCRAPE_DEFAULTS.window_seconds,
                   help=f"window length per step in seconds (default {SCRAPE_DEFAULTS.window_seconds:g}, "
                        "as scrape.window_seconds)")
    p.add_argument("--min-snapshots", type=arguments.at_least(2), default=SCRAPE_DEFAULTS.min_snapshots,
                   help=f"fewest snapshots per window (default {SCRAPE_DEFAULTS.min_snapshots}, "
                        "as scrape.min_snapshots)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--dcgm-metrics", metavar="FILE", help="a saved dcgm-exporter /metrics body")
    gpu.add_argument("--gpu-readings", metavar="FILE",
                     help="GPU readings as JSON (a bench/record_nvml.py recording or a list of readings)")
    p.add_argument("--gpu-sample", type=arguments.at_least(-(2**31)), default=-1, help="which recording sample (default: the last)")
    p.add_argument("--slowdown-temp-c", type=arguments.finite_float, help="GPU slowdown temperature for DCGM data")
    p.add_argument("--platform", choices=knobs.PLATFORMS,
                   help="attention platform, for block-size validity and vLLM's defaults")
    p.add_argument("--gpu-memory-gib", type=arguments.positive_float, help="memory per GPU (vLLM's CUDA defaults depend on it)")
    p.add_argument("--default", action="append", metavar="FLAG=VALUE",
                   help="a known value of a flag absent from --args (repeatable), e.g. --default=--max-num-seqs=1024 "
                        "or --default max_num_seqs=1024")
    p.add_argument("--decisions", metavar="FILE", help="YAML with guard/planner settings (the decisions: section)")
    if "production-stack" in formats:
        p.add_argument("--format", choices=list(formats), default="table",
                       help="production-stack: the change as a diff of vLLM production-stack's Helm values, "
                            "servingEngineSpec.modelSpec[].vllmConfig, for a GitOps review")
        p.add_argument("--model-name", default="MODEL", help="with --format production-stack: the modelSpec's name")
    else:
        p.add_argument("--format", choices=list(formats), default="table",
                       help="table or json (a Helm values diff is `recommend --format production-stack`'s)")


def register(subparsers: Any) -> None:
    """Add ``recommend`` and ``replay`` to the main parser's subcommands."""
    p = subparsers.add_parser("recommend", help="dry run: what would the tuner change, and why (live or files)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-metrics", action="append", metavar="FILE",
                     help="a saved /metrics body; several are consecutive snapshots")
    src.add_argument("--config", metavar="FILE",
                     help="a tuner config: scrape its targets live (--samples scrapes, --window-seconds apart; "
                          "default 3 scrapes 10 s apart) and recommend for each; never touches an engine")
    p.add_argument("--samples", type=arguments.at_least(1), default=3,
                   help="live scrapes per target with --config (default 3)")
    add_decision_options(p, formats=("table", "json", "production-stack"))
    p.set_defaults(func=cmd_recommend)

    p = subparsers.add_parser("replay", help="run a directory of timestamped snapshots through the planner")
    p.add_argument("dir", help="NNN.prom + meta.json (scraped_at), or <unix-seconds>.prom files")
    p.add_argument("-v", "--verbose", action="store_true", help="show every held rule and action per cycle")
    add_decision_options(p, formats=("table", "json"))
    p.set_defaults(func=cmd_replay)
