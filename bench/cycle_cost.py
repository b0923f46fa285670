"""CPU cost of one tuner cycle's parse + signal work, and the memory of the windows it keeps.

Prints figures; asserts nothing. Inputs are copies of real captures (tests/fixtures): a vLLM 0.32
exposition from the queue-bound scenario and a full dcgm-exporter scrape replicated to 8 GPUs (the
`gpu`/`UUID` labels changed per copy). Each engine copy gets its own `model_name`, so label sets are
not shared between targets more than they would be in a real fleet of distinct models, and is parsed as
scraped from its own URL (``source``: the daemon's scrape passes the target's URL, ``sources.scraping``).

    python -m bench.cycle_cost [--cycles 15] [--targets 512] [--window 10] [--cadence-targets 64] [--split]

The last figure is the daemon's own decision path at the shipped cadence (``scrape.interval_seconds`` 2 s,
the 20 s decision window, the thinned 300 s window, the shipped rules): the parse and ``stepping.step`` per
target per cycle, as the cycle calls them, its CPU per cycle as a share of one core (target ≤ 5 %), and the
snapshots it keeps. ``--split`` also says where that time goes, per target per cycle: the parse, the engine
signals (the long window and the decision window), the decision window's search, the planner (the rules),
and the rest of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tuner import config
from tuner.model import dcgm, dialects, knobs, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import planner, stepping
from tuner.rules import loading
from tuner.signals import engine as engine_signals
from tuner.signals import gpu as gpu_signals

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"


def engine_texts() -> list[str]:
    files = sorted((FIX / "vllm" / "queue-bound").glob("*.prom"))
    return [f.read_text() for f in files]


def dcgm_8gpu_text() -> str:
    text = (FIX / "dcgm" / "rtx4000ada-k8s-full.prom").read_text()
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    out = []
    for gpu in range(8):
        for line in body:
            out.append(line.replace('gpu="0"', f'gpu="{gpu}"').replace("GPU-a8394b51", f"GPU-a8394b5{gpu}"))
    return "\n".join(out) + "\n"


DCGM_URL = "http://dcgm-exporter:9400/metrics"


def url(target: int) -> str:
    """The URL target ``target`` is scraped from: what the daemon's scrape passes ``parse`` as ``source``."""
    return f"http://engine-{target}:8000/metrics"


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_engine_cycle(texts: list[str], dcgm_text: str, window: int, cycles: int) -> list[float]:
    prefixes = dialects.VLLM.parse_prefixes()
    dprefixes = dcgm.dcgm_keep_prefixes()
    hist = [snapshots.parse(texts[i % len(texts)], i * 30.0, keep_prefixes=prefixes, source=url(0))
            for i in range(window)]
    costs = []
    for c in range(cycles):
        t0 = time.process_time()
        snap = snapshots.parse(texts[c % len(texts)], (window + c) * 30.0, keep_prefixes=prefixes, source=url(0))
        hist = [*hist[1:], snap]
        dsnap = snapshots.parse(dcgm_text, (window + c) * 30.0, keep_prefixes=dprefixes, source=DCGM_URL)
        readings = dcgm.readings_from_snapshot(dsnap, slowdown_temp_c=89.0)
        signals = engine_signals.compute(hist)
        signals.update(gpu_signals.compute(readings))
        costs.append(time.process_time() - t0)
        assert len(readings) == 8 and signals["requests_running"].value is not None
    return costs


def fleet_cycle(texts: list[str], targets: int, window: int, cycles: int) -> tuple[list[float], float, float]:
    prefixes = dialects.VLLM.parse_prefixes()
    per_target = [[t.replace('model_name="', f'model_name="m{i}-') for t in texts] for i in range(targets)]
    gc.collect()
    before = rss_mib()
    windows = [[snapshots.parse(per_target[i][k % len(texts)], k * 30.0, keep_prefixes=prefixes, source=url(i))
                for k in range(window)] for i in range(targets)]
    held = rss_mib() - before
    costs = []
    for c in range(cycles):
        t0 = time.process_time()
        for i in range(targets):
            snap = snapshots.parse(per_target[i][c % len(texts)], (window + c) * 30.0, keep_prefixes=prefixes,
                                   source=url(i))
            windows[i] = [*windows[i][1:], snap]
            engine_signals.compute(windows[i])
        costs.append(time.process_time() - t0)
    return costs, held, rss_mib()


_CUMULATIVE = re.compile(r"^(\S+?(?:_total|_count|_sum|_bucket)(?:\{[^}]*\})?) (\S+)$")


def looped(texts: list[str], c: int) -> str:
    """Scrape ``c`` of a capture played in a loop: the loaded files in turn, every cumulative series (counters,
    histogram buckets) advanced by what it grew over the capture per pass, so the engine stays loaded and no
    counter goes back."""
    loaded = texts[1:-1]
    k, passes = c % len(loaded), c // len(loaded)
    if passes == 0:
        return loaded[k]
    first, last = texts[1].splitlines(), texts[-2].splitlines()
    out = []
    for line, a, b in zip(loaded[k].splitlines(), first, last, strict=True):
        m, ma, mb = _CUMULATIVE.match(line), _CUMULATIVE.match(a), _CUMULATIVE.match(b)
        if m and ma and mb and ma.group(1) == mb.group(1) == m.group(1):
            value = float(m.group(2)) + passes * (float(mb.group(2)) - float(ma.group(2)))
            line = f"{m.group(1)} {value!r}"
        out.append(line)
    return "\n".join(out) + "\n"


def _timer(f: Callable[..., Any], name: str, parts: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.process_time()
        try:
            return f(*a, **k)
        finally:
            parts[name] = parts.get(name, 0.0) + time.process_time() - t0
    return wrapper


@contextlib.contextmanager
def timed(parts: dict[str, float]) -> Iterator[None]:
    """While inside: the CPU seconds spent in the step's parts, added up in ``parts``."""
    patched: list[tuple[Any, str, Callable[..., Any]]] = []
    for name, owner, attr in (("engine signals", engine_signals, "compute"), ("planner", planner, "plan"),
                              ("decision window", stepping, "decision_window")):
        patched.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, _timer(getattr(owner, attr), name, parts))
    try:
        yield
    finally:
        for owner, attr, f in patched:
            setattr(owner, attr, f)


def cadence_cycle(texts: list[str], targets: int, cycles: int, split: dict[str, list[float]] | None = None
                  ) -> tuple[list[float], float, int]:
    """The parse and ``stepping.step`` for every target every ``interval_seconds`` (the shipped cadence), after a
    warm-up long enough to fill the thinned long window: CPU seconds per cycle, the interval, snapshots kept per
    target. ``split``: filled with each part's CPU seconds per cycle (``timed``)."""
    scrape = config.ScrapeSettings()
    window = scrape.window_settings()
    interval = scrape.interval_seconds
    rules = tuple(loading.load(loading.default_rules_path()))
    settings = planner.DecisionSettings()
    args = knobs.EngineArgs.parse(["--max-num-seqs", "4", "--max-model-len", "2048"])
    prefixes = dialects.VLLM.parse_prefixes()
    per_target = [[t.replace('model_name="', f'model_name="m{i}-') for t in texts] for i in range(targets)]
    info, gpus = EngineInfo(max_model_len=2048), GpuInputs(unavailable="none in this benchmark")
    states = [stepping.TargetState() for _ in range(targets)]
    warm = int(scrape.window_seconds / interval) + 5
    costs = []
    for c in range(warm + cycles):
        now = c * interval
        bodies = [looped(per_target[i], c) for i in range(targets)]  # the scrapes' bodies, made outside the clock
        parts: dict[str, float] = {"parse": 0.0}
        with timed(parts) if split is not None else contextlib.nullcontext():
            t0 = time.process_time()
            for i in range(targets):
                t1 = time.process_time()
                snap = snapshots.parse(bodies[i], now, keep_prefixes=prefixes, source=url(i))
                parts["parse"] += time.process_time() - t1
                d = stepping.step(states[i], snap, info=info, gpus=gpus, now=now, target=f"t{i}", kind="vllm",
                                  args=args, settings=settings, window=window, rules=rules)
                states[i] = d.state
            cost = time.process_time() - t0
        if c >= warm:
            costs.append(cost)
            if split is not None:
                parts["rest of the step"] = cost - sum(parts.values())
                for name, seconds in parts.items():
                    split.setdefault(name, []).append(seconds)
    return costs, interval, max(len(s.window) for s in states)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=15)
    ap.add_argument("--targets", type=int, default=512)
    ap.add_argument("--window", type=int, default=10, help="snapshots kept per target (300 s at 30 s)")
    ap.add_argument("--cadence-targets", type=int, default=64, help="targets for the shipped-cadence figure")
    ap.add_argument("--split", action="store_true", help="say where the shipped-cadence figure's time goes")
    args = ap.parse_args()
    texts = engine_texts()
    dtext = dcgm_8gpu_text()
    print(f"inputs: vLLM capture {len(texts[0]) / 1024:.0f} KiB ({texts[0].count(chr(10))} lines), "
          f"dcgm 8 GPUs {len(dtext) / 1024:.0f} KiB ({dtext.count(chr(10))} lines); window {args.window}")
    one = one_engine_cycle(texts, dtext, args.window, max(args.cycles, 30))
    print(f"one engine + 8 GPUs: median {statistics.median(one) * 1000:.2f} ms CPU per cycle "
          f"(min {min(one) * 1000:.2f}, max {max(one) * 1000:.2f}; target ≤ 20 ms)")
    fleet, held, peak = fleet_cycle(texts, args.targets, args.window, args.cycles)
    print(f"{args.targets} engine targets: median {statistics.median(fleet):.3f} s CPU per cycle "
          f"(min {min(fleet):.3f}, max {max(fleet):.3f}; target ≤ 1.5 s)")
    print(f"memory: {held:.0f} MiB for {args.targets}×{args.window} snapshots; peak RSS {peak:.0f} MiB")
    cad, interval, kept = cadence_cycle(texts, args.cadence_targets, args.cycles)
    med = statistics.median(cad)
    print(f"{args.cadence_targets} targets at the shipped cadence (parse + stepping.step, shipped rules, a cycle every "
          f"{interval:g} s): median {med:.3f} s CPU per cycle (min {min(cad):.3f}, max {max(cad):.3f}) = "
          f"{med / interval:.1%} of one core (target ≤ 5 %); {kept} snapshots kept per target")
    if args.split:
        split: dict[str, list[float]] = {}
        cadence_cycle(texts, args.cadence_targets, args.cycles, split)
        total = sum(statistics.median(v) for v in split.values())
        print(f"where it goes (medians per target per cycle; timers on, {total / args.cadence_targets * 1000:.2f} ms "
              "in all):")
        for name, values in split.items():
            m = statistics.median(values)
            print(f"  {name:<18} {m / args.cadence_targets * 1000:6.3f} ms  {m / total:4.0%}")


if __name__ == "__main__":
    main()
