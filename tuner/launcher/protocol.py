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
answer (see ``launching.Launcher.status``). Both are written atomically: a temporary file in the same
directory, fsync, rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import argv as argvs
from . import untrusted

VERSION = 1
DESIRED = "desired.json"
STATUS = "status.json"
ZIPAPP = "launcher.pyz"
MAX_BYTES = 1 << 20  # a desired.json larger than 1 MiB is refused unread
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


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
