"""The live-knob file protocol between the tuner and the engine-side plugin: the one definition of it.

One file in two places, byte for byte: ``tuner/portable/live_protocol.py`` (the tuner's) and the plugin's
``vllm_tuner_plugin/protocol.py`` (tests/contract/test_live_knobs_protocol.py holds them equal; edit the
tuner's and copy it over). Standard library and ``untrusted`` only: the plugin runs in vLLM's environment.

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

Acknowledgements belong to a launch. The directory outlives the engine (a restart, a new
``--data-parallel-size``), and each rank writes only its own file, so an ``ack-1.json`` of an earlier
launch with two ranks can lie beside the single rank's ``ack-0.json`` of this one. Every ack therefore
carries ``launch`` — the identity of the engine launch: the boot, pid and start time of the launch's first
process (``this_launch``; the plugin puts it into ``$VLLM_TUNER_LAUNCH`` there, so every EngineCore that
process starts inherits it) — ``launched_at`` (that start, unix time) and ``ranks`` (the data-parallel
rank count, where the plugin can tell). Readers take only the newest launch's acks; the plugin removes the
files of older launches when it starts (``remove_stale``), and the tuner does too, whatever the actuator.

The tuner's side (``tuner/sources/live_knobs.py``) names the files, knobs and fields from here, and reads
the acks more strictly (every field checked for shape); a contract test runs both sides against the same files.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
import time
from collections.abc import MutableMapping, Sequence
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
    "launch",  # the engine launch this ack belongs to (see above); the same for every rank of it
    "launched_at",  # unix time the launch's first process started
    "ranks",  # the data-parallel rank count of the launch; null where the plugin cannot tell
)
ENV_LAUNCH = "VLLM_TUNER_LAUNCH"  # set by the plugin in a launch's first process, inherited by its EngineCores


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
    raw_seq = data.get("seq")
    seq = raw_seq if isinstance(raw_seq, int) and not isinstance(raw_seq, bool) and raw_seq >= 0 else None
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


# -- the launch ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One start of the engine: ``id`` is the same in every process of it and differs from every other
    start's; ``at`` is when its first process started (unix time)."""

    id: str
    at: float


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip().replace("-", "")[:12] or "noboot"
    except OSError:
        return "noboot"


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) from ``/proc/<pid>/stat``; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm) ": state ppid ... starttime is field 22
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f.read(1 << 20).splitlines():
                if line.startswith(b"btime "):
                    return float(int(line.split()[1]))
    except (OSError, ValueError):
        return None
    return None


def _launch_of(pid: int, ticks: int, boot: str) -> Launch:
    btime = _boot_time()
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    at = btime + ticks / hz if btime is not None else time.time()
    return Launch(f"{boot}-{pid}-{ticks}", at)


def this_launch(environ: MutableMapping[str, str] | None = None, *, parent: bool = False) -> Launch:
    """The launch this process belongs to. ``$VLLM_TUNER_LAUNCH`` when it names this process or one of its
    ancestors (with the same start time: not a reused pid); else this process starts a launch — or, with
    ``parent`` (an EngineCore whose launch's first process did not name it: every rank's parent is the
    process that started them all), its parent does — and says so in the environment its children inherit.
    Off Linux: this process and the time now."""
    env = os.environ if environ is None else environ
    boot = _boot_id()
    inherited = env.get(ENV_LAUNCH, "")
    parts = inherited.split("-")
    if len(parts) == 3 and parts[0] == boot and parts[1].isdigit() and parts[2].isdigit():
        pid, ticks = int(parts[1]), int(parts[2])
        walk: int | None = os.getpid()
        for _ in range(64):  # the ancestors, up to init
            if walk is None or walk <= 0:
                break
            st = _stat(walk)
            if st is None:
                break
            if walk == pid:
                if st[1] == ticks:
                    return _launch_of(pid, ticks, boot)
                break
            walk = st[0]
    me = os.getppid() if parent else os.getpid()
    st = _stat(me)
    launch = _launch_of(me, st[1], boot) if st is not None else Launch(f"{boot}-{me}-{time.time_ns()}", time.time())
    env[ENV_LAUNCH] = launch.id
    return launch


def rank_count(parallel_config: Any, argv: Sequence[str] | None = None) -> int | None:
    """The launch's data-parallel rank count. vLLM keeps it in ``data_parallel_size`` for an MoE model; a
    non-MoE rank runs as an independent engine whose size is reset to 1, so it is read from the command line
    (``--data-parallel-size N``, ``-dp N``, with ``=`` or ``_`` too). None where a ``--config`` file may set
    it and the command line does not."""
    size = getattr(parallel_config, "data_parallel_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 1:
        return size
    args = list(sys.argv if argv is None else argv)
    found: int | None = None
    config = False
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        if name in ("--data-parallel-size", "-dp"):
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            found = int(raw) if raw.isdigit() and int(raw) >= 1 else None
        elif name == "--config":
            config = True
    if found is not None:
        return found
    return None if config else 1


def _ack_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def stale_acks(control_dir: str, launch: Launch) -> list[tuple[str, tuple[int, int]]]:
    """The ack files of earlier launches (and ones that do not read and were last written before this launch
    began), each with its (inode, mtime) when read: ``remove_stale`` removes a file only if it is unchanged.
    An ack of a *later* launch is left alone: it is this one that is stale."""
    try:
        names = sorted(os.listdir(control_dir))
    except OSError:
        return []
    out = []
    for name in names:
        if not (name.startswith(ACK_PREFIX) and name.endswith(ACK_SUFFIX)):
            continue
        path = os.path.join(control_dir, name)
        key = _ack_key(path)
        if key is None:
            continue
        try:
            doc = untrusted.mapping(untrusted.read_json(path, max_bytes=MAX_CONTROL_BYTES), what=name)
        except (OSError, ValueError, untrusted.Untrusted):
            doc = None
        if doc is None:
            if key[1] / 1e9 < launch.at:
                out.append((path, key))
            continue
        theirs, at = doc.get("launch"), doc.get("launched_at")
        if theirs == launch.id:
            continue
        older = not isinstance(at, (int, float)) or isinstance(at, bool) or at <= launch.at
        if older:
            out.append((path, key))
    return out


def remove_stale(control_dir: str, launch: Launch) -> list[str]:
    """Remove the ack files of earlier launches (``stale_acks``); the names removed."""
    removed = []
    for path, key in stale_acks(control_dir, launch):
        if _ack_key(path) != key:
            continue  # rewritten since it was read: by a rank of this (or a later) launch
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(os.path.basename(path))
    return removed
