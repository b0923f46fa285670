"""From an arm's raw data to its numbers: pure functions, standard library only.

Definitions (docs/evaluation.md repeats them):

- A request **meets the SLO** when it completed (no error, every token it asked for) with a time to first
  token at most ``slo.ttft_seconds`` and a mean inter-token gap at most ``slo.itl_mean_seconds``.
- **Goodput**: requests meeting the SLO per second of the trace (its nominal duration, the same for every
  arm). **Throughput**: completed requests per second from the trace's start to the last response's end.
- **TTFT p50/p99**: over the completed requests. **ITL p50/p99**: over the completed requests' mean
  inter-token latency ((last token − first token) / (tokens − 1), vLLM's TPOT; the quantity the SLO bounds).
- **Restarts**: engine starts the tuner's rollouts made (journal ``started`` events, both legs), per
  replica; the first start of a pool is not a restart.
- **Flags over time**: the admission cap (``--max-num-seqs``, or the plugin's cap) each replica serves
  with: from the tuner's journal (a restarted replica serves its new flags from its undrain), from the
  plugin's acknowledgements (live caps), or the arm's static value.
- **Time to converge**: from the trace's start until the flags stop changing: the last replica begins
  serving the last change (undrained after its restart, or its live cap acknowledged); **decided at**: the
  tuner's decision of that change. **Converged**: that decision came at least ``converge_quiet_seconds``
  before the trace's end and no rollout was in flight when the tuner was stopped. No change: 0 s.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

FLAG = "--max-num-seqs"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def meets_slo(r: Mapping[str, Any], *, ttft_s: float, itl_mean_s: float) -> bool:
    if not r.get("ok") or r.get("ttft") is None:
        return False
    itl = r.get("itl_mean")
    return bool(r["ttft"] <= ttft_s and (itl is None or itl <= itl_mean_s))


# --- flags over time --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlagChange:
    replica: str
    at: float  # seconds since the trace's start
    value: int | None  # None: the engine's default
    source: str  # "start", "journal", "ack", "static"


@dataclass(frozen=True)
class Restart:
    replica: str
    out_at: float  # drained (seconds since the trace's start)
    back_at: float | None  # undrained, None if never during the record
    leg: str


def _flag_of(argv: Sequence[str] | None) -> int | None:
    if not argv:
        return None
    value = None
    for i, a in enumerate(argv[:-1]):
        if a == FLAG:
            value = argv[i + 1]
    return int(value) if value is not None else None


def journal_flags(records: Sequence[Mapping[str, Any]], *, start_at: float,
                  initial: Mapping[str, int | None]) -> tuple[list[FlagChange], list[Restart], dict[str, Any]]:
    """Flag changes, restarts and the convergence facts of a tuner arm, from its journal.

    A replica serves a rollout leg's flags from that leg's ``undrained`` event on (new flags on the
    forward leg, the old ones on the back leg)."""
    rollouts = {r["rollout"]["id"]: r["rollout"] for r in records if r.get("kind") == "rollout"}
    decided = {r["rollout"]: r["at"] for r in records if r.get("kind") == "decision" and r.get("rollout")}
    changes = [FlagChange(n, 0.0, v, "start") for n, v in initial.items()]
    restarts: list[Restart] = []
    out: dict[tuple[str, str], tuple[float, str]] = {}
    last_state: dict[tuple[str, str], str] = {}
    starts: dict[str, int] = defaultdict(int)
    for r in records:
        if r.get("kind") != "event":
            continue
        rid, name, leg, to = r["rollout_id"], r["replica"], r.get("leg", "forward"), r["to"]
        last_state[(rid, name)] = to
        if r.get("event") == "started":
            starts[name] += 1
        if to in ("draining", "rolling_back") and (rid, name) not in out:
            out[(rid, name)] = (r["at"], leg if to == "draining" else "back")
        if r.get("event") == "undrained":
            roll = rollouts.get(rid, {})
            argv = (roll.get("new_argv") if leg == "forward" else roll.get("old_argv")) or {}
            changes.append(FlagChange(name, r["at"] - start_at, _flag_of(argv.get(name)), "journal"))
            if (rid, name) in out:
                began, _ = out.pop((rid, name))
                restarts.append(Restart(name, began - start_at, r["at"] - start_at, leg))
    for (_, name), (began, leg) in out.items():
        restarts.append(Restart(name, began - start_at, None, leg))
    terminal = {"done", "rolled_back", "failed", "pending"}
    in_flight = sorted({rid for (rid, _), s in last_state.items() if s not in terminal})
    decisions = sorted(t - start_at for t in decided.values())
    facts = {
        "restarts": {n: starts.get(n, 0) for n in initial},
        "rollouts": len(rollouts),
        "in_flight_at_end": in_flight,
        "decisions_at": decisions,
    }
    return changes, restarts, facts


def ack_flags(samples: Iterable[Mapping[str, Any]], *, start_at: float) -> list[FlagChange]:
    """Live cap changes from the sampled plugin acknowledgements (``cap``: the request in force,
    None = the startup envelope)."""
    changes: list[FlagChange] = []
    last: dict[str, Any] = {}
    for s in sorted(samples, key=lambda s: s["t"]):
        if "cap" not in s or s.get("ack_problem"):
            continue
        name = s["replica"]
        value = s["cap"]
        if name not in last or last[name] != value:
            changes.append(FlagChange(name, s["t"] - start_at, value, "ack"))
            last[name] = value
    return changes


def real_changes(changes: Sequence[FlagChange]) -> list[FlagChange]:
    """The changes that moved a replica's value. Its first value (its ``start`` entry, or its first
    acknowledgement) is the baseline, not a change."""
    current: dict[str, int | None] = {}
    real: list[FlagChange] = []
    for c in sorted(changes, key=lambda c: (c.source != "start", c.at)):
        if c.replica not in current:
            current[c.replica] = c.value
        elif current[c.replica] != c.value:
            current[c.replica] = c.value
            real.append(c)
    return real


def convergence(changes: Sequence[FlagChange], *, decisions_at: Sequence[float], in_flight: Sequence[str],
                duration: float, quiet_s: float) -> dict[str, Any]:
    """Whether and when the flags stopped changing."""
    real = real_changes(changes)
    live_s = max((c.at for c in real), default=None)
    if live_s is None and not in_flight:
        return {"converged": True, "changed": False, "converge_s": 0.0, "decided_s": None}
    if in_flight:
        decided_s = max(decisions_at, default=live_s)
        converge_s = None
    else:
        decided = [d for d in decisions_at if live_s is None or d <= live_s]
        decided_s = max(decided) if decided else live_s
        converge_s = live_s
    converged = not in_flight and decided_s is not None and decided_s <= duration - quiet_s
    return {"converged": converged, "changed": bool(real), "converge_s": converge_s, "decided_s": decided_s}


# --- one arm --------------------------------------------------------------------------------------


@dataclass
class ArmSummary:
    arm: str
    kind: str  # static | tuner
    mode: str  # plugin | restart | live
    flags: str
    requests: int
    completed: int
    failed: int
    met_slo: int
    goodput: float
    throughput: float
    output_tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    restarts: dict[str, int] = field(default_factory=dict)
    converged: bool | None = None
    converge_s: float | None = None  # the last flag change live: the flags stopped changing
    decided_s: float | None = None  # ... decided
    errors: dict[str, int] = field(default_factory=dict)
    replicas_served: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(meta: Mapping[str, Any], requests: Sequence[Mapping[str, Any]], *, slo: Mapping[str, float],
              duration: float, converge: Mapping[str, Any] | None = None,
              restarts: Mapping[str, int] | None = None) -> ArmSummary:
    start_at = float(meta["start_at"])
    ok = [r for r in requests if r.get("ok")]
    met = [r for r in requests if meets_slo(r, ttft_s=slo["ttft_seconds"], itl_mean_s=slo["itl_mean_seconds"])]
    ends = [r["start"] + r["e2e"] for r in ok if r.get("e2e") is not None]
    span = (max(ends) - start_at) if ends else duration
    errors: dict[str, int] = defaultdict(int)
    for r in requests:
        if not r.get("ok"):
            errors[(r.get("error") or "unknown")[:80]] += 1
    served: dict[str, int] = defaultdict(int)
    for r in requests:
        served[r.get("replica") or "?"] += 1
    ttfts = [r["ttft"] for r in ok if r.get("ttft") is not None]
    itls = [r["itl_mean"] for r in ok if r.get("itl_mean") is not None]
    out_tokens = sum(r.get("output_tokens") or r.get("max_tokens") or 0 for r in ok)
    converge = converge or {}
    return ArmSummary(
        arm=meta["arm"], kind=meta["kind"], mode=meta["mode"], flags=meta.get("flags_label", ""),
        requests=len(requests), completed=len(ok), failed=len(requests) - len(ok), met_slo=len(met),
        goodput=len(met) / duration, throughput=len(ok) / span if span > 0 else 0.0,
        output_tokens_per_s=out_tokens / span if span > 0 else 0.0,
        ttft_p50=percentile(ttfts, 0.5), ttft_p99=percentile(ttfts, 0.99),
        itl_p50=percentile(itls, 0.5), itl_p99=percentile(itls, 0.99),
        restarts=dict(restarts or {}), converged=converge.get("converged"), converge_s=converge.get("converge_s"),
        decided_s=converge.get("decided_s"), errors=dict(errors), replicas_served=dict(served),
    )


def bins(requests: Sequence[Mapping[str, Any]], *, start_at: float, duration: float, width: float,
         slo: Mapping[str, float]) -> list[dict[str, Any]]:
    """Per time bin of arrival (send time): goodput (SLO-meeting requests per second) and TTFT p99."""
    n = max(1, math.ceil(duration / width))
    grouped: list[list[Mapping[str, Any]]] = [[] for _ in range(n)]
    for r in requests:
        t = (r.get("start") or r["arrival"]) - start_at
        i = min(n - 1, max(0, int(t // width)))
        grouped[i].append(r)
    out = []
    for i, group in enumerate(grouped):
        met = sum(meets_slo(r, ttft_s=slo["ttft_seconds"], itl_mean_s=slo["itl_mean_seconds"]) for r in group)
        ttfts = [r["ttft"] for r in group if r.get("ok") and r.get("ttft") is not None]
        out.append({"t": i * width, "mid": (i + 0.5) * width, "requests": len(group), "met_slo": met,
                    "goodput": met / width, "ttft_p99": percentile(ttfts, 0.99),
                    "failed": sum(not r.get("ok") for r in group)})
    return out


def by_phase(requests: Sequence[Mapping[str, Any]], *, slo: Mapping[str, float]) -> dict[str, tuple[int, int]]:
    """Per phase of the trace: (requests meeting the SLO, requests)."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in requests:
        row = out[r["phase"]]
        row[0] += meets_slo(r, ttft_s=slo["ttft_seconds"], itl_mean_s=slo["itl_mean_seconds"])
        row[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


# --- goals ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    measured: str
    met: bool | None  # None: cannot be judged from the arms present


def goals(summaries: Mapping[str, ArmSummary], *, tuner_arm: str, replicas: int,
          converge_limit_s: float = 600.0) -> list[Goal]:
    t = summaries.get(tuner_arm)
    # Like for like: a tuner that restarts engines started at the bad start against the bad start held by
    # an engine start, a live tuner against the bad start held by the plugin; the other one if alone.
    order = ("bad-restart", "bad") if t is not None and t.mode == "restart" else ("bad", "bad-restart")
    bad = next((summaries[n] for n in order if n in summaries), None)
    sweep = [s for s in summaries.values() if s.arm.startswith("sweep-")]
    oracle = max(sweep, key=lambda s: s.goodput, default=None)
    out: list[Goal] = []
    if t is None:
        return out
    if oracle is not None and oracle.goodput > 0:
        r = t.goodput / oracle.goodput
        out.append(Goal("goodput vs the oracle", "≥ 0.90 × oracle",
                        f"{r:.2f} × ({t.goodput:.2f} / {oracle.goodput:.2f} req/s, oracle {oracle.arm})", r >= 0.90))
    else:
        out.append(Goal("goodput vs the oracle", "≥ 0.90 × oracle", "no sweep arm with goodput > 0", None))
    if bad is not None and bad.goodput > 0:
        r = t.goodput / bad.goodput
        other = next((summaries[n] for n in order[1:] if n in summaries and summaries[n].goodput > 0), None)
        also = f"; {t.goodput / other.goodput:.2f} × {other.arm} ({other.goodput:.2f})" if other is not None else ""
        out.append(Goal("goodput vs the bad start", "≥ 1.5 × bad start",
                        f"{r:.2f} × ({t.goodput:.2f} / {bad.goodput:.2f} req/s, {bad.arm}){also}", r >= 1.5))
    elif bad is not None:
        out.append(Goal("goodput vs the bad start", "≥ 1.5 × bad start",
                        f"bad start goodput 0, tuner {t.goodput:.2f} req/s", t.goodput > 0))
    else:
        out.append(Goal("goodput vs the bad start", "≥ 1.5 × bad start", "no bad-start arm", None))
    most = max(t.restarts.values(), default=0)
    out.append(Goal("restarts", "≤ 1 per replica", f"{most} at most ({', '.join(f'{k} {v}' for k, v in t.restarts.items()) or 'none'})",
                    most <= 1))
    if replicas >= 2:
        out.append(Goal("failed requests", "0 (two replicas)", str(t.failed), t.failed == 0))
    if t.converged and t.converge_s is not None:
        measured = (f"{t.converge_s:.0f} s (decided at {t.decided_s:.0f} s)" if t.decided_s is not None
                    else "0 s (no change)")
        out.append(Goal("time to converge", f"≤ {converge_limit_s / 60:g} min", measured,
                        t.converge_s <= converge_limit_s))
    else:
        last = f" (last change decided at {t.decided_s:.0f} s)" if t.decided_s is not None else ""
        out.append(Goal("time to converge", f"≤ {converge_limit_s / 60:g} min", "not converged" + last, False))
    return out
