"""nginx refusing a drain, with real nginx in front of simulated replicas (``vllm-tuner run``, drain kind
nginx): a configuration ``nginx -t`` rejects, and a reload that fails (the master's pid file is gone, as
after someone restarted nginx by hand with another pid path). Either way the drainer puts the old
upstream file back, the drain step fails and the rollout goes back by undraining alone — the engine is
never touched, nothing is left drained, the pool stays on its verified arguments.

And a file a killed tuner left behind: written with a replica ``down`` but never reloaded. The next
drainer does not take the file's word for what nginx runs: it writes and reloads again.

And the harness's balancer passing every request body a prompt can make: under nginx's defaults a body past
16 KB went to a temp file its workers (nobody, under root) could not write, and past 1 MB was refused — every
request of a 3,072-token trace answered 500 on the GPU machine.
"""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness import nginx as nginx_support
from harness import required
from tests.faults import support
from tuner.actuators import draining
from tuner.errors import TemporaryActuatorError
from tuner.rollout import machine


@pytest.fixture(scope="module", autouse=True)
def real_nginx() -> None:
    required.need(nginx_support.skip_reason(), "real nginx")


def workers(lb: nginx_support.NginxBalancer) -> set[int]:
    """The nginx worker processes of this balancer (a reload replaces them)."""
    return lb.workers()


@pytest.mark.parametrize("fault", ["config-rejected", "reload-fails"])
def test_a_drain_nginx_refuses_is_undone_and_the_rollout_rolls_back_cleanly(tmp_path: Path, fault: str) -> None:
    with support.sim_pool(tmp_path / "work") as pool:
        servers = {n: f"127.0.0.1:{p}" for n, p in pool.ports.items()}
        with nginx_support.NginxBalancer(servers, base_dir=str(tmp_path)) as lb:
            pool.upstream_file = lb.upstream_file
            pool.write_config(drain={"kind": "nginx", "upstream_file": str(lb.upstream_file), "nginx": lb.command,
                                     "servers": servers, "parameters": "max_fails=0", "settle_seconds": 0.2})
            original = lb.upstream_file.read_bytes()
            tuner = pool.start_tuner(stop_at=2)  # the rollout is journaled; sim-a is not admitted yet
            tuner.wait_stopped()
            pid_a = pool.pidfile("sim-a")["pid"]
            conf, pidfile = lb.conf.read_text(), lb.dir / "nginx.pid"
            if fault == "config-rejected":  # someone else's edit, not ours, breaks `nginx -t`
                lb.conf.write_text(conf + "this_is_not_a_directive on;\n")
            else:
                pidfile.rename(lb.dir / "nginx.pid.moved")
            tuner.resume()
            try:
                rollout = support.wait_for(pool.finished_rollout, 120, "the rollout to end", poll=0.2,
                                           detail=pool.diagnostics)
            finally:
                lb.conf.write_text(conf)
                if (lb.dir / "nginx.pid.moved").exists():  # (`nginx -t` leaves an empty one behind)
                    os.replace(lb.dir / "nginx.pid.moved", pidfile)
            assert machine.outcome(rollout) is machine.Outcome.ROLLED_BACK, machine.describe(rollout)
            events = [(r["replica"], r["event"]) for r in pool.records() if r["kind"] == "event"]
            assert events == [("sim-a", "go"), ("sim-a", "failed_before_stop"), ("sim-a", "undrained")], events
            why = rollout.of("sim-a").reason
            assert ("nginx -t" in why) if fault == "config-rejected" else ("nginx -s reload" in why), why
            assert "the old" in why and "back" in why  # the drainer put the old file back
            assert lb.upstream_file.read_bytes() == original  # nobody drained, in the file nginx reads
            assert pool.pidfile("sim-a")["pid"] == pid_a  # the engine was never stopped
            assert support.healthy(lb.url)  # nginx still serves
            pool.wait_cycles(3)
            assert tuner.terminate() == 0, tuner.tail()
            support.check_invariants(pool)


def test_a_file_left_down_by_a_killed_tuner_is_reloaded_not_trusted(tmp_path: Path) -> None:
    """SIGKILL between writing the upstream file and `nginx -s reload`: the file says sim-a is down, nginx
    still routes to it. The resumed drain must reload (it used to see "already so" and skip the reload,
    and the rollout then stopped an engine nginx was still sending requests to)."""
    servers = {"a": f"127.0.0.1:{support.free_port()}", "b": f"127.0.0.1:{support.free_port()}"}
    with nginx_support.NginxBalancer(servers, base_dir=str(tmp_path)) as lb:
        lb.upstream_file.write_text(draining.render_upstreams(servers, drained=frozenset({"a"}),
                                                              parameters=lb.parameters))  # …and killed
        before = workers(lb)
        drainer = lb.drainer(settle_seconds=0.2)
        assert drainer.drained == {"a"}  # what the file says
        drainer.drain("a")
        support.wait_for(lambda: workers(lb) and not workers(lb) & before, 30, "nginx to reload")
        reloaded = workers(lb)
        drainer.drain("a")  # loaded by this drainer now: really already so, no reload
        assert workers(lb) == reloaded
        # a reload that fails puts the old file back, and the next attempt reloads again
        pidfile = lb.dir / "nginx.pid"
        pidfile.rename(lb.dir / "moved")
        try:
            with pytest.raises(TemporaryActuatorError, match="nginx -s reload"):
                drainer.undrain("a")
            assert " down;" in lb.upstream_file.read_text() and drainer.drained == {"a"}
        finally:
            os.replace(lb.dir / "moved", pidfile)
        drainer.undrain("a")
        assert " down;" not in lb.upstream_file.read_text()
        support.wait_for(lambda: workers(lb) and not workers(lb) & reloaded, 30, "nginx to reload")
        assert os.path.exists(pidfile)


class _Echo(BaseHTTPRequestHandler):
    """An upstream that reads the whole body and answers its length."""

    def do_POST(self) -> None:
        n = int(self.headers["content-length"])
        body = str(len(self.rfile.read(n))).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


# around nginx's two limits: the 8/16 KB in-memory body buffer and the 1 MB client_max_body_size
@pytest.mark.parametrize("size", [1_000, 16_383, 16_385, 60_000, 1_048_577, 20_000_000])
def test_the_balancer_passes_any_body_a_prompt_makes(tmp_path: Path, size: int) -> None:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        servers = {"a": f"127.0.0.1:{upstream.server_address[1]}"}
        with nginx_support.NginxBalancer(servers, base_dir=str(tmp_path)) as lb:
            r = httpx.post(f"{lb.url}/v1/completions", content=b"x" * size, timeout=60)
            assert (r.status_code, r.text) == (200, str(size)), (lb.dir / "error.log").read_text()[-2000:]
    finally:
        upstream.shutdown()
        upstream.server_close()
