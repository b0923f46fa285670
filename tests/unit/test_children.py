"""``tuner.actuators.children.stop``: every child it is given ends reaped, whatever the child does with the
signals, whatever the deadlines; dropping the ``Popen`` afterwards warns of nothing. Real children (``sh``);
nothing here asserts how long anything took."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.actuators import children

# What the child does. Each writes its grandchild's pid (a ``sleep`` in its process group) to argv[1] first.
BEHAVIOURS = {
    # exits by itself, soon
    "exits": "sleep 30 & echo $! > \"$1\"; sleep 0.05",
    # dies of the first signal (sh's default disposition of SIGTERM and SIGINT)
    "dies": "sleep 30 & echo $! > \"$1\"; while :; do sleep 0.05; done",
    # ignores SIGTERM and SIGINT (its sleeps too: an ignored signal stays ignored across exec): SIGKILL only
    "ignores": "trap '' TERM INT; sleep 30 & echo $! > \"$1\"; while :; do sleep 0.05; done",
}


def spawn(tmp: Path, behaviour: str, group: bool) -> tuple[subprocess.Popen[bytes], Path]:
    pidfile = tmp / f"grandchild-{os.urandom(4).hex()}"
    proc = subprocess.Popen(["sh", "-c", BEHAVIOURS[behaviour], "sh", str(pidfile)], start_new_session=group)
    return proc, pidfile


def grandchild(pidfile: Path, proc: subprocess.Popen[bytes]) -> int:
    """The grandchild's pid, once the child wrote it (the first thing each child does)."""
    for _ in range(1000):
        with contextlib.suppress(OSError, ValueError):
            return int(pidfile.read_text())
        time.sleep(0.01)
    raise AssertionError("the child never wrote its grandchild's pid")


def gone(pid: int) -> bool:
    """True once ``pid`` has ended (a zombie has: only its parent's wait is missing); polls up to 10 s."""
    for _ in range(1000):
        if not alive(pid):
            return True
        time.sleep(0.01)
    return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def dropped_quietly(box: list[subprocess.Popen[Any]]) -> list[str]:
    """The warnings that dropping the last reference to the ``Popen`` in ``box`` gives (the caller keeps none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box.clear()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


@settings(max_examples=20)
@given(behaviour=st.sampled_from(sorted(BEHAVIOURS)), group=st.booleans(),
       signal_first=st.sampled_from([signal.SIGTERM, signal.SIGINT, None]), timeout=st.sampled_from([0.0, 0.02, 0.1]))
def test_every_child_ends_reaped_whatever_it_does_with_the_signals(
        tmp_path_factory: pytest.TempPathFactory, behaviour: str, group: bool, signal_first: int | None,
        timeout: float) -> None:
    proc, pidfile = spawn(tmp_path_factory.mktemp("c"), behaviour, group)
    pid, sleeper = proc.pid, grandchild(pidfile, proc)
    try:
        rc = children.stop(proc, timeout_seconds=timeout, signal_first=signal_first, group=group,
                           kill_timeout_seconds=30)
        assert rc == proc.returncode is not None
        assert not alive(pid)
        # how it ended follows from what it does, whichever deadline it met
        allowed = {-signal.SIGKILL} | ({0} if behaviour == "exits" else set())
        if signal_first is not None and behaviour != "ignores":
            allowed |= {-signal_first, 128 + signal_first}  # died of it, or the shell exited on it
        assert rc in allowed, (behaviour, signal_first, rc)
        if group and behaviour != "exits" and (rc == -signal.SIGKILL or signal_first == signal.SIGTERM):
            # the signal that ended a child that never ends by itself went to its whole group (a non-interactive
            # shell's background job ignores SIGINT: only SIGTERM and SIGKILL are sure to take the grandchild)
            assert gone(sleeper), f"pid {sleeper} of the group outlived the stop"
        assert children.stop(proc, timeout_seconds=0) == rc  # a reaped child is not signalled again
        box = [proc]
        del proc
        assert dropped_quietly(box) == []
    finally:
        if alive(sleeper):
            os.kill(sleeper, signal.SIGKILL)


def test_a_child_already_gone_is_only_reaped(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 3"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited; its status not yet read
    assert children.stop(proc, timeout_seconds=5) == 3
    box = [proc]
    del proc
    assert dropped_quietly(box) == []


class StuckInTheKernel(subprocess.Popen[bytes]):
    """A real child whose SIGKILL (we pretend) does not take: what a child in uninterruptible sleep does."""

    stuck = True

    def leave_the_kernel(self) -> None:
        """Stop pretending, and block until the real child, SIGKILLed, has exited — without reaping it, which is
        the later look's to do. On a loaded machine (the fast tier's three workers on 2 cores) a SIGKILLed child
        can take longer than the test's next line to become a zombie, and a ``poll`` then still sees it running:
        ``make check`` failed so once (2026-12-07)."""
        self.stuck = False
        deadline = time.monotonic() + 10.0
        while os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            assert time.monotonic() < deadline, f"pid {self.pid} still runs 10 s after its SIGKILL"
            time.sleep(0.005)

    def wait(self, timeout: float | None = None) -> int:
        if self.stuck and timeout is not None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return super().wait(timeout)

    def poll(self) -> int | None:
        return None if self.stuck else super().poll()


def test_a_child_that_outlives_sigkill_raises_and_stays_referenced_until_reaped() -> None:
    proc = StuckInTheKernel(["sleep", "30"])
    pid = proc.pid
    with pytest.raises(children.Unstoppable, match=rf"pid {pid} \(sleep\) outlived SIGKILL by 0.1 s"):
        children.stop(proc, timeout_seconds=0.1, signal_first=None, kill_timeout_seconds=0.1)
    box: list[subprocess.Popen[Any]] = [proc]
    del proc
    assert dropped_quietly(box) == []  # kept: no warning, the child is not lost
    (kept,) = [p for p in children.unreaped() if p.pid == pid]
    assert isinstance(kept, StuckInTheKernel)
    kept.leave_the_kernel()  # it leaves the kernel (it was SIGKILLed): the next look reaps it
    assert kept not in children.unreaped()
    assert kept.returncode == -signal.SIGKILL


def test_the_guard_runs_whatever_ends_the_block(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    started: list[subprocess.Popen[bytes]] = []

    def fails() -> None:
        spawned = subprocess.Popen(["sh", "-c", "trap '' TERM; touch \"$1\"; while :; do sleep 0.05; done", "sh",
                                    str(ready)], stdout=subprocess.PIPE)
        with children.stopped(spawned, timeout_seconds=0.05) as proc:
            started.append(proc)
            while not ready.exists():  # SIGTERM is ignored from here on
                time.sleep(0.01)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails()
    assert started[0].returncode == -signal.SIGKILL
    assert started[0].stdout is not None and started[0].stdout.closed
    assert dropped_quietly(started) == []


def test_a_popen_dropped_unreaped_names_its_child_and_the_test_that_started_it() -> None:
    """tests/support/popen_guard.py (installed by tests/conftest.py): what CI showed as only "Exception ignored
    in: <function Popen.__del__>" in some other test now says which child and which test."""
    box = [subprocess.Popen(["sleep", "30"])]
    pid = box[0].pid
    try:
        (said,) = dropped_quietly(box)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert said.startswith(f"subprocess {pid} is still running")  # Python's words: filterwarnings marks still match
    assert "['sleep', '30']" in said and "(in fact: running)" in said
    assert "tests/unit/test_children.py::test_a_popen_dropped_unreaped_names_its_child_and_the_test_that" in said


def test_stop_all_stops_every_child_even_after_one_outlives_sigkill() -> None:
    stuck = StuckInTheKernel(["sleep", "30"])
    rest = [subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"]),
            subprocess.Popen(["sleep", "30"])]
    try:
        # the real children get the default 10 s to die of their SIGKILL (the stuck one's pretend wait gives up
        # at once whatever the deadline): 0.1 s was a race with the kernel on a loaded machine
        with pytest.raises(children.Unstoppable, match=rf"pid {stuck.pid} "):
            children.stop_all([stuck, *rest], timeout_seconds=0.1)
        assert all(p.returncode is not None for p in rest)  # the ones after it were stopped all the same
    finally:
        stuck.leave_the_kernel()
        children.unreaped()
    assert stuck.returncode is not None  # reaped by the later look


def test_the_callers_escalation_runs_before_sigkill() -> None:
    """``before_kill``: what a private systemd does to its namespace's PID 1 before unshare's SIGKILL."""
    proc = subprocess.Popen(["sleep", "30"])
    seen: list[int | None] = []
    assert children.stop(proc, timeout_seconds=0, signal_first=None, before_kill=lambda: seen.append(proc.poll())) \
        == -signal.SIGKILL
    assert seen == [None]  # it ran while the child still ran, then SIGKILL ended it
