"""The live knobs' control directory between two uids: the agent (the tuner's image runs it as 65532:0)
and an engine of another uid (vLLM's images run as root; OpenShift gives each container an arbitrary uid
in group 0; a pod's ``fsGroup`` is a supplementary group of every container). Each side runs in a
process of its own under its own uid and groups (forked, ``setuid``), on real files: the agent prepares
the directory in an emptyDir-like state directory and writes a request, the plugin (on a fake 0.32
scheduler) applies it and acknowledges, the agent reads the acknowledgement.

And the rule that made it possible, generated: the plugin accepts a directory or a file only when the
engine's uid owns it and nobody else can write, or when it is shared through one of the engine's groups
(setgid) and not writable by others (plugin/README.md, "Safety")."""

from __future__ import annotations

import codecs
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support import fake_schedulers as fakes
from tests.support.plugin import live, protocol
from tuner.sources import live_knobs

AGENT = (65532, 0, ())  # uid, gid, supplementary groups: the tuner's image (USER 65532:0)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root (CI and make test run as root)")


class _Swallowed(logging.Handler):
    """The exceptions the plugin caught and logged (it never lets one reach the engine)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.seen.append(f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}")


def _load_before_dropping_root() -> None:
    """What the child may need that Python loads lazily. The interpreter may live where only root can
    read (here, pyenv under /root, 0700): after ``setuid`` the child can import nothing new, and a codec
    looked up for the first time (``open(..., encoding="ascii")``) fails with LookupError. The
    plugin, run by an engine whose own interpreter it can read, never meets this; the test must not
    depend on which earlier test in the same worker happened to load it."""
    for name in ("ascii", "utf-8", "latin-1"):
        codecs.lookup(name)


def as_user(ids: tuple[int, int, tuple[int, ...]], work: Callable[[], Any]) -> Any:
    """``work()`` in a forked child under uid, gid and groups ``ids``; its JSON-able result, or the
    exception's type and text as ``{"error": ...}``; with ``"swallowed"``, the exceptions the plugin
    caught and logged on the way (an assertion's diff then says why nothing was applied)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            _load_before_dropping_root()
            swallowed = _Swallowed()
            logging.getLogger().addHandler(swallowed)
            uid, gid, groups = ids
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            try:
                out: Any = {"ok": work()}
            except Exception as exc:
                out = {"error": f"{type(exc).__name__}: {exc}"}
            if swallowed.seen:
                out["swallowed"] = swallowed.seen
            os.write(write, json.dumps(out).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed before it could answer"
    result = json.loads(b"".join(chunks))
    return result


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A directory every uid can reach (pytest's own tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="vllm-tuner-uids-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base / "state"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def make_state(path: Path, *, fs_group: int | None) -> None:
    """What the kubelet makes of an emptyDir: 0777; with ``fsGroup``, group-owned by it and setgid."""
    path.mkdir()
    if fs_group is None:
        os.chmod(path, 0o777)
    else:
        os.chown(path, 0, fs_group)
        os.chmod(path, 0o2777)


def agent_writes(state: Path, seq: int, cap: int) -> Callable[[], Any]:
    def work() -> Any:
        control = live_knobs.prepare_control_dir(state / "control", group=live_knobs.shared_group(state))
        live_knobs.write_request(control, seq, max_num_active_seqs=cap)
        st_ = control.lstat()
        return {"mode": stat.S_IMODE(st_.st_mode), "gid": st_.st_gid, "uid": st_.st_uid}
    return work


def engine_applies(control: Path) -> Callable[[], Any]:
    def work() -> Any:
        cls = fakes.fresh(fakes.Scheduler032)
        live.install(cls, engine_version="0.32.0", control_dir=str(control))
        sched = cls(fakes.vllm_config(max_num_seqs=64, max_num_batched_tokens=2048))
        sched.__dict__[live.CONTROLLER_ATTR]._next_poll = 0.0
        sched.step()
        return {"cap": sched.max_num_active_reqs}
    return work


def agent_reads(control: Path) -> Callable[[], Any]:
    def work() -> Any:
        acks = live_knobs.read_acks(control)
        return [{"seq": a.seq, "applied": a.is_applied, "refused": a.refused, "problem": a.problem} for a in acks]
    return work


SHARED = {
    # name: (fsGroup, the engine's uid, gid, groups)
    "an emptyDir, a root engine (vLLM's images)": (None, (0, 0, ())),
    "an emptyDir, an engine of an arbitrary uid in group 0 (OpenShift)": (None, (1000680001, 0, ())),
    "fsGroup, an engine of another uid and group": (2000, (1000, 1000, (2000,))),
}


@needs_root
@pytest.mark.parametrize("case", list(SHARED))
def test_a_live_request_crosses_from_the_agents_uid_to_the_engines(state_dir: Path, case: str) -> None:
    fs_group, engine_ids = SHARED[case]
    make_state(state_dir, fs_group=fs_group)
    agent_ids = (AGENT[0], AGENT[1], (fs_group,) if fs_group is not None else ())
    made = as_user(agent_ids, agent_writes(state_dir, 7, 8))["ok"]
    assert made == {"mode": 0o2770, "gid": fs_group if fs_group is not None else 0, "uid": AGENT[0]}, \
        "group-shared, setgid, never writable by others"
    control = state_dir / "control"
    assert as_user(engine_ids, engine_applies(control)) == {"ok": {"cap": 8}}
    (ack,) = as_user(agent_ids, agent_reads(control))["ok"]
    assert ack == {"seq": 7, "applied": True, "refused": None, "problem": None}
    # nobody outside the group can write a request (the kernel says so; the plugin would refuse it too)
    intruder = (4242, 4242, ())
    got = as_user(intruder, lambda: live_knobs.write_request(control, 9, max_num_active_seqs=1) and None)
    assert "error" in got and "Permission denied" in got["error"]


@needs_root
def test_an_engine_outside_the_agents_group_is_answered_not_crashed(state_dir: Path) -> None:
    """No fsGroup and an engine of its own uid and group: it cannot use the directory. The plugin says so;
    nothing is applied; the agent sees no acknowledgement (docs/kubernetes.md: set the pod's fsGroup)."""
    make_state(state_dir, fs_group=None)
    as_user(AGENT, agent_writes(state_dir, 7, 8))
    assert as_user((1000, 1000, ()), engine_applies(state_dir / "control")) == {"ok": {"cap": 64}}
    assert as_user(AGENT, agent_reads(state_dir / "control"))["ok"] == []


@needs_root
def test_a_directory_of_another_uid_without_setgid_is_still_refused(state_dir: Path) -> None:
    """The group is trusted only through setgid (without it, files made there would carry their maker's
    group, and anyone could have made the directory group-writable for an unrelated group)."""
    make_state(state_dir, fs_group=None)
    control = state_dir / "control"
    as_user(AGENT, agent_writes(state_dir, 7, 8))
    os.chmod(control, 0o770)  # setgid gone
    assert as_user((0, 0, ()), engine_applies(control)) == {"ok": {"cap": 64}}
    ack = json.loads((control / "ack-0.json").read_text())
    assert ack["seq"] == 7 and "not shared with the engine through a group" in ack["refused"]


# --- the rule, generated -----------------------------------------------------------------------------

ENGINE_UID = 1000
ids = st.sampled_from([0, 1000, 65532, 2000])
modes = st.integers(0, 0o7777)


def stat_of(kind: int, mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((kind | mode, 1, 1, 1, uid, gid, 0, 0, 0, 0))


@given(d_mode=modes, d_uid=ids, d_gid=ids, f_mode=modes, f_uid=ids, f_gid=ids,
       groups=st.frozensets(ids, max_size=3))
def test_the_plugin_trusts_only_its_own_uid_or_a_setgid_group_of_its_own(
        d_mode: int, d_uid: int, d_gid: int, f_mode: int, f_uid: int, f_gid: int, groups: frozenset[int]) -> None:
    d = stat_of(stat.S_IFDIR, d_mode, d_uid, d_gid)
    f = stat_of(stat.S_IFREG, f_mode, f_uid, f_gid)
    dir_ok = protocol.insecure_reason("d", d, uid=ENGINE_UID, groups=groups, what="control directory") is None
    file_ok = protocol.insecure_reason("f", f, uid=ENGINE_UID, groups=groups, what="control file",
                                       directory=d) is None
    shared = bool(d_mode & stat.S_ISGID) and d_gid in groups
    if dir_ok:
        assert not d_mode & stat.S_IWOTH, "never a directory others can write"
        assert (d_uid == ENGINE_UID and not d_mode & stat.S_IWGRP) or shared
    if file_ok:
        assert not f_mode & (stat.S_IWOTH | stat.S_IWGRP), "never a file anyone but its owner can write"
        assert f_uid == ENGINE_UID or (shared and f_gid == d_gid and not d_mode & stat.S_IWOTH)
    # and what it must accept: the two shapes the tuner makes
    if d_uid == ENGINE_UID and stat.S_IMODE(d_mode) == 0o700:
        assert dir_ok
    if stat.S_IMODE(d_mode) == 0o2770 and d_gid in groups:
        assert dir_ok
        if stat.S_IMODE(f_mode) == 0o640 and f_gid == d_gid:
            assert file_ok
