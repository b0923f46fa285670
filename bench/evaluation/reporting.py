"""The results directory → ``report.md``, ``summary.json`` and the PNG plots.

Reads only the raw data the arms wrote (``trace.json``, ``arms/<arm>/{meta.json, requests.jsonl,
samples.jsonl}`` and, for tuner arms, ``arms/<arm>/tuner/journal.jsonl``), so ``--report-only DIR``
re-renders everything from a copy of the directory. matplotlib is needed for the plots only (the dev
extra has it; the GPU machine does not need it: render there without plots, or copy the directory back).
"""

from __future__ import annotations

import collections
import gzip
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.evaluation import analysis
from tuner.model import gpus as gpu_model

# the clock-event reasons that mean the driver held the clock for power or heat (not idle, not an app setting)
POWER_OR_HEAT = gpu_model.SW_POWER_CAP | gpu_model.HW_POWER_BRAKE_SLOWDOWN | gpu_model.THERMAL_MASK | gpu_model.HW_SLOWDOWN


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file, or its gzip'd copy ``<path>.gz`` (committed fixtures are compressed)."""
    if path.exists():
        text = path.read_text()
    elif path.with_name(path.name + ".gz").exists():
        text = gzip.decompress(path.with_name(path.name + ".gz").read_bytes()).decode()
    else:
        return []
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a torn last line (a killed run)
    return out


class Arm:
    """One arm's raw data and what follows from it."""

    def __init__(self, directory: Path, *, trace: Mapping[str, Any], slo: Mapping[str, float],
                 quiet_s: float) -> None:
        self.dir = directory
        self.meta: dict[str, Any] = json.loads((directory / "meta.json").read_text())
        self.requests = read_jsonl(directory / "requests.jsonl")
        self.samples = read_jsonl(directory / "samples.jsonl")
        self.gpu = read_jsonl(directory / "gpu.jsonl")
        self.journal = read_jsonl(directory / "tuner" / "journal.jsonl")
        self.name: str = self.meta["arm"]
        self.start_at = float(self.meta["start_at"])
        self.duration = float(trace["duration"])
        replicas = list(self.meta.get("replicas", {}))
        initial = self.meta.get("initial_flags", {})
        restarts: dict[str, int] = {}
        converge: dict[str, Any] | None = None
        self.restart_spans: list[analysis.Restart] = []
        if self.meta["kind"] == "tuner":
            jchanges, self.restart_spans, facts = analysis.journal_flags(
                self.journal, start_at=self.start_at, initial={n: initial.get(n) for n in replicas})
            restarts = facts["restarts"]
            achanges = analysis.ack_flags(self.samples, start_at=self.start_at) if self.meta["mode"] == "live" else []
            self.changes = jchanges + achanges
            converge = analysis.convergence(self.changes, decisions_at=facts["decisions_at"],
                                            in_flight=facts["in_flight_at_end"], duration=self.duration,
                                            quiet_s=quiet_s)
            self.facts = facts
        else:
            achanges = analysis.ack_flags(self.samples, start_at=self.start_at)
            self.changes = achanges or [analysis.FlagChange(n, 0.0, initial.get(n), "static") for n in replicas]
            self.facts = {}
        self.summary = analysis.summarize(self.meta, self.requests, slo=slo, duration=self.duration,
                                          converge=converge, restarts=restarts)
        self.bins: list[dict[str, Any]] = []

    def decisions(self) -> list[dict[str, Any]]:
        return [r for r in self.journal if r.get("kind") == "decision"]


def read_json(path: Path) -> Any:
    """A JSON file, or its gzip'd copy ``<path>.gz``."""
    if not path.exists() and path.with_name(path.name + ".gz").exists():
        return json.loads(gzip.decompress(path.with_name(path.name + ".gz").read_bytes()))
    return json.loads(path.read_text())


def load_arms(results: Path, *, slo: Mapping[str, float], quiet_s: float) -> tuple[dict[str, Any], list[Arm]]:
    trace = read_json(results / "trace.json")
    arms = [Arm(d, trace=trace, slo=slo, quiet_s=quiet_s) for d in sorted((results / "arms").iterdir())
            if (d / "meta.json").exists()]

    def order(a: Arm) -> tuple[int, float, str]:
        if a.name.startswith("sweep-"):
            return (1, float(a.meta.get("flags", {}).get("max_num_seqs") or 0), a.name)
        return (0 if a.name.startswith("bad") else 2 if a.name == "default" else 3, 0.0, a.name)

    return trace, sorted(arms, key=order)


def _fmt(v: float | None, unit: str = "s", digits: int = 3) -> str:
    if v is None:
        return "–"
    if unit == "s" and v >= 10:
        return f"{v:.1f} s"
    return f"{v:.{digits}f} {unit}".strip()


def render(results: Path, *, plots: bool = True) -> Path:
    """Write ``report.md``, ``summary.json`` and (``plots``) ``plots/*.png`` into ``results``."""
    meta_run = json.loads((results / "run.json").read_text())
    slo = meta_run["slo"]
    timings = meta_run["timings"]
    trace, arms = load_arms(results, slo=slo, quiet_s=timings["converge_quiet_seconds"])
    for a in arms:
        a.bins = analysis.bins(a.requests, start_at=a.start_at, duration=a.duration, width=timings["bin_seconds"],
                               slo=slo)
    summaries = {a.name: a.summary for a in arms}
    tuner_arms = [a for a in arms if a.meta["kind"] == "tuner"]
    all_goals = {a.name: analysis.goals(summaries, tuner_arm=a.name, replicas=meta_run["replicas"])
                 for a in tuner_arms}
    (results / "summary.json").write_text(json.dumps({
        "profile": meta_run["profile"], "slo": slo, "trace_digest": trace["digest"],
        "arms": {n: s.as_dict() for n, s in summaries.items()},
        "goals": {n: [g.__dict__ for g in gs] for n, gs in all_goals.items()},
    }, indent=1))
    pngs: list[str] = []
    plot_note = ""
    if plots:
        try:
            pngs = _plots(results, arms, trace)
        except ImportError:
            plot_note = "matplotlib is not installed here: no plots (render again with `--report-only`)."
    (results / "report.md").write_text(_markdown(meta_run, trace, arms, all_goals, pngs, plot_note))
    return results / "report.md"


def _measured_on(run: Mapping[str, Any]) -> str:
    """The report's "Measured on: …" from run.json's ``gpus`` (NVML's names, recorded at the run); nothing for
    runs that predate the record."""
    counts = collections.Counter(run.get("gpus") or [])
    if not counts:
        return ""
    return " Measured on: " + ", ".join(f"{n} × {g}" if n > 1 else g for g, n in counts.items()) + "."


def _markdown(run: Mapping[str, Any], trace: Mapping[str, Any], arms: Sequence[Arm],
              all_goals: Mapping[str, Sequence[analysis.Goal]], pngs: Sequence[str], plot_note: str) -> str:
    slo = run["slo"]
    lines = [f"# Evaluation: {run['profile']}", ""]
    if run.get("description"):
        lines += [run["description"].strip(), ""]
    lines += [
        f"SLO: TTFT ≤ {slo['ttft_seconds']:g} s and mean ITL ≤ {slo['itl_mean_seconds']:g} s per request "
        f"(and no error). Goodput = requests meeting it per second of the trace ({trace['duration']:g} s). "
        f"{run['replicas']} replicas behind nginx. Engine: {run.get('engine_version') or '?'}, "
        f"`{' '.join(run.get('engine_args', []))}`.{_measured_on(run)}",
        "",
        f"Trace (seed {trace['seed']}, digest `{trace['digest']}`, {len(trace['requests'])} requests):",
        "",
        "| phase | from | to | rate req/s | burstiness | prompt tokens | output tokens | requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in trace["phases"]:
        n = sum(1 for r in trace["requests"] if r["phase"] == p["name"])
        lines.append(f"| {p['name']} | {p['start']:g} s | {p['end']:g} s | {p['rate']:g} | {p['burstiness']:g} | "
                     f"{p['input_len']} | {p['output_len']} | {n} |")
    lines += ["", "## Arms", "",
              "| arm | how | flags | goodput req/s | throughput req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
              "| met SLO | failed | restarts | converged at (decided at) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        s = a.summary
        restarts = ", ".join(f"{k} {v}" for k, v in s.restarts.items()) if s.kind == "tuner" else "–"
        if s.kind != "tuner":
            conv = "–"
        elif s.converged and s.converge_s is not None:
            conv = f"{s.converge_s:.0f} s ({s.decided_s:.0f} s)" if s.decided_s is not None else "no change"
        else:
            conv = "not converged" + (f" (decided {s.decided_s:.0f} s)" if s.decided_s is not None else "")
        lines.append(
            f"| {s.arm} | {a.meta.get('how', s.mode)} | {s.flags} | {s.goodput:.2f} | {s.throughput:.2f} | "
            f"{_fmt(s.ttft_p50)} | {_fmt(s.ttft_p99)} | {_fmt(s.itl_p50)} | {_fmt(s.itl_p99)} | "
            f"{s.met_slo}/{s.requests} | {s.failed} | {restarts} | {conv} |")
    phases = [p["name"] for p in trace["phases"]]
    lines += ["", "Share of each phase's requests meeting the SLO:", "",
              "| arm | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for a in arms:
        per = analysis.by_phase(a.requests, slo=slo)
        cells = [f"{100 * per[p][0] / per[p][1]:.0f} %" if per.get(p, (0, 0))[1] else "–" for p in phases]
        lines.append(f"| {a.name} | " + " | ".join(cells) + " |")
    lines += _gpu_lines(arms)
    oracle = max((a.summary for a in arms if a.name.startswith("sweep-")), key=lambda s: s.goodput, default=None)
    if oracle is not None:
        lines += ["", f"Oracle (best static of the sweep): **{oracle.arm}**, {oracle.goodput:.2f} req/s."]
        default = next((a.summary for a in arms if a.name == "default"), None)
        if default is not None and default.goodput > oracle.goodput:
            lines.append(f"The engine's defaults did better still ({default.goodput:.2f} req/s).")
    for name, goal_list in all_goals.items():
        lines += ["", f"## Goals: `{name}`", "", "| goal | target | measured | met |", "|---|---|---|---|"]
        for g in goal_list:
            mark = "yes" if g.met else ("–" if g.met is None else "**no**")
            lines.append(f"| {g.name} | {g.target} | {g.measured} | {mark} |")
    tuner_arms = [a for a in arms if a.meta["kind"] == "tuner"]
    for a in tuner_arms:
        lines += ["", f"### What `{a.name}` did", ""]
        decisions = a.decisions()
        if not decisions and not analysis.real_changes(a.changes):
            lines.append("Nothing: no decision in the journal, no flag changed.")
        for d in decisions:
            lines.append(f"- {d['at'] - a.start_at:+.0f} s: {d.get('summary') or d.get('action') or d}")
        for r in a.restart_spans:
            back = f"{r.back_at:.0f} s" if r.back_at is not None else "not back before the end"
            lines.append(f"- replica {r.replica} out of service {r.out_at:.0f} s → {back} ({r.leg} leg)")
        for c in analysis.real_changes(a.changes):
            if c.source in ("journal", "ack"):
                lines.append(f"- {c.at:+.0f} s: {c.replica} serves {analysis.FLAG} "
                             f"{c.value if c.value is not None else 'default'} ({c.source})")
        if a.facts.get("in_flight_at_end"):
            lines.append(f"- rollout(s) still in flight when the trace ended: {', '.join(a.facts['in_flight_at_end'])}")
        lines.append(f"- tuner config: `{a.meta.get('tuner_config', '?')}`")
    failed = [a for a in arms if a.summary.failed]
    if failed:
        lines += ["", "## Failed requests", ""]
        for a in failed:
            for err, n in sorted(a.summary.errors.items(), key=lambda kv: -kv[1]):
                lines.append(f"- {a.name}: {n} × {err}")
    lines += ["", "## Plots", ""]
    if plot_note:
        lines.append(plot_note)
    for png in pngs:
        lines.append(f"![{png}](plots/{png})")
        lines.append("")
    lines += ["## How it ran", "", "```console"]
    for cmd in run.get("commands", []):
        lines.append(f"$ {cmd}")
    lines += ["```", ""]
    for a in arms:
        load = a.meta.get("host_load")
        load_text = f"; host load (1-min average) {load[0]:g} → {load[1]:g}" if load else ""
        lines.append(f"- `{a.name}`: {a.meta.get('how_long', '')} started {a.meta.get('started_iso', '?')}"
                     f"{load_text}; {a.meta.get('note', '')}".rstrip("; "))
    lines.append("")
    return "\n".join(lines)


def _plots(results: Path, arms: Sequence[Arm], trace: Mapping[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = results / "plots"
    out.mkdir(exist_ok=True)
    duration = float(trace["duration"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {a.name: colors[i % len(colors)] for i, a in enumerate(arms)}
    styles = ["-", "--", ":", "-."]

    def phases(ax: Any) -> None:
        for i, p in enumerate(trace["phases"]):
            if i % 2:
                ax.axvspan(p["start"], p["end"], color="0.93", zorder=0)
            ax.text((p["start"] + p["end"]) / 2, 1.0, p["name"], transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8)

    names = []
    # 1. flags over time, with restart marks; past the trace's end when a tuner was still rolling out
    horizon = max([duration, *(c.at for a in arms for c in a.changes),
                   *(r.back_at for a in arms for r in a.restart_spans if r.back_at is not None)])
    horizon = duration if horizon <= duration else horizon * 1.03
    fig, ax = plt.subplots(figsize=(10, 4.5))
    phases(ax)
    if horizon > duration:
        ax.axvline(duration, color="black", linestyle="--", linewidth=1)
        ax.text(duration, 0.02, " trace ends", transform=ax.get_xaxis_transform(), fontsize=8)
    for a in arms:
        by_replica: dict[str, list[analysis.FlagChange]] = {}
        for c in a.changes:
            by_replica.setdefault(c.replica, []).append(c)
        for j, (rep, cs) in enumerate(sorted(by_replica.items())):
            cs = sorted(cs, key=lambda c: c.at)
            default = a.meta.get("envelope") or a.meta.get("default_max_num_seqs")
            xs, ys = [], []
            for c in cs:
                v = c.value if c.value is not None else default
                if v is None:
                    continue
                xs.append(max(0.0, c.at))
                ys.append(v)
            if not xs:
                continue
            xs.append(horizon)
            ys.append(ys[-1])
            label = a.name if len(by_replica) == 1 or a.meta["kind"] != "tuner" else f"{a.name} ({rep})"
            if a.meta["kind"] != "tuner" and j > 0:
                continue  # static arms: every replica alike
            ax.step(xs, ys, where="post", color=color[a.name], linestyle=styles[j % len(styles)], label=label,
                    linewidth=2 if a.meta["kind"] == "tuner" else 1)
        for r in a.restart_spans:
            end = r.back_at if r.back_at is not None else horizon
            ax.axvspan(r.out_at, end, color=color[a.name], alpha=0.12)
            ax.axvline(r.out_at, color=color[a.name], linestyle=":", linewidth=1)
    ax.set_yscale("log", base=2)
    ax.set_xlim(0, horizon)
    ax.set_xlabel("seconds since the trace's start")
    ax.set_ylabel("admission cap (--max-num-seqs)")
    ax.set_title("Flags over time (coloured band: a tuner replica drained and restarting; grey: phases)", pad=16)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(out / "flags.png", dpi=110)
    plt.close(fig)
    names.append("flags.png")
    # 2. goodput and 3. TTFT p99 over time
    for key, fname, ylabel, log in (("goodput", "goodput.png", "goodput (req/s meeting the SLO)", False),
                                    ("ttft_p99", "ttft_p99.png", "TTFT p99 (s)", True)):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        phases(ax)
        for a in arms:
            xs = [b["mid"] for b in a.bins if b[key] is not None]
            ys = [b[key] for b in a.bins if b[key] is not None]
            ax.plot(xs, ys, marker=".", color=color[a.name], label=a.name,
                    linewidth=2 if a.meta["kind"] == "tuner" else 1)
            for r in a.restart_spans:
                ax.axvline(r.out_at, color=color[a.name], linestyle=":", linewidth=1)
        if log:
            ax.set_yscale("log")
        ax.set_xlim(0, duration)
        ax.set_xlabel("seconds since the trace's start (requests binned by send time)")
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel + " per time bin; dotted: a tuner restart began", pad=16)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def _gpu_lines(arms: Sequence[Arm]) -> list[str]:
    """What the cards did while each arm ran (``gpu.jsonl``, arms recorded since 2026-12-06): the SM clock and
    the power while busy (GPU utilisation ≥ 50 %), and the share of those samples the driver was holding the
    clock for power (SW power cap, HW power brake) or heat. Nothing where no arm has GPU samples."""
    rows = []
    for a in arms:
        busy = [r for r in a.gpu if (r.get("gpu_util") or 0) >= 0.5]
        if not busy:
            continue

        def med(key: str, rows: list[dict[str, Any]] = busy) -> float | None:
            xs = [r[key] for r in rows if r.get(key) is not None]
            return statistics.median(xs) if xs else None

        clock, top, power, limit = med("sm_clock_mhz"), med("sm_clock_max_mhz"), med("power_w"), med("power_limit_w")
        held = [r for r in busy if (r.get("clocks_event_reasons") or 0) & POWER_OR_HEAT]
        rows.append(f"| {a.name} | {len(busy)} | {_num(clock)} of {_num(top)} MHz | {_num(power)} of {_num(limit)} W | "
                    f"{100 * len(held) / len(busy):.0f} % |")
    if not rows:
        return []
    return ["", "The GPU while busy (NVML, one sample a second; read-only):", "",
            "| arm | busy samples | SM clock (median) | power (median) | held for power or heat |",
            "|---|---|---|---|---|", *rows]


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.0f}"
