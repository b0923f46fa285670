"""Every bad configuration is one clear line and exit code 2 — from ``check-config`` first, which runs every
check ``run`` runs without touching the world, and from ``run`` itself, never a traceback.

Real subprocesses (``python -m tuner``), real sockets, real locks, a real read-only and a real full file
system (tmpfs in a private mount namespace), a real pipe to ``head``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.ports import free_port
from tuner.actuators import children
from tuner.rollout import locks

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tuner" / "data" / "scenarios" / "queue-bound"


def tuner(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def valid_config(tmp: Path) -> dict[str, Any]:
    """mode apply with the process actuator; its 'engine' leaves a marker if it is ever started."""
    engine = tmp / "engine.sh"
    engine.write_text(f"#!/bin/sh\ntouch {tmp / 'ENGINE-STARTED'}\nexec sleep 60\n")
    engine.chmod(0o755)
    port = free_port()
    return {
        "mode": "apply",
        "targets": [{"name": "a", "metrics_url": f"http://127.0.0.1:{port}/metrics", "args": ["--port", str(port)]}],
        "actuator": {"kind": "process", "command": [str(engine)], "state_dir": str(tmp / "engines")},
        "rollout": {"journal_file": str(tmp / "var" / "journal.jsonl")},
        "daemon": {"listen_port": free_port(), "state_file": str(tmp / "var" / "state.json"),
                   "maintenance_windows": ["* 2-4 * * *"]},
    }


def write(tmp: Path, cfg: dict[str, Any]) -> Path:
    path = tmp / "tuner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def untouched(tmp: Path) -> None:
    """No engine started, and neither the actuator's directory nor the state/journal directory created."""
    assert not (tmp / "ENGINE-STARTED").exists(), "an engine was started"
    assert not (tmp / "engines").exists(), "the actuator's state directory was created"
    assert not (tmp / "var").exists(), "the state directory was created"


def one_line_each(proc: subprocess.CompletedProcess[str], where: str) -> list[str]:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines and all(x.startswith("error: ") for x in lines), proc.stderr
    assert any(f": {where}: " in x for x in lines), (where, proc.stderr)
    for x in lines:  # where, what, and what was expected (or what to do)
        assert any(w in x for w in ("expected", "e.g.", "move it aside", "move the file aside", "stop the other")), x
    return lines


def set_in(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node: Any = cfg
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    node[last] = value


Case = tuple[str, str, Callable[[Path, dict[str, Any]], None]]


def _bad(dotted: str, value: Any) -> Callable[[Path, dict[str, Any]], None]:
    return lambda tmp, cfg: set_in(cfg, dotted, value)


def _garbage_state(tmp: Path, cfg: dict[str, Any]) -> None:
    (tmp / "var").mkdir(exist_ok=True)
    (tmp / "var" / "state.json").write_text("{not json")


def _garbage_journal(tmp: Path, cfg: dict[str, Any]) -> None:
    (tmp / "var").mkdir(exist_ok=True)
    (tmp / "var" / "journal.jsonl").write_text('{"kind": "event"}\nnot json\n{"kind": "event"}\n')


def _outside_rules(tmp: Path, cfg: dict[str, Any]) -> None:
    (tmp.parent / "outside.yaml").write_text("version: 1\nrules: []\n")
    cfg["rule_files"] = ["../outside.yaml"]


CASES: list[Case] = [
    ("a bad cron expression", "daemon.maintenance_windows[0]", _bad("daemon.maintenance_windows", ["61 * * * *"])),
    ("a bad time zone", "daemon.maintenance_timezone", _bad("daemon.maintenance_timezone", "Mars/Olympus")),
    ("a missing bearer-token file", "scrape.bearer_token_file", _bad("scrape.bearer_token_file", "/nonexistent/token")),
    ("an empty command word", "actuator.command", _bad("actuator.command", [""])),
    ("a command that does not exist", "actuator.command[0]", _bad("actuator.command", ["/nonexistent/vllm"])),
    ("an argument with a newline", "targets[0].args", _bad("targets.0.args", ["--port", "80\n81"])),
    ("a missing rules file", "rule_files", _bad("rule_files", ["missing.yaml"])),
    ("a rules file outside the config's directory", "rule_files", _outside_rules),
    ("a garbage state.json", "daemon.state_file", _garbage_state),
    ("a garbage journal", "rollout.journal_file", _garbage_journal),
]


@pytest.mark.parametrize(("what", "where", "spoil"), CASES, ids=[c[0] for c in CASES])
def test_check_config_catches_what_run_would_fail_on_and_run_says_it_in_one_line(
        tmp_path: Path, what: str, where: str, spoil: Callable[[Path, dict[str, Any]], None]) -> None:
    tmp = tmp_path / "cfg"
    tmp.mkdir()
    cfg = valid_config(tmp)
    spoil(tmp, cfg)
    path = write(tmp, cfg)
    before = {p.name for p in (tmp / "var").iterdir()} if (tmp / "var").exists() else set()
    for argv in (["check-config", str(path)], ["run", "--config", str(path)]):
        one_line_each(tuner(*argv, timeout=60), where)
        assert not (tmp / "ENGINE-STARTED").exists() and not (tmp / "engines").exists()
        after = {p.name for p in (tmp / "var").iterdir()} if (tmp / "var").exists() else set()
        assert after == before, (argv[0], before, after)


def test_a_valid_configuration_is_checked_without_touching_the_world(tmp_path: Path) -> None:
    cfg = valid_config(tmp_path)
    path = write(tmp_path, cfg)
    listing = sorted(p.name for p in tmp_path.iterdir())
    done = tuner("check-config", str(path))
    assert done.returncode == 0, done.stderr
    assert "every check `run` makes" in done.stdout
    untouched(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no probe file, no lock, nothing created


def test_a_busy_port_and_a_journal_held_by_another_tuner(tmp_path: Path) -> None:
    cfg = valid_config(tmp_path)
    path = write(tmp_path, cfg)
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", cfg["daemon"]["listen_port"]))
        busy.listen(1)
        for argv in (["check-config", str(path)], ["run", "--config", str(path)]):
            lines = one_line_each(tuner(*argv, timeout=60), "daemon.listen_port")
            assert any("already in use" in x for x in lines), lines
    untouched(tmp_path)
    journal = Path(cfg["rollout"]["journal_file"])
    with locks.acquire(locks.lock_path(journal)):  # this process plays the other tuner
        for argv in (["check-config", str(path)], ["run", "--config", str(path)]):
            lines = one_line_each(tuner(*argv, timeout=60), "rollout.journal_file")
            assert any(f"held by another vllm-tuner (pid {os.getpid()})" in x for x in lines), lines
    assert not (tmp_path / "ENGINE-STARTED").exists()


def _private_tmpfs(script: str) -> subprocess.CompletedProcess[str] | None:
    """``script`` in a private mount namespace (sh); None where this host cannot make one (not root…)."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec", script],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_a_read_only_or_full_state_directory_is_one_line(tmp_path: Path, how: str) -> None:
    cfg = valid_config(tmp_path)
    var = tmp_path / "var"
    var.mkdir()
    path = write(tmp_path, cfg)
    spoil = (f"mount -o remount,ro {var}" if how == "read-only"
             else f"dd if=/dev/zero of={var}/fill bs=4k 2>/dev/null || true")
    runs = []
    for argv in (["check-config", str(path)], ["run", "--config", str(path)]):
        done = _private_tmpfs(f"mount -t tmpfs -o size=256k tmpfs {var}\n{spoil}\n"
                              f"exec {sys.executable} -m tuner {' '.join(argv)}")
        if done is None:
            pytest.skip("no private mount namespace here (needs root and unshare)")
        runs.append(done)
    for done in runs:
        lines = one_line_each(done, "daemon.state_file")
        expected = "the file system is read-only" if how == "read-only" else "the disk is full"
        assert any(expected in x for x in lines), lines
    assert not (tmp_path / "ENGINE-STARTED").exists()


def test_replay_names_a_bad_meta_json_in_one_line(tmp_path: Path) -> None:
    for meta in ("{", "[]", '{"scraped_at": "yesterday"}', '{"engine_args": "--max-num-seqs 8"}'):
        d = tmp_path / f"rec-{len(meta)}"
        shutil.copytree(SCENARIO, d)
        (d / "meta.json").write_text(meta)
        done = tuner("replay", str(d))
        assert done.returncode == 2, (meta, done.stderr)
        assert "Traceback" not in done.stderr and "meta.json" in done.stderr, (meta, done.stderr)
        assert len([x for x in done.stderr.splitlines() if x.strip()]) == 1, done.stderr


def test_replay_into_a_pipe_that_closes_early_ends_quietly() -> None:
    """``vllm-tuner replay DIR -v | head -1``: the reader goes away after one line."""
    replay = subprocess.Popen([sys.executable, "-m", "tuner", "replay", str(SCENARIO), "-v"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with children.stopped(replay, timeout_seconds=0, signal_first=None) as tuner_proc:  # SIGKILL if a wait fails
        assert tuner_proc.stdout is not None
        head = subprocess.run(["head", "-1"], stdin=tuner_proc.stdout, capture_output=True, timeout=120)
        tuner_proc.stdout.close()  # only head holds the pipe's read end now
        _, err = tuner_proc.communicate(timeout=120)
    assert head.stdout.strip(), "replay printed nothing"
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert tuner_proc.returncode == 0, (tuner_proc.returncode, err.decode())


def test_schema_errors_come_first_then_every_check_of_the_host(tmp_path: Path) -> None:
    """A file that does not parse is reported as such (every schema problem); one that parses is checked
    against this host (every problem at once)."""
    cfg = valid_config(tmp_path)
    cfg["actuator"]["command"] = [""]
    cfg["targets"][0]["args"] = ["x\ny"]
    lines = one_line_each(tuner("check-config", str(write(tmp_path, cfg))), "actuator.command")
    assert len(lines) == 2 and any(": targets[0].args: " in x for x in lines), lines
    cfg = valid_config(tmp_path)
    cfg["daemon"]["maintenance_timezone"] = "Mars/Olympus"
    cfg["rule_files"] = ["missing.yaml"]
    cfg["scrape"] = {"bearer_token_file": "nope"}
    lines = one_line_each(tuner("check-config", str(write(tmp_path, cfg))), "daemon.maintenance_timezone")
    assert len(lines) == 3, lines
