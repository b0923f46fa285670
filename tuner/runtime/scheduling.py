"""APScheduler 3.x wiring, and nothing else: run one step every ``interval_seconds``; stop gracefully;
read maintenance windows.

- The cycle is an interval job with ``max_instances=1`` and ``coalesce=True``: a cycle that runs long
  (a rolling restart) delays the next one instead of overlapping it, and the missed runs collapse into
  one. The first cycle runs at once.
- ``between`` (optional): a light job every ``between_seconds`` while no cycle runs (the two never
  overlap: they share one lock) — the dispatcher advances a rollout in flight there, so a change is
  carried out and verified at the rollout's own pace while cycles go on at theirs.
- SIGTERM / SIGINT: no new cycle starts; the running one is told to stop (``should_stop()`` turns true,
  and the cycle and the rollout return between their steps); once it has returned — or
  ``stop_timeout_seconds`` passed, or a second signal came — ``on_stop`` persists the state and
  ``run()`` returns 0 (1 if persisting failed).
- SIGHUP (``systemctl reload``, ``ExecReload=``): ``on_reload`` runs in the main thread between polls —
  it re-reads and validates the configuration and keeps the running one if the new one does not load —
  framed by ``RELOADING=1`` and ``READY=1``. Without ``on_reload`` SIGHUP is left as it was.
- the supervisor (``notifier``: systemd's sd_notify, handed in by the daemon's root; silent by default):
  ``READY=1`` once the scheduler runs, ``STATUS=`` with each cycle's summary, ``WATCHDOG=1`` at half
  ``watchdog_seconds`` while the loop is healthy (a cycle finished recently, or the running one is not
  stuck), ``STOPPING=1`` on the way out.

Maintenance windows. A window is a crontab expression read as the set of minutes it matches
(``"* 2-4 * * 6,0"`` = 02:00-04:59 on weekends), evaluated with APScheduler's ``CronTrigger`` against
``now``. Outside every window a change that needs a restart is deferred, not dropped
(``planning.pooling.admit``). No windows configured: restarts may happen at any time.

The signal handler only records the signal; the main thread polls for it. (Setting a
``threading.Event`` from a handler can deadlock when the signal lands inside that Event's own lock.)
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from types import FrameType
from typing import Any, Protocol

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

log = logging.getLogger("tuner.scheduling")

_POLL_SECONDS = 0.2


class Notifier(Protocol):
    """What the loop tells its supervisor (``daemon.notify.Notifier`` under systemd)."""

    def send(self, **fields: str | int) -> bool: ...
    def ready(self, status: str | None = None) -> bool: ...
    def watchdog(self) -> bool: ...
    def stopping(self, status: str | None = None) -> bool: ...
    def status(self, text: str) -> bool: ...


class Silent:
    """No supervisor to tell (the Kubernetes agent, tests)."""

    def send(self, **fields: str | int) -> bool:
        return False

    def ready(self, status: str | None = None) -> bool:
        return False

    def watchdog(self) -> bool:
        return False

    def stopping(self, status: str | None = None) -> bool:
        return False

    def status(self, text: str) -> bool:
        return False


class Loop:
    """Runs ``step()`` every ``interval_seconds`` on a ``BackgroundScheduler``.

    ``step`` should check ``loop.should_stop()`` between its own steps. Its return value's
    ``summary`` attribute (if any) becomes the systemd STATUS line.
    """

    def __init__(
        self,
        step: Callable[[], object],
        *,
        interval_seconds: float,
        on_stop: Callable[[], None] | None = None,
        notifier: Notifier | None = None,
        watchdog_seconds: float | None = None,
        stop_timeout_seconds: float = 120.0,
        stuck_after_seconds: float | None = None,
        between: Callable[[], object] | None = None,
        between_seconds: float = 1.0,
        on_reload: Callable[[], str] | None = None,
    ) -> None:
        if interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be > 0, got {interval_seconds}")
        self.step = step
        self.interval_seconds = interval_seconds
        self.between, self.between_seconds = between, between_seconds
        self.on_stop = on_stop
        self.on_reload = on_reload
        self._reloads_asked = 0
        self._reloads_done = 0
        self.notifier: Notifier = notifier if notifier is not None else Silent()
        self.watchdog_seconds = watchdog_seconds
        self.stop_timeout_seconds = stop_timeout_seconds
        # A cycle running longer than this is stuck: the watchdog stops pinging and systemd restarts
        # us. A rolling restart legitimately takes minutes, hence the generous default.
        self.stuck_after_seconds = stuck_after_seconds or max(1800.0, 10 * interval_seconds)
        self._scheduler: BackgroundScheduler | None = None
        self._stop = threading.Event()
        self._busy = threading.Lock()
        self._signals_seen = 0
        self._running_since: float | None = None
        self.cycles = 0

    # -- state ----------------------------------------------------------------------------------
    @property
    def stop_event(self) -> threading.Event:
        """Set once a stop was requested (within ``_POLL_SECONDS`` of a signal): hand it to code that
        waits, e.g. the rollout driver's ``stop_event``."""
        return self._stop

    def should_stop(self) -> bool:
        return self._stop.is_set() or self._signals_seen > 0

    def is_alive(self) -> bool:
        """The scheduler runs, no stop was requested, and the current cycle (if any) is not stuck."""
        if self._scheduler is None or not self._scheduler.running or self.should_stop():
            return False
        since = self._running_since
        return since is None or time.monotonic() - since < self.stuck_after_seconds

    def is_busy(self) -> bool:
        """A cycle is running right now (a rolling restart keeps it running for minutes)."""
        return self._running_since is not None

    # -- running --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler in the background (the first cycle runs at once)."""
        if self._scheduler is not None:
            raise RuntimeError("the loop was already started")
        scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(3)},  # the cycle, the job between cycles, the watchdog
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone=UTC,
        )
        scheduler.add_job(self._tick, IntervalTrigger(seconds=self.interval_seconds, timezone=UTC),
                          id="cycle", name="tuner cycle", next_run_time=datetime.now(UTC),
                          max_instances=1, coalesce=True)
        if self.between is not None:
            scheduler.add_job(self._between, IntervalTrigger(seconds=self.between_seconds, timezone=UTC),
                              id="between", name="between cycles", max_instances=1, coalesce=True)
        if self.watchdog_seconds:
            scheduler.add_job(self._ping, IntervalTrigger(seconds=max(0.5, self.watchdog_seconds / 2),
                                                          timezone=UTC),
                              id="watchdog", name="sd_notify watchdog", max_instances=1, coalesce=True)
        scheduler.start(paused=True)  # READY=1 goes out before the first cycle's STATUS=
        self._scheduler = scheduler
        self.notifier.ready(f"running a cycle every {self.interval_seconds:g}s")
        scheduler.resume()

    def run(self, *, install_signal_handlers: bool = True) -> int:
        """Block until SIGTERM/SIGINT (or ``request_stop()``), then stop gracefully; the exit code."""
        previous: dict[int, Any] = {}
        if install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, self._on_signal)
            if self.on_reload is not None:
                previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        try:
            self.start()
            while not self.should_stop():
                self._stop.wait(_POLL_SECONDS)
                self.reload_if_asked()
            return self.stop()
        finally:
            for restored, handler in previous.items():
                signal.signal(restored, handler)

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> int:
        """No new cycles; wait for the running one (bounded); persist; 0 on success."""
        first_signals = self._signals_seen
        self._stop.set()
        self.notifier.stopping("stopping: finishing the current step")
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        deadline = time.monotonic() + self.stop_timeout_seconds
        finished = False
        while time.monotonic() < deadline:
            if self._busy.acquire(timeout=_POLL_SECONDS):
                self._busy.release()
                finished = True
                break
            if self._signals_seen > first_signals:
                log.warning("second stop signal: not waiting for the current cycle any longer")
                break
        if not finished:
            log.warning("the current cycle did not return within %.0fs; persisting state anyway",
                        self.stop_timeout_seconds)
        code = 0
        if self.on_stop is not None:
            try:
                self.on_stop()
            except OSError as exc:  # a full or read-only disk: say it in one line
                log.error("persisting state on stop failed: %s", exc)
                code = 1
            except Exception:
                log.exception("persisting state on stop failed")
                code = 1
        log.info("stopped after %d cycle(s)", self.cycles)
        return code

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals_seen += 1  # only record it; see the module docstring

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        self._reloads_asked += 1  # only record it: the main thread reloads (reload_if_asked)

    def request_reload(self) -> None:
        self._reloads_asked += 1

    def reload_if_asked(self) -> None:
        """Run ``on_reload`` once for any number of SIGHUPs since the last time; its line is systemd's STATUS."""
        if self.on_reload is None or self._reloads_done == self._reloads_asked:
            return
        self._reloads_done = self._reloads_asked
        self.notifier.send(RELOADING=1, STATUS="reloading the configuration")
        try:
            said = self.on_reload()
        except Exception:  # a bug in reloading must not stop the tuner: it keeps what it runs
            log.exception("reloading the configuration failed; keeping the running one")
            said = "reloading the configuration failed; keeping the running one"
        self.notifier.send(READY=1, STATUS=said)

    def _tick(self) -> None:
        if self.should_stop():
            return
        with self._busy:
            self._running_since = time.monotonic()
            try:
                result = self.step()
            except Exception:
                log.exception("cycle failed")
                result = None
            finally:
                self._running_since = None
                self.cycles += 1
        summary = getattr(result, "summary", None)
        if isinstance(summary, str):
            self.notifier.status(summary)

    def _between(self) -> None:
        if self.should_stop() or self.between is None or not self._busy.acquire(blocking=False):
            return  # a cycle runs (or the loop stops): the next cycle does the same work
        try:
            self.between()
        except Exception:
            log.exception("the job between cycles failed")
        finally:
            self._busy.release()

    def _ping(self) -> None:
        if self.is_alive():
            self.notifier.watchdog()


class MaintenanceWindows:
    """Crontab expressions read as sets of minutes. Raises ValueError naming a bad expression."""

    def __init__(self, expressions: Sequence[str], *, timezone: str = "UTC") -> None:
        if not expressions:
            raise ValueError("at least one crontab expression is needed, e.g. '* 2-4 * * *' (02:00-04:59)")
        self.expressions = tuple(expressions)
        self.timezone = timezone
        self._triggers = []
        for expr in expressions:
            try:
                self._triggers.append(CronTrigger.from_crontab(expr, timezone=timezone))
            except (ValueError, TypeError, LookupError) as exc:
                raise ValueError(f"maintenance window {expr!r}: {exc}; expected 5 crontab fields "
                                 "(minute hour day month weekday), e.g. '* 2-4 * * 6,0'") from exc
        self._tz = self._triggers[0].timezone

    def _minute(self, now: float) -> datetime:
        return datetime.fromtimestamp(now, self._tz).replace(second=0, microsecond=0)

    def is_open(self, now: float) -> bool:
        minute = self._minute(now)
        return any(t.get_next_fire_time(None, minute) == minute for t in self._triggers)

    def next_open(self, now: float) -> float | None:
        """When a window next opens (now if open); None if no expression ever fires again."""
        minute = self._minute(now)
        times = [t.get_next_fire_time(None, minute) for t in self._triggers]
        known = [t.timestamp() for t in times if t is not None]
        return min(known) if known else None
