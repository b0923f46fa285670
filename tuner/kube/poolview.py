"""The leader's view of its pool, and the one write of its cycle — pure: typed documents in (the pool's
ConfigMap parsed once: ``documents.inspect``), values out, no I/O, the time given (``now=``).

``view`` says, at the start of a cycle, what the leader decides on:

- **members**: the pods that run, have an IP, are not being deleted, and whose agent reports a launcher
  whose engine runs (``documents.Report.running``), with the command line each runs: the cycle's targets;
- **hold**: the members run different base command lines (``helm upgrade`` changed the Deployment's
  args and it is rolling): no rollout begins — the leader does not fight the Deployment;
- **the user wins**: every member runs one base command line other than the one the pool's verified
  overrides were computed for: those overrides are dropped from the pool (the launchers dropped them
  already), the rollouts finished so far set aside, and a journal note says so;
- **known**: the pods whose report and desired state stay in the ConfigMap (every pod listed, and every
  replica the unfinished rollout names);
- **history**: the pool's decision history as saved, with the last rollout it includes.

``settle`` is the cycle's one write, applied to the ConfigMap as it is at the write (a compare-and-swap:
on a conflict it is applied again to what is there then): the journal's lines that do not read set aside,
the gone pods' keys removed, the user's win, the **verified arguments** (a rollout that finished *done*
makes its overrides, as a pod it moved runs them, the pool's: what a new pod starts on — once per rollout)
and the decision history (``state``), all in one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from tuner.kube.api import PodView, dumps
from tuner.kube.documents import (
    JOURNAL_BUDGET,
    QUARANTINE,
    REPORT_PREFIX,
    BadLine,
    Inspection,
    PoolArgs,
    Report,
    appended,
    desired_of,
    inspect,
    journal_text,
    quarantined,
)
from tuner.planning import history as history_mod
from tuner.rollout import journal as journaling
from tuner.rollout import machine

HOLD = "the pool's pods run different base command lines (the Deployment is rolling out new args)"


@dataclass(frozen=True)
class UserWins:
    """The pool's verified overrides dropped: its pods run another base command line now."""

    base: str  # the base command line every member runs
    pool: PoolArgs  # the pool's arguments from now on
    note: str  # the journal note (and the log line) that says so


@dataclass(frozen=True)
class PoolView:
    """What the leader decides on at the start of a cycle (``view``)."""

    at: float  # the cycle's time
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # pod → the command line it runs
    hold: str | None = None  # why no rollout begins now (None: one may)
    user_wins: UserWins | None = None
    known: frozenset[str] = frozenset()  # pods whose report and desired state stay in the ConfigMap
    unfinished: tuple[str, ...] = ()  # the replicas the unfinished rollout names
    history: Mapping[str, history_mod.History] = field(default_factory=dict)  # as saved
    booked_rollout: str | None = None  # the last rollout the saved history includes ("": none; None: not said)


def running(pods: Sequence[PodView]) -> list[PodView]:
    """The pods that run: an IP, phase Running, not being deleted."""
    return [p for p in pods if not p.deleting and p.ip and p.phase == "Running"]


def finished(records: Sequence[journaling.Record]) -> list[machine.Rollout]:
    """The journal's finished rollouts, in the order they began."""
    return [r for r in journaling.replay(records).values() if machine.outcome(r) is not machine.Outcome.RUNNING]


def view(docs: Inspection, pods: Sequence[PodView], *, now: float) -> PoolView:
    """The pool as the leader sees it now, from its ConfigMap's documents and the pods the API server lists
    (``pods``: every pod of the pool, those being deleted too)."""
    members = {p.name: r.argv for p in running(pods)
               if (r := docs.reports.get(p.name)) is not None and r.running and r.argv is not None}
    bases = {docs.reports[name].base_sha256 for name in members}
    records = docs.journal.records
    unfinished = journaling.unfinished(records)
    keep = tuple(unfinished.replicas) if unfinished is not None else ()
    wins = None
    if len(bases) == 1 and (base := next(iter(bases))) is not None:
        wins = user_wins(docs.pool, base, records)
    return PoolView(at=now, members=members, hold=HOLD if len(bases) > 1 else None, user_wins=wins,
                    known=frozenset({p.name for p in pods} | set(keep)), unfinished=keep, history=docs.histories,
                    booked_rollout=docs.booked_rollout)


def user_wins(pool: PoolArgs | None, base: str, records: Sequence[journaling.Record]) -> UserWins | None:
    """The pool's overrides dropped when its pods run a base other than theirs (None: they run it, or the
    pool has no overrides)."""
    if pool is None or not pool.overrides or pool.base_sha256 in (None, base):
        return None
    old = str(pool.base_sha256)
    note = (f"the Deployment's base command line changed ({old[:12]} → {base[:12]}): the user wins, the pool's "
            f"overrides {list(pool.overrides)} are dropped")
    done = finished(records)
    # the rollouts finished so far are set aside: none of them makes the pool's arguments again
    return UserWins(base, PoolArgs((), base, done[-1].id if done else pool.rollout, note), note)


def verified(records: Sequence[journaling.Record], pool: PoolArgs | None, reports: Mapping[str, Report],
             members: Collection[str]) -> PoolArgs | None:
    """The pool's new verified arguments: the last rollout that finished done, as a member it moved runs
    them (its agent's report), where the launcher kept them; None when there is none or the pool took (or
    set aside) that rollout already."""
    done = [r for r in journaling.replay(records).values() if machine.outcome(r) is machine.Outcome.DONE]
    if not done or (pool is not None and pool.rollout == done[-1].id):
        return None
    last = done[-1]
    for p in last.progress:
        report = reports.get(p.name)
        if p.state is machine.State.DONE and p.name in members and report is not None \
                and not report.overrides_dropped:
            return PoolArgs(report.overrides, report.base_sha256, last.id)
    return None


@dataclass(frozen=True)
class Settled:
    """What the cycle's write (``settle``) changed."""

    data: dict[str, str] | None  # the ConfigMap's new data (None: nothing to write)
    bad: tuple[BadLine, ...] = ()  # journal lines set aside
    notes: tuple[str, ...] = ()  # journal notes added
    verified: PoolArgs | None = None  # the pool's new verified arguments
    compactions: int = 0


def settle(data: Mapping[str, str], pool_view: PoolView, *, state: str | None, epoch: int,
           budget: int = JOURNAL_BUDGET) -> Settled:
    """The cycle's one write over ``data`` (the ConfigMap as it is now; its leader keys read, or the write
    is refused before this): the journal's bad lines set aside, the keys of gone pods removed, the user's
    win, the verified arguments and the decision history (``state``, its text; None: the key as it is)."""
    docs = inspect(data)
    new = dict(data)
    records: Sequence[journaling.Record] = docs.journal.records
    bad = docs.journal.bad
    gone = [k for k in data if k.startswith(REPORT_PREFIX) and k[len(REPORT_PREFIX):] not in pool_view.known]
    desired = desired_of(data)
    kept = {n: d for n, d in desired.items() if n in pool_view.known}
    if gone or kept != desired:
        for key in gone:
            del new[key]
        new["desired"] = dumps(kept)
    pool, notes, compactions = docs.pool, [], 0
    wins = pool_view.user_wins
    if wins is not None and pool is not None and pool.overrides and pool.base_sha256 not in (None, wins.base):
        pool = wins.pool
        new["pool"] = dumps(pool.as_dict())
        note = appended(records, "note", at=pool_view.at, fields={"note": wins.note}, epoch=epoch, budget=budget)
        records, compactions = note.records, note.compactions
        new["journal"] = note.text
        notes.append(wins.note)
    elif bad:
        new["journal"] = journal_text(records)
    if bad:
        new[QUARANTINE] = quarantined(data.get(QUARANTINE), bad)
    args = verified(records, pool, docs.reports, pool_view.members)
    if args is not None:
        new["pool"] = dumps(args.as_dict())
    if state is not None:
        new["state"] = state
    return Settled(new if new != dict(data) else None, bad, tuple(notes), args, compactions)
