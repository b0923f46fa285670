"""One trace, every arm: the static sweep, vLLM's defaults, and the tuner — the whole loop of
``vllm-tuner run`` (``runtime.cycle.run_cycle``: collecting through the one engine client, ``stepping.step``,
pooling, the dispatcher and rollout machine with its verification, cooldowns and hysteresis, the live
apply and the restart path with its drain and start-up) — in virtual time, against the simulated pool of
``bench.family.pool``. Nothing of the tuner is replaced but its clock, its transport and its actuator.

Goodput as docs/evaluation.md defines it: requests that completed with every token, a TTFT ≤ 1 s and a
mean inter-token gap ≤ 0.1 s (the H200 profiles' SLO), per second of the trace's nominal length; a request
not answered within 150 s (the player's client timeout) failed.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.family.pool import Pool, Transport, bad_argv
from bench.family.traces import Trace
from tuner import config
from tuner.model import live as live_mod
from tuner.rollout import journal as journaling
from tuner.rules import loading
from tuner.runtime import collecting, cycle, dispatching
from tuner.runtime.state import TunerState
from tuner.sim.config import GpuModel
from tuner.sources import engines, scraping

TTFT_SLO, ITL_SLO, TIMEOUT = 1.0, 0.1, 150.0
FRONTEND_SECONDS = 0.018  # bench.family.calibration: nginx and the API server before a first token
SWEEP = (8, 16, 32, 64, 128, 256)  # with vLLM's default (1024 on an H200): the static arms
BAD_START = 8  # the H200 profiles' bad start
RULES = loading.load_all([loading.default_rules_path()])


@dataclass
class Arm:
    name: str
    goodput: float
    met: int
    requests: int
    failed: int
    changes: list[tuple[float, str, str]] = field(default_factory=list)  # (at, replica, what)
    restarts: int = 0
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    itl_p50: float = float("nan")  # the median request's mean inter-token gap

    def as_dict(self) -> dict[str, Any]:
        return {"arm": self.name, "goodput": round(self.goodput, 4), "met": self.met, "requests": self.requests,
                "failed": self.failed, "restarts": self.restarts,
                "changes": [[round(a, 1), r, w] for a, r, w in self.changes]}


def _finish(pool: Pool, trace: Trace) -> None:
    """The trace's tail: until every request is answered or the client timeout passed."""
    end = trace.duration + TIMEOUT
    while pool.now < end and pool.busy():
        pool.advance_to(min(end, pool.now + 5.0))


def static(trace: Trace, cap: int | None, *, gpu: GpuModel) -> Arm:
    """A static arm: the wide envelope with the admission cap held at ``cap`` (None: vLLM's default), as the
    H200 evaluation's plugin-mode static arms."""
    pool = Pool(trace, bad_argv(trace, cap=None), gpu=gpu, cap=cap)
    pool.advance_to(trace.duration)
    _finish(pool, trace)
    res = pool.results(ttft_slo=TTFT_SLO, itl_slo=ITL_SLO, timeout=TIMEOUT, frontend=FRONTEND_SECONDS)
    return Arm(f"static-{cap or 'default'}", res["goodput"], int(res["met"]), int(res["requests"]), int(res["failed"]),
               ttft_p50=res["ttft_p50"], ttft_p99=res["ttft_p99"],
               itl_p50=res["itl_p50"])


class _NoPlugin:
    """No plugin files: the live path is vLLM's /trimtab (the transport answers it)."""

    def read(self) -> live_mod.LiveState:
        return live_mod.LiveState(why_not="no plugin in the simulation")

    def request(self, seq: int, values: Mapping[str, int | None]) -> str | None:
        return "no plugin in the simulation"


class _Gatherer:
    """The cycle's collection, in the calling thread (virtual time has no deadlines to race)."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock

    def gather(self, collectors: Sequence[collecting.Collecting], *, deadline_seconds: float
               ) -> list[collecting.Inputs]:
        return [collecting.collect_one(c, clock=self.clock) for c in collectors]

    def close(self) -> None:
        pass


def settings_for(pool: Pool, *, live: bool, work: Path, overrides: Mapping[str, Any] | None = None
                 ) -> config.TunerSettings:
    """The shipped defaults (bench/evaluation/tuner/defaults.yaml is empty), in apply mode, the pool's
    replicas as targets, live knobs on or off."""
    raw: dict[str, Any] = {
        "mode": "apply",
        "targets": [{"name": r.name, "metrics_url": f"http://127.0.0.1:{r.port}/metrics", "args": list(r.argv)}
                    for r in pool.replicas.values()],
        "actuator": {"kind": "process", "command": ["vllm", "serve"], "state_dir": str(work / "engines")},
        "daemon": {"state_file": str(work / "state.json")},
        "rollout": {"journal_file": str(work / "journal.jsonl")},
        "live": {"enabled": live, "control_dir": str(work / "control" / "{name}")},
    }
    for key, value in (overrides or {}).items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return config.TunerSettings.model_validate(raw)


def tuner(trace: Trace, start: int | None, *, gpu: GpuModel, live: bool = True, startup_seconds: float = 90.0,
          overrides: Mapping[str, Any] | None = None, summaries: list[tuple[float, str]] | None = None,
          scrape_phase: float = 0.0) -> Arm:
    """The tuner from ``start`` (None: vLLM's default flags). Live: the wide envelope with the cap at
    ``start`` (the H200 ``tuner-live`` arm); restart: engines started with ``--max-num-seqs start``.
    ``scrape_phase`` (0 to 1) puts the tuner's first scrape that far into its first interval: where the
    trace's changes fall between two scrapes, which a real tuner started at any moment does not choose."""
    if not 0.0 <= scrape_phase < 1.0:
        raise ValueError(f"scrape_phase must be in [0, 1), got {scrape_phase}")
    argv = bad_argv(trace, cap=None if live else start)
    pool = Pool(trace, argv, gpu=gpu, cap=start if live else None, startup_seconds=startup_seconds)
    clock = lambda: pool.now  # noqa: E731 - the virtual clock every part of the tuner reads
    with tempfile.TemporaryDirectory(prefix="family-") as tmp:
        work = Path(tmp)
        settings = settings_for(pool, live=live, work=work, overrides=overrides)
        transport = Transport(pool)
        client = engines.EngineClient(scraping.HttpSettings(), transport=httpx.MockTransport(transport), clock=clock)
        state = TunerState.fresh(settings.targets, path=work / "state.json")
        journal = journaling.Journal(work / "journal.jsonl", fsync=False, lock=False)
        applying = dispatching.build(
            settings, state, client, actuator=pool.actuator(), drainer=pool.drainer(), journal=journal,
            kind="vllm", stop_event=threading.Event(), server_load=True, drains=not live,
            plugin=lambda name: None, clock=clock)
        collectors = [collecting.Collector(t, client=client, live=_NoPlugin() if live else None,
                                           slow_every_seconds=settings.scrape.gpu_interval_seconds, clock=clock)
                      for t in settings.targets]
        gatherer = _Gatherer(clock)
        interval, poll = settings.scrape.interval_seconds, settings.rollout.poll_seconds
        end = trace.duration + TIMEOUT
        next_cycle = pool.now + scrape_phase * interval
        while pool.now < end and (pool.now < trace.duration or pool.busy()):
            if pool.now >= next_cycle - 1e-9:
                result = cycle.run_cycle(state, settings=settings, collectors=collectors, rules=RULES,
                                         dispatcher=applying, gatherer=gatherer, now=pool.now,  # type: ignore[arg-type]
                                         monotonic=clock)
                if summaries is not None:
                    summaries.append((pool.now, result.summary))
                next_cycle += interval
            elif applying.busy:
                applying.advance()
            pool.advance_to(min(next_cycle, pool.now + poll))
        client.close()
        journal.close()
    res = pool.results(ttft_slo=TTFT_SLO, itl_slo=ITL_SLO, timeout=TIMEOUT, frontend=FRONTEND_SECONDS)
    changes = [e for e in pool.events if e[2].startswith(("cap", "budget", "start"))]
    restarts = sum(max(0, r.starts - 1) for r in pool.replicas.values())
    name = f"tuner-{'live' if live else 'restart'}-from-{start or 'default'}"
    return Arm(name, res["goodput"], int(res["met"]), int(res["requests"]), int(res["failed"]), changes, restarts,
               ttft_p50=res["ttft_p50"], ttft_p99=res["ttft_p99"],
               itl_p50=res["itl_p50"])


def evaluate(trace: Trace, *, mode: str, gpu: GpuModel, sweep: Sequence[int] = SWEEP, phases: int = 1
             ) -> dict[str, Any]:
    """Every arm of one trace: the static sweep (``sweep`` and vLLM's default; the start values always), the
    tuner from the bad start and from the defaults; the ratio to the best static and the harm (a tuner run
    that served fewer requests within the SLO than staying at its start flags, by more than one in 200).
    ``phases`` > 1 runs the bad start again with its first scrape at k / ``phases`` of an interval (k = 1 …
    phases − 1): ``ratio_phases`` holds every phase's ratio (the first the one above), ``harm_phases`` those
    runs' harm against staying at the bad start (not counted in ``harm``, the issue's figure)."""
    live = mode == "live"
    started = time.perf_counter()
    caps: list[int | None] = sorted({*sweep, BAD_START})
    statics = {cap: static(trace, cap, gpu=gpu) for cap in (*caps, None)}
    best_cap, best = max(statics.items(), key=lambda kv: (kv[1].goodput, -(kv[0] or 1024)))
    bad = tuner(trace, BAD_START, gpu=gpu, live=live)
    default = tuner(trace, None, gpu=gpu, live=live)
    ratio_of = lambda arm: round(arm.goodput / best.goodput, 4) if best.goodput > 0 else 1.0  # noqa: E731
    harm = [arm.name for arm, start in ((bad, statics[BAD_START]), (default, statics[None]))
            if _worse_than_staying(arm, start)]
    shifted = [tuner(trace, BAD_START, gpu=gpu, live=live, scrape_phase=k / phases) for k in range(1, phases)]
    extra: dict[str, Any] = {}
    if shifted:
        extra = {"ratio_phases": [ratio_of(a) for a in (bad, *shifted)],
                 "harm_phases": [f"{a.name}@{k}/{phases}" for k, a in enumerate(shifted, 1)
                                 if _worse_than_staying(a, statics[BAD_START])]}
    return {**extra, "trace": trace.name, "seed": trace.seed, "describe": trace.describe(), "duration": trace.duration,
            "requests": len(trace.requests), "best_static": best_cap or 1024, "best_goodput": round(best.goodput, 4),
            "statics": {str(c or "default"): round(a.goodput, 4) for c, a in statics.items()},
            "tuner_bad": bad.as_dict(), "tuner_default": default.as_dict(), "ratio": ratio_of(bad),
            "ratio_default": ratio_of(default),
            "harm": harm, "wall_seconds": round(time.perf_counter() - started, 2)}


def _worse_than_staying(arm: Arm, start: Arm) -> bool:
    """Fewer requests within the SLO than staying at the start flags, by more than one in 200."""
    return arm.met < start.met - max(1, start.met // 200)


logging.getLogger("tuner").setLevel(logging.WARNING)
