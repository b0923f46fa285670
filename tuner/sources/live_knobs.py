"""The tuner's side of the live-knob file protocol with the engine-side plugin (``plugin/``).

The engine runs ``vllm-tuner-plugin`` with ``$VLLM_TUNER_CONTROL_DIR`` set to a directory both sides
share: on a host one private to their common uid (0700); in Kubernetes a subdirectory of the pod's
emptyDir that the agent creates group-shared (02770, ``shared_group``), so that the agent (uid 65532)
and an engine of another uid (vLLM's images run as root) both use it. The tuner writes ``control.json``
(``write_request``); each EngineCore answers in its own ``ack-<dp_rank>.json`` (``read_acks``).

Acknowledgements belong to a launch: the directory outlives the engine, so files of earlier launches (an
``ack-1.json`` of a launch with two ranks beside this single rank's ``ack-0.json``) lie beside the current
ones. Each ack names its launch (``launch``, ``launched_at``, ``ranks``: the plugin's ``protocol``
docstring); ``current`` keeps the newest launch's and sets the others aside, ``state`` reads only those, and
``Files.read`` removes the stale files (the plugin does too when it starts) — the same code whether the
directory is on this host or in a pod, read by its agent.

The format is defined once, in ``tuner/portable/live_protocol.py``, which the plugin carries byte for byte
as its ``protocol.py`` (the tuner never imports the plugin, which lives in vLLM's environment); the names,
knobs, fields and the request document come from there, and ``tests/contract/test_live_knobs_protocol.py``
runs both sides against the same files.

``control.json`` is the whole desired state: a knob left out or ``None`` means "the engine's startup
value". A ``Channel``'s request is a change to it, as every engine API's is: the knobs it names, the others
kept as the request in force asks (``Files.request``; a live change of the step budget must not put the cap
back to the startup envelope). Stdlib only, no HTTP.

A ``Channel`` is where one engine's plugin is reached: its control directory on this host (``Files``,
the daemon), or, on Kubernetes, through the agent of the engine's pod, which alone sees the pod's files
(``tuner.kube.acting.RelayedPlugin``). The engine client and the rollout driver take either.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tuner.errors import SourceError
from tuner.model import live
from tuner.portable import live_protocol, untrusted

PROTOCOL = live_protocol.PROTOCOL
CONTROL_FILE = live_protocol.CONTROL_FILE
ACK_GLOB = f"{live_protocol.ACK_PREFIX}*{live_protocol.ACK_SUFFIX}"
ENV_CONTROL_DIR = live_protocol.ENV_CONTROL_DIR  # "VLLM_TUNER_CONTROL_DIR"; the launcher sets it in pods
KNOBS = live_protocol.KNOBS
REQUEST_FIELDS = live_protocol.REQUEST_FIELDS
ACK_FIELDS = live_protocol.ACK_FIELDS
MAX_ACK_BYTES = live_protocol.MAX_CONTROL_BYTES


@dataclass(frozen=True)
class Ack:
    """One EngineCore's acknowledgement. ``live`` is False when the plugin is off in that engine as a
    whole (``refused`` says why). Otherwise ``refused`` is set when request ``seq`` was refused, and
    ``applied`` holds the request now in force when it was applied. ``problem`` is set (and the rest
    left empty) when the file could not be read."""

    path: Path
    live: bool = False
    seq: int | None = None
    applied: Mapping[str, int | None] | None = None
    refused: str | None = None
    effective: Mapping[str, Any] = field(default_factory=dict)
    envelope: Mapping[str, int | None] = field(default_factory=dict)
    not_live: Mapping[str, str] = field(default_factory=dict)
    at: float | None = None
    pid: int | None = None
    dp_rank: int | None = None
    engine_version: str | None = None
    engine_known: bool = False
    mode: str | None = None
    plugin_version: str | None = None
    protocol: int | None = None
    launch: str | None = None  # the engine launch it belongs to (None: a plugin before launches, or unread)
    launched_at: float | None = None
    ranks: int | None = None  # the launch's data-parallel rank count, where the plugin could tell
    problem: str | None = None
    key: tuple[int, int] | None = None  # (inode, mtime ns) of the file when it was read

    def answers(self, seq: int) -> bool:
        """Whether this acknowledges request ``seq`` (applied or refused)."""
        return self.problem is None and self.seq == seq

    @property
    def is_applied(self) -> bool:
        return self.problem is None and self.refused is None and self.applied is not None



def prepare_control_dir(control_dir: str | os.PathLike[str], *, group: int | None = None) -> Path:
    """Create the control directory if missing and check that the plugin will accept it
    (``vllm_tuner_plugin.protocol.insecure_reason``). ``group`` None: private to this uid (0700; the engine
    runs as the same uid), and it must be so already if it exists. ``group`` a gid: shared with an engine
    that runs as another uid in that group (02770: setgid, so that what either side makes in it keeps the
    group; never writable by others); a directory this process owns is brought to that."""
    path = Path(control_dir)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
        if group is not None and st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode):
            if st.st_gid != group:
                os.chown(path, -1, group)
            os.chmod(path, 0o2770)  # after the chown, which clears the setgid bit
            st = path.lstat()
    except OSError as exc:
        raise SourceError(str(path), f"cannot create the control directory ({exc.strerror})") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(str(path), "not a directory (a symbolic link or a file is refused)")
    if st.st_uid != os.geteuid():
        raise SourceError(str(path), f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}; "
                                     "the engine must run as the same uid as the tuner, or share a group with it")
    if group is None and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SourceError(str(path), f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                                     f"use a private subdirectory (chmod 0700)")
    return path


def shared_group(state_dir: str | os.PathLike[str]) -> int:
    """The group a pod's agent shares the control directory through, with an engine of another uid:
    the state directory's group when it is setgid and this process is in it (what Kubernetes' ``fsGroup``
    makes of an emptyDir), else this process's own gid (0 in the tuner's image, ``USER 65532:0``; vLLM's
    images run as root)."""
    try:
        st = os.stat(state_dir)
    except OSError:
        return os.getegid()
    if st.st_mode & stat.S_ISGID and st.st_gid in {os.getegid(), *os.getgroups()}:
        return st.st_gid
    return os.getegid()


def request_document(seq: int, **values: int | None) -> dict[str, Any]:
    """The JSON object of a request; raises ValueError for an unknown knob or a bad value."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"seq must be an integer >= 0, got {seq!r}")
    for name, value in values.items():
        if name not in KNOBS:
            raise ValueError(f"unknown live knob {name!r} (known: {', '.join(KNOBS)})")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    return live_protocol.request_document(seq, **values)


def write_request(control_dir: str | os.PathLike[str], seq: int, **values: int | None) -> Path:
    """Write ``control.json`` atomically (``live_protocol.write_json_atomically``: a 0640 temp file in the
    same directory, then rename) and return its path. ``values``: ``max_num_active_seqs=16,
    max_num_batched_tokens=None``; a knob left out means the engine's startup value."""
    document = request_document(seq, **values)
    target = Path(control_dir) / CONTROL_FILE
    try:
        live_protocol.write_json_atomically(str(target), document)
    except OSError as exc:
        raise SourceError(str(control_dir), f"cannot write a request ({exc.strerror})") from exc
    return target


def _opt_int(value: Any) -> int | None:
    """A non-negative integer, else None (a boolean, a float, a negative number are not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else None


def parse_ack(path: Path, raw: bytes) -> Ack:
    """One ack file's bytes -> ``Ack``; never raises (a bad file gives ``Ack(problem=...)``). The file
    is the engine's: read by ``untrusted`` (depth, size, finite numbers), every field checked for shape."""
    try:
        data = untrusted.mapping(untrusted.loads(raw, what=path.name, max_bytes=MAX_ACK_BYTES), what=path.name)
    except untrusted.Untrusted as exc:
        return Ack(path=path, problem=exc.reason)
    if data.get("protocol") != PROTOCOL:
        return Ack(path=path, problem=f"protocol {untrusted.describe(data.get('protocol'))}, "
                                      f"this tuner speaks {PROTOCOL}")
    applied = data.get("applied")
    at = data.get("at")
    launched_at = data.get("launched_at")
    ranks = _opt_int(data.get("ranks"))
    return Ack(
        path=path,
        protocol=PROTOCOL,
        live=data.get("live") is True,
        seq=_opt_int(data.get("seq")),
        applied={str(k): v for k, v in applied.items()} if isinstance(applied, dict) else None,
        refused=_opt_text(data.get("refused")),
        effective=_int_map(data.get("effective")),
        envelope=_int_map(data.get("envelope")),
        not_live={str(k): str(v)[:untrusted.MAX_TEXT] for k, v in _map(data.get("not_live")).items()},
        at=float(at) if isinstance(at, int | float) and not isinstance(at, bool) and at >= 0 else None,
        pid=_opt_int(data.get("pid")),
        dp_rank=_opt_int(data.get("dp_rank")),
        engine_version=_opt_text(data.get("engine_version")),
        engine_known=data.get("engine_known") is True,
        mode=_opt_text(data.get("mode")),
        plugin_version=_opt_text(data.get("plugin_version")),
        launch=_opt_text(data.get("launch")),
        launched_at=float(launched_at) if isinstance(launched_at, int | float) and not isinstance(launched_at, bool)
        and launched_at >= 0 else None,
        ranks=ranks if ranks is not None and 1 <= ranks <= 4096 else None,
    )


def _map(value: Any) -> dict[str, Any]:
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def _int_map(value: Any) -> dict[str, Any]:
    """A mapping of name → non-negative integer, boolean or null (what the plugin writes); other
    entries (a negative count, a float, a nested object) are dropped, never believed."""
    return {k: v for k, v in _map(value).items() if v is None or isinstance(v, bool) or _opt_int(v) is not None}


def _opt_text(value: Any) -> str | None:
    return value[:untrusted.MAX_TEXT] if isinstance(value, str) else None


def read_acks(control_dir: str | os.PathLike[str]) -> list[Ack]:
    """Every ``ack-*.json`` in the directory, by data-parallel rank. A missing directory gives ``[]``;
    a file that cannot be read or parsed gives an ``Ack`` whose ``problem`` says why."""
    directory = Path(control_dir)
    try:
        paths = sorted(directory.glob(ACK_GLOB))
    except OSError as exc:
        raise SourceError(str(directory), f"cannot list acknowledgements ({exc.strerror})") from exc
    acks = []
    for path in paths:
        try:
            st = path.lstat()
            key = (st.st_ino, st.st_mtime_ns)
            raw = untrusted.read_bytes(path, max_bytes=MAX_ACK_BYTES)
        except FileNotFoundError:
            continue  # replaced between the listing and the open
        except untrusted.Untrusted as exc:
            acks.append(Ack(path=path, problem=exc.reason, key=key))
            continue
        except OSError as exc:
            acks.append(Ack(path=path, problem=f"cannot be read ({exc.strerror})"))
            continue
        acks.append(dataclasses.replace(parse_ack(path, raw), key=key))
    return sorted(acks, key=lambda a: (a.dp_rank is None, a.dp_rank or 0, a.path.name))


def current(acks: list[Ack]) -> tuple[list[Ack], list[Ack]]:
    """(the acks of the newest launch, the stale ones). The newest launch is the one that started last
    (``launched_at``); an ack of no launch (a plugin before launches) is stale beside one that names a launch;
    one that does not read is stale where its file was last written before the newest launch began, else it
    stays (and makes the state unavailable, as before). Where no ack names a launch, every ack is current."""
    named = [a for a in acks if a.launch is not None]
    if not named:
        return list(acks), []
    newest = max(named, key=lambda a: (a.launched_at if a.launched_at is not None else -1.0, a.launch or ""))
    began = newest.launched_at
    keep, stale = [], []
    for a in acks:
        if a.launch == newest.launch:
            keep.append(a)
        elif a.problem is not None and a.key is not None and (began is None or a.key[1] / 1e9 >= began):
            keep.append(a)  # written during this launch and unreadable: not to be ignored
        else:
            stale.append(a)
    return keep, stale


def remove_stale(stale: list[Ack]) -> list[str]:
    """Remove the files of ``stale`` acks that are still as they were read (a file rewritten since, by a rank
    of a launch, is kept); the names removed."""
    removed = []
    for a in stale:
        try:
            st = a.path.lstat()
            if a.key is None or (st.st_ino, st.st_mtime_ns) != a.key:
                continue
            a.path.unlink()
        except OSError:
            continue
        removed.append(a.path.name)
    return removed


def state(acks: list[Ack]) -> live.LiveState:
    """What the engine's acknowledgements say it can change live and runs now (``model.live``)."""
    acks, _ = current(acks)  # only the current launch's (module docstring)
    if not acks:
        return live.LiveState(why_not="no acknowledgement from the engine yet (the plugin writes one at its "
                                      "first step: is vllm-tuner-plugin installed and VLLM_TUNER_CONTROL_DIR set?)")
    broken = next((a for a in acks if a.problem is not None), None)
    if broken is not None:
        return live.LiveState(why_not=f"{broken.path.name}: {broken.problem}")
    off = next((a for a in acks if not a.live), None)
    if off is not None:
        return live.LiveState(why_not=f"the plugin is off in this engine: {off.refused or 'no reason given'}")
    first = acks[0]
    by_name = {name: knob for knob, name in live.LIVE_NAMES.items()}
    envelope = {k: int(v) for k, v in (("max_num_seqs", first.envelope.get("max_num_seqs")),
                                      ("max_num_batched_tokens", first.envelope.get("max_num_batched_tokens")))
                if isinstance(v, int) and not isinstance(v, bool)}
    values = {}
    for name, knob in by_name.items():
        value = first.effective.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            values[knob] = value
        elif knob in envelope:
            values[knob] = envelope[knob]
    not_live = {by_name.get(name, name): why for name, why in first.not_live.items()}
    for knob in live.LIVE_NAMES:
        if live.LIVE_NAMES[knob] not in KNOBS:
            not_live.setdefault(knob, "not a knob of vllm-tuner-plugin")
    seqs = {a.seq for a in acks}
    ranks = max((a.ranks for a in acks if a.ranks is not None), default=None)
    if ranks is not None and not set(range(ranks)) <= {a.dp_rank for a in acks}:
        seqs = set()  # a rank of this launch has not written yet: no request is answered by all of them
    refused = next((a.refused for a in acks if a.refused), None)
    return live.LiveState(available=True, envelope=envelope, values=values, not_live=not_live,
                          seq=seqs.pop() if len(seqs) == 1 else None, refused=refused,
                          pids=tuple(a.pid for a in acks if a.pid is not None))


class Channel(Protocol):
    """Where one engine's plugin is reached (module docstring)."""

    def read(self) -> live.LiveState:
        """What the plugin acknowledges now."""

    def request(self, seq: int, values: Mapping[str, int | None]) -> str | None:
        """Hand request ``seq`` over (tuner knob → value, None: the startup value; a knob not named keeps the
        value it has); None once handed over, else why not."""


class Files:
    """``Channel`` through the control directory on this host."""

    def __init__(self, control_dir: str | os.PathLike[str]) -> None:
        self.control_dir = Path(control_dir)

    def read(self) -> live.LiveState:
        try:
            acks = read_acks(self.control_dir)
        except SourceError as exc:
            return live.LiveState(why_not=str(exc))
        remove_stale(current(acks)[1])  # earlier launches' files: ignored by ``state`` anyway
        return state(acks)

    def request(self, seq: int, values: Mapping[str, int | None]) -> str | None:
        """``values`` written over the request in force (``requested``): the file is the whole state, a
        request the change the tuner decided."""
        try:
            named = {live.LIVE_NAMES[k]: v for k, v in values.items()}
            write_request(self.control_dir, seq, **{**requested(self.control_dir), **named})
        except (SourceError, ValueError, KeyError) as exc:
            return str(exc)
        return None


def requested(control_dir: str | os.PathLike[str]) -> dict[str, int | None]:
    """The knobs of the request in ``control.json`` now (protocol names; ``{}`` when there is none, or it does
    not read: the plugin refuses such a file and keeps the last request it applied, which only the scheduler's
    ``effective`` values in its acks still show)."""
    try:
        raw = untrusted.read_bytes(Path(control_dir) / CONTROL_FILE, max_bytes=live_protocol.MAX_CONTROL_BYTES)
        return live_protocol.parse_request(raw).knobs()
    except (OSError, untrusted.Untrusted, live_protocol.ProtocolError):
        return {}


def request_seq(control_dir: str | os.PathLike[str]) -> int | None:
    """The ``seq`` of the request in ``control.json`` now (None: none, or unreadable)."""
    try:
        doc = untrusted.read_json(Path(control_dir) / CONTROL_FILE, max_bytes=MAX_ACK_BYTES)
    except (OSError, ValueError):
        return None
    return _opt_int(doc.get("seq")) if isinstance(doc, dict) else None
