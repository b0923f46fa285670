"""The file protocol between the tuner and this plugin: the one definition of it.

The control directory (``$VLLM_TUNER_CONTROL_DIR``) holds:

- ``control.json``, written by the tuner only, atomically (a temp file in the same directory, then
  ``rename``). It is the whole desired state, not a patch::

      {"protocol": 1, "seq": 7, "max_num_active_seqs": 16, "max_num_batched_tokens": null}

  ``seq`` (required, an integer >= 0) is echoed in the acknowledgement so the tuner can match the two.
  A knob that is ``null`` or absent means "the value the engine started with". ``max_num_running_seqs``
  (the name vLLM pull request 54816 uses for the same cap) is accepted as an alias of
  ``max_num_active_seqs``. Any other key is refused.

- ``ack-<dp_rank>.json``, written by each EngineCore process (one per data-parallel rank), atomically,
  when it has handled a request, when it starts, and when what it enforces changes (e.g. a drain-down
  finishes). ``ACK_FIELDS`` lists its keys.

The tuner-side reader (``tuner/sources/live_knobs.py``) mirrors this module; a contract test runs both
against the same files.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Any

from . import untrusted

PROTOCOL = 1
CONTROL_FILE = "control.json"
ACK_PREFIX = "ack-"
ACK_SUFFIX = ".json"
MAX_CONTROL_BYTES = 64 * 1024
ENV_CONTROL_DIR = "VLLM_TUNER_CONTROL_DIR"

# Knob names as they appear in control.json and in the acknowledgement, after vLLM's own flags
# (--max-num-active-seqs, --max-num-batched-tokens).
KNOBS = ("max_num_active_seqs", "max_num_batched_tokens")
# Upstream names accepted on input (vLLM PR 54816's PATCH /v1/runtime_config field).
ALIASES = {"max_num_running_seqs": "max_num_active_seqs"}
REQUEST_FIELDS = ("protocol", "seq", *KNOBS)

ACK_FIELDS = (
    "protocol",
    "live",  # false when the plugin is off in this engine as a whole (see "refused"); nothing is applied
    "seq",  # the request this acknowledges; null for the startup acknowledgement
    "applied",  # {knob: value|null} of the request now in force; null if this request was refused
    "refused",  # null, or one line saying why the request (or the whole plugin) was refused
    "effective",  # what the scheduler enforces now (see live.Controller.effective)
    "envelope",  # the startup values nothing may exceed
    "not_live",  # {knob: why} for knobs this engine cannot change live
    "at",  # unix time of this acknowledgement
    "pid",  # the EngineCore process
    "dp_rank",
    "engine_version",
    "engine_known",  # whether engine_version is in the plugin's table of versions it was checked against
    "mode",  # "active-cap" (a separate admission attribute) or "follow-down" (one attribute admits and bounds)
    "plugin_version",
)


class ProtocolError(ValueError):
    """A control file that cannot be applied. ``seq`` is the request's seq when it could be read."""

    def __init__(self, reason: str, *, seq: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.seq = seq


@dataclass(frozen=True)
class Request:
    seq: int
    max_num_active_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def knobs(self) -> dict[str, int | None]:
        return {k: getattr(self, k) for k in KNOBS}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(raw: bytes) -> Request:
    """``control.json`` bytes -> ``Request``; raises ``ProtocolError`` with a one-line reason."""
    try:
        data = untrusted.mapping(untrusted.loads(raw, what=CONTROL_FILE, max_bytes=MAX_CONTROL_BYTES),
                                 what=CONTROL_FILE)
    except untrusted.Untrusted as exc:
        raise ProtocolError(exc.reason) from None
    seq = data.get("seq")
    seq = seq if _is_int(seq) and seq >= 0 else None
    if seq is None:
        raise ProtocolError(f'{CONTROL_FILE} needs "seq", an integer >= 0, e.g. {{"seq": 7, '
                            '"max_num_active_seqs": 16}}')
    protocol = data.get("protocol", PROTOCOL)
    if protocol != PROTOCOL:
        raise ProtocolError(f"{CONTROL_FILE} speaks protocol {untrusted.describe(protocol)}; this plugin speaks {PROTOCOL}",
                            seq=seq)
    values: dict[str, int | None] = {}
    for key, value in data.items():
        if key in ("seq", "protocol"):
            continue
        name = ALIASES.get(key, key)
        if name not in KNOBS:
            known = ", ".join([*KNOBS, *ALIASES])
            raise ProtocolError(f"{CONTROL_FILE}: unknown key {key[:64]!r} (known: {known})", seq=seq)
        if name in values and values[name] != value:
            raise ProtocolError(f"{CONTROL_FILE}: {name} given twice with different values", seq=seq)
        if value is not None and not (_is_int(value) and value >= 1):
            raise ProtocolError(f"{CONTROL_FILE}: {key} must be an integer >= 1 or null, got {untrusted.describe(value)}",
                                seq=seq)
        values[name] = value
    return Request(seq=seq, **values)


def request_document(seq: int, **knobs: int | None) -> dict[str, Any]:
    """The JSON object for a request (what the tuner writes)."""
    return {"protocol": PROTOCOL, "seq": seq, **{k: knobs.get(k) for k in KNOBS}}


def ack_path(control_dir: str, dp_rank: int) -> str:
    return os.path.join(control_dir, f"{ACK_PREFIX}{dp_rank}{ACK_SUFFIX}")


def write_json_atomically(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` via a temp file in the same directory and ``os.replace``, so a
    reader sees the old file or the new one, never half of one. The temp name starts with a dot, which
    keeps it out of ``ack-*.json`` and away from ``control.json``."""
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o640)  # readable by the tuner where it shares the directory through a group
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def own_groups() -> frozenset[int]:
    """This process's groups: its effective gid and its supplementary groups (a pod's ``fsGroup`` is one)."""
    return frozenset({os.getegid(), *os.getgroups()})


def group_shared(st: os.stat_result, groups: frozenset[int]) -> bool:
    """Whether a directory is shared with this process through a group: group-owned by one of
    ``groups``, setgid (what is made in it keeps that group: Kubernetes' ``fsGroup`` sets it), and not
    writable by others."""
    return (stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISGID) and st.st_gid in groups
            and not st.st_mode & stat.S_IWOTH)


def insecure_reason(path: str, st: os.stat_result, *, uid: int, what: str, groups: frozenset[int] = frozenset(),
                    directory: os.stat_result | None = None) -> str | None:
    """Why a control directory (``directory`` None) or file (``directory``: its directory's stat) is not
    to be trusted, or None. Only the engine and the tuner may write there (plugin/README.md, "Safety"):

    - a directory: owned by the engine's uid and writable by nobody else, or ``group_shared`` with the
      engine (the tuner runs as another uid in a group of the engine's: the pod's fsGroup, or group 0);
    - a file: writable by its owner only, and owned by the engine's uid or, in a group-shared
      directory, by that directory's group.

    Never writable by others; links and special files are refused before this (``read_control``)."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH:
        return f"{what} {path} is writable by group or others (mode {mode:04o})"
    if directory is None:
        if st.st_uid == uid and not st.st_mode & stat.S_IWGRP:
            return None
        if group_shared(st, groups):
            return None
        if st.st_uid != uid:
            return (f"{what} {path} is owned by uid {st.st_uid}, not by the engine's uid {uid}, and not shared "
                    f"with the engine through a group (setgid, group {st.st_gid}, mode {mode:04o})")
        return (f"{what} {path} is writable by group or others (mode {mode:04o}) and not shared with the engine "
                f"through one of its groups (setgid)")
    if st.st_mode & stat.S_IWGRP:
        return f"{what} {path} is writable by group or others (mode {mode:04o})"
    if st.st_uid == uid or (group_shared(directory, groups) and st.st_gid == directory.st_gid):
        return None
    return (f"{what} {path} is owned by uid {st.st_uid}, not by the engine's uid {uid}, and not by the group of a "
            f"directory shared with the engine")


def read_control(control_dir: str, *, uid: int, groups: frozenset[int] | None = None) -> Request | None:
    """Read and check ``control.json``: the request, or None when there is no file. A file that is there
    but not to be applied raises ``ProtocolError`` with a one-line reason.

    Never blocks on anything but a small regular file: symlinks, FIFOs and devices are refused before
    they are opened, and the open is non-blocking and does not follow links."""
    try:
        dir_st = os.stat(control_dir)
    except OSError as exc:
        raise ProtocolError(f"control directory {control_dir} cannot be read ({exc.strerror})") from None
    path = os.path.join(control_dir, CONTROL_FILE)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ProtocolError(f"{path} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(f"{path} is not a regular file (symlinks and special files are refused)")
    if st.st_size > MAX_CONTROL_BYTES:
        raise ProtocolError(f"{path} is {st.st_size} bytes; the limit is {MAX_CONTROL_BYTES}")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ProtocolError(f"{path} cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_CONTROL_BYTES + 1)
    groups = own_groups() if groups is None else groups
    why = insecure_reason(control_dir, dir_st, uid=uid, groups=groups, what="control directory") or insecure_reason(
        path, st, uid=uid, groups=groups, what="control file", directory=dir_st
    )
    if why is not None:
        # Nothing in it is applied; its seq is only echoed (when it parses) so the tuner can tell that
        # this refusal answers its request.
        seq = None
        with contextlib.suppress(ProtocolError):
            seq = parse_request(raw).seq
        raise ProtocolError(why, seq=seq)
    return parse_request(raw)
