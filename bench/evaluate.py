"""The evaluation harness: the tuner from a bad start against the best static configuration.

One seeded trace (steady, a step up, a burst, long prompts), played open-loop through real nginx in
front of real vLLM replicas, against:

- ``bad``: the bad start held static (``bad-restart`` when held by its own engine start);
- ``tuner``: ``vllm-tuner run`` (apply mode, process actuator, nginx drain) from the bad start;
- ``tuner-live``: the same tuner with its live knobs on (``live.enabled``), from engines started with a
  wide envelope and the live-knob plugin, the cap at the bad start;
- ``sweep``: static configurations (``sweep-<value>``, or ``sweep-<value>-restart``); the best goodput among
  them is the oracle;
- ``default``: the engine's defaults (no ``--max-num-seqs``).

Usage (docs/evaluation.md has the whole story)::

    python -m bench.evaluate --profile bench/evaluation/profiles/cpu.yaml --out results/cpu
    python -m bench.evaluate --profile PROFILE --out DIR --arms tuner --tuner-config FILE --tuner-arm tuner-x
    python -m bench.evaluate --profile PROFILE --out DIR --arms sweep --sweep-values 32,64
    python -m bench.evaluate --report-only DIR
    python -m bench.evaluate --pack DIR tests/fixtures/evaluation/NAME

Each invocation appends its arms to ``DIR`` (an arm run again replaces its own data); the trace in
``DIR`` must be the profile's. The report (``DIR/report.md``, ``DIR/plots/*.png``, ``DIR/summary.json``)
is rendered from the raw data of every arm present.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.evaluation import profiles, reporting

if TYPE_CHECKING:
    from collections.abc import Callable

    from bench.evaluation import arms as arms_mod

ARMS = ("bad", "sweep", "default", "tuner", "tuner-live")


def _values(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {', '.join(unknown) or '(none)'}; known: {', '.join(ARMS)}")
    return arms


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.evaluate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, help="the profile (bench/evaluation/profiles/*.yaml)")
    p.add_argument("--out", type=Path, help="the results directory (created; arms are appended)")
    p.add_argument("--arms", type=_arms, help=f"which arms, in this order (default: bad,sweep,default,tuner; "
                                               f"tuner-live); known: {', '.join(ARMS)}")
    p.add_argument("--sweep-values", type=_values, help="only these values of the profile's sweep")
    p.add_argument("--static-mode", choices=("plugin", "restart"),
                   help="how the bad start and the sweep are held, instead of the profile's static_mode and "
                        "sweep.mode: plugin (the cap on one wide-envelope start; arms bad, sweep-N) or restart (an "
                        "engine start per value; arms bad-restart, sweep-N-restart)")
    p.add_argument("--tuner-config", type=Path, help="the tuner arm's settings instead of the profile's")
    p.add_argument("--tuner-arm", default=None, help="name of the tuner arm (default: tuner / tuner-live); "
                                                      "e.g. tuner-defaults for a variant")
    p.add_argument("--report-only", type=Path, metavar="DIR", help="only re-render DIR's report from its raw data")
    p.add_argument("--pack", nargs=2, type=Path, metavar=("DIR", "DEST"),
                   help="copy DIR's raw data, report and plots to DEST compactly (gzip'd records, no engine logs), "
                        "e.g. to commit under tests/fixtures/evaluation/")
    p.add_argument("--no-report", action="store_true", help="run the arms, do not render the report")
    p.add_argument("--no-plots", action="store_true", help="render the report without the PNG plots")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.report_only is not None:
        if not (a.report_only / "run.json").exists():
            print(f"evaluate: {a.report_only} is not a results directory (no run.json)", file=sys.stderr)
            return 2
        print(reporting.render(a.report_only, plots=not a.no_plots))
        return 0
    if a.pack is not None:
        from bench.evaluation import packing

        src, dest = a.pack
        if not (src / "run.json").exists():
            print(f"evaluate: {src} is not a results directory (no run.json)", file=sys.stderr)
            return 2
        written = packing.pack(src, dest)
        print(f"{dest}: {len(written)} files, {sum(p.stat().st_size for p in written) / 1e6:.1f} MB")
        return 0
    if a.profile is None or a.out is None:
        print("evaluate: --profile and --out are needed (or --report-only DIR)", file=sys.stderr)
        return 2
    from bench.evaluation import arms as arms_mod  # needs httpx, the tuner and tests.support

    try:
        profile, base = profiles.load(a.profile)
    except profiles.ProfileError as exc:
        print(f"evaluate: {exc}", file=sys.stderr)
        return 2
    chosen = a.arms or ["bad", "sweep", "default", "tuner", "tuner-live"]
    values = a.sweep_values or profile.sweep.values
    if a.sweep_values and not set(a.sweep_values) <= set(profile.sweep.values):
        print(f"evaluate: --sweep-values {a.sweep_values} are not all in the profile's sweep {profile.sweep.values}",
              file=sys.stderr)
        return 2
    command = "python -m bench.evaluate " + shlex.join(argv)
    try:
        ctx = arms_mod.prepare(profile, base, a.out)
        arms_mod.write_run(ctx, command=command)
        run_arms(ctx, chosen, values=values, tuner_config=a.tuner_config, tuner_arm=a.tuner_arm,
                 static_mode=a.static_mode)
    except (arms_mod.HarnessError, profiles.ProfileError, TimeoutError) as exc:
        print(f"evaluate: {exc}", file=sys.stderr)
        return 1
    if not a.no_report:
        print(reporting.render(a.out, plots=not a.no_plots))
    return 0


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def run_arms(ctx: arms_mod.Context, chosen: list[str], *, values: list[int], tuner_config: Path | None,
             tuner_arm: str | None, static_mode: str | None = None) -> None:
    from bench.evaluation import arms as arms_mod

    p = ctx.profile
    bad_label = f"--max-num-seqs {p.bad_start}"
    plugin_arms: list[tuple[str, int | None, str]] = []
    restart_arms: list[tuple[str, int | None, str]] = []
    if "bad" in chosen:
        if (static_mode or p.static_mode) == "plugin":
            plugin_arms.append(("bad", p.bad_start, bad_label))
        else:
            restart_arms.append(("bad-restart", p.bad_start, bad_label))
    if "sweep" in chosen:
        for v in values:
            if (static_mode or p.sweep.mode) == "plugin":
                plugin_arms.append((f"sweep-{v}", v, f"--max-num-seqs {v}"))
            else:
                restart_arms.append((f"sweep-{v}-restart", v, f"--max-num-seqs {v}"))
    if "default" in chosen:
        (plugin_arms if plugin_arms else restart_arms).append(("default", None, "engine defaults"))

    def summary(meta: dict) -> None:
        log(f"   {meta['arm']}: {meta['requests']} requests, {meta['failed']} failed, "
            f"{meta['end'] - meta['start_at']:.0f} s")

    def plugin_arms_on(pool: arms_mod.StaticPool) -> None:
        for name, cap, label in plugin_arms:
            how = "engine defaults (cap released)" if cap is None else "static, cap via plugin"
            log(f"arm {name}: {how}" if cap is None else f"arm {name}: {label} ({how})")
            summary(arms_mod.run_static(ctx, pool, name, cap=cap, mode="plugin", how=how, flags_label=label))

    def run_tuner_arm(kind: str, then: Callable[[arms_mod.TunerPool], None] | None = None) -> None:
        live = kind == "tuner-live"
        setting = tuner_config or ((p.tuner.live_config or p.tuner.config) if live else p.tuner.config)
        assert setting is not None
        template = setting if isinstance(setting, Path) else p.path(setting, ctx.base)
        name = tuner_arm or kind
        log(f"arm {name}: the tuner from --max-num-seqs {p.bad_start} ({'live cap' if live else 'restarts'}), "
            f"settings {template}")
        summary(arms_mod.run_tuner(ctx, name, template=template, live=live, then=then))

    shared = p.share_engines and bool(plugin_arms) and "tuner-live" in chosen
    if shared:  # the live tuner arm first; the plugin arms then run on its engines (profiles.Profile.share_engines)
        def after_tuner(tuner_pool: arms_mod.TunerPool) -> None:
            log(f"the plugin arms ({', '.join(n for n, _, _ in plugin_arms)}) on the live tuner arm's engines")
            pool = arms_mod.SharedPool(ctx, tuner_pool).start()
            log(f"   envelope --max-num-seqs {pool.envelope}")
            plugin_arms_on(pool)

        run_tuner_arm("tuner-live", after_tuner)
    elif plugin_arms:
        log(f"starting {p.replicas} wide-envelope replicas with the live-knob plugin (one start for "
            f"{', '.join(n for n, _, _ in plugin_arms)})")
        with arms_mod.StaticPool(ctx, "wide", max_num_seqs=None, plugin=True) as pool:
            log(f"   up after {pool.started_seconds:.0f} s; envelope --max-num-seqs {pool.envelope}")
            plugin_arms_on(pool)
    for name, seqs, label in restart_arms:
        log(f"arm {name}: starting {p.replicas} replicas at {label}")
        with arms_mod.StaticPool(ctx, name, max_num_seqs=seqs, plugin=False) as pool:
            log(f"   up after {pool.started_seconds:.0f} s")
            summary(arms_mod.run_static(ctx, pool, name, cap=None, mode="restart",
                                        how="static, own engine start", flags_label=label))
    for kind in ("tuner", "tuner-live"):
        if kind in chosen and not (shared and kind == "tuner-live"):
            run_tuner_arm(kind)


if __name__ == "__main__":
    sys.exit(main())
