"""The one bounded reader of untrusted input: files and JSON that another process wrote.

Standard library only, for Python 3.10 and later: the tuner, the launcher (PID 1 of the engine
container, under the engine image's Python) and the engine-side plugin (``vllm_tuner_plugin``, which
cannot import the tuner and carries a byte-identical copy of this file,
``plugin/src/vllm_tuner_plugin/untrusted.py``; ``tests/properties/test_untrusted.py`` holds the two equal
and runs the same generated cases through both) read through it.

Every failure is ``Untrusted`` (a ``ValueError``) with a one-line reason that describes the input —
its size, its type, where it went wrong — and never quotes it:

- ``read_bytes``: opens without following a symbolic link in the last component (unless asked: a
  Kubernetes Secret's files are links into ``..data``) and without blocking (``O_NONBLOCK``: a FIFO
  cannot hold the reader), refuses anything but a regular file, and reads at most ``max_bytes``.
  A missing file is ``FileNotFoundError``, as from ``open``: callers tell "absent" from "bad".
  ``read_tail`` reads a file's last bytes (a log) with the same refusals.
- ``loads``: JSON no deeper than ``max_depth``, no larger than ``max_bytes``, with ``NaN``,
  ``Infinity`` and numbers that overflow a float refused, so what comes back is plain data whose
  every number is finite; valid-for-Python JSON never surfaces as ``RecursionError``,
  ``OverflowError`` or ``MemoryError``.
- ``mapping``, ``integer``, ``number``, ``text``, ``listing``: the shapes callers expect, with bounds:
  a boolean is not an integer, a negative or absurd value is refused where the caller says so.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from typing import Any

MAX_BYTES = 1024 * 1024
MAX_DEPTH = 32
MAX_TEXT = 4096
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


class Untrusted(ValueError):
    """Input that cannot be used; ``reason`` is one line that does not quote the input."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _open_regular(name: str, *, follow_symlinks: bool) -> int:
    """A descriptor of the regular file ``name``, opened without blocking; ``Untrusted`` for anything else."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(name, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Untrusted(f"{name} is a symbolic link (refused: only a regular file is read)") from None
        raise Untrusted(f"{name} cannot be opened ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Untrusted(f"{name} is not a regular file (FIFOs, devices and directories are refused)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES, follow_symlinks: bool = False) -> bytes:
    """The bytes of a small regular file. ``FileNotFoundError`` when it is absent; ``Untrusted`` for a
    link (unless ``follow_symlinks``), a FIFO, a device, a directory, more than ``max_bytes`` bytes."""
    name = os.fspath(path)
    fd = _open_regular(name, follow_symlinks=follow_symlinks)
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise Untrusted(f"{name} is larger than the limit of {max_bytes} bytes ({st.st_size})")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            try:
                chunk = os.read(fd, max_bytes + 1 - size)
            except OSError as exc:
                raise Untrusted(f"{name} cannot be read ({exc.strerror})") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise Untrusted(f"{name} grew past the limit of {max_bytes} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_tail(path: str | os.PathLike[str], *, max_bytes: int, follow_symlinks: bool = False) -> bytes:
    """The last ``max_bytes`` bytes of a regular file (a log of any size), with ``read_bytes``' refusals."""
    name = os.fspath(path)
    fd = _open_regular(name, follow_symlinks=follow_symlinks)
    try:
        size = os.fstat(fd).st_size
        try:
            return os.pread(fd, max_bytes, max(0, size - max_bytes))
        except OSError as exc:
            raise Untrusted(f"{name} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def depth(text: str) -> int:
    """How deeply the arrays and objects of a JSON text nest (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") == 0:
        return 0
    deepest = level = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        level += 1 if bracket in "[{" else -1
        deepest = max(deepest, level)
    return deepest


def _refuse_constant(name: str) -> Any:
    raise Untrusted(f"holds {name}, which is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Untrusted(f"holds a number too large for a float ({len(text)} characters)")
    return value


def loads(raw: str | bytes, *, what: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """Plain data (dict, list, str, int, finite float, bool, None) from a JSON text, or ``Untrusted``."""
    if len(raw) > max_bytes:
        raise Untrusted(f"{what}: {len(raw)} bytes; the limit is {max_bytes}")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Untrusted(f"{what}: not valid JSON (not UTF-8 at byte {exc.start})") from None
    nesting = depth(raw)
    if nesting > max_depth:
        raise Untrusted(f"{what}: nested {nesting} deep; the limit is {max_depth}")
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except Untrusted as exc:
        raise Untrusted(f"{what}: {exc.reason}") from None
    except (ValueError, RecursionError, OverflowError, MemoryError) as exc:
        where = f" at character {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        raise Untrusted(f"{what}: not valid JSON ({type(exc).__name__}{where}; {len(raw)} characters)") from None


def read_json(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
              follow_symlinks: bool = False) -> Any:
    """``loads(read_bytes(path))``; ``FileNotFoundError`` when absent, ``Untrusted`` when bad."""
    raw = read_bytes(path, max_bytes=max_bytes, follow_symlinks=follow_symlinks)
    return loads(raw, what=os.fspath(path), max_bytes=max_bytes, max_depth=max_depth)


def describe(value: Any) -> str:
    """What a value is, never what it says: a short number or a boolean as itself (numbers are not
    credentials), anything else by its type and size."""
    if isinstance(value, (str, bytes, list, dict)):
        return f"{type(value).__name__} of length {len(value)}"
    if isinstance(value, (bool, int, float)) and len(repr(value)) <= 24:
        return repr(value)
    return "null" if value is None else type(value).__name__


def mapping(value: Any, *, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Untrusted(f"{what} must be a JSON object (got {describe(value)})")
    return value


def listing(value: Any, *, what: str, max_items: int = 10_000) -> list[Any]:
    if not isinstance(value, list):
        raise Untrusted(f"{what} must be a JSON array (got {describe(value)})")
    if len(value) > max_items:
        raise Untrusted(f"{what} holds {len(value)} items; the limit is {max_items}")
    return value


def integer(value: Any, *, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """An integer in ``[lo, hi]`` (a boolean is not one; nor is ``4.0``)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise Untrusted(f"{what} must be an integer (got {describe(value)})")
    if not lo <= value <= hi:
        raise Untrusted(f"{what} must be an integer between {lo} and {hi} (got {describe(value)})")
    return value


def number(value: Any, *, what: str, lo: float = 0.0, hi: float = 1e15) -> float:
    """A finite number in ``[lo, hi]`` (a boolean is not one)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Untrusted(f"{what} must be a number (got {describe(value)})")
    try:
        as_float = float(value)
    except OverflowError:
        raise Untrusted(f"{what} is too large for a float") from None
    if not (math.isfinite(as_float) and lo <= as_float <= hi):
        raise Untrusted(f"{what} must be a finite number between {lo:g} and {hi:g}")
    return as_float


def text(value: Any, *, what: str, max_chars: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise Untrusted(f"{what} must be a string (got {describe(value)})")
    if len(value) > max_chars:
        raise Untrusted(f"{what} is {len(value)} characters; the limit is {max_chars}")
    return value
