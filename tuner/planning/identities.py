"""Which engine a target's URL reached: its identity, and the flip between two of them. Pure.

A metrics URL can land on two engines in turn — a Service in front of two pods, a port reused by an
engine started elsewhere after a restart. Read naively, each flip is an engine restart (its process
start time changed): a warm-up planned at every cycle, windows that mix two engines, and no word that
the target is two engines.

An engine's identity is what it says of itself at every scrape: its process start time and the
``model_name`` it labels its series with. Rules:

1. An identity never seen before: a restart (the step plans its warm-up, as before). A restarted
   engine never comes back as the process it replaced.
2. An identity seen before that is not the current one (A → B → A): a second engine behind the URL.
   The target is held — no plan, no warm-up — for ``hold_seconds`` after the last such flip, and the
   reason says "two engines behind one URL". (An earlier start time alone is not taken as a second
   engine: a step of the engine host's clock moves ``process_start_time_seconds`` too.)
3. At most ``MEMORY`` identities are remembered (newest last): a flip back to one older than that reads
   as a restart once (a warm-up), and is seen as a flip from the next one on.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.model import dialects, snapshots
from tuner.signals import engine as engine_signals

MEMORY = 16  # a restarted process never comes back: only a second engine does


@dataclass(frozen=True, slots=True)
class Identity:
    started_at: float  # process_start_time_seconds, the engine's own clock
    model: str  # its model_name label ("" where it has none)

    def describe(self) -> str:
        return f"{self.model or 'an engine'} started at {self.started_at:.0f}"


@dataclass(frozen=True, slots=True)
class Seen:
    """What a target carries from step to step (``stepping.TargetState.identities``)."""

    identities: tuple[Identity, ...] = ()  # distinct, newest last; the last is the current engine
    two_engines_at: float | None = None  # the last flip (rule 2), in the loop's time
    why: str = ""


def of(snapshot: snapshots.Snapshot, dialect: dialects.Dialect) -> Identity | None:
    """The identity ``snapshot`` shows; None when it shows no start time (a failed scrape, an old engine)."""
    if not snapshot.ok:
        return None
    started = engine_signals.gauge(snapshot, dialect, "process_start")
    if started is None:
        return None
    models = sorted(snapshot.label_values("model_name"))
    return Identity(started, ",".join(models))


def observe(seen: Seen, current: Identity | None, *, now: float) -> tuple[Seen, bool]:
    """``seen`` after ``current``, and whether ``current`` is a flip to another engine (rule 2)."""
    if current is None or (seen.identities and seen.identities[-1] == current):
        return seen, False
    last = seen.identities[-1] if seen.identities else None
    flip = last is not None and current in seen.identities
    kept = (*tuple(i for i in seen.identities if i != current)[-(MEMORY - 1):], current)
    if not flip:
        return Seen(kept, seen.two_engines_at, seen.why), False
    assert last is not None
    why = (f"two engines behind one URL: it answered as {last.describe()}, then as {current.describe()}; "
           "decisions are held until it answers as one engine (give each engine a URL of its own)")
    return Seen(kept, now, why), True


def held(seen: Seen, *, now: float, hold_seconds: float) -> str | None:
    """Why the target is held (rule 2), or None."""
    if seen.two_engines_at is not None and now - seen.two_engines_at < hold_seconds:
        return seen.why
    return None
