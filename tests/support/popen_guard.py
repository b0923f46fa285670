"""Which test started the child behind a ``Popen`` dropped with its exit status unread.

Such a ``Popen`` warns from ``__del__`` ("subprocess N is still running", a ``ResourceWarning``); pytest
(``filterwarnings = error``) turns it into ``PytestUnraisableExceptionWarning: Exception ignored in:
<function Popen.__del__ …>``, an error of whatever test is running when the garbage collector frees the
object — often another test, in another file, naming neither the child nor the test that left it. With
``install()`` the warning says what the child runs, whether it still runs or only was never reaped, and
which test started it (``PYTEST_CURRENT_TEST`` at the spawn).

``VLLM_TUNER_GC_EACH_TEST=1`` collects garbage after every test (``collect_after``), so that the warning
lands in the test that dropped the object: slower, for hunting one down.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from typing import Any

_ATTR = "_vllm_tuner_started_in"  # on each Popen: the test it was started in
_INSTALLED = "_vllm_tuner_guarded"  # on the class


def _quiet(*args: Any, **kwargs: Any) -> None:
    pass


def _state(pid: int) -> str:
    try:
        exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # looks, does not reap
    except ChildProcessError:
        return "reaped by someone else"
    except OSError:
        return "unknown"
    return "running" if exited is None else "exited, its status never read"


def install() -> None:
    """Wrap ``subprocess.Popen`` (once per process): the spawn records the current test, ``__del__`` names it."""
    popen: Any = subprocess.Popen
    if getattr(popen, _INSTALLED, False):
        return
    original_init, original_del = popen.__init__, popen.__del__

    def __init__(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        setattr(self, _ATTR, os.environ.get("PYTEST_CURRENT_TEST", "outside any test"))
        original_init(self, *args, **kwargs)

    def __del__(self: subprocess.Popen[Any], _warn: Any = warnings.warn) -> None:
        try:
            if getattr(self, "_child_created", False) and self.returncode is None:
                # Python's own words first: a test's filterwarnings("ignore:subprocess .* is still running") holds
                _warn(f"subprocess {self.pid} is still running, says its Popen (in fact: {_state(self.pid)}): "
                      f"{self.args!r}, started in {getattr(self, _ATTR, '?')}; stop it with "
                      "tuner.actuators.children.stop",
                      ResourceWarning, source=self)
        finally:
            original_del(self, _warn=_quiet)  # its own bookkeeping (the reap of an exited child) without its warning

    popen.__init__, popen.__del__ = __init__, __del__
    setattr(popen, _INSTALLED, True)


def collect_after() -> bool:
    """True when every test's teardown should end with a garbage collection (``VLLM_TUNER_GC_EACH_TEST``)."""
    return os.environ.get("VLLM_TUNER_GC_EACH_TEST", "") not in ("", "0")

