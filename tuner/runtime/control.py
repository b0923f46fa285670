"""The operator's runtime switches: pause the tuner, pin a flag — a file in the state directory.

``vllm-tuner pause | resume | pin FLAG | unpin FLAG`` write ``control.json`` beside the daemon's state
file (``daemon.state_file``'s directory, ``/var/lib/vllm-tuner``); the daemon reads it at every cycle, so
a switch takes effect at the next cycle and survives restarts of the tuner (and of the host). The
configuration's ``decisions.paused`` and ``decisions.pins`` are the same switches, set in the file the
config management owns; the two add up: paused if either says so, pinned if either pins.

The daemon only reads the file. One that does not read (garbled, not JSON, unreadable) pauses the
tuner, with the reason: a switch the operator set must not be lost by a bad write, and holding changes
is the safe side. Written atomically (temp file, fsync, rename), mode 0644: the CLI runs as root or the
tuner's user, the daemon as ``vllm-tuner``.

On Kubernetes the same switches are annotations on the pool's ConfigMap (``tuner.kube.switches`` reads
them into a ``Control``). Either way ``take`` is the one place they act: the decisions a cycle runs with
(``effective``), ``/status`` (``report``), ``tuner_paused`` and ``tuner_pinned``, and a log line per change —
the daemon's cycle and the Kubernetes leader's call it, then the one decision path (``runtime.cycle``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner import config
from tuner.actuators import files
from tuner.errors import TunerError
from tuner.model import knobs
from tuner.planning.planner import DecisionSettings
from tuner.portable import untrusted
from tuner.runtime.selfmetrics import TunerMetrics
from tuner.runtime.state import TunerState

log = logging.getLogger("tuner.control")

FILE_NAME = "control.json"
MAX_BYTES = 1024 * 1024


class ControlFileError(TunerError):
    """The control file cannot be read or written (exit code 2 from the CLI)."""


@dataclasses.dataclass(frozen=True)
class Pin:
    reason: str = ""
    at: float | None = None
    by: str = ""


@dataclasses.dataclass(frozen=True)
class Control:
    """The runtime switches. ``paused``: None, or why (``""`` when no reason was given)."""

    paused: str | None = None
    paused_at: float | None = None
    paused_by: str = ""
    pins: Mapping[str, Pin] = dataclasses.field(default_factory=dict)
    error: str | None = None  # the file did not read: the tuner holds everything (``paused`` says why)
    # what set a runtime pause, and a pin given no reason, as the reasons say it (Kubernetes: the annotation)
    pause_source: str = "vllm-tuner pause"
    pin_source: str = "vllm-tuner pin"

    def as_dict(self) -> dict[str, Any]:
        return {"paused": self.paused is not None, "paused_reason": self.paused, "paused_at": self.paused_at,
                "paused_by": self.paused_by,
                "pins": {flag: dataclasses.asdict(pin) for flag, pin in sorted(self.pins.items())}}


def clock() -> float:
    """When a switch is set (seconds since the epoch)."""
    return time.time()


def path_for(settings: config.TunerSettings, config_path: str | os.PathLike[str]) -> Path:
    """``control.json`` in the directory of ``daemon.state_file`` (relative: to the config file's)."""
    state = Path(settings.daemon.state_file)
    if not state.is_absolute():
        state = Path(config_path).resolve().parent / state
    return state.parent / FILE_NAME


def load(path: Path) -> Control:
    """The switches in ``path``; none when it does not exist; paused, with why, when it does not read."""
    try:  # the one bounded reader: a FIFO or a device put there is refused, never waited on
        raw = untrusted.read_bytes(path, max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return Control()
    except untrusted.Untrusted as exc:
        return _unreadable(path, exc.reason)
    except OSError as exc:
        return _unreadable(path, exc.strerror or str(exc))
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        paused = data.get("paused")
        pins = data.get("pins") or {}
        if not isinstance(pins, dict) or not (paused is None or isinstance(paused, str)):
            raise ValueError("expected {\"paused\": null or a reason, \"pins\": {flag: {...}}}")
        return Control(paused=paused, paused_at=_number(data.get("paused_at")), paused_by=str(data.get("paused_by", "")),
                       pins={str(flag): Pin(str((p or {}).get("reason", "")), _number((p or {}).get("at")),
                                            str((p or {}).get("by", "")))
                             for flag, p in pins.items()})
    except (ValueError, TypeError, AttributeError) as exc:
        return _unreadable(path, str(exc))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _unreadable(path: Path, why: str) -> Control:
    reason = f"{path} does not read ({why}): holding every change until it is fixed or removed " \
             "(vllm-tuner resume rewrites it)"
    return Control(paused=reason, error=reason)


def save(path: Path, control: Control) -> None:
    data = {"paused": control.paused, "paused_at": control.paused_at, "paused_by": control.paused_by,
            "pins": {flag: dataclasses.asdict(pin) for flag, pin in sorted(control.pins.items())}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(path, (json.dumps(data, indent=1) + "\n").encode("utf-8"), mode=0o644)
    except OSError as exc:
        raise ControlFileError(f"cannot write {path}: {exc.strerror or exc}") from exc


def pin_name(flag: str) -> str:
    """A flag as pinned: the spelling given (``max-num-seqs`` read as ``--max-num-seqs``), checked to be one
    the tuner changes."""
    if not flag.startswith("-") and knobs.knob_for(flag) is None:
        flag = "--" + flag
    if knobs.knob_for(flag) is None:
        raise ControlFileError(f"{flag}: not a flag the tuner changes; expected one of "
                               f"{', '.join(knobs.known_flags())}")
    return knobs.normalize_flag(flag)


def effective(decisions: DecisionSettings, control: Control) -> DecisionSettings:
    """The configuration's switches with the runtime ones added (either pauses, either pins)."""
    paused: bool | str = decisions.paused
    if control.paused is not None and paused in (False, ""):
        paused = f"{control.paused or control.pause_source}" if control.error else \
            f"{control.pause_source}{': ' + control.paused if control.paused else ''}"
    pins = dict(decisions.pins)
    for flag, pin in control.pins.items():
        pins.setdefault(flag, pin.reason or control.pin_source)
    if paused == decisions.paused and pins == decisions.pins:
        return decisions
    return decisions.model_copy(update={"paused": paused, "pins": pins})


def report(decisions: DecisionSettings, control: Control) -> dict[str, Any]:
    """What ``/status`` shows under ``control``: the switches in force and where each comes from."""
    eff = effective(decisions, control)
    pins = {flag: {"reason": why, "from": "config" if flag in decisions.pins else "runtime",
                   **({"at": control.pins[flag].at, "by": control.pins[flag].by} if flag in control.pins else {})}
            for flag, why in sorted(eff.pins.items())}
    return {"paused": eff.paused not in (False, ""),
            "paused_reason": None if eff.paused in (False, "") else
            ("decisions.paused" if eff.paused is True else str(eff.paused)),
            "paused_from": "config" if decisions.paused not in (False, "") else
            ("runtime" if control.paused is not None else None),
            "paused_at": control.paused_at, "pins": pins, "file_error": control.error}


def take(decisions: DecisionSettings, control: Control, *, state: TunerState,
         metrics: TunerMetrics | None) -> DecisionSettings:
    """The switches in force for this cycle, for the daemon's cycle and the Kubernetes leader's alike:
    shown on ``/status`` (``state.control``), as ``tuner_paused`` and ``tuner_pinned{flag}``, and in the log
    once per change (``say``); the decisions the cycle runs with (``effective``)."""
    now = report(decisions, control)
    if now != state.control:
        say(now, state.control)
    state.control = now
    if metrics is not None:
        metrics.set_control(paused=now["paused"], pins=set(now["pins"]))
    return effective(decisions, control)


def say(now: Mapping[str, Any], before: Mapping[str, Any]) -> None:
    """One line when a switch changes (and at start, when one is on): paused, resumed, pinned, unpinned."""
    if now.get("paused") and (not before.get("paused") or now.get("paused_reason") != before.get("paused_reason")):
        log.warning("paused (%s): no change goes out until resumed", now.get("paused_reason"))
    elif before.get("paused") and not now.get("paused"):
        log.warning("resumed: changes go out again")
    pins, was = now.get("pins", {}), before.get("pins", {})
    for flag in sorted(set(pins) - set(was)):
        log.warning("pinned %s (%s): the tuner holds changes to it", flag, pins[flag].get("reason"))
    for flag in sorted(set(was) - set(pins)):
        log.warning("unpinned %s", flag)
