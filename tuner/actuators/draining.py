"""Drainers: take a replica out of the load balancer before its restart, put it back after.

- ``NginxDrainer``: owns one upstream include file (``server host:port;`` per replica), marks a
  drained replica's line ``down``, replaces the file atomically, checks the whole config with
  ``nginx -t`` and reloads with ``nginx -s reload``, restoring the old file if either fails (the file
  then says what nginx still runs). A drain is skipped, with no reload, only where this drainer itself
  has had nginx load that very content: a file written by a tuner killed before its reload, or one
  whose reload timed out, is written and reloaded again (else a replica nginx still routes to would be
  stopped). An undrain the file already shows is skipped (at worst the replica stays out of the pool
  until the next reload; and a rollback through an nginx that rejects every change still succeeds).
- ``CommandDrainer``: runs an argv template (``{name}``, ``{host}``, ``{port}``, ``{url}``), never a shell;
  the commands must be idempotent (a rollback or a resumed rollout drains again).
- ``HttpDrainer``: calls a URL template (same fields) and expects a 2xx.
- ``NoDrainer``: does nothing (a single replica inside a maintenance window, or a balancer that
  health-checks on its own).

nginx facts this relies on (measured in a trial here): a reload is asynchronous (new workers take
new requests, old ones finish theirs), so the drain settles briefly before the rollout's idle wait;
and nginx only retries a refused POST on another upstream with ``proxy_next_upstream error timeout
non_idempotent;`` in the location — without it a request that races the restart fails.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tuner.actuators import base, files
from tuner.errors import PermanentActuatorError, TemporaryActuatorError
from tuner.portable import untrusted


def _fields(replica: base.Replica) -> dict[str, str]:
    url = urlsplit(replica.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    return {"name": replica.name, "host": url.hostname or "", "port": str(port), "url": replica.base_url}


def _by_name(replicas: Sequence[base.Replica], name: str, who: str) -> base.Replica:
    for r in replicas:
        if r.name == name:
            return r
    raise PermanentActuatorError(f"{who}: no replica named {name!r} (known: {', '.join(r.name for r in replicas)})")


def _format(template: str, fields: Mapping[str, str], who: str) -> str:
    try:
        return template.format_map(fields)
    except (KeyError, IndexError, ValueError) as exc:
        raise PermanentActuatorError(
            f"{who}: bad template {template!r} ({exc}); use the fields {{name}}, {{host}}, {{port}}, {{url}}, "
            "e.g. \"http://127.0.0.1:9000/drain?server={host}:{port}\""
        ) from exc


class NoDrainer:
    def drain(self, name: str) -> None:
        pass

    def undrain(self, name: str) -> None:
        pass


class _HookDrainer:
    """A drainer that calls one hook to drain and another to undrain (a command, an HTTP call)."""

    _drain: object
    _undrain: object

    def _hook(self, template: object, name: str) -> None:
        raise NotImplementedError

    def drain(self, name: str) -> None:
        self._hook(self._drain, name)

    def undrain(self, name: str) -> None:
        self._hook(self._undrain, name)


class CommandDrainer(_HookDrainer):
    def __init__(
        self,
        replicas: Sequence[base.Replica],
        *,
        drain: Sequence[str],
        undrain: Sequence[str],
        timeout_seconds: float = 30.0,
    ) -> None:
        if not drain or not undrain:
            raise PermanentActuatorError("command drainer: `drain` and `undrain` must be non-empty argv lists")
        self._replicas = tuple(replicas)
        self._drain, self._undrain = tuple(drain), tuple(undrain)
        self._timeout = timeout_seconds
        for r in self._replicas:  # fail at startup, not in the middle of a rollout
            self._argv(self._drain, r.name)
            self._argv(self._undrain, r.name)

    def _argv(self, template: Sequence[str], name: str) -> list[str]:
        fields = _fields(_by_name(self._replicas, name, "command drainer"))
        return [_format(t, fields, "command drainer") for t in template]

    def _hook(self, template: object, name: str) -> None:
        assert isinstance(template, tuple)
        argv = self._argv(template, name)
        done = files.run(argv, who="command drainer", timeout_seconds=self._timeout)
        if done.returncode != 0:
            raise TemporaryActuatorError(
                f"command drainer: {argv} exited {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}"
            )


class HttpDrainer(_HookDrainer):
    def __init__(
        self,
        replicas: Sequence[base.Replica],
        *,
        drain_url: str,
        undrain_url: str,
        method: str = "POST",
        timeout_seconds: float = 10.0,
        client: httpx.Client | None = None,
    ) -> None:
        self._replicas = tuple(replicas)
        self._drain, self._undrain, self._method = drain_url, undrain_url, method
        self._client = client or httpx.Client(timeout=timeout_seconds)
        for r in self._replicas:
            _format(drain_url, _fields(r), "http drainer")
            _format(undrain_url, _fields(r), "http drainer")

    def _hook(self, template: object, name: str) -> None:
        assert isinstance(template, str)
        url = _format(template, _fields(_by_name(self._replicas, name, "http drainer")), "http drainer")
        try:  # the status is the answer: the body is never read (nor decoded: no size to bound)
            with self._client.stream(self._method, url) as response:
                status, ok = response.status_code, response.is_success
        except httpx.HTTPError as exc:
            raise TemporaryActuatorError(f"http drainer: {self._method} {url} failed: {type(exc).__name__}") from exc
        if not ok:
            raise TemporaryActuatorError(f"http drainer: {self._method} {url} answered {status}")

    def close(self) -> None:
        self._client.close()


UPSTREAM_MAX_BYTES = 1024 * 1024  # one server line per replica
_SERVER_LINE = re.compile(r"^\s*server\s+(\S+)(.*?);")


def render_upstreams(servers: Mapping[str, str], *, drained: frozenset[str] = frozenset(), parameters: str = "") -> str:
    """The include file: one ``server`` line per replica (``servers``: name → host:port)."""
    lines = ["# Managed by vllm-tuner: rewritten atomically on every drain and undrain. Do not edit."]
    for name, address in servers.items():
        extra = (" " + parameters.strip()) if parameters.strip() else ""
        lines.append(f"server {address}{extra}{' down' if name in drained else ''};  # {name}")
    return "\n".join(lines) + "\n"


class NginxDrainer:
    def __init__(
        self,
        replicas: Sequence[base.Replica],
        *,
        upstream_file: str | Path,
        nginx: Sequence[str] = ("nginx",),
        servers: Mapping[str, str] | None = None,
        parameters: str = "",
        settle_seconds: float = 1.0,
        timeout_seconds: float = 30.0,
    ) -> None:
        self.upstream_file = Path(upstream_file)
        self._nginx = tuple(nginx)
        self._servers = dict(servers) if servers else {
            r.name: f"{_fields(r)['host']}:{_fields(r)['port']}" for r in replicas
        }
        self._parameters = parameters
        self._settle = settle_seconds
        self._timeout = timeout_seconds
        self._lock = threading.Lock()
        self.drained = self._read_drained()
        self._loaded: bytes | None = None  # what this drainer last had nginx load (None: not known)

    def _read_drained(self) -> set[str]:
        """Recover the drained set from the file itself (a restarted tuner must not forget one)."""
        previous = self._read_file()
        if previous is None:
            return set()
        text = previous.decode("utf-8", "replace")
        by_address = {address: name for name, address in self._servers.items()}
        drained = set()
        for line in text.splitlines():
            m = _SERVER_LINE.match(line)
            if m and m.group(1) in by_address and re.search(r"\bdown\b", m.group(2)):
                drained.add(by_address[m.group(1)])
        return drained

    def _read_file(self) -> bytes | None:
        """The include file as it is (None: absent), through the one bounded reader."""
        try:
            return untrusted.read_bytes(self.upstream_file, max_bytes=UPSTREAM_MAX_BYTES, follow_symlinks=True)
        except FileNotFoundError:
            return None
        except untrusted.Untrusted as exc:
            raise PermanentActuatorError(f"nginx drainer: {exc.reason}; expected the upstream include file the "
                                         "tuner writes (server lines only)") from None

    def _nginx_run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return files.run([*self._nginx, *args], who="nginx drainer", timeout_seconds=self._timeout)

    def _apply(self, drained: set[str], *, draining: bool) -> None:
        content = render_upstreams(self._servers, drained=frozenset(drained), parameters=self._parameters)
        previous = self._read_file()
        data = content.encode("utf-8")
        if previous == data and (self._loaded == data or not draining):
            # Already so, and loaded by us (a re-drain on rollback, a resumed rollout): no reload. Every
            # reload makes old workers close idle client keep-alive connections, and a client that sends
            # a request on one at that instant sees the connection reset.
            self.drained = drained
            return
        files.write_atomically(self.upstream_file, data)
        test = self._nginx_run("-t", "-q")
        if test.returncode != 0:
            self._restore(previous)
            raise PermanentActuatorError(
                f"nginx drainer: `nginx -t` rejected the config with {self.upstream_file} rewritten; the old "
                f"file is back: {test.stderr.strip()[:500]}"
            )
        try:
            reload = self._nginx_run("-s", "reload")
        except TemporaryActuatorError:  # timed out: whether nginx reloaded is not known
            self._loaded = None
            self._restore(previous)
            raise
        if reload.returncode != 0:
            self._restore(previous)
            raise TemporaryActuatorError(f"nginx drainer: `nginx -s reload` failed, the old {self.upstream_file} "
                                         f"is back: {reload.stderr.strip()[:500]}", delay=5)
        self._loaded = data
        self.drained = drained
        time.sleep(self._settle)  # the reload is asynchronous: let the new workers take over

    def _restore(self, previous: bytes | None) -> None:
        if previous is not None:
            files.write_atomically(self.upstream_file, previous)

    def _check(self, name: str) -> None:
        if name not in self._servers:
            raise PermanentActuatorError(
                f"nginx drainer: no server for replica {name!r} (known: {', '.join(self._servers)})"
            )

    def drain(self, name: str) -> None:
        self._check(name)
        with self._lock:
            self._apply(self.drained | {name}, draining=True)

    def undrain(self, name: str) -> None:
        self._check(name)
        with self._lock:
            self._apply(self.drained - {name}, draining=False)
