"""One decision step for one target: its newest snapshot in, its signals and plan out. Pure.

This is the one decision path of the tuner. The daemon's cycle, ``replay``, ``recommend``, ``inspect``
and the scenario tests all call ``step`` with the same inputs a cycle has — the target's state from
the previous step, the snapshot just scraped, what ``/v1/models`` said, the GPUs' readings — so a
recorded scenario that passes here passes in the daemon::

    TargetState ─┐
    snapshot ────┼─▶ window (last window_seconds) ─▶ restart seen? ─▶ signals ─▶ planner.plan ─▶ Decision
    info, gpus ──┘   └▶ decision window (since the last change) ─┘ (engine + GPU)

Rules of the step:

1. The window is the snapshots of the last ``window_seconds`` (at most ``max_snapshots``), the new one
   included. Signals are computed over it with the staleness limit and ``min_snapshots``; a failed
   scrape voids the windows it falls in (``signals.engine.compute``).
1a. With ``decision_seconds`` set, the signals rules read are computed over the *decision window*: the
   snapshots since the latest of ``decision_seconds`` ago (further back where that span holds fewer than
   ``min_snapshots`` scrapes or fewer than ``decisions.idle.min_requests_per_window`` finished requests: a
   slow engine's evidence), the engine's last restart (its process start time changed), the tuner's last
   change of this target's flags
   (``History.changes``), and the change point of the arrivals inside that span (``signals.changes``) —
   so a decision is made on data of the regime it is for, within seconds of a load change. What changes
   slowly and must not forget (request sizes, the length tails the ``--max-model-len`` floor keeps, idle
   time) stays on the long window (``SLOW_SIGNALS``) — except what the KV cache holds for the requests
   (``kv_concurrency_observed``, the bound a raise is capped at), which is this regime's where the decision
   window has finished requests: a long window that still held a phase of 2,578-token requests capped the
   next phase's 474-token ones at 132, then 166, 186, 212… slots as it rolled over, with the cache 16 % full
   and 500 waiting (the trace family, live-181 of seed 7). A regime of bigger requests bounds it lower at once.
1b. With a decision window, snapshots older than two decision windows are thinned (``thinned``).
2. A snapshot whose ``process_start_time_seconds`` differs from the one seen before is a restart; the
   planner then plans a warm-up once (not for the tuner's own restarts, which its rollout warmed).
3. A failed scrape decides nothing: no plan, the history (streaks, cooldowns) is kept as it was, so one
   transient failure does not reset a rule that has held for several windows.
4. ``decide=False`` (mode observe) computes signals only.

``now`` is the step's time: the cycle's start in the daemon, the snapshot's time in a replay.
``replay`` runs recorded snapshots through ``step`` one at a time, booking each change as a finished
rollout would (``pooling``) when asked to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter

from tuner.model import dialects, knobs, snapshots
from tuner.model import live as live_mod
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import history as history_mod
from tuner.planning import identities as identities_mod
from tuner.planning import planner, pooling
from tuner.planning.history import History
from tuner.rules.schema import Rule
from tuner.signals import Signal
from tuner.signals import changes as change_points
from tuner.signals import engine as engine_signals
from tuner.signals import gpu as gpu_signals

# Read over the long window even when rules decide on the decision window (rule 1a).
SLOW_SIGNALS = frozenset({
    "prompt_tokens_mean", "generation_tokens_mean", "kv_concurrency_observed", "prompt_tokens_p99",
    "max_tokens_p99", "idle_seconds",
})
# Read over the decision window: the rest (what the decision window computed of SLOW_SIGNALS was thrown away).
FAST_SIGNALS = frozenset(engine_signals.WINDOW_SIGNALS) - SLOW_SIGNALS
# Computed over the decision window too, for the KV bound of this regime (its request sizes); the long window's
# stands where the decision window holds no finished request.
REGIME_SIGNALS = frozenset({"prompt_tokens_mean", "generation_tokens_mean", "kv_concurrency_observed"})


@dataclass(frozen=True, slots=True)
class WindowSettings:
    """How a target's window of snapshots is kept and read (config ``scrape:``)."""

    window_seconds: float = 300.0
    min_snapshots: int = 2
    stale_after_seconds: float | None = None  # None: no staleness limit
    max_snapshots: int = 100_000
    decision_seconds: float | None = None  # None: rules read the whole window (rule 1a)
    gpu_stale_after_seconds: float | None = None  # None: as stale_after_seconds (GPUs read at their own cadence)


@dataclass(frozen=True, slots=True)
class TargetState:
    """What one target carries from step to step. ``history`` is what the daemon persists."""

    window: tuple[snapshots.Snapshot, ...] = ()
    history: History = field(default_factory=History)
    engine_started_at: float | None = None  # the engine's process start time last seen
    identities: identities_mod.Seen = field(default_factory=identities_mod.Seen)  # which engines the URL reached


@dataclass(frozen=True, slots=True)
class Decision:
    target: str
    at: float
    signals: Mapping[str, Signal]
    plan: planner.Plan | None
    state: TargetState
    skipped: str | None = None  # why there is no plan (a failed scrape, observe mode)
    decided_since: float | None = None  # where the decision window began (rule 1a); None: the whole window
    change_point: change_points.ChangePoint | None = None  # the arrivals' change it restarted at, if one
    held: str | None = None  # why decisions for this target are held (two engines behind one URL)


def step(
    state: TargetState,
    snapshot: snapshots.Snapshot,
    *,
    info: EngineInfo | None,
    gpus: GpuInputs,
    now: float,
    target: str,
    kind: knobs.EngineKind,
    args: knobs.EngineArgs,
    settings: planner.DecisionSettings,
    window: WindowSettings,
    rules: Iterable[Rule],
    decide: bool = True,
    power_control: bool = False,
    live: live_mod.LiveState = live_mod.NONE,
    started_args: knobs.EngineArgs | None = None,
) -> Decision:
    """The step of the module docstring; ``power_control``: plan GPU power caps (``gpu_control.enabled``).
    ``started_args``: the command line the running engine is known to have started with (a recording's), for
    the check that no more requests run than its ``--max-num-seqs`` lets them; None: only a live engine's own
    report of its envelope is used — the tuner's ``args`` can lag the engine while a rollout is in flight (a
    raise restarts engines before it is booked) and a lowered live cap drains down, never preempting."""
    kept = thinned(tuple(s for s in (*state.window, snapshot) if s.scraped_at >= now - window.window_seconds),
                   now=now, window=window)
    dialect = dialects.DIALECTS[kind]

    started = engine_signals.gauge(snapshot, dialect, "process_start") if snapshot.ok else None
    # two engines behind one URL (planning.identities): a flip is no restart, and nothing is decided
    seen, _ = identities_mod.observe(state.identities, identities_mod.of(snapshot, dialect), now=now)
    held = identities_mod.held(seen, now=now, hold_seconds=window.window_seconds)
    restarted_at = (started if started is not None and state.engine_started_at not in (None, started)
                    and held is None else None)
    engine_started_at = started if started is not None else state.engine_started_at

    max_running = _engine_cap(started_args, live, kind=kind)
    since, point = decision_window(kept, state.history, now=now, window=window, dialect=dialect,
                                   min_requests=settings.idle.min_requests_per_window)
    # with a decision window, the long window is read for the slow signals only (the others come from `fresh`)
    signals = engine_signals.compute(kept, dialect=dialect, info=info, now=now,
                                     stale_after_seconds=window.stale_after_seconds,
                                     min_snapshots=window.min_snapshots, max_running=max_running,
                                     only=SLOW_SIGNALS if since is not None else None)
    if since is not None:
        fresh = engine_signals.compute([s for s in kept if s.scraped_at >= since], dialect=dialect, info=info,
                                       now=now, stale_after_seconds=window.stale_after_seconds,
                                       min_snapshots=window.min_snapshots, max_running=max_running,
                                       only=FAST_SIGNALS | REGIME_SIGNALS)
        signals.update({k: v for k, v in fresh.items() if k not in SLOW_SIGNALS})
        # the KV bound a raise is capped at: for the sizes of this regime where its window has them (rule 1a)
        kv = fresh.get("kv_concurrency_observed")
        if kv is not None and kv.value is not None:
            signals["kv_concurrency_observed"] = kv
    _kv_bound_unseen(signals)
    signals.update(gpu_signals.compute(gpus.readings, unavailable=gpus.unavailable, now=now,
                                       stale_after_seconds=window.gpu_stale_after_seconds
                                       or window.stale_after_seconds))
    after = TargetState(window=kept, history=state.history, engine_started_at=engine_started_at, identities=seen)
    if held is not None and snapshot.ok:
        return Decision(target, now, signals, None, after, skipped=held, decided_since=since, change_point=point,
                        held=held)
    if not snapshot.ok:
        return Decision(target, now, signals, None, after, skipped=f"scrape failed: {snapshot.error}",
                        decided_since=since, change_point=point)
    if not decide:
        return Decision(target, now, signals, None, after, skipped="observe mode: no plan", decided_since=since,
                        change_point=point)
    plan = planner.plan(target, signals, args, state.history, settings, rules=rules, kind=kind, now=now,
                        restarted_at=restarted_at, power_control=power_control, live=live,
                        regime_since=point.at if point is not None else None)
    return Decision(target, now, signals, plan, replace(after, history=plan.history), decided_since=since,
                    change_point=point)


def _kv_bound_unseen(signals: dict[str, Signal]) -> None:
    """No request has finished in either window (an engine's first seconds, long outputs at a small cap), so no
    request size is known: the KV bound a raise is capped at is then what the cache holds of the longest request
    the engine admits (``kv_cache_max_concurrency``, ``max_model_len`` tokens each), never more than the cache
    holds whatever the sizes turn out to be. The next window with finished requests bounds it by their size."""
    kv = signals.get("kv_concurrency_observed")
    worst = signals.get("kv_cache_max_concurrency")
    if (kv is None or kv.value is None) and worst is not None and worst.value is not None:
        why = kv.reason if kv is not None and kv.reason else "request sizes unknown"
        signals["kv_concurrency_observed"] = Signal(
            worst.value, f"{why}: as many max_model_len requests as the KV cache holds (kv_cache_max_concurrency)")


def _engine_cap(started_args: knobs.EngineArgs | None, live: live_mod.LiveState, *, kind: knobs.EngineKind
                ) -> float | None:
    """The most requests the running engine's scheduler can run (its startup ``--max-num-seqs``), if known."""
    if live.available and isinstance(live.envelope.get("max_num_seqs"), int | float):
        return float(live.envelope["max_num_seqs"])
    if started_args is None:
        return None
    cap = knobs.effective("max_num_seqs", started_args, kind=kind).value
    return float(cap) if isinstance(cap, int | float) and not isinstance(cap, bool) else None


THIN_TO = 20  # snapshots per long window outside the recent span (rule 1b)
_START = attrgetter("start")  # reads.Reading.start: the process start time a snapshot shows


def thinned(snaps: tuple[snapshots.Snapshot, ...], *, now: float, window: WindowSettings
            ) -> tuple[snapshots.Snapshot, ...]:
    """Rule 1b: with a decision window, every snapshot of the last two decision windows is kept, older ones
    one per ``window_seconds / THIN_TO`` (what the slow signals need: a histogram's or counter's two ends,
    the gauges' activity for idle time), failed ones always (they void the windows they fall in). A scrape
    every 2 s then keeps about 40 snapshots per target instead of 150 for a 300 s window."""
    if window.decision_seconds is not None:
        recent = now - 2 * window.decision_seconds
        spacing = window.window_seconds / THIN_TO
        out: list[snapshots.Snapshot] = []
        last_old: float | None = None
        for s in snaps:
            if s.scraped_at >= recent or s.error is not None or last_old is None or s.scraped_at - last_old >= spacing:
                out.append(s)
                if s.scraped_at < recent and s.error is None:
                    last_old = s.scraped_at
        snaps = tuple(out)
    return snaps[-window.max_snapshots:]


def decision_window(kept: Sequence[snapshots.Snapshot], history: History, *, now: float, window: WindowSettings,
                    dialect: dialects.Dialect, min_requests: int = 0
                    ) -> tuple[float | None, change_points.ChangePoint | None]:
    """Where the decision window of rule 1a begins, and the change point it restarted at (if it did)."""
    if window.decision_seconds is None:
        return None, None
    since = now - window.decision_seconds
    good = [s for s in kept if s.error is None]
    if len(good) >= window.min_snapshots:  # scrapes sparser than the decision window: its fewest snapshots
        since = min(since, good[-window.min_snapshots].scraped_at)
    read = engine_signals.readings(good, dialect)  # each snapshot's counters and gauges, read once (reads.Reading)
    if min_requests > 0 and good:  # a slow engine: back to where the window holds enough finished requests
        done = read[-1].counters["request_success"][0]
        if done is not None:
            for s, r in zip(reversed(good), reversed(read), strict=True):
                before = r.counters["request_success"][0]
                if before is None or before > done:
                    break
                if done - before >= min_requests:
                    since = min(since, s.scraped_at)
                    break
    last_change = max((c.at for c in history.changes.values()), default=None)
    if last_change is not None:
        since = max(since, last_change)
    starts = list(map(_START, read))
    if len(set(starts)) > 1:  # else one process all along (the usual window, found at C speed)
        for a, b, s in zip(starts, starts[1:], good[1:], strict=False):
            if a is not None and b is not None and a != b:  # the engine restarted: its new process is a new regime
                since = max(since, s.scraped_at)
    span = [s for s in kept if s.scraped_at >= since]
    # found as soon as one interval shows it; the window then holds too few snapshots to decide until the new
    # regime has min_snapshots of its own (a decision never mixes the two)
    point = change_points.latest(span, dialect, min_after=1)
    if point is not None:
        since = max(since, point.at)
    return since, point


def replay(
    snaps: Sequence[snapshots.Snapshot],
    *,
    target: str,
    kind: knobs.EngineKind,
    args: knobs.EngineArgs,
    rules: Sequence[Rule],
    settings: planner.DecisionSettings,
    window: WindowSettings,
    info: EngineInfo,
    gpus: GpuInputs,
    apply: bool = False,
    decide: bool = True,
    live: live_mod.LiveState = live_mod.NONE,
) -> Iterator[Decision]:
    """Recorded snapshots through ``step``, one step per snapshot at the snapshot's time (what ``replay``,
    ``recommend``, ``inspect`` and the scenario tests run). The GPU inputs stand for every step (a file's
    readings are taken as read at each step). ``apply``: each change is booked as a finished rollout of
    this one replica would book it (``pooling.choose`` and ``pooling.book``), so cooldowns, hysteresis and
    the restart budget bite as they would in the daemon. ``live``: what the engine can change live (the
    plugin's acknowledgements); a booked live change is taken as acknowledged, its values in force from
    the next step on."""
    state = TargetState()
    recorded = args  # the recording's engine: a booked change does not restart it
    for snap in snaps:
        now = snap.scraped_at
        gpus_now = GpuInputs(tuple(replace(r, read_at=now) for r in gpus.readings), gpus.unavailable)
        decision = step(state, snap, info=info, gpus=gpus_now, now=now, target=target, kind=kind, args=args,
                        settings=settings, window=window, rules=rules, decide=decide, live=live,
                        started_args=recorded)
        state = decision.state
        plan = decision.plan
        if apply and plan is not None and plan.changes:
            pool = pooling.choose({target: plan}, {target: args}, kind=kind, settings=settings,
                                  signals={target: decision.signals}, now=now, lives={target: live})
            if pool.change is not None:
                outcome = pooling.ReplicaOutcome("ok", pool.change.new_args[target])
                histories, owned = pooling.book(
                    {target: state.history}, {target: args}, changes=pool.change.changes, outcomes={target: outcome},
                    pool_new_args=pool.change.new_args, rolled_back=False, now=now,
                    reject_seconds=settings.safety.reject_seconds)
                state, args = replace(state, history=histories[target]), owned[target]
                if pool.change.live:
                    live = replace(live, values={**live.values, **pool.change.values})
        yield decision


# --- a re-based loop clock (issue 28) -------------------------------------------------------------------


def rebased(state: TargetState, *, by: float) -> TargetState:
    """``state`` with every time of the loop moved by ``by`` seconds: the daemon's clock re-based on a
    stepped wall clock (``daemon.clocks``), so the window keeps its order and span and nothing in it, or
    in the history, is "in the future". The engine's own start time is the engine's clock: kept."""
    if not by:
        return state
    return replace(state, window=tuple(replace(s, scraped_at=s.scraped_at + by) for s in state.window),
                   history=history_mod.shifted(state.history, by=by))
