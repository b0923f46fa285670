"""The pool's ConfigMap written: the leader's compare-and-swap writes, its journal, and the agents' reports.

Its keys, and how each is read (once, into typed documents): ``tuner.kube.documents``. Its **annotations**
are the operator's switches (``vllm-tuner.io/paused``, ``pin.vllm-tuner.io/<flag>``:
``tuner.kube.switches``), set with ``kubectl annotate``; the tuner reads them (``PoolStore.annotations``)
and writes back, unchanged, those it read.

**Leader writes are compare-and-swap** on the ConfigMap's resourceVersion (a PUT with it, and with the
labels and annotations read: a PUT replaces them; 409: re-read, apply the change again to what is there
now, retry) and **fenced**: each carries the writer's epoch, and a
write whose epoch is older than the ``epoch`` stored — or the same, written by another leader — is refused
(``Deposed``) before it is attempted. The CAS makes the check and the write one step: a deposed leader
whose copy is stale gets 409, re-reads, and is refused then. **Agent reports** are JSON merge patches of
their own key only (atomic on the server, no CAS: they touch nothing else).

No leader write is made while a key the leader relies on does not read (``PoolUnreadableError``) —
neither fencing switched off by an unreadable epoch nor a history replaced by an empty one.

The leader writes the pool's ConfigMap once per cycle with everything the cycle settled (``tuner.kube.
poolview``), and the rollout driver through the journal (``ConfigMapJournal``) at each step of a rollout;
the write of the record that finishes a rollout carries that rollout's booking too (``ConfigMapJournal.
booking``): no leader's end, between the two, loses it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tuner.errors import TunerError
from tuner.kube.api import ApiError, ConfigMapRecord, KubeApi, dumps
from tuner.kube.documents import (
    FIXES,
    JOURNAL_BUDGET,
    KEEP_DECISIONS,
    KEEP_ROLLOUTS,
    QUARANTINE,
    REPORT_PREFIX,
    BadLine,
    Inspection,
    ParsedJournal,
    PoolUnreadableError,
    Problem,
    appended,
    compact,
    epoch_floor,
    inspect,
    journal_text,
    loads,
    parse_journal,
    quarantined,
    set_aside,
)
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.runtime import selfmetrics

__all__ = ["JOURNAL_BUDGET", "KEEP_DECISIONS", "KEEP_ROLLOUTS", "QUARANTINE", "REPORT_PREFIX", "BadLine",
           "ConfigMapJournal", "Deposed", "Inspection", "ParsedJournal", "PoolStore", "PoolUnreadableError",
           "Problem", "compact", "dumps", "epoch_floor", "inspect", "journal_text", "loads", "parse_journal",
           "quarantined", "set_aside"]

log = logging.getLogger("tuner.kube.store")

MAX_ATTEMPTS = 8


class Deposed(TunerError):
    """A newer leader has written to the pool's ConfigMap: this one's write is refused."""

    def __init__(self, epoch: int, current: int, leader: str) -> None:
        self.epoch, self.current, self.leader = epoch, current, leader
        super().__init__(f"epoch {epoch} is deposed: the pool's ConfigMap is at epoch {current} (leader {leader}); "
                         "the write was refused")


class PoolStore:
    """The ConfigMap, cached: ``data`` is the last version seen (read, written or watched)."""

    def __init__(self, api: KubeApi, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self._lock = threading.Condition()
        self._record: ConfigMapRecord | None = None
        self._mono = monotonic
        self.name = api.settings.journal_configmap
        self.writes = 0
        self.conflicts = 0
        self.refused = 0  # writes refused for an older epoch (Deposed)
        self.unreadable = 0  # writes refused for a key that does not read (PoolUnreadableError)

    # --- reading ---------------------------------------------------------------------------------------

    @property
    def data(self) -> Mapping[str, str]:
        with self._lock:
            return dict(self._record.data) if self._record is not None else {}

    @property
    def annotations(self) -> Mapping[str, str]:
        """The ConfigMap's annotations, as last seen (the operator's switches: ``tuner.kube.switches``)."""
        with self._lock:
            return dict(self._record.annotations) if self._record is not None else {}

    @property
    def resource_version(self) -> str | None:
        with self._lock:
            return self._record.resource_version if self._record is not None else None

    def refresh(self) -> Mapping[str, str]:
        self._take(self.api.get_configmap())
        return self.data

    def _take(self, record: ConfigMapRecord) -> None:
        with self._lock:
            if self._record is None or _rv(record.resource_version) >= _rv(self._record.resource_version):
                self._record = record
            self._lock.notify_all()

    def wait_change(self, since: str | None, timeout: float) -> str | None:
        """Until the cached resourceVersion differs from ``since`` (or ``timeout``); the version now."""
        deadline = self._mono() + timeout
        with self._lock:
            while (self._record.resource_version if self._record else None) == since:
                left = deadline - self._mono()
                if left <= 0:
                    break
                self._lock.wait(left)
            return self._record.resource_version if self._record else None

    def watch(self, stop: threading.Event, *, server_timeout: int = 30, retry_seconds: float = 2.0) -> None:
        """Keep the cache current from a watch (a thread's body) until ``stop``; re-read and re-watch on
        any failure."""
        while not stop.is_set():
            try:
                self.refresh()
                for _, record in self.api.watch_configmap(self.resource_version, server_timeout=server_timeout):
                    self._take(record)
                    if stop.is_set():
                        return
            except ApiError as exc:
                if not stop.is_set():
                    log.warning("watching the pool's ConfigMap: %s; again in %gs", exc, retry_seconds)
            except Exception:  # the watch must outlive any surprise; the loop re-reads
                if not stop.is_set():  # closing the client at shutdown ends a watch this way
                    log.exception("watching the pool's ConfigMap failed")
            stop.wait(retry_seconds)

    # --- writing -----------------------------------------------------------------------------------------

    def update(self, change: Callable[[dict[str, str]], dict[str, str] | None], *, epoch: int,
               leader: str) -> Mapping[str, str]:
        """The leader's write: ``change`` gets a copy of the data as it is now and returns the new data (None:
        nothing to write). Compare-and-swap on the resourceVersion, and refused before it is attempted:

        - ``Deposed`` when the ConfigMap is at a higher epoch, or at this one but written by another leader
          (two leaders get one epoch only from a re-created Lease: the first to write keeps it);
        - ``PoolUnreadableError`` when a key the leader relies on does not read (``inspect``): fencing is
          not switched off by a garbled epoch, nor history replaced by an empty one.

        Either is confirmed on a fresh read first (the cache may be behind)."""
        fresh = self._record is None
        for _attempt in range(MAX_ATTEMPTS):
            if fresh:
                self.refresh()
            with self._lock:
                assert self._record is not None
                current = self._record
            found = inspect(current.data)
            deposed = found.epoch > epoch or (found.epoch == epoch and found.leader != leader)
            if (found.problems or deposed) and not fresh:
                fresh = True
                continue
            if found.problems:
                self.unreadable += 1
                raise PoolUnreadableError(self.name, found.problems)
            if deposed:
                self.refused += 1
                raise Deposed(epoch, found.epoch, found.leader or "?")
            new = change(dict(current.data))
            if new is None:
                return current.data
            new = {**new, "epoch": dumps(epoch), "leader": dumps(leader)}
            if new == dict(current.data):
                return current.data
            try:
                written = self.api.replace_configmap(current.resource_version, new, labels=current.labels,
                                                     annotations=current.annotations)
            except ApiError as exc:
                if exc.conflict:
                    self.conflicts += 1
                    fresh = True
                    continue
                raise
            self.writes += 1
            self._take(written)
            return written.data
        raise ApiError("update the pool's ConfigMap", 409, f"{MAX_ATTEMPTS} compare-and-swap attempts lost in a row")

    def report(self, pod: str, doc: Mapping[str, Any] | None) -> None:
        """An agent's report of its own pod (a merge patch of one key; None removes it)."""
        self._take(self.api.patch_configmap_key(REPORT_PREFIX + pod, None if doc is None else dumps(doc)))


def _rv(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:  # resourceVersions are opaque; ours and the API server's are integers
        return 0


class ConfigMapJournal:
    """``journaling.JournalLike`` over the pool's ConfigMap: ``records`` and ``append(kind, at=, **fields)``
    with the file journal's record format (v, seq, at, kind, …), plus the writer's ``epoch``. An append is
    durable once it returns (the CAS succeeded); a deposed leader's append raises ``Deposed`` and writes
    nothing.

    A line of the key that is not a record replay can use (a hand edit) is never dropped: where it cannot
    hide a record of the unfinished rollout (``parse_journal``), the next write moves it verbatim to
    ``journal.quarantine`` and says so once (and counts it); where it could, reading the records raises
    ``PoolUnreadableError``, naming the line, and nothing is written until a human has looked."""

    def __init__(self, store: PoolStore, *, epoch: int, leader: str, budget: int = JOURNAL_BUDGET,
                 metrics: selfmetrics.TunerMetrics | None = None) -> None:
        self.store, self.epoch, self.leader, self.budget, self.metrics = store, epoch, leader, budget, metrics
        self.compactions = 0
        self.lines_set_aside = 0  # moved to journal.quarantine
        # The pool's ``state`` with a rollout booked, from the rollout and the journal that finishes it (the
        # leader's: ``Leader.booking``); written with the record that finishes it, in one write.
        self.booking: Callable[[machine.Rollout, Sequence[journaling.Record]], str | None] | None = None

    def _parsed(self) -> ParsedJournal:
        parsed = parse_journal(self.store.data.get("journal", ""))
        if parsed.refusal is not None:
            raise PoolUnreadableError(self.store.name, [Problem("journal", parsed.refusal, FIXES["journal"])])
        return parsed

    @property
    def records(self) -> Sequence[journaling.Record]:
        return self._parsed().records

    def quarantine(self) -> int:
        """Move the lines replay cannot use to ``journal.quarantine`` now (the leader does it at the start of
        its cycle); how many. ``PoolUnreadableError`` where they cannot be set aside."""
        if not self._parsed().bad:
            return 0
        out: dict[str, Any] = {}

        def change(data: dict[str, str]) -> dict[str, str] | None:
            parsed = parse_journal(data.get("journal", ""))  # update() has refused it where it cannot be
            out["bad"] = parsed.bad
            return set_aside(data, parsed) if parsed.bad else None

        self.store.update(change, epoch=self.epoch, leader=self.leader)
        return self.said_set_aside(out.get("bad", ()))

    def append(self, kind: str, *, at: float, **fields: Any) -> journaling.Record:
        out: dict[str, Any] = {}

        def change(data: dict[str, str]) -> dict[str, str]:
            parsed = parse_journal(data.get("journal", ""))  # update() has refused it where it cannot be
            done = appended(parsed.records, kind, at=at, fields=fields, epoch=self.epoch, budget=self.budget)
            out["record"], out["bad"], out["compactions"] = done.record, parsed.bad, done.compactions
            new = {**data, "journal": done.text}
            if parsed.bad:
                new[QUARANTINE] = quarantined(data.get(QUARANTINE), parsed.bad)
            booked = self._booked(parsed.records, done.record)
            if booked is not None:
                new["state"] = booked
            return new

        self.store.update(change, epoch=self.epoch, leader=self.leader)
        self.compactions += out["compactions"]
        self.said_set_aside(out["bad"])
        return dict(out["record"])

    def _booked(self, before: Sequence[journaling.Record], record: journaling.Record) -> str | None:
        """The ``state`` key with the rollout ``record`` finishes booked (``booking``), or None: it finishes
        none, or there is no booking to write."""
        if self.booking is None or record.get("kind") not in ("event", "abort"):
            return None
        rid = record.get("rollout_id")
        mine = [r for r in before if r.get("rollout_id") == rid
                or (r["kind"] == "rollout" and r["rollout"].get("id") == rid)]  # its records only: replayed twice
        try:
            was, now = journaling.replay(mine).get(str(rid)), journaling.replay([*mine, record]).get(str(rid))
        except Exception:  # never the reason a record is not written: booked in memory, saved at the cycle's write
            log.exception("replaying rollout %s to book it with its last record failed", rid)
            return None
        if was is None or now is None or machine.outcome(was) is not machine.Outcome.RUNNING \
                or machine.outcome(now) is machine.Outcome.RUNNING:
            return None
        return self.booking(now, [*before, record])

    def said_set_aside(self, bad: Sequence[BadLine]) -> int:
        """One line for the lines just set aside, and the counter."""
        if not bad:
            return 0
        them = "it" if len(bad) == 1 else "them"
        log.warning("the pool's ConfigMap %s: %s; set aside verbatim in key %r (no unfinished rollout needs %s): "
                    "read %s there, then delete that key", self.store.name, "; ".join(b.reason for b in bad),
                    QUARANTINE, them, them)
        self.lines_set_aside += len(bad)
        if self.metrics is not None:
            self.metrics.journal_set_aside.inc(len(bad))
        return len(bad)
