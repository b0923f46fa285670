"""The loop's clock: durations and order from the monotonic clock, wall time only as the label.

Every time inside the loop — a snapshot's ``scraped_at``, a cycle's ``now``, a rollout's deadlines, a
rule's cooldown — is read from one ``LoopClock``: the wall time at its base plus the monotonic time since.
A step of the wall clock (an NTP correction, a clock that ran fast and was set back, a VM resumed) then
moves nothing the loop holds: no snapshot stamped before the step counts as "in the future", none leaves
its window late or sorts as the latest.

The step is still seen: ``offset`` is how far the wall clock has moved from the loop's time. Beyond
``tolerance_seconds`` it is a step, logged once (``detected``); the cycle then re-bases the loop on the
wall clock (``rebase``) and shifts what it holds by the same amount (``TunerState.rebase``), so labels,
the state file and the journal read as wall time again — but not while a rollout is in flight, whose
deadlines stay on the time they began in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("tuner.clock")

TOLERANCE_SECONDS = 1.0  # NTP slews at most 0.5 ms/s: a second of drift is hours of slewing, or a step


class LoopClock:
    def __init__(self, *, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 tolerance_seconds: float = TOLERANCE_SECONDS) -> None:
        self._wall, self._monotonic = wall, monotonic
        self.tolerance_seconds = tolerance_seconds
        self._base_wall, self._base_mono = wall(), monotonic()
        self._reported: float | None = None  # the step last logged (once per step)

    def now(self) -> float:
        """Seconds since the epoch as of the last re-base, advanced by the monotonic clock (never steps)."""
        return self._base_wall + (self._monotonic() - self._base_mono)

    def offset(self) -> float:
        """How far the wall clock is from ``now`` (positive: ahead)."""
        return self._wall() - self.now()

    def detected(self) -> float | None:
        """The wall clock's step, the first time it is seen beyond the tolerance (logged then); else None."""
        off = self.offset()
        if abs(off) <= self.tolerance_seconds:
            self._reported = None
            return None
        if self._reported is not None and abs(off - self._reported) <= self.tolerance_seconds:
            return None  # this step was said already
        self._reported = off
        log.warning("the wall clock stepped %s by %.1fs; the tuner's windows, cooldowns and deadlines run on "
                    "the monotonic clock and are not moved by it", "forward" if off > 0 else "back", abs(off))
        return off

    def rebase(self) -> float:
        """Re-base on the wall clock; the amount ``now`` moved (add it to every time the loop holds)."""
        wall, mono = self._wall(), self._monotonic()
        moved = wall - (self._base_wall + (mono - self._base_mono))
        self._base_wall, self._base_mono = wall, mono
        self._reported = None
        return moved
