"""The shipped installer (deploy/systemd/install.sh, `make install-systemd`) on a real systemd, and the tuner
it installs, unprivileged, carrying out a rolling restart through polkit and reloading on SIGHUP.

A private systemd boots as PID 1 of a namespace (tests/support/systemd.py) whose /etc, /var/lib, /var/cache
and /var/log are overlays: the installer's users, units and polkit rule, and the tuner's state, land in the
overlays' upper layers, never on this host — and the /etc layer shows exactly what was written to /etc.
The engines are simulated replicas (tuner/sim/engine.py) started by the shipped vllm@.service, whose
ExecStart the installer points at the `vllm` given (`--vllm`); systemd, D-Bus, polkitd, systemd-sysusers
and the sandbox are real.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import required, waiting
from harness.ports import free_port
from tests.support import systemd as systemd_support

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "deploy" / "systemd" / "install.sh"
OVERLAYS = ("/etc", "/var/lib", "/var/cache", "/var/log")
BIN_DIR = "/var/lib/vllm-tuner-test-bin"  # inside the /var/lib overlay: the namespace's only


def wait_for(what: Callable[[], Any], timeout: float, message: Callable[[], str]) -> Any:
    """harness.waiting's wait, failing the test with ``message()`` at the deadline."""
    return waiting.wait_for(what, timeout, "the condition", poll=0.5, detail=message, error=AssertionError)


def skip_reason() -> str | None:
    reason = systemd_support.skip_reason()
    if reason is None and not Path("/usr/lib/polkit-1/polkitd").exists():
        reason = "polkitd is not installed (apt-get install polkitd)"
    if reason is None and shutil.which("dbus-daemon") is None:
        reason = "dbus-daemon is not installed (apt-get install dbus)"
    return reason


@pytest.fixture(scope="module")
def sd() -> Iterator[systemd_support.PrivateSystemd]:
    required.need(skip_reason(), "a real systemd with D-Bus and polkitd")
    with systemd_support.PrivateSystemd(overlays=OVERLAYS) as booted:
        yield booted


def commands(sd: systemd_support.PrivateSystemd) -> tuple[str, str]:
    """`vllm-tuner` (this checkout) and a `vllm` whose `serve` is the simulator, as the installer finds them.
    The units run them as vllm-tuner and vllm, with ProtectHome=: an interpreter under /root or /home (pyenv)
    is bound (in the namespace only) under /var/lib, and the test's packages come by PYTHONPATH."""
    bin_dir = sd.root / BIN_DIR.lstrip("/")
    (bin_dir / "python").mkdir(parents=True, exist_ok=True)
    real = Path(sys.executable).resolve()
    bound = sd.run("mount", "--bind", str(real.parents[1]), f"{BIN_DIR}/python")
    assert bound.returncode == 0, bound.stderr
    python = f"{BIN_DIR}/python/bin/{real.name}"
    # (an absolute RUNPATH into /root finds nothing there: its libpython comes by LD_LIBRARY_PATH)
    env = f"env PYTHONPATH={REPO}:{sysconfig.get_paths()['purelib']} LD_LIBRARY_PATH={BIN_DIR}/python/lib"
    tuner, vllm = bin_dir / "vllm-tuner", bin_dir / "vllm"
    tuner.write_text(f"#!/bin/sh\nexec {env} {python} -m tuner \"$@\"\n")
    vllm.write_text(f"#!/bin/sh\n[ \"$1\" = serve ] && shift\nexec {env} {python} -m tuner.sim.engine \"$@\"\n")
    for f in (tuner, vllm):
        f.chmod(0o755)
    bin_dir.chmod(0o755)
    return f"{BIN_DIR}/vllm-tuner", f"{BIN_DIR}/vllm"


def config(ports: dict[str, int], listen: int, **extra: Any) -> dict[str, Any]:
    return {
        "mode": "apply",
        # 64 simulated users against 8 slots: the tuner raises --max-num-seqs with a rolling restart
        "targets": [{"name": n, "metrics_url": f"http://127.0.0.1:{p}/metrics",
                     "args": ["--port", str(p), "--max-num-seqs", "8", "--sim-concurrency", "64",
                              "--sim-startup-seconds", "2", "--sim-time-scale", "4"]} for n, p in ports.items()],
        "scrape": {"interval_seconds": 2, "window_seconds": 20, "min_snapshots": 3},
        "decisions": {"safety": {"restart_evidence_seconds": 6}},
        "actuator": {"kind": "systemd"},
        "drain": {"kind": "http", "drain_url": "{url}/sim/drain", "undrain_url": "{url}/sim/undrain"},
        "rollout": {"verify_seconds": 6, "poll_seconds": 0.5, "idle_settle_seconds": 0.5, "idle_timeout_seconds": 20,
                    "start_timeout_seconds": 60, "warmup_requests": 2},
        "daemon": {"listen_port": listen},
        **extra,
    }


def test_install_enable_roll_and_reload_unprivileged(sd: systemd_support.PrivateSystemd, tmp_path: Path) -> None:
    tuner_bin, vllm_bin = commands(sd)
    ports = {"a": free_port(), "b": free_port()}
    listen = free_port()
    cfg = config(ports, listen)
    source = sd.root / BIN_DIR.lstrip("/") / "config.yaml"
    source.write_text(json.dumps(cfg))

    def journal() -> str:
        return sd.run("journalctl", "--no-pager", "-o", "cat", "-u", "vllm-tuner.service").stdout

    # 1. the shipped installer: users, units, polkit rule, configuration, enabled and started
    done = sd.run("sh", str(INSTALL), "--bin", tuner_bin, "--vllm", vllm_bin, "--config", f"{BIN_DIR}/config.yaml",
                  timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sd.systemctl("is-enabled", "vllm-tuner.service").stdout.strip() == "enabled"
    installed = sd.written("/etc")
    assert {"sysusers.d/vllm-tuner.conf", "systemd/system/vllm-tuner.service", "systemd/system/vllm@.service",
            "polkit-1/rules.d/50-vllm-tuner.rules", "vllm-tuner/config.yaml", "passwd", "group"} <= installed

    def running() -> bool:
        return sd.systemctl("is-active", "vllm-tuner.service", check=False).stdout.strip() == "active"

    wait_for(running, 60, lambda: sd.systemctl("status", "vllm-tuner.service", check=False).stdout + journal())

    # 2. it runs unprivileged, as vllm-tuner; the engines it started run as vllm
    def main_user(unit: str) -> str:
        pid = sd.systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip()  # in the namespace's pids
        return sd.run("ps", "-o", "user=", "-p", pid).stdout.strip()

    assert main_user("vllm-tuner.service") == "vllm-tuner"

    def engines_up() -> bool:
        return all(sd.systemctl("is-active", f"vllm@{n}.service", check=False).stdout.strip() == "active"
                   for n in ports)

    wait_for(engines_up, 90, journal)  # started by the tuner: `systemctl start` as vllm-tuner, through polkit
    assert {main_user(f"vllm@{n}.service") for n in ports} == {"vllm"}
    state = sd.root / "var/lib/vllm-tuner"
    assert sorted(p.name for p in (state / "env").iterdir()) == ["a.env", "b.env"]

    # 3. polkit: vllm-tuner may manage vllm@*.service and nothing else
    sd.install_unit("other.service", "[Service]\nType=oneshot\nExecStart=/bin/true\n")
    sd.systemctl("daemon-reload")
    allowed = sd.run("systemctl", "reset-failed", "vllm@a.service", user="vllm-tuner")
    assert allowed.returncode == 0, allowed.stderr
    refused = sd.run("systemctl", "start", "other.service", user="vllm-tuner")
    assert refused.returncode != 0 and ("Access denied" in refused.stderr or "authentication" in refused.stderr.lower())
    refused = sd.run("systemctl", "restart", "dbus.service", user="vllm-tuner")
    assert refused.returncode != 0

    # 4. a rolling restart to better flags, carried out through polkit (stop and start, one at a time)
    def rolled() -> list[dict[str, Any]]:
        out = sd.run(tuner_bin, "history", "--config", "/etc/vllm-tuner/config.yaml", "--format", "json")
        return [e for e in json.loads(out.stdout) if e.get("outcome") == "done"] if out.returncode == 0 else []

    (entry,) = wait_for(rolled, 240, journal)
    assert entry["kind"] == "restart" and entry["changes"][0]["flag"] == "--max-num-seqs"
    for n in ports:
        (line,) = [x for x in (state / "env" / f"{n}.env").read_text().splitlines() if x.startswith("# argv: ")]
        argv = json.loads(line.removeprefix("# argv: "))
        assert argv[argv.index("--max-num-seqs") + 1] == entry["changes"][0]["to"]
    # it wrote nothing under /etc: what /etc holds is what the installer put there
    assert sd.written("/etc") == installed

    # 5. systemctl reload: a configuration that does not load is kept out, a valid one is taken
    pid = sd.systemctl("show", "-p", "MainPID", "--value", "vllm-tuner.service").stdout.strip()
    etc_config = sd.root / "etc/vllm-tuner/config.yaml"
    etc_config.write_text(json.dumps({**cfg, "scrape": {"interval_seconds": 0}}))
    reload = sd.systemctl("reload", "vllm-tuner.service", check=False)
    # once under make test (load 7.7) this returned 1 with nothing said: the unit's state and journal say why
    assert reload.returncode == 0, (reload.stdout + reload.stderr
                                    + sd.systemctl("status", "vllm-tuner.service", check=False).stdout + journal())
    wait_for(lambda: "keeping the running configuration" in journal(), 30, journal)
    assert running() and sd.systemctl("show", "-p", "MainPID", "--value", "vllm-tuner.service").stdout.strip() == pid
    etc_config.write_text(json.dumps(config(ports, listen, decisions={"paused": "reloaded by systemctl"})))
    assert sd.systemctl("reload", "vllm-tuner.service", check=False).returncode == 0

    def paused() -> bool:
        try:
            body = httpx.get(f"http://127.0.0.1:{listen}/status", timeout=5).json()
        except httpx.HTTPError:
            return False
        return bool((body.get("control") or {}).get("paused"))

    wait_for(paused, 30, journal)
    assert sd.systemctl("show", "-p", "MainPID", "--value", "vllm-tuner.service").stdout.strip() == pid
    assert "Traceback" not in journal()

    # 6. check-config on this host (the tuner stopped: it holds the journal's lock while it runs): PID 1 is
    # systemd and the engine units are installed, every check made
    sd.systemctl("stop", "vllm-tuner.service", timeout=120)
    checked = sd.run(tuner_bin, "check-config", "/etc/vllm-tuner/config.yaml")
    assert checked.returncode == 0, checked.stderr
    assert "not checked here" not in checked.stdout
    assert sd.written("/etc") - installed == set()
