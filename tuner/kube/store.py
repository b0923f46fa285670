"""The pool's ConfigMap: its journal, its verified arguments, each pod's desired state and report.

Keys of ``data`` (every value a JSON text, compact and sorted):

===================  ===========================================================================  =========
key                  what                                                                         writer
===================  ===========================================================================  =========
``epoch``            the highest leader epoch that wrote here (the fencing token)                 leader
``leader``           that leader's identity                                                       leader
``pool``             the verified arguments: ``{"overrides": [[flag, value]…], "base_sha256"}``   leader
                     — what a new pod starts on (the launcher drops them for another base)
``desired``          ``{pod: {"serial", "overrides", "base_sha256", "drain"}}``: what each pod's  leader
                     launcher is asked for now
``state``            the pool's decision history (cooldowns, hysteresis, budgets, crash memory)  leader
``journal``          the journal: JSON lines, the file journal's record format                   leader
``report.<pod>``     that pod's agent's report: its launcher's status.json, condensed           its agent
===================  ===========================================================================  =========

**Leader writes are compare-and-swap** on the ConfigMap's resourceVersion (a PUT with it; 409: re-read,
apply the change again to what is there now, retry) and **fenced**: each carries the writer's epoch, and a
write whose epoch is older than the ``epoch`` stored is refused (``Deposed``) before it is attempted. The
CAS makes the check and the write one step: a deposed leader whose copy is stale gets 409, re-reads, and is
refused then. **Agent reports** are JSON merge patches of their own key only (atomic on the server, no
CAS: they touch nothing else).

The ConfigMap is at most 1 MiB: once the journal passes ``JOURNAL_BUDGET`` bytes, the records of finished
rollouts (all but the last ``KEEP_ROLLOUTS``) and their decisions are dropped (``compact``), then fewer
until it fits; the unfinished rollout is always kept whole.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tuner.errors import TunerError
from tuner.kube.api import ApiError, ConfigMapRecord, KubeApi, dumps

__all__ = ["REPORT_PREFIX", "ConfigMapJournal", "Deposed", "PoolStore", "compact", "dumps", "loads"]
from tuner.rollout import journal as journaling
from tuner.rollout import machine

log = logging.getLogger("tuner.kube.store")

JOURNAL_BUDGET = 512 * 1024  # bytes of journal text before compaction (the ConfigMap's limit is 1 MiB)
KEEP_ROLLOUTS = 5  # finished rollouts kept (the health wait is sized from the last five starts)
KEEP_DECISIONS = 50
MAX_ATTEMPTS = 8
REPORT_PREFIX = "report."


class Deposed(TunerError):
    """A newer leader has written to the pool's ConfigMap: this one's write is refused."""

    def __init__(self, epoch: int, current: int, leader: str) -> None:
        self.epoch, self.current, self.leader = epoch, current, leader
        super().__init__(f"epoch {epoch} is deposed: the pool's ConfigMap is at epoch {current} (leader {leader}); "
                         "the write was refused")


def loads(data: Mapping[str, str], key: str, default: Any) -> Any:
    text = data.get(key)
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        log.warning("the pool's ConfigMap has an unreadable %r; ignored", key)
        return default


def epoch_of(data: Mapping[str, str]) -> int:
    value = loads(data, "epoch", 0)
    return int(value) if isinstance(value, int) else 0


def parse_journal(text: str) -> list[dict[str, Any]]:
    records = []
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            if not isinstance(record, dict) or "kind" not in record:
                raise ValueError(f"not a journal record: {line[:80]}")
            records.append(record)
    return records


def journal_text(records: Iterable[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(dict(r), separators=(",", ":"), sort_keys=True, ensure_ascii=False) + "\n"
                   for r in records)


def compact(records: Sequence[Mapping[str, Any]], *, keep_rollouts: int = KEEP_ROLLOUTS,
            keep_decisions: int = KEEP_DECISIONS) -> list[Mapping[str, Any]]:
    """The journal without finished rollouts older than the last ``keep_rollouts``, their records, and
    decisions beyond the last ``keep_decisions`` that belong to no kept rollout. The unfinished rollout
    (if any) is always kept whole. Record order and ``seq`` are kept."""
    rollouts = journaling.replay(records)
    finished = [rid for rid, r in rollouts.items() if machine.outcome(r) is not machine.Outcome.RUNNING]
    dropped = set(finished[:-keep_rollouts]) if keep_rollouts else set(finished)
    decisions = [r for r in records if r["kind"] == "decision" and r.get("rollout") not in rollouts]
    old_decisions = {id(r) for r in decisions[:-keep_decisions]} if keep_decisions else {id(r) for r in decisions}

    def rid(r: Mapping[str, Any]) -> str | None:
        if r["kind"] == "rollout":
            return str(r["rollout"]["id"])
        return r.get("rollout_id") or r.get("rollout")

    return [r for r in records if rid(r) not in dropped and id(r) not in old_decisions]


class PoolStore:
    """The ConfigMap, cached: ``data`` is the last version seen (read, written or watched)."""

    def __init__(self, api: KubeApi, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self._lock = threading.Condition()
        self._record: ConfigMapRecord | None = None
        self._mono = monotonic
        self.writes = 0
        self.conflicts = 0
        self.refused = 0

    # --- reading ---------------------------------------------------------------------------------------

    @property
    def data(self) -> Mapping[str, str]:
        with self._lock:
            return dict(self._record.data) if self._record is not None else {}

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
                log.exception("watching the pool's ConfigMap failed")
            stop.wait(retry_seconds)

    # --- writing -----------------------------------------------------------------------------------------

    def update(self, change: Callable[[dict[str, str]], dict[str, str] | None], *, epoch: int,
               leader: str) -> Mapping[str, str]:
        """The leader's write: ``change`` gets a copy of the data as it is now and returns the new data (None:
        nothing to write). Compare-and-swap on the resourceVersion, fenced by ``epoch`` (``Deposed``)."""
        fresh = self._record is None
        for _attempt in range(MAX_ATTEMPTS):
            if fresh:
                self.refresh()
            with self._lock:
                assert self._record is not None
                current = self._record
            stored = epoch_of(current.data)
            if stored > epoch:
                self.refused += 1
                raise Deposed(epoch, stored, str(loads(current.data, "leader", "?")))
            new = change(dict(current.data))
            if new is None:
                return current.data
            new = {**new, "epoch": dumps(epoch), "leader": dumps(leader)}
            if new == dict(current.data):
                return current.data
            try:
                written = self.api.replace_configmap(current.resource_version, new)
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
    nothing."""

    def __init__(self, store: PoolStore, *, epoch: int, leader: str, budget: int = JOURNAL_BUDGET) -> None:
        self.store, self.epoch, self.leader, self.budget = store, epoch, leader, budget
        self.compactions = 0

    @property
    def records(self) -> Sequence[journaling.Record]:
        return tuple(parse_journal(self.store.data.get("journal", "")))

    def append(self, kind: str, *, at: float, **fields: Any) -> journaling.Record:
        out: dict[str, Any] = {}

        def change(data: dict[str, str]) -> dict[str, str]:
            records: list[Mapping[str, Any]] = list(parse_journal(data.get("journal", "")))
            seq = (int(records[-1].get("seq", 0)) if records else 0) + 1
            record = {"v": journaling.VERSION, "seq": seq, "at": at, "kind": kind, **fields, "epoch": self.epoch}
            records.append(record)
            text = journal_text(records)
            keep_rollouts, keep_decisions = KEEP_ROLLOUTS, KEEP_DECISIONS
            while len(text.encode()) > self.budget and (keep_rollouts or keep_decisions):
                # fewer and fewer finished rollouts and loose decisions, never the unfinished rollout
                records = compact(records, keep_rollouts=keep_rollouts, keep_decisions=keep_decisions)
                text = journal_text(records)
                keep_rollouts, keep_decisions = keep_rollouts // 2, keep_decisions // 2
                self.compactions += 1
            out["record"] = record
            return {**data, "journal": text}

        self.store.update(change, epoch=self.epoch, leader=self.leader)
        return dict(out["record"])
