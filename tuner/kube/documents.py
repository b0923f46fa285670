"""The pool's ConfigMap read: its keys parsed once into typed documents (``inspect``), pure.

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

The leader's keys are read strictly (``inspect``): one that does not read is a ``Problem`` naming the key
and its fix, and no leader write is made until it reads (``PoolUnreadableError``). A journal line that
does not read is moved to ``journal.quarantine`` where it cannot hide a record of the unfinished rollout,
and refuses the pool where it could (``parse_journal``). The agents' keys are read leniently (``loads``:
absent or unreadable is the default, said once). Every key goes through the bounded reader
(``tuner.launcher.untrusted``): a human can edit the ConfigMap.

The ConfigMap is at most 1 MiB: once the journal passes ``JOURNAL_BUDGET`` bytes, the records of finished
rollouts (all but the last ``KEEP_ROLLOUTS``) and their decisions are dropped (``compact``), then fewer
until it fits; the unfinished rollout is always kept whole (``appended``).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner.errors import TunerError
from tuner.kube.api import dumps
from tuner.planning import history as history_mod
from tuner.portable import untrusted
from tuner.rollout import journal as journaling
from tuner.rollout import machine

log = logging.getLogger("tuner.kube.store")

JOURNAL_BUDGET = 512 * 1024  # bytes of journal text before compaction (the ConfigMap's limit is 1 MiB)
QUARANTINE_BUDGET = 64 * 1024  # bytes of set-aside journal lines kept (the newest whole lines)
KEEP_ROLLOUTS = 5  # finished rollouts kept (the health wait is sized from the last five starts)
KEEP_DECISIONS = 50
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


ABSENT: object = type("Absent", (), {"__repr__": lambda self: "ABSENT"})()  # a key not there (JSON null is a value)


def _strict(data: Mapping[str, str], key: str) -> object:
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


def _pool(data: Mapping[str, str]) -> PoolArgs | None:
    pool = _strict(data, "pool")
    if pool is ABSENT:
        return None
    doc = untrusted.mapping(pool, what="key 'pool'")
    overrides = untrusted.listing(doc.get("overrides", []), what="key 'pool', its overrides,")
    return PoolArgs(tuple(overrides), _text_or_none(doc.get("base_sha256")), _text_or_none(doc.get("rollout")),
                    _text_or_none(doc.get("reason")))


def _text_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _check_desired(data: Mapping[str, str]) -> None:
    desired = _strict(data, "desired")
    if desired is ABSENT:
        return
    for entry in untrusted.mapping(desired, what="key 'desired'").values():
        entry = untrusted.mapping(entry, what="key 'desired', each pod's entry,")
        untrusted.integer(entry.get("serial", 0), what="key 'desired', a pod's serial,")
        untrusted.listing(entry.get("overrides", []), what="key 'desired', a pod's overrides,")


RUNNING_STATES = frozenset({"starting", "serving", "draining", "stopping"})  # a launcher's engine runs


@dataclass(frozen=True)
class PoolArgs:
    """Key ``pool``: the pool's verified arguments, what a new pod starts on."""

    overrides: tuple[object, ...] = ()  # ``[flag, value]`` pairs on the base command line, as written
    base_sha256: str | None = None  # the base command line they were computed for
    rollout: str | None = None  # the rollout that verified them (or that the user's change set aside)
    reason: str | None = None  # why they are what they are, when the leader said so (the user wins)

    def as_dict(self) -> dict[str, object]:
        doc: dict[str, object] = {"overrides": list(self.overrides), "base_sha256": self.base_sha256}
        if self.reason is not None:
            doc["reason"] = self.reason
        doc["rollout"] = self.rollout
        return doc


@dataclass(frozen=True)
class Report:
    """Key ``report.<pod>``: what the leader decides on of a pod's agent's report (its launcher's status)."""

    state: str | None = None  # the launcher's state
    argv: tuple[str, ...] | None = None  # the command line its engine runs (None: not a list of strings)
    base_sha256: str | None = None  # the base command line (the Deployment's) it runs on
    overrides: tuple[object, ...] = ()  # the overrides it runs, as written
    overrides_dropped: bool = False  # the launcher dropped the desired overrides (another base)

    @property
    def running(self) -> bool:
        """The pod's engine runs a command line the leader can tune: the pod is a member of the pool."""
        return self.argv is not None and self.state in RUNNING_STATES

    @classmethod
    def of(cls, doc: object) -> Report | None:
        if not isinstance(doc, dict):
            return None
        argv, state, overrides = doc.get("argv"), doc.get("state"), doc.get("overrides")
        return cls(state=state if isinstance(state, str) else None,
                   argv=tuple(argv) if isinstance(argv, list) and all(isinstance(a, str) for a in argv) else None,
                   base_sha256=_text_or_none(doc.get("base_sha256")),
                   overrides=tuple(overrides) if isinstance(overrides, list) else (),
                   overrides_dropped=bool(doc.get("overrides_dropped")))


def reports(data: Mapping[str, str]) -> dict[str, Report]:
    """Every pod's report (read leniently: one that does not read is no report, said once)."""
    out = {}
    for key in data:
        if key.startswith(REPORT_PREFIX):
            report = Report.of(loads(data, key, None))
            if report is not None:
                out[key[len(REPORT_PREFIX):]] = report
    return out


def desired_of(data: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Key ``desired``: each pod's desired state (read leniently: what does not read is no entry)."""
    doc = loads(data, "desired", {})
    return {k: v for k, v in doc.items() if isinstance(v, dict)} if isinstance(doc, dict) else {}


def state_text(histories: Mapping[str, history_mod.History], booked_rollout: str | None) -> str:
    """Key ``state``: the pool's decision history, with the last rollout it includes (``booked_rollout``)."""
    doc: dict[str, object] = {"histories": {n: history_mod.to_dict(h) for n, h in sorted(histories.items())}}
    if booked_rollout is not None:  # with the histories that include it: one write
        doc["booked_rollout"] = booked_rollout
    return dumps(doc)


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
    pool: PoolArgs | None = None  # key 'pool' (None: absent)
    reports: Mapping[str, Report] = field(default_factory=dict)  # by pod


def inspect(data: Mapping[str, str]) -> Inspection:
    """The pool's ConfigMap parsed once into typed documents. Every key the leader relies on, read strictly:
    ``epoch`` (the fencing token), ``state`` (the decision history), ``pool``, ``desired`` and ``journal``. An
    absent key is a fresh pool; a present one that does not read is a ``Problem`` (the leader then makes no
    write at all). The agents' reports are read leniently (``reports``)."""
    problems: list[Problem] = []
    epoch = 0
    histories: Mapping[str, history_mod.History] = {}
    booked: str | None = None
    pool: PoolArgs | None = None
    journal = ParsedJournal(())
    for key in ("epoch", "state", "pool", "desired", "journal"):
        try:
            if key == "epoch":
                epoch = _epoch(data)
            elif key == "state":
                histories = _histories(data.get("state"))
                booked = _booked(data.get("state"))
            elif key == "pool":
                pool = _pool(data)
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
                      booked, pool, reports(data))


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


@dataclass(frozen=True)
class Appended:
    """The journal with one record more (``appended``)."""

    record: dict[str, Any]  # the record as written: v, seq, at, kind, its fields, epoch
    records: tuple[Mapping[str, Any], ...]  # every record kept, the new one last
    text: str  # the key's text
    compactions: int = 0  # how many times it was compacted to fit the budget


def appended(records: Sequence[Mapping[str, Any]], kind: str, *, at: float, fields: Mapping[str, Any], epoch: int,
             budget: int = JOURNAL_BUDGET) -> Appended:
    """The journal with a record of ``kind`` added (the file journal's record format: the next ``seq``, and
    the writer's ``epoch``), compacted while its text passes ``budget`` bytes: fewer and fewer finished
    rollouts and loose decisions, never the unfinished rollout."""
    kept: list[Mapping[str, Any]] = list(records)
    seq = max((int(r.get("seq", 0)) for r in kept), default=0) + 1
    record = {"v": journaling.VERSION, "seq": seq, "at": at, "kind": kind, **fields, "epoch": epoch}
    kept.append(record)
    text = journal_text(kept)
    keep_rollouts, keep_decisions, compactions = KEEP_ROLLOUTS, KEEP_DECISIONS, 0
    while len(text.encode()) > budget and (keep_rollouts or keep_decisions):
        kept = compact(kept, keep_rollouts=keep_rollouts, keep_decisions=keep_decisions)
        text = journal_text(kept)
        keep_rollouts, keep_decisions = keep_rollouts // 2, keep_decisions // 2
        compactions += 1
    return Appended(record, tuple(kept), text, compactions)
