"""Guards: one pure function per check, each answering with a ``Ruling`` (allowed or not, and why; the verdict on a
change after its rollout is ``verification.Verdict``).

A guard never raises and never acts. The planner asks them in this order and records the first "no"
as the held reason (the same text goes to logs and the ``reason`` label of tuner_decisions_total):

  paused      the operator's pause (decisions.paused, `vllm-tuner pause`): no change, no action
  pinned      the flag is not pinned (decisions.pins, `vllm-tuner pin`): VPA's per-container mode Off
  window      the window is readable (rates known); otherwise no decision at all
  idle        enough requests in the window to judge (min_requests_per_window); else no decision
  thermal     hot GPU → freeze every change that adds load (``adds_load``); power cap alone is not heat
  crash       the resulting command line never failed to start before (crash memory)
  cooldown    the flag was not changed within max(rule cooldown, safety.cooldown_seconds)
  hysteresis  the flag does not reverse direction within safety.hysteresis_seconds
  floor       --max-model-len never below observed traffic need + margin (no request is rejected;
              planning.model_len)
  engine      vLLM's startup validation passes (knobs.validate)
  budget      at most N restarts per hour and per day

Why power_capped is not thermal: a real H200 under full matmul load sits at its 700 W cap
(clock-event reason 0x4, SM clock 1470 of 1980 MHz) at 69-72 °C, 17 °C below its 89 °C slowdown
threshold (tests/fixtures/nvml/h200-matmul.json). Freezing on the power cap would freeze every busy
GPU. Thermal means: ``thermal_throttle`` (SW/HW thermal slowdown bits), the temperature margin, or
HW slowdown (0x8/0x40/0x80: the board protecting itself).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from tuner.model import bounds, knobs
from tuner.planning.history import ROLLED_BACK, History
from tuner.signals import SignalSet, reason_of, value_of


class _Model(bounds.Settings, BaseModel):  # model.bounds: finite numbers, durations a scheduler holds
    pass


class ThermalSettings(_Model):
    margin_c: float = Field(default=5.0, ge=0)
    """Freeze load-adding changes while the hottest GPU is fewer than this many °C below its NVML
    slowdown temperature (signal temp_margin_c). On an H200 (slowdown 89 °C) the default freezes
    from 84 °C; the busiest measured H200 ran at 72 °C."""
    max_temp_c: float | None = None
    """Also freeze above this absolute GPU temperature (the seed used 82). None: margin only, which
    adapts to each GPU model's own threshold."""
    freeze_on_hw_slowdown: bool = True
    """Treat hardware slowdown (HW slowdown, HW thermal, HW power brake bits) as thermal."""
    step_down: bool = False
    """While thermally throttled, also propose lowering --max-num-seqs (a restart, so off by default)."""
    step_down_factor: float = Field(default=0.75, gt=0, lt=1)
    """Multiplier for the thermal step-down of --max-num-seqs."""
    step_down_min: int = Field(default=1, ge=1)
    """The thermal step-down never goes below this many sequences."""


class IdleSettings(_Model):
    min_requests_per_window: int = Field(default=10, ge=0)
    """A window with fewer finished requests (request_rate × window_seconds) decides nothing: its
    latencies and quantiles are noise."""
    keep_warm_after_seconds: float | None = Field(default=600.0, gt=0)
    """After this long without any request, plan keep-warm requests (then again after as long).
    None: never."""
    keep_warm_requests: int = Field(default=10, ge=1)
    """How many tiny requests one keep-warm sends (the seed sent 10)."""
    keep_warm_max_tokens: int = Field(default=1, ge=1)
    """max_tokens of each keep-warm request."""
    warm_up_after_restart: bool = True
    """Plan a warm-up (keep_warm_requests tiny requests) right after every engine restart."""
    sleep_after_seconds: float | None = Field(default=None, gt=0)
    """vLLM sleep mode, OFF by default (None). After this long without any request, put the engine to
    sleep (``POST /sleep``, freeing its GPU memory), and wake it (``POST /wake_up``) as soon as a request
    waits on it. Needs an engine started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``
    (dev-mode routes: keep the engine's port private) on a GPU; the first request after a sleep waits
    for the wake-up and the next cycle (``scrape.interval_seconds``). While it is on, keep-warm
    requests are not sent to a sleeping engine."""
    sleep_level: Literal[1] = 1
    """1: weights offloaded to CPU memory, KV cache discarded; an H200 went 120.4 → 2.4 GiB and woke in
    0.6 s (vLLM 0.26, 8B). Level 2 is not offered: it discards the weights, and vLLM's wake-up does not
    reload them (it answers 200 and would serve from garbage)."""


class SafetySettings(_Model):
    live_cooldown_seconds: float = Field(default=30.0, ge=0)
    """A flag changed live (no restart: the admission cap, the step budget) is not moved back within this
    long: a decision window (``scrape.decision_window_seconds``, 20 s) of the new regime and a margin. A live
    step the same way as the last one is not held at all (``cooldown``): the evidence that keeps pointing
    there is the reason for it, and the H200 live path served a new cap 1 s after the decision. A rule's
    own cooldown is for restarts."""
    restart_evidence_seconds: float = Field(default=60.0, ge=0)
    """A change that needs a restart goes out only after its rule's condition held this long without a break
    (besides the rule's ``for`` windows; the span of the window it was first true on counts): a restart costs
    a start-up per replica (70-121 s on the H200), a burst shorter than that is not worth one. Live changes
    need only their ``for_live`` windows."""
    restart_cost_seconds: float = Field(default=120.0, ge=0)
    """What one replica's restart costs in serving time: its start-up (H200, 8B: 70-121 s, docs/evaluation.md)."""
    payback_horizon_seconds: float = Field(default=600.0, gt=0)
    """The payback test for a restart that adds load (more slots): the unmet demand it serves over this horizon
    (arrivals − completions, per second × horizon) must exceed what the restart costs (the replica's
    completions per second × ``restart_cost_seconds``). 600 s: the restart cooldown's order of magnitude."""
    live_hysteresis_seconds: float = Field(default=600.0, ge=0)
    """A flag changed live is not moved the opposite way within this long — except inside the bracket its
    last change opened (``bracket``): halfway back at most, so that reversals halve their distance each time
    and end within the model's deadband (a bisection, not a flap)."""
    cooldown_seconds: float = Field(default=900.0, ge=0)
    """A flag is not changed again within this long after its last change (a rule's own cooldown
    may be longer; the longer wins). 15 min ≈ 10 restarts' worth of start-up on an H200 (73-84 s)."""
    hysteresis_seconds: float = Field(default=3600.0, ge=0)
    """A flag is not moved the opposite way within this long after a change (stops flapping
    between e.g. a throughput rule and a latency rule)."""
    max_restarts_per_hour: int = Field(default=2, ge=0)
    """Restarts the tuner may cause per rolling hour (every change set is one restart; 0: none at all)."""
    max_restarts_per_day: int = Field(default=8, ge=0)
    """Restarts the tuner may cause per rolling 24 h (0: none at all)."""
    max_model_len_margin: float = Field(default=0.10, ge=0)
    """--max-model-len stays ≥ (observed need) × (1 + this)."""
    reject_seconds: float = Field(default=86400.0, ge=0)
    """A command line that was rolled back because it did no good (its verification failed, or it
    started too slowly) is not proposed again for this long. One the engine refused to start with,
    or crashed on, is never proposed again."""


@dataclass(frozen=True, slots=True)
class Ruling:
    allowed: bool
    guard: str
    reason: str
    until: float | None = None  # when a hold lifts by itself (None: never, e.g. a budget of 0); names the hold


def allow(guard: str, reason: str = "") -> Ruling:
    return Ruling(True, guard, reason)


def deny(guard: str, reason: str, *, until: float | None = None) -> Ruling:
    return Ruling(False, guard, reason, until)


ActionKind = Literal["keep-warm", "warm-up", "sleep", "wake", "power-cap", "power-restore"]


@dataclass(frozen=True, slots=True)
class Action:
    """Something the shell should do besides changing flags: tiny requests, sleep or wake the engine,
    cap or restore the GPUs' power limit (``gpu_control``)."""

    kind: ActionKind
    reason: str
    requests: int = 10
    max_tokens: int = 1
    after_restart: bool = False  # do it once the restarted engine is healthy
    level: int | None = None  # sleep: the vLLM sleep level

    def label(self) -> str:
        """``keep-warm ×10``, ``warm-up ×10 after the restart``, ``sleep (level 1)``, ``wake``."""
        if self.kind == "sleep":
            return f"sleep (level {self.level})"
        if self.kind in ("wake", "power-cap", "power-restore"):
            return self.kind
        return f"{self.kind} ×{self.requests}{' after the restart' if self.after_restart else ''}"

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind, "reason": self.reason, "requests": self.requests,
                                  "max_tokens": self.max_tokens, "after_restart": self.after_restart}
        if self.level is not None:
            out["level"] = self.level
        return out


def duration(seconds: float) -> str:
    """``252`` → ``4m12s``; ``7200`` → ``2h``; ``59.4`` → ``59s``."""
    s = max(0, math.ceil(seconds))
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    parts = [f"{v}{u}" for v, u in ((d, "d"), (h, "h"), (m, "m"), (sec, "s")) if v]
    return "".join(parts[:2]) or "0s"


# --- window and idle ------------------------------------------------------------------------------


def sustained(rule: str, signals: SignalSet, history: History, settings: SafetySettings, *, now: float) -> Ruling:
    """A restart's evidence: its rule true without a break for ``restart_evidence_seconds``, counting the
    span of the window it was first found true on (the evidence of one long window is its span)."""
    since = history.streak_since.get(rule)  # where the first true window began (planner.plan books it)
    need = settings.restart_evidence_seconds
    if need <= 0:
        return allow("sustained")
    held = (value_of(signals, "window_seconds") or 0.0) if since is None else now - since
    if held < need:
        return deny("sustained", f"after {duration(need - held)} more of sustained evidence (a restart needs "
                    f"{duration(need)}; true for {duration(held)} so far)")
    return allow("sustained", f"true for {duration(held)}")


def payback(signals: SignalSet, settings: SafetySettings, *, knob: str, from_value: float, to_value: float,
            alpha: float) -> Ruling:
    """The payback test of ``payback_horizon_seconds`` for a restart that gives the engine more sequence
    slots: the completions it adds over the horizon against those lost while the replica restarts.

    The gain is the throughput the concurrency model predicts at the new value, N / S(N) with
    S(N) ∝ N^α (``decisions.model.tpot_exponent``), for the requests there are — at most the requests inside
    now (a closed loop's demand), at most the arrivals (an open loop's) — over today's completions. Other
    changes, and unknown rates, are not tested (the rule's own evidence stands; said so).

    A larger ``--gpu-memory-utilization`` (kv-more-memory) gains about in proportion: the KV cache, and the
    requests it holds at once, grow with the memory given to it (a little faster, as the weights' share is
    fixed: 0.40 → 0.42 of an H200 is 5 % more memory and 6.6 % more cache for an 8B model). On the trace
    family a live pool restarted both replicas for 0.40 → 0.42 in its last phase (live-013 of seed 2 from
    vLLM's defaults: 0.45 × staying put)."""
    memory = knob == "gpu_memory_utilization"
    if knob not in ("max_num_seqs", "gpu_memory_utilization") or to_value <= from_value or from_value <= 0:
        return allow("payback", "not a change this test sizes (only more sequence slots or KV memory)")
    arrivals, served = value_of(signals, "arrival_rate_per_s"), value_of(signals, "request_rate")
    running, waiting = value_of(signals, "requests_running"), value_of(signals, "requests_waiting")
    if arrivals is None or served is None or running is None or waiting is None:
        return allow("payback", "arrival or completion rate unknown: not tested")
    if served <= 0:
        return allow("payback", "no completions to weigh against: not tested")
    if memory:
        predicted = served * to_value / from_value
    else:
        slots = min(to_value, max(from_value, running + waiting))
        predicted = served * (slots / from_value) ** (1 - alpha)
    if arrivals > served * 1.1:  # an open loop: the arrivals bound what more slots can serve
        predicted = min(predicted, arrivals)
    gain = max(0.0, predicted - served) * settings.payback_horizon_seconds
    cost = served * settings.restart_cost_seconds
    text = (f"{served:.3g} → {predicted:.3g} completions/s predicted over {duration(settings.payback_horizon_seconds)}"
            f" = {gain:.0f} more, against {cost:.0f} lost to {duration(settings.restart_cost_seconds)} of restart")
    return allow("payback", text) if gain > cost else deny("payback", f"a restart does not pay back: {text}")


def window(signals: SignalSet) -> Ruling:
    """Rates need a valid window: no decisions from a failed, stale or restarted one."""
    if value_of(signals, "window_seconds") is None:
        return deny("window", f"no decision: {reason_of(signals, 'window_seconds')}")
    if value_of(signals, "request_rate") is None:
        return deny("window", f"no decision: request_rate unknown ({reason_of(signals, 'request_rate')})")
    return allow("window")


def requests_in_window(signals: SignalSet) -> float | None:
    rate, span = value_of(signals, "request_rate"), value_of(signals, "window_seconds")
    return None if rate is None or span is None else rate * span


def idle(signals: SignalSet, settings: IdleSettings) -> Ruling:
    n = requests_in_window(signals)
    if n is None:
        return deny("idle", "no decision: the number of requests in the window is unknown")
    if n < settings.min_requests_per_window:
        span = value_of(signals, "window_seconds") or 0.0
        return deny("idle", f"no decision: {n:.0f} requests finished in the {duration(span)} window "
                    f"(need ≥ {settings.min_requests_per_window})")
    return allow("idle", f"{n:.0f} requests in the window")


def backlog_at_cap(signals: SignalSet, cap: float | None) -> str | None:
    """Why the window is not idle whatever finished in it: requests wait, and waited through the window, while
    every slot of the admission cap is busy (a closed loop of long requests, or a bad cap under a full load,
    finishes few in its first seconds); None when that is not so. Only a raise of the cap may go out on it
    (``planner.plan``): the idle guard is there for thin evidence, and a queue at the cap is not thin."""
    waiting, mean = value_of(signals, "requests_waiting"), value_of(signals, "requests_waiting_mean")
    running = value_of(signals, "requests_running_max")
    if cap is None or cap <= 0 or waiting is None or mean is None or running is None:
        return None
    if waiting >= 1 and mean >= 1 and running >= 0.9 * cap:
        return (f"{waiting:.0f} requests wait ({mean:.3g} on average over the window) while {running:.0f} run at "
                f"a cap of {cap:.0f}")
    return None


def idle_since(signals: SignalSet, history: History, *, now: float) -> float | None:
    """When the engine went idle, carried across windows (a window only sees its own span)."""
    seconds = signals.get("idle_seconds")
    if seconds is None or seconds.value is None:
        return history.idle_since
    if seconds.value <= 0:
        return None
    start = now - seconds.value
    # "no activity in the whole window" is a lower bound: an earlier remembered start is better.
    if seconds.reason and history.idle_since is not None and history.idle_since < start:
        return history.idle_since
    return start


def keep_warm(signals: SignalSet, history: History, settings: IdleSettings, *, now: float,
              since: float | None) -> Action | None:
    """Tiny requests after a long idle so the first real request does not pay for cold caches. Not for an
    engine put to sleep by sleep mode: the requests would only wait for a wake."""
    after = settings.keep_warm_after_seconds
    if after is None or since is None:
        return None
    if settings.sleep_after_seconds is not None and (value_of(signals, "sleep_level") or 0) > 0:
        return None
    quiet = now - since
    if quiet < after:
        return None
    if history.last_keep_warm is not None and now - history.last_keep_warm < after:
        return None
    return Action("keep-warm", f"idle for {duration(quiet)} (keep-warm after {duration(after)})",
                  requests=settings.keep_warm_requests, max_tokens=settings.keep_warm_max_tokens)


def sleep_or_wake(signals: SignalSet, settings: IdleSettings, *, now: float, since: float | None) -> Action | None:
    """vLLM sleep mode (``sleep_after_seconds``; off by default): sleep after a long idle, wake on demand.
    Reads ``sleep_level`` (vllm:engine_sleep_state); an engine that does not report it is left alone. Demand
    while asleep is ``server_load`` (GET /load) too, since vLLM's request gauges do not move then."""
    after = settings.sleep_after_seconds
    level = value_of(signals, "sleep_level")
    if after is None or level is None:
        return None
    if level > 0:
        # vLLM's own gauges stand still while it sleeps (H200, vLLM 0.26: a request sent to a sleeping
        # engine left num_requests_waiting/running at 0); GET /load counts it.
        load = value_of(signals, "server_load")
        waiting, running = value_of(signals, "requests_waiting"), value_of(signals, "requests_running")
        demand = max(load or 0, (waiting or 0) + (running or 0))
        if demand > 0:
            return Action("wake", f"{demand:.0f} requests on a sleeping engine (sleep level {level:.0f})",
                          requests=0)
        return None
    if since is None or now - since < after:
        return None
    return Action("sleep", f"idle for {duration(now - since)} (sleep after {duration(after)})", requests=0,
                  level=settings.sleep_level)


def warm_up(settings: IdleSettings, *, reason: str) -> Action | None:
    if not settings.warm_up_after_restart:
        return None
    return Action("warm-up", reason, requests=settings.keep_warm_requests,
                  max_tokens=settings.keep_warm_max_tokens, after_restart=True)


# --- thermal -----------------------------------------------------------------------------------------


def hot(signals: SignalSet, settings: ThermalSettings) -> str | None:
    """Why the GPUs count as thermally stressed, or None. The power cap alone never does."""
    reasons = []
    if value_of(signals, "thermal_throttle") == 1:
        reasons.append("thermal throttling (clock-event reason SW/HW thermal slowdown)")
    if settings.freeze_on_hw_slowdown and value_of(signals, "hw_slowdown") == 1:
        reasons.append("hardware slowdown (clock-event reason HW slowdown / power brake)")
    margin = value_of(signals, "temp_margin_c")
    temp = value_of(signals, "gpu_temp_c")
    if margin is not None and margin < settings.margin_c:
        at = f"GPU {temp:g} °C, " if temp is not None else ""
        reasons.append(f"{at}{margin:g} °C below its slowdown temperature (keep ≥ {settings.margin_c:g} °C)")
    if settings.max_temp_c is not None and temp is not None and temp >= settings.max_temp_c:
        reasons.append(f"GPU {temp:g} °C ≥ max_temp_c {settings.max_temp_c:g} °C")
    return "; ".join(reasons) or None


def power(signals: SignalSet, settings: ThermalSettings, *, capped: bool) -> Action | None:
    """The privileged power cap (``gpu_control``, off by default): cap while ``hot`` says the GPUs are
    thermally stressed, restore the board's default once every thermal signal is known and clear. The
    power cap alone (SW power cap) is never a reason: a loaded H200 sits at it far from its slowdown
    temperature (docs/gpu-telemetry.md)."""
    why = hot(signals, settings)
    if why is not None:
        return None if capped else Action("power-cap", why, requests=0)
    known = any(value_of(signals, name) is not None for name in ("thermal_throttle", "temp_margin_c", "gpu_temp_c"))
    if capped and known:
        return Action("power-restore", "thermal condition cleared", requests=0)
    return None


def paused(pause: bool | str) -> Ruling:
    """The operator's switch (KEDA's ``paused``): while on, nothing the tuner would do goes out. ``True``
    or the text of why."""
    if pause is False or pause == "":
        return allow("paused")
    return deny("paused", "paused" + (f": {pause}" if isinstance(pause, str) else " (decisions.paused)"))


def pinned(knob: str, flag: str, pins: Mapping[str, str]) -> Ruling:
    """A pinned flag is held where it is: ``pins`` maps a flag (either engine's spelling, or the knob's
    name) to why. Keyed on the knob, so ``--max-running-requests`` pins ``--max-num-seqs`` too."""
    for pin, why in pins.items():
        found = knobs.knob_for(pin)
        if (found.name if found is not None else pin) == knob:
            return deny("pinned", f"{flag} is pinned" + (f": {why}" if why else ""))
    return allow("pinned")


def thermal(signals: SignalSet, settings: ThermalSettings, *, adds_load: bool) -> Ruling:
    why = hot(signals, settings)
    if why is None:
        note = ""
        if value_of(signals, "power_capped") == 1:
            note = "power-capped, which is not thermal"
        return allow("thermal", note)
    if not adds_load:
        return allow("thermal", f"hot ({why}) but this change adds no load")
    return deny("thermal", f"frozen: {why}; this change adds load")


# --- crash memory, cooldown, hysteresis, budget ----------------------------------------------------


def crash_memory(args_after: knobs.EngineArgs, history: History, *, now: float | None = None) -> Ruling:
    why = history.is_bad(args_after, now=now)
    if why is not None:
        return deny("crash", f"this command line failed before: {why}")
    return allow("crash")


def cooldown(knob: str, flag: str, history: History, *, rule_cooldown_seconds: float,
             settings: SafetySettings, now: float, live: bool = False, direction: int = 0,
             breach: bool = False, experiment: str | None = None, retry_to: float | None = None) -> Ruling:
    """A flag is not changed again within the cooldown of its last change — except live, the way its last
    change went (``direction``): live changes are cheap, and a cooldown only delays a controller correcting
    itself (H200, issue 25: 8 → 10 on a diluted window, then 64 s of verification and cooldown in series
    while 181 requests waited per replica). The cooldown guards reversals, with the hysteresis.

    ``experiment``: the experimental rule proposing. Its own change put back (not shown to help) holds its
    next try for the whole cooldown, live too — no bisection toward a value an experiment found worse: on the
    trace family (seed 7, from vLLM's 1024) kv-preemption-cap's 1024 → 254, put back, was tried again 30 s
    later at 639, then 157, 398, 519…, each an experiment the goodput paid for (live-108: 0.66 × staying).

    ``retry_to``: a live breach raise halfway back toward a raise put back (planner ``_retries``) is not held:
    the bisection shrinks its swings (seed 31's live-006 held 30 s at the cap 8: 0.42 × the best static; 0.81 ×)."""
    last = history.changes.get(knob)
    if last is None:
        return allow("cooldown")
    if experiment is not None and last.rule == experiment + ROLLED_BACK:
        period = max(rule_cooldown_seconds, settings.cooldown_seconds)
        left = last.at + period - now
        if left > 0:
            return deny("cooldown", f"cooldown {duration(left)} left ({flag}: the experiment {experiment} was put "
                        f"back {duration(now - last.at)} ago, not shown to help)")
    if live and direction != 0 and last.direction == direction:
        return allow("cooldown", f"{flag} goes on the way its last live change went")
    if live and breach and not last.rule.endswith(ROLLED_BACK):
        # the price of the last change breaks its SLO: taken back as fast as it was made (not the knob's own
        # rollback: that put back what did not help)
        return allow("cooldown", f"{flag}: the SLO is broken; a live reversal is not held")
    if live and breach and within_bracket(knob, direction, history, retry_to, settings=settings, now=now):
        return allow("cooldown", f"{flag}: the SLO is broken; halfway back at most toward the value its "
                     f"verification put back ({last.from_value})")
    period = settings.live_cooldown_seconds if live else max(rule_cooldown_seconds, settings.cooldown_seconds)
    left = last.at + period - now
    if left > 0:
        return deny("cooldown", f"cooldown {duration(left)} left ({flag} changed {duration(now - last.at)} ago "
                    f"by {last.rule})")
    return allow("cooldown")


def _hysteresis_seconds(settings: SafetySettings, live: bool) -> float:
    return settings.live_hysteresis_seconds if live else settings.hysteresis_seconds


def bracket(knob: str, direction: int, history: History, *, settings: SafetySettings, now: float,
            live: bool = True) -> tuple[float, float] | None:
    """A reversal of the knob's last change within the hysteresis period (``live``: the live one) goes halfway
    back at most: (the value it stands at, the halfway point), or None (no last change, the same direction).
    After a change put back (``history.reverted``) it bisects toward the value that failed, instead of holding
    for the whole hysteresis or retrying whole at each verification. The hysteresis held every raise for 10
    minutes after a lowering while a queue grew (live-016 of seed 2: 263 → 129 by kv-preemption-cap, then a
    phase that needed 250: 0.007 × the best static); each reversal halves the distance: the swings shrink."""
    last = history.changes.get(knob)
    if last is None or direction == 0 or last.direction == direction:
        return None
    if now - last.at >= _hysteresis_seconds(settings, live):
        return None
    try:
        was, now_at = float(last.from_value), float(last.to_value)
    except ValueError:
        return None
    return now_at, (was + now_at) / 2


def within_bracket(knob: str, direction: int, history: History, value: float | None, *,
                   settings: SafetySettings, now: float, live: bool = True) -> bool:
    """Whether ``value`` lies in ``bracket``'s span and off the value the knob stands at: a move the
    hysteresis and the cooldown let through, halfway back at most."""
    span = bracket(knob, direction, history, settings=settings, now=now, live=live)
    return span is not None and value is not None and min(span) <= value <= max(span) and value != span[0]


def hysteresis(knob: str, flag: str, direction: int, history: History, *, settings: SafetySettings,
               now: float, live: bool = False, breach: bool = False, to_value: float | None = None) -> Ruling:
    """A flag does not reverse its last change within the hysteresis period — except live, by a rule that
    fires on a broken SLO (``breach``): the price of a raise is put right as fast as the raise was made; and
    halfway back at most (``bracket``; the planner clamps a proposal to it), by restart after the cooldown."""
    last = history.changes.get(knob)
    if last is None or last.direction == direction or direction == 0:
        return allow("hysteresis")
    if live and breach and not last.rule.endswith(ROLLED_BACK):
        return allow("hysteresis", f"{flag}: the SLO is broken; a live reversal is not held")
    if within_bracket(knob, direction, history, to_value, settings=settings, now=now, live=live):
        return allow("hysteresis", f"{flag}: halfway back at most within the hysteresis "
                     f"({last.from_value}→{last.to_value} by {last.rule})")
    left = last.at + _hysteresis_seconds(settings, live) - now
    if left > 0:
        moved = "raised" if last.direction > 0 else "lowered"
        return deny("hysteresis", f"{flag} was {moved} {last.from_value}→{last.to_value} by {last.rule} "
                    f"{duration(now - last.at)} ago; no reversal for {duration(left)}")
    return allow("hysteresis")


def restart_budget(history: History, settings: SafetySettings, *, now: float) -> Ruling:
    """At most ``max_restarts_per_hour`` and ``max_restarts_per_day`` restarts; a hold lifts when the oldest
    restart in the window ages out (``until``), and a budget of 0 never lifts: no restart at all."""
    hour, day = history.restarts_within(3600, now=now), history.restarts_within(86400, now=now)
    windows = ((settings.max_restarts_per_hour, hour, 3600, "max_restarts_per_hour", "hour"),
               (settings.max_restarts_per_day, day, 86400, "max_restarts_per_day", "24h"))
    for limit, used, span, setting, where in windows:
        if limit == 0:
            return deny("budget", f"restart budget: no restart is allowed (safety.{setting} is 0)")
        if used >= limit:
            lifts = min(t for t in history.restarts if now - t < span) + span
            return deny("budget", f"restart budget: {used} restart(s) in the last {where} (max {limit}); "
                                  f"next in {duration(lifts - now)}", until=lifts)
    return allow("budget", f"{hour}/{settings.max_restarts_per_hour} this hour, "
                 f"{day}/{settings.max_restarts_per_day} today")


# --- engine constraints -------------------------------------------------------------------------------


def engine_constraints(args_after: knobs.EngineArgs, kind: knobs.EngineKind, *, platform: str | None,
                       defaults: dict[str, knobs.Value]) -> Ruling:
    problems = knobs.validate(args_after, kind, platform=platform, defaults=defaults)
    if problems:
        return deny("engine", "; ".join(problems))
    return allow("engine")
