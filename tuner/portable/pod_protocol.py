"""The files the agent and the launcher share in the pod's ``emptyDir`` (protocol version 1).

``desired.json`` (written by the agent, read by the launcher)::

    {"v": 1, "generation": 12, "overrides": [["--max-num-seqs", "64"]],
     "base_sha256": "<argv.sha256 of the base command line>", "drain": false}

- ``generation``: an integer that grows with every write; the launcher ignores a file whose generation
  is not greater than the last one it accepted (after its own restart it accepts any).
- ``overrides``: ``[flag, value]`` pairs applied in order to the base command line (``argv.apply``);
  a value is a string, ``true``/``false`` (a boolean flag: ``--flag``/``--no-flag``) or ``null`` (remove).
- ``base_sha256``: the base command line the overrides were computed for. When it is not this
  launcher's (the Deployment's args changed: a new pod with new base args), the overrides are dropped
  and the base runs: the user wins. Required when ``overrides`` is not empty.
- ``drain``: true takes the replica out of service (readiness false) without stopping the engine.

The launcher relaunches the engine when the command line that ``desired.json`` asks for differs from
the one running (or when nothing runs after a failed candidate). ``status.json`` is the launcher's
answer (see ``tuner.launcher.launching.Launcher.status``). Both are written atomically: a temporary file in the same
directory, fsync, rename.

``allowed-flags.json`` (written by the agent at its start, from its own rules; read by the launcher,
which keeps the first one it finds for its whole life)::

    {"v": 1, "flags": {"--max-num-seqs": {"type": "int", "min": 1, "max": 1024},
                       "--enable-chunked-prefill": {"type": "bool"}}}

Only these flags may be overridden, each inside its bounds (``Allowed.refusal``): whoever can write the
pool's ConfigMap (and so desired.json, through the agent) cannot set ``--trust-remote-code`` or another
``--model``. The file comes from the rules the agent was configured with, not from the ConfigMap, and
a later one does not widen it. No file: no override passes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import argv as argvs
from . import live_protocol, untrusted

VERSION = 1
DESIRED = "desired.json"
STATUS = "status.json"
ZIPAPP = "launcher.pyz"
ALLOWED = "allowed-flags.json"
CONTROL_DIR = "control"  # the live knobs' control directory (the agent creates it 02770, group-shared, when live.enabled)
ENV_CONTROL_DIR = live_protocol.ENV_CONTROL_DIR  # the engine-side plugin's variable (plugin/README.md)
MAX_BYTES = 1 << 20  # a desired.json larger than 1 MiB is refused unread
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_INT = re.compile(r"^[0-9]{1,18}$")  # no sign, no space, no exponent: what the tuner writes
_FLOAT = re.compile(r"^(?:[0-9]{1,18}(?:\.[0-9]{1,18})?|\.[0-9]{1,18})(?:[eE][-+]?[0-9]{1,3})?$")


class ProtocolError(ValueError):
    """desired.json is unreadable or malformed; the message says where and what was expected."""


@dataclass(frozen=True)
class Desired:
    generation: int
    overrides: tuple[tuple[str, argvs.Value], ...] = ()
    base_sha256: str | None = None
    drain: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)  # unknown keys, kept for status

    def document(self) -> dict[str, Any]:
        return {"v": VERSION, "generation": self.generation, "overrides": [list(o) for o in self.overrides],
                "base_sha256": self.base_sha256, "drain": self.drain}


EXAMPLE = '{"v": 1, "generation": 1, "overrides": [["--max-num-seqs", "64"]], "base_sha256": "<64 hex>", "drain": false}'


def parse_desired(text: str | bytes) -> Desired:
    """``desired.json``'s text → ``Desired``; ``ProtocolError`` naming what is wrong, never quoting it
    (an override may carry a secret flag's value)."""
    try:
        doc = untrusted.loads(text, what="desired.json", max_bytes=MAX_BYTES)
    except untrusted.Untrusted as exc:
        raise ProtocolError(f"{exc.reason}; expected e.g. {EXAMPLE}") from None
    d = untrusted.describe
    if not isinstance(doc, dict):
        raise ProtocolError(f"desired.json must be an object, e.g. {EXAMPLE}")
    if doc.get("v") != VERSION:
        raise ProtocolError(f"desired.json: v must be {VERSION} (got {d(doc.get('v'))})")
    try:
        generation = untrusted.integer(doc.get("generation"), what="desired.json: generation")
    except untrusted.Untrusted as exc:
        raise ProtocolError(exc.reason) from None
    raw = doc.get("overrides", [])
    if not isinstance(raw, list):
        raise ProtocolError(f"desired.json: overrides must be a list of [flag, value] pairs (got {d(raw)})")
    overrides: list[tuple[str, argvs.Value]] = []
    for i, pair in enumerate(raw):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ProtocolError(f"desired.json: overrides[{i}] must be [flag, value] (got {d(pair)})")
        flag, value = pair
        if not argvs.FLAG_NAME.match(flag):
            raise ProtocolError(f"desired.json: overrides[{i}]: {d(flag)} is not a --long-flag")
        if value is not None and not isinstance(value, (str, bool)):
            raise ProtocolError(f"desired.json: overrides[{i}]: the value of {flag} must be a string, "
                                f"true, false or null (got {d(value)})")
        overrides.append((flag, value))
    base = doc.get("base_sha256")
    if base is not None and not (isinstance(base, str) and _HEX64.match(base)):
        raise ProtocolError(f"desired.json: base_sha256 must be 64 lower-case hex digits (got {d(base)})")
    if overrides and base is None:
        raise ProtocolError("desired.json: overrides need base_sha256 (the base command line they were computed for)")
    drain = doc.get("drain", False)
    if not isinstance(drain, bool):
        raise ProtocolError(f"desired.json: drain must be true or false (got {d(drain)})")
    extra = {k: v for k, v in doc.items() if k not in ("v", "generation", "overrides", "base_sha256", "drain")}
    return Desired(generation, tuple(overrides), base, drain, extra)


def read_desired(path: Path) -> Desired | None:
    """The file's request, None when there is no file; ``ProtocolError`` when it is malformed."""
    try:
        data = untrusted.read_bytes(path, max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return None
    except untrusted.Untrusted as exc:
        raise ProtocolError(exc.reason) from None
    return parse_desired(data)


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """Atomically replace ``path`` with ``doc`` (temp file in the same directory, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_desired(state_dir: Path, *, generation: int, overrides: Sequence[tuple[str, argvs.Value]] = (),
                  base_sha256: str | None = None, drain: bool = False) -> Desired:
    """What the agent calls: validate and write ``desired.json`` atomically."""
    desired = parse_desired(json.dumps(Desired(generation, tuple(overrides), base_sha256, drain).document()))
    write_json(Path(state_dir) / DESIRED, desired.document())
    return desired


def read_status(state_dir: Path) -> dict[str, Any] | None:
    """The launcher's ``status.json``; None when it is absent or cannot be used (``untrusted``)."""
    try:
        doc = untrusted.read_json(Path(state_dir) / STATUS, max_bytes=MAX_BYTES)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# --- allowed-flags.json ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """What one flag may be set to: ``bool`` (true or false), or a number (``int`` or ``float``) within
    ``[low, high]`` (``low_open``: above ``low``); ``also``: exact texts allowed besides (SGLang's
    ``--chunked-prefill-size -1``, chunked prefill off); ``removable``: ``null`` (drop the flag) allowed."""

    type: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    also: tuple[str, ...] = ()
    removable: bool = False

    def problem(self, value: argvs.Value) -> str | None:
        """Why ``value`` may not pass (None: it may). Values are shown only for the allowed flags (tuner
        knobs, never secrets), shortened."""
        if value is None:
            return None if self.removable else "may not be removed"
        if self.type == "bool":
            return None if isinstance(value, bool) else "takes true or false only"
        if isinstance(value, bool):
            return f"takes a number, not {str(value).lower()}"
        if value in self.also:
            return None
        if not (_INT if self.type == "int" else _FLOAT).match(value):
            what = "an integer" if self.type == "int" else "a number"
            return f"takes {what} as the tuner writes it, not a {untrusted.describe(value)}"
        shown, number = repr(value), float(value)  # a short number: shown
        if self.low is None or self.high is None or not math.isfinite(number):
            return f"{shown} is not one of {list(self.also)}"
        above = number > self.low if self.low_open else number >= self.low
        if not (above and number <= self.high):
            return f"{shown} is outside {self.span()}"
        return None

    def span(self) -> str:
        return f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": self.type}
        if self.low is not None:
            doc["min"] = self.low
        if self.high is not None:
            doc["max"] = self.high
        if self.low_open:
            doc["min_exclusive"] = True
        if self.also:
            doc["also"] = list(self.also)
        if self.removable:
            doc["removable"] = True
        return doc


@dataclass(frozen=True)
class Allowed:
    flags: Mapping[str, Bound]  # by normalized flag (``argv.normalize``)

    def refusal(self, overrides: Sequence[tuple[str, argvs.Value]]) -> str | None:
        """Why these overrides may not pass (None: every one may): a flag not in the list, a value out of
        its bounds. All or nothing: one bad pair refuses the set."""
        for i, (flag, value) in enumerate(overrides):
            name = flag if len(flag) <= 60 else flag[:60] + "…"
            bound = self.flags.get(argvs.normalize(flag))
            if bound is None:
                allowed = ", ".join(sorted(self.flags)) or "none"
                return f"overrides[{i}]: {name} is not a flag the rules may change (allowed: {allowed})"
            why = bound.problem(value)
            if why is not None:
                return f"overrides[{i}]: {name} {why}"
        return None

    def document(self) -> dict[str, Any]:
        return {"v": VERSION, "flags": {f: b.document() for f, b in sorted(self.flags.items())}}

    def describe(self) -> dict[str, str]:
        """For status.json: flag → its bounds, in words."""
        out = {}
        for flag, b in sorted(self.flags.items()):
            if b.type == "bool":
                out[flag] = "true|false"
            else:
                parts = [b.span()] if b.low is not None and b.high is not None else []
                out[flag] = " | ".join([*parts, *b.also, *(["null"] if b.removable else [])])
        return out


def _number(value: float | None) -> str:
    return "?" if value is None else str(int(value)) if float(value).is_integer() else f"{value:g}"


ALLOWED_EXAMPLE = '{"v": 1, "flags": {"--max-num-seqs": {"type": "int", "min": 1, "max": 1024}}}'


def parse_allowed(text: str | bytes) -> Allowed:
    """``allowed-flags.json``'s text → ``Allowed``; ``ProtocolError`` naming what is wrong."""
    try:
        doc = untrusted.loads(text, what=ALLOWED, max_bytes=MAX_BYTES)
    except untrusted.Untrusted as exc:
        raise ProtocolError(f"{exc.reason}; expected e.g. {ALLOWED_EXAMPLE}") from None
    d = untrusted.describe
    if not isinstance(doc, dict) or doc.get("v") != VERSION or not isinstance(doc.get("flags"), dict):
        raise ProtocolError(f"{ALLOWED}: expected an object with v: {VERSION} and flags, e.g. {ALLOWED_EXAMPLE}")
    flags: dict[str, Bound] = {}
    for flag, spec in doc["flags"].items():
        where = f"{ALLOWED}: flags[{d(flag)}]"
        if not argvs.FLAG_NAME.match(flag) or not isinstance(spec, dict):
            raise ProtocolError(f"{where}: a --long-flag and an object, e.g. {ALLOWED_EXAMPLE}")
        kind = spec.get("type")
        if kind not in ("bool", "int", "float"):
            raise ProtocolError(f"{where}: type must be bool, int or float (got {d(kind)})")
        low, high = spec.get("min"), spec.get("max")
        for name, bound in (("min", low), ("max", high)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                      or not math.isfinite(bound)):
                raise ProtocolError(f"{where}: {name} must be a number (got {d(bound)})")
        also = spec.get("also", [])
        if not isinstance(also, list) or not all(isinstance(a, str) for a in also):
            raise ProtocolError(f"{where}: also must be a list of strings (got {d(also)})")
        if kind != "bool" and (low is None) != (high is None):
            raise ProtocolError(f"{where}: give both min and max, or neither (then only `also`)")
        flags[argvs.normalize(flag)] = Bound(str(kind), low, high, spec.get("min_exclusive") is True, tuple(also),
                                             spec.get("removable") is True)
    return Allowed(flags)


def read_allowed(state_dir: Path) -> Allowed | None:
    """The allow-list in ``state_dir``, None when there is none; ``ProtocolError`` when it is malformed."""
    try:
        data = untrusted.read_bytes(Path(state_dir) / ALLOWED, max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return None
    except untrusted.Untrusted as exc:
        raise ProtocolError(exc.reason) from None
    return parse_allowed(data)


def write_allowed(state_dir: Path, allowed: Allowed) -> None:
    """What the agent calls at its start."""
    write_json(Path(state_dir) / ALLOWED, allowed.document())
