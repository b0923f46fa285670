"""The tuner's state between cycles, in one place: per target its step state (window, history, the
engine start last seen) and the engine arguments the tuner owns; the pool's pending change.

Only the loop thread changes it. What must survive a restart of the tuner — the owned arguments and
each target's ``History`` (cooldowns, hysteresis, restart budget, crash memory) — is saved to
``daemon.state_file`` after every change (atomic write, fsync). Windows and a pending change are not:
a restarted tuner rebuilds its windows in ``window_seconds`` and re-plans what still holds then.

Owned arguments: ``targets[].args`` at first, then what the last finished rollout left. An edited
configuration wins over the tuner's own changes (the saved ``config_sha256`` no longer matches).

Secrets: the file holds every command line masked (``--api-key ***``, ``model.secrets``), the
configuration's arguments only as a hash of their masked form, and crash memory's fingerprints masked
too; loading puts the real values back from ``targets[].args`` (the tuner never changes a secret flag).
``current_args`` — what ``/status`` and ``tuner_engine_arg_info`` show — is masked as well.

Booked rollout: the id of the last rollout whose outcome these arguments and histories include, saved in
the same atomic write. A tuner killed after a rollout's last journal record but before that write finds
the rollout finished and not booked, and books it then — once (``dispatching.Dispatcher.book_unbooked``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner import config
from tuner.actuators.files import write_atomically
from tuner.errors import ConfigError
from tuner.model import knobs, secrets
from tuner.planning import history as history_mod
from tuner.planning import pooling, stepping
from tuner.portable import untrusted
from tuner.runtime.results import CycleResult

STATE_MAX_BYTES = 64 * 1024 * 1024  # the tuner's own state: histories of every target

log = logging.getLogger("tuner.state")


@dataclass
class TunerState:
    targets: dict[str, stepping.TargetState]
    args: dict[str, knobs.EngineArgs]
    config_args: dict[str, list[str]]
    path: Path | None = None  # None: never saved (the CLI's one-shot uses)
    pending: pooling.Pending | None = None
    started_at: float = field(default_factory=time.time)
    number: int = 0  # cycles run
    last: CycleResult | None = None  # the last cycle's result (what /status and /healthz read)
    rollout_state: Mapping[str, Any] = field(default_factory=dict)  # the rollout as it stands (/status)
    left_drained: Mapping[str, Any] = field(default_factory=dict)  # replicas a failed rollout left out (/status)
    redactor: secrets.Redactor = secrets.DEFAULT  # what is masked in the file and in current_args
    booked_rollout: str | None = None  # the last rollout booked here ("": none yet; None: not known)
    control: Mapping[str, Any] = field(default_factory=dict)  # the pause and pins in force (/status)
    logged: tuple[Any, float, int] | None = None  # the last cycle line logged: (its gist, when, since cycle)

    @classmethod
    def fresh(cls, targets: Sequence[config.Target], *, path: Path | None = None,
              redactor: secrets.Redactor = secrets.DEFAULT) -> TunerState:
        return cls(targets={t.name: stepping.TargetState() for t in targets},
                   args={t.name: knobs.EngineArgs.parse(t.args or []) for t in targets},
                   config_args={t.name: list(t.args or []) for t in targets}, path=path, redactor=redactor)

    @classmethod
    def load(cls, path: Path, targets: Sequence[config.Target], *,
             redactor: secrets.Redactor = secrets.DEFAULT, now: float | None = None) -> TunerState:
        """The saved state for these targets (a fresh one where nothing was saved). A file that cannot
        be read is a ``ConfigError`` naming it: the tuner does not start on state it cannot trust. A
        history written while the wall clock ran ahead (set back since) is re-based so that nothing in it
        is later than ``now`` (default: the clock): a cooldown does not hold for the size of the step."""
        state = cls._load(path, targets, redactor=redactor)
        now = time.time() if now is None else now
        for name, target in state.targets.items():
            latest = history_mod.latest_time(target.history)
            if latest is not None and latest > now + 1.0:
                log.warning("%s: the state file holds times up to %.0fs ahead of the clock (it ran fast when "
                            "they were written): re-based to now", name, latest - now)
                state.set_history(name, history_mod.shifted(target.history, by=now - latest))
        return state

    def rebase(self, by: float) -> None:
        """Every time the state holds moved by ``by`` seconds: the loop's clock was re-based on a stepped
        wall clock (``runtime.clocks``). Windows, histories, the pending change."""
        if not by:
            return
        self.targets = {name: stepping.rebased(t, by=by) for name, t in self.targets.items()}
        if self.pending is not None:
            self.pending = replace(self.pending, since=self.pending.since + by)
        self.started_at += by

    @classmethod
    def _load(cls, path: Path, targets: Sequence[config.Target], *,
              redactor: secrets.Redactor = secrets.DEFAULT) -> TunerState:
        state = cls.fresh(targets, path=path, redactor=redactor)
        if not path.exists():
            return state
        try:
            data = untrusted.mapping(untrusted.read_json(path, max_bytes=STATE_MAX_BYTES, max_depth=64),
                                     what="the state file")
            saved_targets = data["targets"]
            if not isinstance(saved_targets, dict):
                raise TypeError("targets is not a mapping")
            booked = data.get("booked_rollout")
            if booked is not None and not isinstance(booked, str):
                raise TypeError("booked_rollout is not a string")
            state.booked_rollout = booked
            for name, saved in saved_targets.items():
                if name not in state.args:
                    continue  # a target removed from the config
                configured = state.config_args[name]
                same = (secrets.digest_matches(state.redactor.argv(configured), saved["config_sha256"])
                        if "config_sha256" in saved
                        else saved.get("config_args") == configured)  # a file written before secrets were masked
                if same and saved.get("args") is not None:
                    with contextlib.suppress(ValueError):  # a secret that cannot be put back: the config's args
                        state.args[name] = knobs.EngineArgs.parse(
                            redactor.restore([str(a) for a in saved["args"]], configured))
                if saved.get("history"):
                    history = dict(saved["history"])
                    reference = knobs.EngineArgs.parse(configured).fingerprint()
                    for key in ("bad_args", "rejected_args"):
                        history[key] = [{**entry, "args": redactor.restore_pairs(entry["args"], reference)}
                                        for entry in history.get(key, [])]
                    state.set_history(name, history_mod.from_dict(history))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            raise ConfigError(str(path), [("", f"the tuner's state file cannot be read ({type(exc).__name__}: "
                                               f"{exc}); move it aside to start from an empty history")]) from exc
        return state

    def history(self, name: str) -> history_mod.History:
        return self.targets[name].history

    def set_history(self, name: str, history: history_mod.History) -> None:
        self.targets[name] = replace(self.targets[name], history=history)

    def histories(self) -> dict[str, history_mod.History]:
        return {name: t.history for name, t in self.targets.items()}

    def current_args(self, name: str) -> dict[str, str]:
        """The flags with values the tuner believes ``name`` runs (for ``tuner_engine_arg_info`` and
        ``/status``), secret ones masked."""
        args = self.args[name]
        return {f: secrets.MASK if self.redactor.is_secret_flag(f) else str(v)
                for f in args.flags() if (v := args.get(f)) is not None}

    def config_digest(self, name: str) -> str:
        """The configured arguments of ``name``, masked, hashed: detects an edit without storing them."""
        return secrets.digest(self.redactor.argv(self.config_args[name]))

    def book(self, histories: Mapping[str, history_mod.History], args: Mapping[str, knobs.EngineArgs]) -> None:
        """Take a booked rollout (``pooling.book``) and persist it. A save that fails (a full or read-only
        disk) is logged, not raised: the journal holds the finished rollout, and a tuner that stops
        before a later save succeeds books it again at its next start (``booked_rollout``)."""
        for name, h in histories.items():
            self.set_history(name, h)
        self.args.update(args)
        try:
            self.save()
        except OSError as exc:
            log.error("%s: the tuner's state was not saved (%s%s); it is kept in memory and saved at the next "
                      "change or stop, and the journal holds the rollout", self.path, exc.strerror or exc,
                      f" [errno {exc.errno}]" if exc.errno is not None else "")

    def as_json(self) -> dict[str, Any]:
        return {"targets": {name: {"args": self.redactor.argv(self.args[name].argv()),
                                   "config_sha256": self.config_digest(name),
                                   "history": self._history_json(name)}
                            for name in self.args},
                "booked_rollout": self.booked_rollout}

    def _history_json(self, name: str) -> dict[str, Any]:
        data = history_mod.to_dict(self.history(name))
        for key in ("bad_args", "rejected_args"):
            data[key] = [{**entry, "args": self.redactor.pairs(entry["args"]),
                          "reason": self.redactor.text(str(entry["reason"]))} for entry in data[key]]
        return data

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, json.dumps(self.as_json(), indent=1).encode(), mode=0o600)
