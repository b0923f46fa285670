"""One suite, every actuator: fake (in memory), process (real local processes) and systemd (a real
systemd booted in a private namespace, running ``deploy/systemd/vllm@.service``).

The real ones run ``tests/support/stub_engine.py``, which serves /health and reports its own argv at
/stub/argv: that is how the suite proves the arguments arrive unchanged through systemd's
EnvironmentFile quoting. Every wait is bounded; all traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness import nginx as nginx_support
from harness import required
from tests.support import systemd as systemd_support
from tuner.actuators import base, draining, fake, process, systemd
from tuner.errors import PermanentActuatorError

REPO = Path(__file__).resolve().parents[2]
STUB = REPO / "tests" / "support" / "stub_engine.py"
UNIT = REPO / "deploy" / "systemd" / "vllm@.service"
TRICKY = ["--served-model-name", "my model", "--chat-template", "it's \"quoted\" \\ $HOME ${X} %i %% `tick`",
          "--empty", "", "--json", '{"a": [1, 2]}', "--tab", "a\tb", "--unicode", "é ✓"]
_names = itertools.count(1)
# The unit runs with ProtectHome=yes, which hides a python that lives under /root or /home (pyenv):
# the stub is stdlib-only, so the system's python3 runs it.
SYSTEM_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if Path(p).exists()), sys.executable)


# The unit runs with PrivateTmp=yes: a checkout under /tmp (a CI clone) is invisible to the service, so
# the stub is copied into the private systemd's own /run, which the service sees (read-only).
STUB_IN_UNIT = "/run/vllm-tuner-test/stub_engine.py"


def dropin(env_dir: Path) -> str:
    """The test's override of the shipped unit: the stub instead of vllm, root, no state directories
    on the host's /var; everything else (EnvironmentFile parsing, KillMode, hardening) as shipped."""
    return (
        "[Service]\n"
        "ExecStart=\n"
        f"ExecStart={SYSTEM_PYTHON} {STUB_IN_UNIT} $VLLM_ARGS\n"
        "EnvironmentFile=\n"
        f"EnvironmentFile={env_dir}/%i.env\n"
        "User=\nGroup=\nStateDirectory=\nCacheDirectory=\nEnvironment=HOME=/tmp\n"
    )


@pytest.fixture(scope="session")
def private_systemd() -> Iterator[systemd_support.PrivateSystemd]:
    required.need(systemd_support.skip_reason(), "real systemd")
    with systemd_support.PrivateSystemd() as sd:
        env_dir = sd.shared_dir / "env"
        env_dir.mkdir()
        stub = sd.root / STUB_IN_UNIT.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_bytes(STUB.read_bytes())
        sd.install_unit("vllm@.service", UNIT.read_text())
        sd.install_unit("vllm@.service.d/test.conf", dropin(env_dir))
        sd.systemctl("daemon-reload")
        yield sd


def _fake_fails(argv: Sequence[str]) -> str | None:
    return "exited with status 1: max_num_seqs must be positive" if _opt(argv, "--max-num-seqs") == "0" else None


def _opt(argv: Sequence[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


@dataclass
class World:
    kind: str
    actuator: base.Actuator
    reopen: Callable[[], base.Actuator]  # a fresh instance, as a restarted tuner would build
    ports: dict[str, int]

    @property
    def serves_http(self) -> bool:
        return self.kind != "fake"

    def argv(self, name: str, *extra: str) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(self.ports[name]), "--model", "stub", *extra]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def live_argv(self, name: str, timeout: float = 15) -> list[str]:
        """What the engine process itself says it received, once it serves."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return list(httpx.get(self.url(name) + "/stub/argv", timeout=1).json()["argv"])
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def wait_state(self, name: str, state: base.State, timeout: float = 15) -> base.ReplicaStatus:
        deadline = time.monotonic() + timeout
        while True:
            status = self.actuator.status(name)
            if status.state is state or time.monotonic() > deadline:
                return status
            time.sleep(0.1)


@pytest.fixture(params=["fake", "process", pytest.param("systemd", marks=pytest.mark.slow)])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    n = next(_names)
    names = [f"t{n}a", f"t{n}b"]
    ports = {name: nginx_support.free_port() for name in names}
    replicas = [base.Replica(name, f"http://127.0.0.1:{ports[name]}") for name in names]
    if request.param == "fake":
        actuator: base.Actuator = fake.FakeActuator(
            replicas, fails=_fake_fails, ignores_sigterm=lambda argv: "--stub-ignore-sigterm" in argv
        )
        w = World("fake", actuator, lambda: actuator, ports)
    elif request.param == "process":
        def make_process() -> base.Actuator:
            return process.ProcessActuator(replicas, command=[sys.executable, str(STUB)],
                                           state_dir=tmp_path / "state", log_dir=tmp_path / "logs")
        w = World("process", make_process(), make_process, ports)
    else:
        sd: systemd_support.PrivateSystemd = request.getfixturevalue("private_systemd")

        def make_systemd() -> base.Actuator:
            return systemd.SystemdActuator(replicas, env_dir=sd.shared_dir / "env", systemctl=sd.systemctl_prefix,
                                           poll_seconds=0.1, proc_root=sd.root / "proc")
        w = World("systemd", make_systemd(), make_systemd, ports)
    yield w
    for name in names:
        w.actuator.stop(name, timeout_seconds=2)


def test_replicas_start_stopped_with_no_argv(world: World) -> None:
    assert [r.name for r in world.actuator.replicas()] == list(world.ports)
    for r in world.actuator.replicas():
        status = world.actuator.status(r.name)
        assert (status.state, status.argv, status.pid) == (base.State.STOPPED, None, None)


def test_start_runs_exactly_the_given_argv_without_a_shell(world: World) -> None:
    name = next(iter(world.ports))
    argv = world.argv(name, *TRICKY)
    world.actuator.start(name, argv)
    status = world.actuator.status(name)
    assert status.state is base.State.RUNNING
    assert status.argv == tuple(argv)
    assert status.pid
    if world.serves_http:
        assert world.live_argv(name) == argv  # through systemd: EnvironmentFile + $VLLM_ARGS splitting


def test_start_is_idempotent_and_refuses_to_change_a_running_replica(world: World) -> None:
    name = next(iter(world.ports))
    world.actuator.start(name, world.argv(name))
    pid = world.actuator.status(name).pid
    world.actuator.start(name, world.argv(name))
    assert world.actuator.status(name).pid == pid
    with pytest.raises(PermanentActuatorError, match="running other arguments; stop it first"):
        world.actuator.start(name, world.argv(name, "--max-num-seqs", "64"))


def test_restart_with_new_argv_runs_the_new_values(world: World) -> None:
    name = next(iter(world.ports))
    world.actuator.start(name, world.argv(name, "--max-num-seqs", "8"))
    if world.serves_http:
        world.live_argv(name)
    stopped = world.actuator.stop(name, timeout_seconds=10)
    assert stopped.state is base.State.STOPPED
    assert "SIGKILL" not in stopped.detail
    new = world.argv(name, "--max-num-seqs", "64")
    world.actuator.start(name, new)
    assert world.actuator.status(name).argv == tuple(new)
    if world.serves_http:
        assert world.live_argv(name) == new


def test_an_engine_that_rejects_its_flags_is_reported_failed_and_can_be_started_again(world: World) -> None:
    name = next(iter(world.ports))
    world.actuator.start(name, world.argv(name, "--max-num-seqs", "0"))
    status = world.wait_state(name, base.State.FAILED)
    assert status.state is base.State.FAILED, status
    assert status.detail
    assert world.actuator.stop(name, timeout_seconds=5).state is base.State.STOPPED
    good = world.argv(name, "--max-num-seqs", "8")
    world.actuator.start(name, good)
    assert world.wait_state(name, base.State.RUNNING).argv == tuple(good)


def test_stop_escalates_to_sigkill_at_the_deadline(world: World) -> None:
    name = next(iter(world.ports))
    world.actuator.start(name, world.argv(name, "--stub-ignore-sigterm"))
    if world.serves_http:
        world.live_argv(name)
    began = time.monotonic()
    stopped = world.actuator.stop(name, timeout_seconds=1.5)
    took = time.monotonic() - began
    assert stopped.state is base.State.STOPPED
    assert "SIGKILL" in stopped.detail
    assert world.actuator.status(name).state is base.State.STOPPED
    if world.serves_http:
        assert 1.4 <= took < 8, took
        with pytest.raises(httpx.ConnectError):
            httpx.get(world.url(name) + "/health", timeout=1)


def test_a_sigint_after_the_sigterm_ends_the_wait_without_sigkill(world: World) -> None:
    """An engine that waits on SIGTERM (vLLM's HTTP server with clients attached) exits on the SIGINT sent
    after ``force_after_seconds``, long before the SIGKILL deadline."""
    name = next(iter(world.ports))
    world.actuator.start(name, world.argv(name, "--stub-ignore-sigterm"))
    if world.serves_http:
        world.live_argv(name)
    stopped = world.actuator.stop(name, timeout_seconds=60, force_after_seconds=1)
    assert stopped.state is base.State.STOPPED
    log = world.actuator.log_path(name).read_text()[-2000:] if world.kind == "process" else ""
    assert "SIGINT after 1s" in stopped.detail and "SIGKILL" not in stopped.detail, (stopped.detail, log)
    assert world.actuator.status(name).state is base.State.STOPPED


def test_stop_is_idempotent(world: World) -> None:
    name = next(iter(world.ports))
    assert world.actuator.stop(name, timeout_seconds=1).state is base.State.STOPPED
    world.actuator.start(name, world.argv(name))
    world.actuator.stop(name, timeout_seconds=5)
    assert world.actuator.stop(name, timeout_seconds=1).state is base.State.STOPPED


def test_an_engine_that_dies_at_its_first_request_is_reported_failed(world: World) -> None:
    name = next(iter(world.ports))
    world.actuator.start(name, world.argv(name, "--stub-crash-after-requests", "1"))
    if isinstance(world.actuator, fake.FakeActuator):
        world.actuator.crash(name, "exited with status 3")
    else:
        world.live_argv(name)
        with pytest.raises(httpx.HTTPError):
            httpx.post(world.url(name) + "/v1/completions", json={"prompt": "x"}, timeout=5)
    status = world.wait_state(name, base.State.FAILED)
    assert status.state is base.State.FAILED, status


def test_unknown_replicas_are_a_permanent_error(world: World) -> None:
    for call in (lambda: world.actuator.status("nope"), lambda: world.actuator.start("nope", []),
                 lambda: world.actuator.stop("nope", timeout_seconds=1)):
        with pytest.raises(PermanentActuatorError, match="no replica named 'nope'"):
            call()


def test_a_restarted_tuner_knows_what_each_replica_runs(world: World) -> None:
    a, b = world.ports
    world.actuator.start(a, world.argv(a, "--max-num-seqs", "16"))
    again = world.reopen()
    status = again.status(a)
    assert (status.state, status.argv) == (base.State.RUNNING, tuple(world.argv(a, "--max-num-seqs", "16")))
    assert again.status(b).state is base.State.STOPPED
    stopped = again.stop(a, timeout_seconds=5)  # the new instance can stop what the old one started
    assert stopped.state is base.State.STOPPED
    if world.serves_http:
        with pytest.raises(httpx.ConnectError):
            httpx.get(world.url(a) + "/health", timeout=1)
    # In-process only: let the old instance notice its child is gone (a dead tuner has no Popen left).
    assert world.actuator.status(a).state is not base.State.RUNNING
    world.actuator = again


def test_adopt_starts_a_replica_never_started_and_leaves_a_running_one_alone(world: World) -> None:
    a, _ = world.ports
    first = world.argv(a, "--max-num-seqs", "8")
    status = world.actuator.adopt(a, first)  # what a tuner does at start for every replica
    assert (status.state, status.argv) == (base.State.RUNNING, tuple(first))
    if world.serves_http:
        assert world.live_argv(a) == first
    again = world.reopen()
    status = again.adopt(a, world.argv(a, "--max-num-seqs", "16"))  # the tuner now believes otherwise
    assert (status.state, status.argv) == (base.State.RUNNING, tuple(first))  # what runs is what counts


def test_systemd_adopts_a_hand_written_environment_file_only_if_the_engine_runs_those_arguments(
        private_systemd: systemd_support.PrivateSystemd, tmp_path: Path) -> None:
    sd = private_systemd
    n = next(_names)
    name, port = f"t{n}h", nginx_support.free_port()
    env_dir = sd.shared_dir / "env"
    env_dir.mkdir(exist_ok=True)
    act = systemd.SystemdActuator([base.Replica(name, f"http://127.0.0.1:{port}")], env_dir=env_dir,
                                  systemctl=sd.systemctl_prefix, poll_seconds=0.1, proc_root=sd.root / "proc")
    argv = ["--host", "127.0.0.1", "--port", str(port), "--model", "stub", "--max-num-seqs", "8"]
    # An operator's own file, written the way the unit's comment shows, without the tuner's argv line.
    (env_dir / f"{name}.env").write_text("VLLM_ARGS=" + " ".join(argv) + "\n")
    sd.systemctl("start", f"vllm@{name}.service")
    try:
        status = act.status(name)
        assert status.state is base.State.RUNNING and status.argv is None  # unknown: rollouts refused
        other = act.adopt(name, [*argv[:-1], "16"])  # the config says otherwise: left alone, said why
        assert other.argv is None and "rollouts of" in other.detail and "--max-num-seqs 8" in other.detail
        assert act.written_argv(name) is None
        adopted = act.adopt(name, argv)  # the config says what runs: the tuner takes the file over
        assert adopted.argv == tuple(argv) and act.written_argv(name) == tuple(argv)
        assert adopted.pid == status.pid  # nothing was restarted
    finally:
        act.stop(name, timeout_seconds=5)


# --- drainers: one suite over nginx (real), command, http (a real local server), fake ----------------


class _Recorder(BaseHTTPRequestHandler):
    calls: list[str] = []

    def do_POST(self) -> None:
        type(self).calls.append(self.path)
        self.send_response(200 if "fail" not in self.path else 500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class DrainWorld:
    drainer: base.Drainer
    is_drained: Callable[[str], bool]


@pytest.fixture(params=[pytest.param("nginx", marks=pytest.mark.slow), "command", "http", "fake"])
def drain_world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DrainWorld]:
    ports = {"a": nginx_support.free_port(), "b": nginx_support.free_port()}
    replicas = [base.Replica(n, f"http://127.0.0.1:{p}") for n, p in ports.items()]
    if request.param == "nginx":
        required.need(nginx_support.skip_reason(), "real nginx")
        with nginx_support.NginxBalancer({n: f"127.0.0.1:{p}" for n, p in ports.items()}) as lb:
            d = lb.drainer(settle_seconds=0.2)
            yield DrainWorld(d, lambda n: f"127.0.0.1:{ports[n]} max_fails=0 down;" in lb.upstream_file.read_text())
    elif request.param == "command":
        marks = tmp_path / "marks"
        marks.mkdir()
        script = "import pathlib, sys; p = pathlib.Path(sys.argv[1], sys.argv[2] + '@' + sys.argv[3]); "
        yield DrainWorld(
            draining.CommandDrainer(
                replicas,
                drain=[sys.executable, "-c", script + "p.touch()", str(marks), "{name}", "{port}"],
                undrain=[sys.executable, "-c", script + "p.unlink(missing_ok=True)", str(marks), "{name}", "{port}"],
            ),
            lambda n: (marks / f"{n}@{ports[n]}").exists(),
        )
    elif request.param == "http":
        calls: list[str] = []
        handler = type("Handler", (_Recorder,), {"calls": calls})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base_url = f"http://127.0.0.1:{server.server_address[1]}"
        http = draining.HttpDrainer(replicas, drain_url=base_url + "/drain/{name}?port={port}",
                                    undrain_url=base_url + "/undrain/{name}?port={port}")

        def http_drained(n: str) -> bool:
            mine = [c for c in calls if f"/{n}?port={ports[n]}" in c]
            return bool(mine) and mine[-1].startswith("/drain/")
        yield DrainWorld(http, http_drained)
        http.close()
        server.shutdown()
        server.server_close()
    else:
        f = fake.FakeDrainer()
        yield DrainWorld(f, lambda n: n in f.drained)


def test_drain_and_undrain_are_idempotent_and_touch_only_that_replica(drain_world: DrainWorld) -> None:
    d, drained = drain_world.drainer, drain_world.is_drained
    d.drain("a")
    d.drain("a")
    assert drained("a") and not drained("b")
    d.undrain("a")
    d.undrain("a")
    assert not drained("a") and not drained("b")


def test_draining_an_unknown_replica_is_a_permanent_error(drain_world: DrainWorld) -> None:
    if isinstance(drain_world.drainer, fake.FakeDrainer):
        pytest.skip("the fake drains any name")
    with pytest.raises(PermanentActuatorError, match="'zz'"):
        drain_world.drainer.drain("zz")


@pytest.mark.slow  # real nginx
def test_nginx_really_stops_routing_to_a_drained_replica(tmp_path: Path) -> None:
    required.need(nginx_support.skip_reason(), "real nginx")
    ports = {"a": nginx_support.free_port(), "b": nginx_support.free_port()}
    engines = process.ProcessActuator([base.Replica(n, "") for n in ports], command=[sys.executable, str(STUB)],
                                      state_dir=tmp_path)
    for n, p in ports.items():
        engines.start(n, ["--port", str(p)])
    try:
        with nginx_support.NginxBalancer({n: f"127.0.0.1:{p}" for n, p in ports.items()}) as lb, \
                httpx.Client(timeout=5) as client:
            deadline = time.monotonic() + 15
            while True:
                try:
                    client.get(f"http://127.0.0.1:{ports['a']}/health").raise_for_status()
                    client.get(f"http://127.0.0.1:{ports['b']}/health").raise_for_status()
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)

            def seen() -> set[int]:
                return {client.get(lb.url + "/stub/argv").json()["pid"] for _ in range(12)}
            pids = {n: engines.status(n).pid for n in ports}
            assert seen() == set(pids.values())
            # Judged on requests admitted after the drain took effect: `nginx -s reload` returns before the
            # old workers stop admitting (on a loaded host, later than the drainer's settle time), and a
            # request an old worker admitted is in flight under the old upstreams, not routed after the drain.
            d = lb.drainer(settle_seconds=0.2)
            before = lb.workers()
            d.drain("a")
            lb.wait_reloaded(before)
            assert seen() == {pids["b"]}
            assert lb.drainer().drained == {"a"}  # a restarted tuner reads the state back from the file
            before = lb.workers()
            d.undrain("a")
            lb.wait_reloaded(before)
            assert seen() == set(pids.values())
            # A config nginx rejects is never left in place.
            broken = draining.NginxDrainer([], upstream_file=lb.upstream_file, nginx=lb.command,
                                           servers={"a": "127.0.0.1:notaport"}, settle_seconds=0)
            before = lb.upstream_file.read_text()
            with pytest.raises(PermanentActuatorError, match="nginx -t"):
                broken.drain("a")
            assert lb.upstream_file.read_text() == before
    finally:
        for n in ports:
            engines.stop(n, timeout_seconds=5)
