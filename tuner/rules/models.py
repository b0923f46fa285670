"""Models of the engine a rule may compute its target from (``then: {op: model, model: ...}``), instead
of a fixed factor: one measured step, not doublings. Pure: signals and settings in, an estimate with the
arithmetic that produced it out.

``concurrency`` — how many sequence slots the traffic needs (``--max-num-seqs``, or the live admission cap):

- the arrival rate λ from the engine's own counters: finished requests per second, plus the growth of
  running + waiting (requests that arrived and are still inside), plus rejections
  (``arrival_rate_per_s``) — the served rate alone is what a slot-bound engine lets through, not what
  arrives;
- the time a request holds a slot at today's batch, S₀ (``slot_seconds_mean``: vLLM's request inference
  time, prefill + decode, queue excluded), measured at n₀ = ``requests_running_mean`` running;
- a larger batch makes every step slower: the slot time grows as S(n) = S₀ · (n / n₀)^α
  (``tpot_exponent`` α; on an H200 with an 8B model 8 → 128 slots took the mean time per output token
  5.2 → 12.7 ms: α = ln 2.44 / ln 16 ≈ 0.32; measure it for your hardware, see docs/rules.md);
- Little's law, N = λ · S(N), solved for N: N = (λ · S₀ · n₀^−α)^(1 / (1 − α));
- while the queue is stable rather than growing (closed-loop clients: every user waits for an answer
  before asking again), the arrival rate is throttled by the engine itself and Little's law on it only
  returns today's cap; the requests inside (running + waiting, ``requests_*_mean``) are then the demand;
- while it grows (open loop), the requests inside beyond the N in service are a backlog B: the slots are
  sized to serve λ + B / ``backlog_seconds`` (the backlog absorbed within that horizon) — never "the
  backlog is the demand" (the H200 ``h200-fit`` run sized 8 → 447 that way from a diluted window and its
  verification then judged the drain of 447 admitted prefills); the rates are fresh because rules read the
  decision window, which restarts at the load's change point (``planning.stepping``, rule 1a);
- headroom: the slots are sized so they are busy ``utilisation`` of the time at steady state,
  ⌈N / utilisation⌉;
- a raise that needs a restart goes further, to the frontier below (``restart_to_frontier``): it is sized for
  the cooldown until the next change may come, not for this window;
- the frontier: the largest batch whose predicted TPOT stays inside the SLO, n₁ · (SLO / TPOT₁)^(1/α) from
  the per-request TPOT p99 (``tpot_p99_s``) measured at the window's batch n₁ (``requests_running_max``: the
  rules that use it fire with the slots pinned) and the same α; a restart's target never passes it (a live
  raise the arrivals call for goes on to the envelope's ceiling, ``live_ceiling``: the frontier is measured on
  a batch pinned at its cap with a queue behind it, and above the demand the arrivals set the batch), and
  when even the frontier cannot carry λ the estimate says **overloaded** (more slots would only trade one
  SLO for the other). With ``direction: down`` the model returns the frontier itself: an engine whose
  requests breach the TPOT SLO at today's batch comes down to it, never below what Little's law needs
  unless overloaded. The rule's ``max`` and ``max_from`` (e.g. what the KV cache holds for the observed
  request sizes, ``kv_concurrency_observed``) cap it as for any other op;
- the prefill frontier (``ModelSettings.prefill_frontier``): a live raise to the ceiling stops where a cap that
  binds under a queue would admit more prefill beside every decode than the TPOT SLO allows (a step costs
  B + n · (s + P/O) prefill-token equivalents, P/O the window's prompt tokens per generated token), while the
  median request still meets its TTFT and the need with today's queue fills that frontier.

``step-budget`` — the per-step token budget (``--max-num-batched-tokens``) for an inter-token-latency
target: a decode step alone takes about the median inter-token gap p₅₀; a step that also carries a prefill
chunk of up to B tokens takes about p₉₉ (the stalls). Scaling the chunk's share linearly,
B′ = B · (SLO − p₅₀) / (p₉₉ − p₅₀) brings the tail to the SLO (``decisions.slo.itl_p99_s``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tuner.model import bounds
from tuner.signals import Signal, reason_of, value_of


class _Model(bounds.Settings, BaseModel):  # BaseModel again: ruff's pydantic detection (RUF012)
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class SloSettings(_Model):
    """The service level the rules steer to (``decisions.slo``): rules compare the tail with it
    (``{signal: ttft_p99_s, op: ">", slo: ttft_p99_s}``) and the step-budget model aims at it."""

    ttft_p99_s: float = Field(default=1.0, gt=0)
    """Time to first token that 99 % of requests should meet, in seconds. Slots pinned near the cap while
    this tail is missed is still a queue, even when the mean queue time looks small."""
    itl_p99_s: float = Field(default=0.1, gt=0)
    """Inter-token latency that 99 % of gaps should meet, in seconds (100 ms ≈ 10 tokens/s per stream). Every
    gap counts, so a prefill step that stalls the batch once counts once per waiting request: the bound the
    decode-latency rules steer the stalls to."""
    tpot_p99_s: float = Field(default=0.1, gt=0)
    """Time per output token that 99 % of requests should meet, in seconds: each request's own mean gap
    (vLLM's per-request TPOT), what a user streaming one answer feels. The price a rule that admits more
    requests at once may pay (queue-slot-bound's ``verify:``); one-off stalls are ``itl_p99_s``'s business."""

    def value(self, name: str) -> float:
        return float(getattr(self, name))


SLO_NAMES = tuple(SloSettings.model_fields)


class ModelSettings(_Model):
    """The engine models' parameters (``decisions.model``)."""

    utilisation: float = Field(default=0.8, gt=0, le=1)
    """Size the slots so they are busy this share of the time at steady state (headroom for bursts)."""
    backlog_seconds: float = Field(default=30.0, gt=0)
    """A growing queue's backlog is served within this horizon on top of the arrivals (the sizing's
    λ + backlog / this). 30 s: a request that waits longer has missed any TTFT SLO already, and a shorter
    horizon admits the whole backlog's prefills at once (what put the H200's 8 → 447 step back)."""
    min_step: float = Field(default=0.1, ge=0, lt=1)
    """A model's target within this share of today's value is no change: the arrivals of a 20 s decision
    window are a count, and at the H200 rise's 6 per second per replica (120 in the window) its noise is
    1/√120 ≈ 9 %. Without it the family benchmark's live law crept 96 → 97 → 98 → 100 → … → 110 on one
    phase, a step every 4 s, each a rollout to verify."""
    live_raise_factor: float = Field(default=2.0, ge=1)
    """A raise the engine takes live at least multiplies today's cap by this (still under the TPOT frontier,
    the rule's bounds and the startup envelope). A live raise is undone in a second and a cap above the
    demand costs nothing but the TPOT the frontier guards, while each step short of it leaves a backlog
    that a pool near its capacity never drains: on the trace family the sizing of ramps and closed loops from
    a window measured at the old cap crept 8 → 13 → 15 → 33 → 48 → 57 → 78 while the queue grew (live-001
    of seed 1: 0.42 × the best static). 1: the model's size alone."""
    live_raise_to_ceiling: bool = True
    """A live raise the arrivals call for (the model's size above today's cap) goes to the live envelope's
    ceiling — the cap the engine was started with, vLLM's 1,024 by default; the rule's ``max``, otherwise —
    under the rule's bounds (what the KV cache holds among them), past the TPOT frontier. In an open loop the
    batch in service is set by the arrivals, not by a cap above them, so a cap above the demand costs nothing;
    every step short of it leaves a backlog that a pool near its capacity drains for minutes, and every request
    behind it misses its TTFT. On the trace family (seed 7, 200 traces) vLLM's default cap alone was 0.952 × the
    best static cap at p5 (median 1.0), while the law that climbed ×2 at a time under the TPOT p99 frontier kept
    p5 0.608 (median 0.967); to the ceiling, 0.78 (median 0.98) (docs/rules.md#live-sizing). A raise the
    model does not call for also goes there once the TTFT p99 breaks its SLO (bursts the mean rate does not
    show: p5 0.778 → 0.814 at seed 7); one on an expected wait alone (a queue of two) goes × ``live_raise_factor``
    only (every raise to the ceiling cost live-189 0.7 % against the cap of 8 it started from).
    False: × ``live_raise_factor`` under the TPOT frontier, the law before 2026-12-05."""
    restart_to_frontier: bool = True
    """A raise that needs a restart goes to the TPOT SLO frontier (under the rule's bounds and what the KV cache
    holds), not to the window's Little's-law size: the next change is a cooldown (15 min) and a start-up per
    replica away, a cap above the demand costs only the TPOT the frontier keeps, and a step short of a drifting
    load leaves a queue for the whole cooldown. The trace family's restart mode (drifts of 10-60 minutes from
    cap 8, seed 3): median 0.49 → 0.88 × the best static, no harm (docs/rules.md#restart-sizing). False: the
    measured step alone, as a live raise without its ``live_raise_factor``."""
    overload_lowering: Literal["need", "median"] = "need"
    """Where a lowering for the TPOT SLO goes when the pool is overloaded (the arrivals need more slots than the
    TPOT SLO frontier allows). ``need``: never below what the arrivals need, and not at all where that would only
    clip the batch's peaks — a lowering under a growing queue moves misses from the TPOT to the TTFT. ``median``:
    while the median request misses its TPOT SLO at a full batch, down to the median's frontier (at most half the
    batch a step): in an overload that still meets the TTFT, a batch past the median's frontier makes nearly every
    request miss its TPOT, and the requests a smaller batch admits meet both. On the calibrated twin (``python -m
    bench.family``, 200 traces): seed 41 p5 0.888 → 0.892, harm 1 → 1, 3 traces better (live-146 0.76 → 1.17 × the
    best static: 652 → 321) and 1 worse; seed 7 p5 0.920 → 0.918, harm 0 → 1 (live-027, 435 short requests/s whose
    best static is vLLM's 1,024: 1,024 → 470 → 223 → 1,024, 0.93 × of staying); seed 13 harm 1 → 2, live-152 0.95 →
    0.009 × (a lowering, then a new load held by the hysteresis); seed 31 harm 0 → 1. The H200 family's draw 124
    (``h200-family-2026-124``) 8.31 → 10.08 req/s, 1.21 × its best static, against 1.00 × on ``need``
    (docs/rules.md). An experiment: on where it is measured to help."""
    prefill_frontier: bool = True
    """A live raise to the envelope's ceiling stops at the **prefill frontier** (``step_base_prefill_tokens``
    below) while the queue is young — the median request still meets its TTFT SLO — and the arrivals' need with
    today's queue would fill that frontier, so the new cap will bind. A cap that binds under a queue admits what
    its finished requests free: n · P/O prompt tokens a step beside n decodes, so a step costs B + n · (s + P/O)
    prefill-token equivalents, and past the batch where that cost meets the TPOT SLO every request the raise
    admits misses its TPOT. On the trace family's seed 53, live-016 (35 requests/s of 1,139/64 tokens: caps of
    32-64 serve the most and 128 or more next to nothing) went 8 → 265 under the ceiling's bet, 0.62 × staying at
    8; with the stop 0.145 → 0.234 × its best static, and live-143 0.195 → 0.667 (harm 2 → 0 on that seed). Once
    the median misses its TTFT, the requests in the queue have missed their SLO already, and draining them is
    what is left: the ceiling (docs/rules.md#the-prefill-frontier). False: the ceiling's bet alone."""
    step_base_prefill_tokens: float = Field(default=230.0, ge=0)
    """A step's fixed cost in prefill-token equivalents (the prefill frontier's B): the H200 fit of
    tuner/sim/config.py on docs/evidence-h200.md, 4.6 ms a step against 20 µs a prefill token. The measured TPOT
    at the window's batch scales it; only its ratio to the per-sequence cost below shapes the frontier."""
    step_sequence_prefill_tokens: float = Field(default=2.25, ge=0)
    """A running sequence's own cost in a step, in prefill-token equivalents (the prefill frontier's s): the same
    fit, 45 µs a sequence against 20 µs a prefill token."""
    tpot_exponent: float = Field(default=0.3, ge=0, lt=1)
    """α in slot time ∝ (running requests)^α: how much a bigger batch slows every request. 0.32 on an
    H200 with an 8B model (5.2 → 12.7 ms per token for 8 → 128 slots); measure yours
    (bench/evidence.py's batch sweep); 0 assumes a bigger batch costs nothing."""


@dataclass(frozen=True, slots=True)
class Estimate:
    value: float | None  # None: not computable (``text`` says why)
    text: str


def _why(signals: Mapping[str, Signal], name: str) -> str:
    return f"{name} unknown ({reason_of(signals, name)})"


MAX_LOWERING = 0.5  # a lowering step keeps at least this share of the window's batch (concurrency, down)
# the prefill frontier stops a live raise only within this multiple of the batch it was measured at: the step
# costs it scales were fitted on H200 batches of 8 to 128 (docs/evidence-h200.md), and read 27-42 × past the
# window's batch it stopped floods of short prompts at +2 s whose best static is vLLM's 1,024 (seed 53 of the
# trace family: live-070 of 69/20 tokens at 498 requests/s read 215 at a batch of 8, 0.909 → 0.899 × the best
# static; live-082 read 330, 0.885 → 0.871; live-023 and live-130 lost 2 % the same way)
PREFILL_FRONTIER_RANGE = 16


def _slots_for(throughput: float, s0: float, n0: float, alpha: float) -> float:
    """The N whose service rate N / S(N) equals ``throughput`` (S(N) = S₀ · (N / n₀)^α)."""
    return float((throughput * s0 * n0 ** -alpha) ** (1 / (1 - alpha)))


def _growing_unfinished(signals: Mapping[str, Signal], growth: float | None) -> str | None:
    """Why the arrivals need more than today's cap though no request finished in the window (no slot time):
    requests wait now and what is inside the engine grows; None otherwise."""
    finished, waiting = value_of(signals, "request_rate"), value_of(signals, "requests_waiting")
    if finished is None or finished > 0 or waiting is None or waiting < 1 or growth is None or growth <= 0:
        return None
    return (f"no request finished in the window (no slot time to size with) while {waiting:.0f} wait and the "
            f"requests inside grow {growth:.3g}/s")


def concurrency(signals: Mapping[str, Signal], settings: ModelSettings, *, utilisation: float | None = None,
                slo: SloSettings | None = None, down: bool = False, growth_share: float = 0.1,
                at_least: float | None = None, past_frontier: bool = False, restart_from: float | None = None,
                live_ceiling: float | None = None, current: float | None = None) -> Estimate:
    """The sequence slots the traffic needs (see the module docstring). ``growth_share``: the queue counts
    as growing (open loop) when running + waiting rises faster than this share of the arrival rate. ``slo``:
    the TPOT SLO the frontier keeps (None: no frontier). ``down``: the frontier itself (a lowering).
    ``at_least``: a raise goes at least this far, the frontier permitting (a live raise: live_raise_factor).
    ``past_frontier``: only the overloaded case, one live step past the frontier to ``at_least`` (None
    otherwise: not overloaded, or no live step). ``live_ceiling``: a live raise, and where the arrivals need more
    than ``current`` (today's value) it goes to this ceiling, past the TPOT frontier (the rule's bounds cap it
    afterwards; ``ModelSettings.live_raise_to_ceiling``). ``restart_from``: today's value, where a raise needs a
    restart; with ``settings.restart_to_frontier`` a raise the arrivals call for (a target above it) goes on to
    the frontier (the rule's bounds and what the KV cache holds cap it afterwards)."""
    u = settings.utilisation if utilisation is None else utilisation
    alpha = settings.tpot_exponent
    names = ("arrival_rate_per_s", "slot_seconds_mean", "requests_running_mean", "requests_waiting_mean",
             "in_system_growth_per_s")
    values = {n: value_of(signals, n) for n in names}
    missing = [n for n, v in values.items() if v is None]
    if missing == ["slot_seconds_mean"] and live_ceiling is not None and not down and not past_frontier \
            and current is not None and live_ceiling > current:
        unseen = _growing_unfinished(signals, values["in_system_growth_per_s"])
        if unseen is not None:
            # no request finished yet, so no slot time to size with, but the queue grows at the cap: the arrivals
            # need more than today's cap by observation, and a live raise that the arrivals call for goes to
            # the ceiling (the rule's bounds — with no request size seen, what the cache holds of max_model_len
            # requests — cap it, and the first finished requests size the next step)
            target = math.ceil(live_ceiling - 1e-9)
            return Estimate(float(target), f"{unseen}: a live raise goes to the envelope's {target}")
    if missing:
        return Estimate(None, "; ".join(_why(signals, n) for n in missing))
    lam, s0, n0 = values["arrival_rate_per_s"], values["slot_seconds_mean"], values["requests_running_mean"]
    waiting, growth = values["requests_waiting_mean"], values["in_system_growth_per_s"]
    assert lam is not None and s0 is not None and n0 is not None and waiting is not None and growth is not None
    if s0 <= 0 or n0 <= 0 or (lam <= 0 and waiting <= 0):
        return Estimate(None, f"no traffic to size for (arrivals {lam:.3g}/s, slot time {s0:.3g} s, "
                              f"{n0:.3g} running, {waiting:.3g} waiting)")
    if lam <= 0:
        # no arrivals in the window (a closed loop running out of clients, the tail of a burst) but requests
        # wait at the cap: a standing backlog is a reason to raise whatever the arrival rate (issue 25: 102
        # waited at a cap of 8 on the H200 while the window said "arrivals 0/s"). It is served within
        # backlog_seconds, and as demand below (the queue is not growing).
        inside = n0 + waiting
        little = _slots_for(inside / settings.backlog_seconds, s0, n0, alpha)
        target = math.ceil(little - 1e-9)
        text = (f"no arrivals in the window but {inside:.3g} requests inside (running + waiting): served within "
                f"{settings.backlog_seconds:g} s at slot time {s0:.3g} s at {n0:.3g} running, slot time ∝ "
                f"running^{alpha:g} → {target}")
    else:
        little = _slots_for(lam, s0, n0, alpha)
        text = (f"arrivals {lam:.3g}/s × slot time {s0:.3g} s at {n0:.3g} running, slot time ∝ running^{alpha:g}"
                f" → {little:.3g} in service (Little's law)")
        target = math.ceil(little / u - 1e-9)
        text += f"; ÷ {u:g} utilisation → {target}"
    share = growth_share * max(lam, 0.0)
    if growth < -share:
        # the queue drains: today's slots serve more than arrives (a backlog left by a burst, or by a bad cap
        # just raised): the arrivals are the demand, and the backlog goes on its own — unless it would take
        # longer than backlog_seconds, which the absorb sizing below covers. Sizing from the requests inside
        # here over-shot a live step already taken (test_cadence: 8 → 63 → 77 → 99 on one rise).
        now_running, now_waiting = value_of(signals, "requests_running"), value_of(signals, "requests_waiting")
        left = (now_running or 0.0) + (now_waiting or 0.0) - n0
        if now_waiting and left > 0 and left / -growth > settings.backlog_seconds:
            absorb = _slots_for(max(lam, 0.0) + left / settings.backlog_seconds, s0, n0, alpha)
            if math.ceil(absorb - 1e-9) > target:
                target = math.ceil(absorb - 1e-9)
                text += (f"; the queue drains too slowly ({left:.3g} left at {-growth:.3g}/s): served within "
                         f"{settings.backlog_seconds:g} s needs {target}")
        else:
            text += f"; the queue drains ({-growth:.3g}/s)"
    elif growth <= share:  # a stable queue: the arrivals are throttled, the demand is inside
        inside = n0 + waiting
        if inside > little and math.ceil(inside / u - 1e-9) > target:
            target = math.ceil(inside / u - 1e-9)
            text += (f"; the queue is stable, {inside:.3g} requests inside (running + waiting) are the demand "
                     f"→ {target}")
    else:
        now_running, now_waiting = value_of(signals, "requests_running"), value_of(signals, "requests_waiting")
        if now_running is not None and now_waiting is not None:
            backlog = now_running + now_waiting - little
            if backlog > 0:
                absorb = _slots_for(lam + backlog / settings.backlog_seconds, s0, n0, alpha)
                if math.ceil(absorb - 1e-9) > target:
                    target = math.ceil(absorb - 1e-9)
                    text += (f"; the queue grows: a backlog of {backlog:.3g} served within "
                             f"{settings.backlog_seconds:g} s needs {target}")
    ttft, ttft_slo = value_of(signals, "ttft_p99_s"), (slo.ttft_p99_s if slo is not None else None)
    broken = ttft is not None and ttft_slo is not None and ttft > ttft_slo
    needs_more = current is not None and target > current
    if live_ceiling is not None and not down and not past_frontier and current is not None and (
            needs_more or broken):
        # the arrivals need more than today's cap, or its queue already breaks the TTFT SLO (bursts the mean rate
        # does not show): in an open loop a cap above the demand costs nothing (the arrivals set the batch), and
        # a step short of it leaves a backlog (settings.live_raise_to_ceiling)
        if target < live_ceiling:
            need = target
            target = math.ceil(live_ceiling - 1e-9)
            because = (f"the arrivals need more than {current:g}" if needs_more else
                       f"the TTFT p99 {ttft:.3g} s breaks its SLO at {current:g}")
            text += f"; {because}: a live raise goes to the envelope's {target}"
            stop = _prefill_stop(signals, settings, slo, need=need, target=target, current=current)
            if stop is not None:
                return Estimate(stop[0], f"{text}; {stop[1]}")
        frontier = _frontier(signals, slo, alpha)
        if not isinstance(frontier, str) and target > frontier:
            text += (f" (past the TPOT SLO frontier {frontier:.3g}: the arrivals, not the cap, set the batch; "
                     "the verification judges the median request's TPOT)")
        return Estimate(float(target), text)
    if at_least is not None and not down and target < at_least:
        target = math.ceil(at_least - 1e-9)
        text += f"; a live raise goes at least ×{settings.live_raise_factor:g} → {target}"
    frontier = _frontier(signals, slo, alpha)
    if isinstance(frontier, str):
        if down or past_frontier:
            return Estimate(None, f"{text}; but {frontier}")
        return Estimate(float(target), f"{text}; {frontier}")
    if down:
        f = max(1, math.floor(frontier + 1e-9))
        need = math.ceil(little / u - 1e-9)
        batch = value_of(signals, "requests_running_max") or 0.0
        if f < need:
            # overloaded: the arrivals need more slots in service (÷ utilisation) than the TPOT SLO allows, and no
            # lowering meets the TPOT SLO without a queue that grows without end — every request would then miss
            # its TTFT instead of some missing their TPOT. So never below that need; and where the need (or half
            # the batch, one step's most) leaves today's mean batch within the utilisation headroom, the lowering
            # would clip the batch's peaks only, trading TTFT for next to no TPOT: none. Lowering to the need
            # whatever the mean batch (the law until 2026-12-05) lost on the trace family, seed 7 on the
            # refitted twin, 200 traces: p5 0.517 → 0.608, harm 1 → 0 without it (live-027: 1024 → 680 at 435
            # short requests/s, 552 running, frontier 27, 0.975 × the default it started from), 7 traces
            # better, 4 worse; no lowering at all when overloaded scored the same, two traces apart
            median = (_frontier(signals, slo, alpha, quantile="tpot_p50_s")
                      if settings.overload_lowering == "median" else None)
            if isinstance(median, float) and median < batch:
                # the median request misses its TPOT at this batch: most requests miss their SLO whatever the
                # queue does, and a batch at the median's frontier serves the ones it admits inside both
                # (ModelSettings.overload_lowering)
                f = max(1, math.floor(median + 1e-9))
                why = [f"TPOT SLO frontier {frontier:.3g} (overloaded)",
                       f"the median request misses its TPOT at {batch:.3g} running: its frontier {median:.3g}"]
            else:
                to = max(need, math.floor(batch * MAX_LOWERING))
                if to >= n0 * u:
                    return Estimate(None, f"{text}; TPOT SLO frontier {frontier:.3g}: overloaded, the arrivals "
                                          f"need {need} (÷ {u:g} utilisation), {n0:.3g} running: a lowering would "
                                          "clip the peaks only")
                f = need
                why = [f"TPOT SLO frontier {frontier:.3g} (overloaded)",
                       f"not below the {need} the arrivals need (÷ {u:g} utilisation)"]
        else:
            why = [f"TPOT SLO frontier {frontier:.3g}"]
        if f < batch * MAX_LOWERING:
            # one step at most halves the batch: TPOT ∝ running^α is measured between 8 and 128 slots (H200)
            # and extrapolates badly far below the window's batch — on the trace family a TPOT p99 of 3.5 × the
            # SLO (a burst of 2,000-token prefills, not the batch) read as "170 → 1"; the live law iterates,
            # and the next window measures the halved batch
            f = max(1, math.floor(batch * MAX_LOWERING))
            why.append(f"at most half the batch {batch:.3g} in one step")
        return Estimate(float(f), f"{text}; {'; '.join(why)} → {f}")
    if past_frontier:
        if at_least is None:
            return Estimate(None, f"{text}; a step past the TPOT SLO frontier {frontier:.3g} is taken live only")
        if little <= frontier:
            return Estimate(None, f"{text}; not overloaded: the TPOT SLO frontier {frontier:.3g} carries the "
                                  "arrivals")
        g = math.ceil(at_least - 1e-9)
        over = (f"{text}; overloaded: even the TPOT SLO frontier {frontier:.3g} cannot carry the arrivals, one "
                f"live step past it (× {settings.live_raise_factor:g}) → {g}")
        # ...to the median's frontier at most: the batch at which the median request's predicted TPOT meets the
        # SLO. Past it most requests miss their TPOT, a cliff the goodput falls off (trace family seed 7,
        # live-029: 34 → 68 slots took the TPOT p50 0.09 → 0.17 s, and 30 s there halved the trace's goodput)
        median = _frontier(signals, slo, alpha, quantile="tpot_p50_s")
        if isinstance(median, str):
            return Estimate(None, f"{over}; but {median.replace('TPOT frontier', 'median TPOT frontier')}")
        batch = value_of(signals, "requests_running_max") or 0.0
        m = math.floor(median + 1e-9)
        if m < g:
            if m < batch * (1 + settings.min_step):
                return Estimate(None, f"{over}; but the median TPOT frontier {median:.3g} leaves no room above "
                                      f"the batch {batch:.3g}")
            g = m
            over += f"; at most the median TPOT frontier {median:.3g} → {g}"
        return Estimate(float(g), over)
    if restart_from is not None and settings.restart_to_frontier and restart_from < target < frontier:
        # a restart is sized for the time until the next one may come (decisions.safety.cooldown_seconds, 15 min),
        # not for this window's arrivals: slots above the demand cost only the TPOT the frontier keeps, and one
        # step short of a drifting load leaves a queue for a whole cooldown (the trace family's restart mode,
        # seed 3: a ramp 5.2 → 16.2 req/s sized 8 → 12 from its first minutes, then 26 minutes at 12 while the
        # rate climbed to 31/s, 0.30 × the best static; to the frontier, 8 → 145 and 0.38 ×: restart_to_frontier)
        f = math.floor(frontier + 1e-9)
        if f > target:
            target = f
            text += (f"; a restart goes to the TPOT SLO frontier {frontier:.3g} (the next change is a cooldown "
                     f"away) → {target}")
    if target > frontier:
        # never below today's batch: a raise the frontier forbids is a no-op here, the lowering rule's to make
        f = max(1, math.floor(frontier + 1e-9), math.floor(value_of(signals, "requests_running_max") or 1))
        if little > frontier:
            return Estimate(float(f), f"{text}; overloaded: even the TPOT SLO frontier {frontier:.3g} cannot carry "
                                      f"the arrivals (the pool needs more replicas) → {f}")
        return Estimate(float(f), f"{text}; capped at the TPOT SLO frontier {frontier:.3g} → {f}")
    return Estimate(float(target), text)


def _prefill_frontier(signals: Mapping[str, Signal], slo: SloSettings, settings: ModelSettings) -> float | None:
    """The batch whose predicted TPOT p99 meets the SLO where a bound cap admits n · P/O prompt tokens a step
    (``ModelSettings.prefill_frontier``): a step costs B + n · (s + P/O) prefill-token equivalents, scaled to the
    TPOT p99 measured at the window's batch; None where a reading is missing."""
    tpot, batch = value_of(signals, "tpot_p99_s"), value_of(signals, "requests_running_max")
    prompt, generated = value_of(signals, "prompt_tokens_per_s"), value_of(signals, "generation_tokens_per_s")
    if tpot is None or batch is None or prompt is None or generated is None or tpot <= 0 or batch <= 0 \
            or generated <= 0:
        return None
    base, per = settings.step_base_prefill_tokens, settings.step_sequence_prefill_tokens + max(prompt, 0.0) / generated
    if per <= 0:
        return None
    seconds_per_unit = tpot / (base + batch * per)
    return max(0.0, (slo.tpot_p99_s / seconds_per_unit - base) / per)


def _prefill_stop(signals: Mapping[str, Signal], settings: ModelSettings, slo: SloSettings | None, *, need: int,
                  target: int, current: float) -> tuple[float | None, str] | None:
    """Where a live raise to the ceiling stops short of it (``ModelSettings.prefill_frontier``): the value (None:
    no raise) and why; None where the ceiling stands."""
    if not settings.prefill_frontier or slo is None:
        return None
    median_ttft = value_of(signals, "ttft_p50_s")
    if median_ttft is None or median_ttft > slo.ttft_p99_s:
        return None  # an old queue (or no reading): its requests missed their SLO already, draining is what is left
    frontier = _prefill_frontier(signals, slo, settings)
    waiting, batch = value_of(signals, "requests_waiting") or 0.0, value_of(signals, "requests_running_max") or 0.0
    if frontier is None or target <= frontier or frontier > PREFILL_FRONTIER_RANGE * batch:
        return None
    if need + waiting <= frontier:
        return None  # the arrivals and today's queue fit inside it: the cap will not bind, the batch floats
    stop = max(math.floor(frontier + 1e-9), need)
    if stop >= target:
        return None
    why = (f"but the median request meets its TTFT ({median_ttft:.3g} s) and the need with the {waiting:.3g} "
           f"waiting fills the prefill frontier {frontier:.3g} (the window's prompt tokens per generated token "
           f"admitted beside every decode)")
    if stop < current * (1 + settings.min_step):
        return None, f"{why}: no room above {current:g}"
    return float(stop), f"{why} → {stop}"


def _frontier(signals: Mapping[str, Signal], slo: SloSettings | None, alpha: float, *,
              quantile: str = "tpot_p99_s") -> float | str:
    """The largest batch whose predicted TPOT p99 (``quantile``: another of the window's TPOT quantiles)
    meets the SLO, or why it is not known. The TPOT was measured at the batch the window's requests ran in:
    ``requests_running_max`` (the rules that use the frontier fire only with the slots pinned, where that is
    the batch)."""
    if slo is None:
        return "no TPOT frontier (no SLO given)"
    tpot, batch = value_of(signals, quantile), value_of(signals, "requests_running_max")
    if tpot is None or tpot <= 0:
        return f"no TPOT frontier ({_why(signals, quantile)})"
    if batch is None or batch <= 0:
        return f"no TPOT frontier ({_why(signals, 'requests_running_max')})"
    if alpha <= 0:
        return "no TPOT frontier (tpot_exponent 0: a bigger batch is assumed free)"
    return float(batch * (slo.tpot_p99_s / tpot) ** (1 / alpha))


def step_budget(signals: Mapping[str, Signal], slo: SloSettings, *, current: float) -> Estimate:
    """The per-step token budget that brings the inter-token tail to the SLO (module docstring)."""
    p50, p99 = value_of(signals, "itl_p50_s"), value_of(signals, "itl_p99_s")
    if p50 is None or p99 is None:
        return Estimate(None, "; ".join(_why(signals, n) for n in ("itl_p50_s", "itl_p99_s")
                                        if value_of(signals, n) is None))
    target_itl = slo.itl_p99_s
    if p99 <= target_itl:
        return Estimate(current, f"itl_p99_s {p99:.3g} s already meets the SLO {target_itl:g} s")
    if target_itl <= p50 or p99 <= p50:
        return Estimate(None, f"a plain decode step (itl_p50_s {p50:.3g} s) already misses the ITL SLO "
                              f"{target_itl:g} s: a smaller step budget cannot help")
    target = current * (target_itl - p50) / (p99 - p50)
    return Estimate(math.floor(target), f"{current:g} tokens × (SLO {target_itl:g} − itl_p50 {p50:.3g}) / "
                                        f"(itl_p99 {p99:.3g} − itl_p50 {p50:.3g}) → {math.floor(target)}")
