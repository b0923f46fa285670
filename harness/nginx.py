"""A private nginx load balancer for tests (Debian's ``nginx`` package, never its system service).

``NginxBalancer(servers)`` writes a config for N upstreams into its own directory, listens on a free
127.0.0.1 port, and runs ``nginx -p DIR -c nginx.conf`` as a daemon with its pid file in DIR. The
upstream servers live in ``upstreams.conf``, the file ``tuner.actuators.draining.NginxDrainer`` owns;
``drainer_command`` is the argv prefix for it. Usable with the stub engine and with real vLLM::

    with NginxBalancer({"a": "127.0.0.1:8001", "b": "127.0.0.1:8002"}) as lb:
        httpx.post(lb.url + "/v1/completions", json=...)

``proxy_next_upstream error timeout non_idempotent`` is on: nginx otherwise does not retry a refused
POST on the other upstream (measured in the trial here).

Client keep-alive is off by default (``client_keepalive_seconds=0``): every drain and undrain reloads
nginx, and a reload makes the old workers close their idle client keep-alive connections; a client
that sends its next request on one at that instant gets "Server disconnected without sending a
response" (measured here: about 1 request in 400 over a 2-replica rollout with 4 keep-alive clients).
With keep-alive off, the same rollouts dropped none. Upstream keep-alive (nginx → engines) stays on.

Every response carries ``X-Upstream-Addr`` (nginx's ``$upstream_addr``): which engine served it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from harness.ports import free_port
from tuner.actuators import draining

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def skip_reason() -> str | None:
    if not Path(NGINX).exists():
        return "nginx is not installed: `apt-get install -y nginx` (Debian's package; its service is not used)"
    return None


CONFIG = """\
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections {connections}; }}
http {{
    access_log {dir}/access.log;
    # a request body in memory up to 16 MB, any size accepted: nginx's defaults (16 KB, then a temp file; 1 MB at
    # most) answered 500 to every 3,072-token prompt when run as root, whose workers (nobody) cannot write here
    client_max_body_size 0;
    client_body_buffer_size 16m;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    upstream engines {{
        include {dir}/upstreams.conf;
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_timeout {client_keepalive};
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout {read_timeout}s;
            proxy_connect_timeout 2s;
            proxy_next_upstream error timeout non_idempotent;
            proxy_next_upstream_tries 3;
            add_header X-Upstream-Addr $upstream_addr always;
        }}
    }}
}}
"""


class NginxBalancer:
    def __init__(self, servers: Mapping[str, str], *, read_timeout_seconds: float = 120,
                 parameters: str = "max_fails=0", client_keepalive_seconds: int = 0,
                 launcher: Sequence[str] = (), base_dir: str | None = None, binary: str | None = None,
                 worker_connections: int = 1024) -> None:
        """``launcher``: an argv prefix to run nginx under (e.g. ``nsenter -t PID -m -p`` to run it
        inside a private systemd's namespaces); ``base_dir``: where its directory goes (default: the
        temp dir; choose one that the launcher's side sees too); ``binary``: another nginx than the
        system's (e.g. one unpacked from Debian's package with ``dpkg -x``; it is then also told its
        error log with ``-e``, since the compiled-in /var/log/nginx may not exist); ``worker_connections``:
        nginx's limit of open connections (each proxied request holds two: an open-loop load against a slow
        engine can hold thousands)."""
        self.binary = binary
        self.servers = dict(servers)
        self.launcher = list(launcher)
        self.parameters = parameters
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-tuner-nginx-", dir=base_dir))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.dir / "nginx.conf"
        self.upstream_file = self.dir / "upstreams.conf"
        (self.dir / "tmp").mkdir()
        # as root nginx's workers run as nobody: they reach the temp directories (a body past the buffer) too
        self.dir.chmod(0o755)
        (self.dir / "tmp").chmod(0o1777)
        self.conf.write_text(CONFIG.format(dir=self.dir, port=self.port, read_timeout=int(read_timeout_seconds),
                                          client_keepalive=int(client_keepalive_seconds),
                                          connections=int(worker_connections), nofile=2 * int(worker_connections) + 64))
        self.upstream_file.write_text(draining.render_upstreams(self.servers, parameters=parameters))

    @property
    def command(self) -> list[str]:
        """The nginx argv prefix for this instance (what NginxDrainer's `nginx` setting takes)."""
        if self.binary is not None:
            return [self.binary, "-e", str(self.dir / "error.log"), "-p", str(self.dir), "-c", str(self.conf)]
        return [NGINX, "-p", str(self.dir), "-c", str(self.conf)]

    def drainer(self, **kwargs: object) -> draining.NginxDrainer:
        return draining.NginxDrainer(
            [], upstream_file=self.upstream_file, nginx=self.command, servers=self.servers,
            parameters=self.parameters, **kwargs,  # type: ignore[arg-type]
        )

    def workers(self) -> set[int]:
        """The pids of this balancer's worker processes (children of its master; a reload replaces them)."""
        master = int((self.dir / "nginx.pid").read_text())
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                except OSError:
                    continue
                if int(stat[stat.rindex(")") + 2:].split()[1]) == master:
                    out.add(int(d.name))
        return out

    def wait_reloaded(self, old_workers: set[int], *, timeout_seconds: float = 15.0) -> None:
        """Until a reload took effect: new workers run and none of ``old_workers`` is left. ``nginx -s
        reload`` only signals the master; until its old workers exit they may still admit a request
        under the old upstreams (seen on a loaded host well after a fixed settle of 0.2 s)."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            now = self.workers()
            if now and not now & old_workers:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not finish reloading in {timeout_seconds:g}s: workers {sorted(now)} "
                                   f"(before: {sorted(old_workers)})")
            time.sleep(0.02)

    def _is_listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def start(self) -> None:
        subprocess.run([*self.launcher, *self.command, "-t", "-q"], check=True, capture_output=True, timeout=10)
        subprocess.run([*self.launcher, *self.command], check=True, capture_output=True, timeout=10)  # daemonizes
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._is_listening():
                return
            time.sleep(0.05)
        raise RuntimeError(f"nginx did not listen on {self.url}; see {self.dir / 'error.log'}")

    def stop(self) -> None:
        if (self.dir / "nginx.pid").exists():
            subprocess.run([*self.launcher, *self.command, "-s", "quit"], capture_output=True, timeout=10, check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self._is_listening():
                time.sleep(0.05)
            if self._is_listening() and not self.launcher:
                os.kill(int((self.dir / "nginx.pid").read_text().strip()), signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> NginxBalancer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
