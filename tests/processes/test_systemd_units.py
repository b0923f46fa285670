"""The units in deploy/systemd/: ``systemd-analyze verify`` and ``security``, the settings the rollout
relies on, and the tuner's sandbox tried for real (a private systemd runs a probe under it).

Exposure thresholds (``systemd-analyze security``, 0 = fully locked down, 10 = nothing):

- ``vllm-tuner.service`` ≤ 2.0 (measured 1.6 with systemd 252 as root with CAP_KILL; 1.3 now that it runs as the
  system user vllm-tuner without capabilities, and polkit (deploy/systemd/vllm-tuner.rules) lets it manage
  vllm@*.service). What remains is the host network (it scrapes the engines). Dropping
  CapabilityBoundingSet=, SystemCallFilter= or RestrictNamespaces= crosses the line; the lines the score
  barely weighs (ProtectSystem=strict, NoNewPrivileges=, PrivateTmp=, ProtectHome=) are asserted one by one.
- ``vllm@.service`` ≤ 3.5 (measured 3.2). An engine needs GPU device nodes, writable+executable
  memory for its JIT compilers and an unfiltered syscall set (CUDA), so it cannot score like the
  tuner; losing User= (3.6) or CapabilityBoundingSet= (5.2) crosses the line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import nginx as nginx_support
from harness import required
from tests.support import systemd as systemd_support
from tuner.actuators import settings

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
TUNER, ENGINE = UNITS / "vllm-tuner.service", UNITS / "vllm@.service"
NVML_DROPIN = UNITS / "vllm-tuner.service.d" / "nvml.conf"
NGINX_DROPIN = UNITS / "vllm-tuner.service.d" / "nginx.conf"
SYSUSERS = UNITS / "vllm-tuner.sysusers"
NVML_NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "h200-device-nodes.json"
THRESHOLDS = {TUNER: 2.0, ENGINE: 3.5, NVML_DROPIN: 2.0, NGINX_DROPIN: 2.0}
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


def directives(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, value
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


@needs_analyze
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists that ExecStart's binaries exist: give it stand-ins on a tmpfs over /usr/local/bin
    # in a private mount namespace, so the host's /usr/local/bin is never touched.
    required.need(systemd_support.skip_reason(), "a private mount namespace")
    for unit in (TUNER, ENGINE):
        shutil.copy(unit, tmp_path / unit.name)
    (tmp_path / NVML_DROPIN.parent.name).mkdir()
    shutil.copy(NVML_DROPIN, tmp_path / NVML_DROPIN.parent.name / NVML_DROPIN.name)
    script = (
        "mount -t tmpfs tmpfs /usr/local/bin && for b in vllm vllm-tuner; do "
        "printf '#!/bin/sh\\n' > /usr/local/bin/$b && chmod +x /usr/local/bin/$b; done && "
        f"systemd-analyze verify {tmp_path / TUNER.name} {tmp_path / ENGINE.name}"
    )
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr


@needs_analyze
@pytest.mark.parametrize("unit", [TUNER, ENGINE, NVML_DROPIN, NGINX_DROPIN], ids=lambda p: p.name)
def test_exposure_score_stays_under_its_threshold(unit: Path, tmp_path: Path) -> None:
    threshold = THRESHOLDS[unit]
    if unit in (NVML_DROPIN, NGINX_DROPIN):  # the tuner's unit with a drop-in, merged the way systemd reads them
        merged = tmp_path / TUNER.name
        merged.write_text(TUNER.read_text() + "\n" + unit.read_text())
        unit = merged
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", f"--threshold={int(threshold * 10)}", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", done.stdout)
    assert m, done.stdout + done.stderr
    assert float(m.group(1)) <= threshold, done.stdout
    assert done.returncode == 0, done.stdout


def test_the_nvml_dropin_grants_exactly_the_nodes_nvml_opened_on_the_h200() -> None:
    """bench/nvml_devices.py on the H200: the device nodes open after NvmlSource read the GPU."""
    measured = {n["path"] for n in json.loads(NVML_NODES.read_text())["after_reading"]["open"]} - {"/dev/null"}
    assert "/dev/nvidiactl" in measured and "/dev/nvidia0" in measured
    d = directives(NVML_DROPIN)
    bound = {w.lstrip("-") for v in d["BindPaths"] + d["BindReadOnlyPaths"] for w in v.split()}
    allowed = dict(v.split() for v in d["DeviceAllow"])
    per_gpu = re.compile(r"/dev/nvidia[0-9]+")
    assert set(allowed) == bound
    assert {p for p in bound if not per_gpu.fullmatch(p)} == {p for p in measured if not per_gpu.fullmatch(p)}
    assert {f"/dev/nvidia{i}" for i in range(8)} <= bound  # one per GPU, eight listed
    # Read-only where NVML only reads (the capability nodes are mode 0400/0444 on the host).
    assert {p for p, mode in allowed.items() if mode == "r"} == {p for p in bound if "nvidia-caps" in p}
    assert "PrivateDevices" not in d  # the private /dev stays; the nodes are bound into it


def test_tuner_unit_settings() -> None:
    d = directives(TUNER)
    assert d["Type"] == ["notify"]
    # The watchdog must outlast the longest single rollout step (an engine stop, then 10 s for SIGKILL).
    assert seconds(d["WatchdogSec"][0]) > settings.RolloutSettings().stop_timeout_seconds + 10
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
                       "ProtectHome": "yes", "CapabilityBoundingSet": "", "AmbientCapabilities": "",
                       "User": "vllm-tuner", "Group": "vllm-tuner", "ExecReload": "/bin/kill -HUP $MAINPID"}.items():
        assert d[key] == [value], key
    users = {line.split()[1] for line in SYSUSERS.read_text().splitlines() if line.startswith("u ")}
    assert users == {"vllm-tuner", directives(ENGINE)["User"][0]}  # the installer creates both
    # It writes only in its state directory: journal, state, the engines' EnvironmentFiles; nothing in /etc.
    assert d["StateDirectory"] == ["vllm-tuner"] and "ReadWritePaths" not in d
    assert settings.RolloutSettings().journal_file.startswith("/var/lib/vllm-tuner/")
    assert settings.SystemdActuatorSettings(kind="systemd").env_dir.startswith("/var/lib/vllm-tuner/")
    assert directives(NGINX_DROPIN)["CapabilityBoundingSet"] == ["CAP_KILL"]  # nginx -s reload, nothing more
    # SIGTERM lets the current step finish; the longest step is one engine stop.
    assert seconds(d["TimeoutStopSec"][0]) > settings.RolloutSettings().stop_timeout_seconds


def test_engine_unit_takes_its_argv_from_the_tuners_file_and_stops_within_the_rollout_deadline() -> None:
    d = directives(ENGINE)
    env_dir = settings.SystemdActuatorSettings(kind="systemd").env_dir
    assert d["EnvironmentFile"] == [f"{env_dir}/%i.env"]
    assert d["ExecStart"][0].endswith(" $VLLM_ARGS")  # unquoted: systemd splits it into words
    assert d["Type"] == ["exec"]
    # SIGTERM to the API server alone (it drains), SIGKILL to everything at the hard deadline.
    assert d["KillMode"] == ["mixed"]
    assert seconds(d["TimeoutStopSec"][0]) >= settings.RolloutSettings().stop_timeout_seconds
    assert d["Restart"] == ["on-failure"]
    assert "StartLimitBurst" in d


PROBE = """\
import json, os, socket, subprocess, sys
out, nginx = sys.argv[1], sys.argv[2:]
result = {}
def attempt(key, fn):
    try:
        fn(); result[key] = "ok"
    except Exception as exc:
        result[key] = f"{type(exc).__name__}: {exc}"
attempt("write_rw_path", lambda: open(os.path.join(os.path.dirname(out), "env-probe"), "w").close())
attempt("write_usr", lambda: open("/usr/vllm-tuner-probe", "w").close())
result["dev"] = sorted(os.listdir("/dev"))
result["uid"] = os.getuid()
show = subprocess.run(["systemctl", "show", "-p", "LoadState", "basic.target"], capture_output=True, text=True)
result["systemctl"] = show.stdout.strip() or show.stderr.strip()
attempt("nginx_test", lambda: subprocess.run([*nginx, "-t", "-q"], check=True, capture_output=True))
attempt("nginx_reload", lambda: subprocess.run([*nginx, "-s", "reload"], check=True, capture_output=True))
sock = os.environ.get("NOTIFY_SOCKET")
if sock:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.connect("\\0" + sock[1:] if sock.startswith("@") else sock)
    s.send(b"READY=1\\nWATCHDOG=1")
json.dump(result, open(out, "w"))
"""


@pytest.fixture(scope="module")
def booted() -> Iterator[systemd_support.PrivateSystemd]:
    """With the unit's user (vllm-tuner), created by the shipped sysusers.d file in the namespace's /etc only."""
    required.need(systemd_support.skip_reason() or nginx_support.skip_reason(), "real systemd + nginx")
    with systemd_support.PrivateSystemd(overlays=("/etc",)) as sd:
        done = sd.run("systemd-sysusers", str(SYSUSERS))
        assert done.returncode == 0, done.stderr
        yield sd


def test_the_tuner_sandbox_allows_what_the_tuner_does_and_nothing_more(booted: systemd_support.PrivateSystemd) -> None:
    sd = booted
    # PrivateTmp= hides /tmp and /var/tmp from the unit, so the probe's files live under /var/lib,
    # a path the host, the namespace and the sandbox all see.
    rw = Path(tempfile.mkdtemp(prefix="vllm-tuner-test-", dir="/var/lib"))
    try:
        _run_probe(sd, rw)
    finally:
        shutil.rmtree(rw, ignore_errors=True)


def _run_probe(sd: systemd_support.PrivateSystemd, rw: Path) -> None:
    python = next(p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if Path(p).exists())
    # nginx runs inside the namespace too, as root: `nginx -s reload` signals the pid in its pid file, which the
    # probe (as vllm-tuner, with the nginx drop-in's CAP_KILL) may do.
    uid = int(sd.run("id", "-u", "vllm-tuner").stdout)
    os.chown(rw, uid, uid)
    (rw / "probe.py").write_text(PROBE)
    with nginx_support.NginxBalancer({"a": "127.0.0.1:9"}, launcher=sd.nsenter, base_dir=str(rw)) as lb:
        for path in (lb.dir, *lb.dir.rglob("*")):
            os.chown(path, uid, uid)
        # The probe stands in for `vllm-tuner run`; only paths are redirected to test directories (the
        # namespace shares the host's /var: no StateDirectory= under the host's /var/lib).
        dropin = textwrap.dedent(f"""\
            [Service]
            ExecStart=
            ExecStart={python} {rw / 'probe.py'} {rw / 'result.json'} {' '.join(lb.command)}
            ReadWritePaths=
            ReadWritePaths={rw} {lb.dir}
            StateDirectory=
            Restart=no
            """)
        sd.install_unit("vllm-tuner.service", TUNER.read_text())
        # With the NVML drop-in: nodes this machine lacks are skipped, nodes it has appear in the private /dev.
        sd.install_unit("vllm-tuner.service.d/nvml.conf", NVML_DROPIN.read_text())
        sd.install_unit("vllm-tuner.service.d/nginx.conf", NGINX_DROPIN.read_text())
        sd.install_unit("vllm-tuner.service.d/test.conf", dropin)
        sd.systemctl("daemon-reload")
        started = sd.systemctl("start", "vllm-tuner.service", check=False, timeout=60)
        assert started.returncode == 0, started.stderr + sd.systemctl("status", "vllm-tuner.service", check=False).stdout
    result = json.loads((rw / "result.json").read_text())
    assert result["uid"] == uid  # unprivileged
    assert result["write_rw_path"] == "ok"
    assert "Read-only file system" in result["write_usr"]
    assert result["systemctl"] == "LoadState=loaded"
    assert result["nginx_test"] == "ok", result
    assert result["nginx_reload"] == "ok", result
    host_gpu_nodes = {p.name for p in Path("/dev").glob("nvidia*") if p.is_char_device()}
    assert host_gpu_nodes & {"nvidiactl", "nvidia0", "nvidia-uvm"} <= set(result["dev"]), result["dev"]
    assert not {n for n in result["dev"] if n.startswith("nvidia")} - host_gpu_nodes
    assert "sda" not in result["dev"] and "vda" not in result["dev"]  # still a private /dev
