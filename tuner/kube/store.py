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
``journal.           journal lines that did not read, moved here verbatim (not JSON; one line     leader
quarantine``         each): for a human to read, then delete
``report.<pod>``     that pod's agent's report: its launcher's status.json, condensed           its agent
===================  ===========================================================================  =========

Its **annotations** are the operator's switches (``vllm-tuner.io/paused``, ``pin.vllm-tuner.io/<flag>``:
``tuner.kube.switches``), set with ``kubectl annotate``; the tuner reads them (``PoolStore.annotations``)
and writes back, unchanged, those it read.

**Leader writes are compare-and-swap** on the ConfigMap's resourceVersion (a PUT with it, and with the
labels and annotations read: a PUT replaces them; 409: re-read, apply the change again to what is there
now, retry) and **fenced**: each carries the writer's epoch, and a
write whose epoch is older than the ``epoch`` stored — or the same, written by another leader — is refused
(``Deposed``) before it is attempted. The CAS makes the check and the write one step: a deposed leader
whose copy is stale gets 409, re-reads, and is refused then. **Agent reports** are JSON merge patches of
their own key only (atomic on the server, no CAS: they touch nothing else).

**Every key is read through the bounded reader** (``tuner.portable.untrusted``): a human can edit the
ConfigMap. The leader's keys are read strictly (``inspect``): one that does not read is a ``Problem``
naming the key and its fix, and no leader writes at all until it reads (``PoolUnreadableError``) —
neither fencing switched off by an unreadable epoch nor a history replaced by an empty one. A journal
line that does not read is moved to ``journal.quarantine`` where it cannot hide a record of the
unfinished rollout, and refuses the pool where it could (``parse_journal``). The agents' keys are read
leniently (``loads``: absent or unreadable is the default, said once).

The ConfigMap is at most 1 MiB: once the journal passes ``JOURNAL_BUDGET`` bytes, the records of finished
rollouts (all but the last ``KEEP_ROLLOUTS``) and their decisions are dropped (``compact``), then fewer
until it fits; the unfinished rollout is always kept whole.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner.errors import TunerError
from tuner.kube.api import ApiError, ConfigMapRecord, KubeApi, dumps
from tuner.planning import history as history_mod
from tuner.portable import untrusted
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.runtime import selfmetrics

__all__ = ["QUARANTINE", "REPORT_PREFIX", "BadLine", "ConfigMapJournal", "Deposed", "Inspection", "ParsedJournal",
           "PoolStore", "PoolUnreadableError", "Problem", "compact", "dumps", "epoch_floor", "inspect",
           "journal_text", "loads", "parse_journal", "quarantined", "set_aside"]

log = logging.getLogger("tuner.kube.store")

JOURNAL_BUDGET = 512 * 1024  # bytes of journal text before compaction (the ConfigMap's limit is 1 MiB)
QUARANTINE_BUDGET = 64 * 1024  # bytes of set-aside journal lines kept (the newest whole lines)
KEEP_ROLLOUTS = 5  # finished rollouts kept (the health wait is sized from the last five starts)
KEEP_DECISIONS = 50
MAX_ATTEMPTS = 8
REPORT_PREFIX = "report."
QUARANTINE = "journal.quarantine"
EPOCH_MAX = 2**31 - 1  # an epoch is a Lease's leaseTransitions: an int32
ROLLOUT_KINDS = frozenset({"rollout", "event", "abort"})  # the records replay folds

FIXES = {
    "epoch": "the leader writes nothing to this pool until it is fixed: set it to an integer above every epoch "
             "used so far (the Lease's spec.leaseTransitions and the journal records' \"epoch\" are some; a value "
             "well above them is safe: the next leader's epoch goes above it)",
    "state": "the leader keeps the pool's decision history rather than replace it with an empty one: put back a "
             "good copy, or delete the key to start the history afresh (its cooldowns, budgets and crash "
             "memory are lost)",
    "pool": "delete the key: new pods then start on their own command line until a rollout verifies arguments "
            "again",
    "desired": "delete the key: every pod keeps what its launcher runs, and the leader asks each one again",
    "journal": "remove those lines once you know what they held (or move them to key 'journal.quarantine'); the "
               "leader then resumes the unfinished rollout from what is left, so check that its pods run what "
               "that says (deleting the key starts an empty journal: a rollout in flight is then not resumed)",
}


class Deposed(TunerError):
    """A newer leader has written to the pool's ConfigMap: this one's write is refused."""

    def __init__(self, epoch: int, current: int, leader: str) -> None:
        self.epoch, self.current, self.leader = epoch, current, leader
        super().__init__(f"epoch {epoch} is deposed: the pool's ConfigMap is at epoch {current} (leader {leader}); "
                         "the write was refused")


@dataclass(frozen=True)
class Problem:
    """A key of the pool's ConfigMap the leader cannot use: what is wrong with it (describing the value,
    never quoting it) and how a human fixes it."""

    key: str
    reason: str
    fix: str

    def line(self, configmap: str) -> str:
        return f"the pool's ConfigMap {configmap}: {self.reason}; {self.fix}"


class PoolUnreadableError(journaling.JournalWriteError):
    """A key of the pool's ConfigMap that the leader needs cannot be read (``problems``): no leader write
    is made until a human fixes it. To the rollout driver it is a journal that takes no records (a
    ``JournalWriteError``): the transition is not taken, the rollout stops on its last durable state."""

    def __init__(self, configmap: str, problems: Sequence[Problem]) -> None:
        self.configmap, self.problems = configmap, tuple(problems)
        text = " | ".join(p.line(configmap) for p in self.problems)
        self.path, self.errno, self.reason = configmap, None, text
        TunerError.__init__(self, text)


# --- reading the keys (pure) --------------------------------------------------------------------------


_said: set[tuple[str, str]] = set()
_said_lock = threading.Lock()


def loads(data: Mapping[str, str], key: str, default: Any) -> Any:
    """A key's document, read through the bounded reader; ``default`` when it is absent or unreadable (said
    once per key and reason). For what an agent reads and reports; the leader's own keys go through
    ``inspect``, which refuses rather than defaults."""
    text = data.get(key)
    if not text:
        return default
    try:
        return untrusted.loads(text, what=f"key {key!r}")
    except untrusted.Untrusted as exc:
        with _said_lock:
            first = (key, exc.reason) not in _said
            if first and len(_said) < 1024:
                _said.add((key, exc.reason))
        if first:
            log.warning("the pool's ConfigMap: %s; ignored", exc.reason)
        return default


ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "ABSENT"})()  # a key not there (JSON null is a value)


def _strict(data: Mapping[str, str], key: str) -> Any:
    """A leader key's document, ``ABSENT`` when absent; ``Untrusted`` when present but unreadable."""
    text = data.get(key)
    if text is None:
        return ABSENT
    if not text.strip():
        raise untrusted.Untrusted(f"key {key!r} is empty (no JSON document)")
    return untrusted.loads(text, what=f"key {key!r}")


def _epoch(data: Mapping[str, str]) -> int:
    value = _strict(data, "epoch")
    if value is ABSENT:
        return 0
    return untrusted.integer(value, what="key 'epoch'", lo=0, hi=EPOCH_MAX)


def epoch_floor(data: Mapping[str, str]) -> int:
    """The epoch the ConfigMap holds (0 when absent or unreadable: the leader refuses the latter anyway);
    a new leader's epoch must be above it."""
    try:
        return _epoch(data)
    except untrusted.Untrusted:
        return 0


@functools.lru_cache(maxsize=8)
def _histories(text: str | None) -> Mapping[str, history_mod.History]:
    if text is None:
        return {}
    if not text.strip():
        raise untrusted.Untrusted("key 'state' is empty (no JSON document)")
    doc = untrusted.mapping(untrusted.loads(text, what="key 'state'", max_depth=64), what="key 'state'")
    histories = untrusted.mapping(doc.get("histories", {}), what="key 'state', its histories,")
    out = {}
    for name, h in histories.items():
        try:
            out[name] = history_mod.from_dict(untrusted.mapping(h, what="a history"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise untrusted.Untrusted(f"key 'state': the history of {untrusted.describe(name)} does not read "
                                      f"({type(exc).__name__})") from None
    return out


@functools.lru_cache(maxsize=8)
def _booked(text: str | None) -> str | None:
    """The last rollout the pool's state says it booked ("": none yet); None where it does not say (a state
    an older leader wrote: the journal's finished rollouts are then taken as booked)."""
    if text is None or not text.strip():
        return None
    doc = untrusted.mapping(untrusted.loads(text, what="key 'state'", max_depth=64), what="key 'state'")
    booked = doc.get("booked_rollout")
    if booked is not None and not isinstance(booked, str):
        raise untrusted.Untrusted("key 'state': booked_rollout is not a string")
    return booked


def _check_pool(data: Mapping[str, str]) -> None:
    pool = _strict(data, "pool")
    if pool is not ABSENT:
        untrusted.listing(untrusted.mapping(pool, what="key 'pool'").get("overrides", []),
                          what="key 'pool', its overrides,")


def _check_desired(data: Mapping[str, str]) -> None:
    desired = _strict(data, "desired")
    if desired is ABSENT:
        return
    for entry in untrusted.mapping(desired, what="key 'desired'").values():
        entry = untrusted.mapping(entry, what="key 'desired', each pod's entry,")
        untrusted.integer(entry.get("serial", 0), what="key 'desired', a pod's serial,")
        untrusted.listing(entry.get("overrides", []), what="key 'desired', a pod's overrides,")


@dataclass(frozen=True)
class BadLine:
    """A line of the ``journal`` key that is not a record replay can use."""

    number: int  # 1-based, as an editor counts
    text: str = field(repr=False)  # verbatim (kept in the quarantine, never logged)
    reason: str  # describes the line, never quotes it
    kind: str | None = None  # the record's kind, where it has one


@dataclass(frozen=True)
class ParsedJournal:
    records: tuple[journaling.Record, ...]
    bad: tuple[BadLine, ...] = ()
    refusal: str | None = None  # why the bad lines cannot be set aside (None: they can, or there are none)


def _record(value: Any, what: str) -> dict[str, Any]:
    record = untrusted.mapping(value, what=what)
    untrusted.text(record.get("kind"), what=f"{what}, its kind,", max_chars=64)
    if "seq" in record:
        untrusted.integer(record["seq"], what=f"{what}, its seq,")
    if "at" in record:
        untrusted.number(record["at"], what=f"{what}, its at,")
    for key in ("reason", "replica", "rollout_id"):
        if key in record:
            untrusted.text(record[key], what=f"{what}, its {key},", max_chars=64 * 1024)
    return record


@functools.lru_cache(maxsize=8)
def parse_journal(text: str) -> ParsedJournal:
    """The ``journal`` key's records, and the lines that are not records replay can use.

    A line is bad when it is not a JSON object with a string ``kind`` (and a whole ``seq``, a finite ``at``),
    or when replay cannot fold it (a rollout whose payload does not build, an event of an unknown rollout
    or replica, a transition the machine refuses). Bad lines can be set aside (moved to ``journal.quarantine``)
    only where they cannot hide a record of the rollout a new leader must resume (``refusal`` says why not):

    - at most one rollout replays as unfinished, and it is the last one begun (only one runs at a time: an
      earlier one that looks unfinished lost its last records);
    - no bad line comes after the start of the unfinished rollout (it may be one of its events);
    - after the start of the last rollout (of the journal, where none replays) at most one bad line, and
      not a rollout's record (``rollout``, ``event``, ``abort``): two could be a later rollout and its
      events, garbled alike.

    A bad line before the start of the last rollout belongs to a time before it began, when any rollout
    then running had to finish (else it looks unfinished: refused above). What is left when the lines are
    set aside is then what a leader killed just before writing them would have left, or the same rollouts
    with finished history missing: a decision, a note, a finished rollout's records — or the record of a
    rollout that had no event yet (no pod was touched for it).
    """
    rollouts: dict[str, machine.Rollout] = {}
    begun: dict[str, int] = {}
    records: list[journaling.Record] = []
    bad: list[BadLine] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        what = f"line {number} of key 'journal'"
        try:
            value = untrusted.loads(line, what=what)
        except untrusted.Untrusted as exc:
            bad.append(BadLine(number, line, exc.reason))
            continue
        kind = value.get("kind") if isinstance(value, dict) and isinstance(value.get("kind"), str) else None
        try:
            record = _record(value, what)
        except untrusted.Untrusted as exc:
            bad.append(BadLine(number, line, exc.reason, kind))
            continue
        try:
            journaling.fold(rollouts, record)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, machine.RolloutError) as exc:
            bad.append(BadLine(number, line, f"{what} is a record of kind {untrusted.describe(kind)} that does "
                                             f"not replay ({type(exc).__name__})", kind))
            continue
        records.append(record)
        if kind == "rollout":
            begun[str(record["rollout"]["id"])] = number
    return ParsedJournal(tuple(records), tuple(bad), _refusal(rollouts, begun, bad) if bad else None)


def _refusal(rollouts: Mapping[str, machine.Rollout], begun: Mapping[str, int], bad: Sequence[BadLine]) -> str | None:
    lines = ", ".join(str(b.number) for b in bad)
    running = [rid for rid, r in rollouts.items() if machine.outcome(r) is machine.Outcome.RUNNING]
    last = max(begun.values(), default=0)
    if len(running) > 1:
        return (f"without its line(s) {lines} (unreadable) the key 'journal' holds {len(running)} unfinished "
                "rollouts, and only one ever runs")
    if running and begun[running[0]] != last:
        return (f"without its line(s) {lines} (unreadable) rollout {running[0]} of the key 'journal' looks "
                "unfinished though a later one began: they held its end")
    if running and bad[-1].number > begun[running[0]]:
        return (f"line {bad[-1].number} of the key 'journal' is unreadable and comes after the start of the "
                f"unfinished rollout {running[0]} (line {begun[running[0]]}): it may be one of its records")
    late = [b for b in bad if b.number > last]
    if any(b.kind in ROLLOUT_KINDS for b in late):
        b = next(b for b in late if b.kind in ROLLOUT_KINDS)
        return (f"line {b.number} of the key 'journal' is a record of kind {b.kind} that does not replay, after "
                "the start of the last rollout: the rollout it belongs to may be unfinished")
    if len(late) > 1:
        return (f"lines {', '.join(str(b.number) for b in late)} of the key 'journal' are unreadable, after the "
                "start of the last rollout: they may be a later rollout and its events")
    return None


@dataclass(frozen=True)
class Inspection:
    """What the leader reads of the pool's ConfigMap, or the problems that keep it from acting."""

    problems: tuple[Problem, ...]
    epoch: int = 0
    leader: str | None = None
    histories: Mapping[str, history_mod.History] = field(default_factory=dict)
    journal: ParsedJournal = ParsedJournal(())
    booked_rollout: str | None = None  # the last rollout the saved history includes ("": none; None: not said)


def inspect(data: Mapping[str, str]) -> Inspection:
    """Every key the leader relies on, read strictly: ``epoch`` (the fencing token), ``state`` (the
    decision history), ``pool``, ``desired`` and ``journal``. An absent key is a fresh pool; a present one
    that does not read is a ``Problem`` (the leader then makes no write at all)."""
    problems: list[Problem] = []
    epoch = 0
    histories: Mapping[str, history_mod.History] = {}
    booked: str | None = None
    journal = ParsedJournal(())
    for key in ("epoch", "state", "pool", "desired", "journal"):
        try:
            if key == "epoch":
                epoch = _epoch(data)
            elif key == "state":
                histories = _histories(data.get("state"))
                booked = _booked(data.get("state"))
            elif key == "pool":
                _check_pool(data)
            elif key == "desired":
                _check_desired(data)
            else:
                journal = parse_journal(data.get("journal", ""))
                if journal.refusal is not None:
                    problems.append(Problem("journal", journal.refusal, FIXES["journal"]))
        except untrusted.Untrusted as exc:
            problems.append(Problem(key, exc.reason, FIXES[key]))
    leader = loads(data, "leader", None)
    return Inspection(tuple(problems), epoch, leader if isinstance(leader, str) else None, histories, journal,
                      booked)


def journal_text(records: Iterable[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(dict(r), separators=(",", ":"), sort_keys=True, ensure_ascii=False) + "\n"
                   for r in records)


def quarantined(existing: str | None, lines: Sequence[BadLine], *, budget: int = QUARANTINE_BUDGET) -> str:
    """The ``journal.quarantine`` key with ``lines`` added (verbatim, one per line), the oldest whole lines
    dropped past ``budget`` bytes."""
    kept = [*(line for line in (existing or "").split("\n") if line), *(b.text for b in lines)]
    while kept and len("".join(line + "\n" for line in kept).encode()) > budget:
        kept.pop(0)
    return "".join(line + "\n" for line in kept)


def set_aside(data: Mapping[str, str], parsed: ParsedJournal) -> dict[str, str]:
    """``data`` with the journal's bad lines moved to ``journal.quarantine`` (``parsed`` allows it)."""
    assert parsed.refusal is None
    return {**data, "journal": journal_text(parsed.records), QUARANTINE: quarantined(data.get(QUARANTINE), parsed.bad)}


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
        return self._said(out.get("bad", ()))

    def append(self, kind: str, *, at: float, **fields: Any) -> journaling.Record:
        out: dict[str, Any] = {}

        def change(data: dict[str, str]) -> dict[str, str]:
            parsed = parse_journal(data.get("journal", ""))  # update() has refused it where it cannot be
            records: list[Mapping[str, Any]] = list(parsed.records)
            seq = max((int(r.get("seq", 0)) for r in records), default=0) + 1
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
            out["record"], out["bad"] = record, parsed.bad
            new = {**data, "journal": text}
            if parsed.bad:
                new[QUARANTINE] = quarantined(data.get(QUARANTINE), parsed.bad)
            return new

        self.store.update(change, epoch=self.epoch, leader=self.leader)
        self._said(out["bad"])
        return dict(out["record"])

    def _said(self, bad: Sequence[BadLine]) -> int:
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
