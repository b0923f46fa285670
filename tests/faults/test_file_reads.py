"""Class 4 of issue 28: one reader for every file the tuner opens.

A FIFO named as a TLS CA file hung ``check-config`` and ``run``: preflight opened it with a plain
``open()``, which waits in the kernel for a writer that never comes. The mechanism is any open of a path
someone else named (a configuration field, a file beside the tuner's own) outside the one bounded reader,
``tuner.portable.untrusted`` (non-blocking open, regular files only, a size limit).

Two tests hold the class:

- every call under ``tuner/`` that opens or reads a file is listed; one outside the reader must be in
  ``ALLOWED`` with the reason it cannot block (a procfs file, a directory, a file the tuner just created);
- generated: every reader of a named path, given a FIFO (no writer), a directory or a character device
  in place of its file, answers within a deadline with a clear error — never a wait. A reader that did
  block is freed by opening the FIFO's other end, and the case fails naming it.
"""

from __future__ import annotations

import ast
import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuner import config
from tuner.actuators import base, draining, process
from tuner.cli import inputs
from tuner.daemon import preflight
from tuner.errors import TunerError
from tuner.portable import untrusted
from tuner.rollout import journal
from tuner.runtime import collecting

ROOT = Path(__file__).resolve().parents[2]

# (file, the call as written) -> why it cannot block or read something unbounded
ALLOWED: dict[tuple[str, str], str] = {
    ("tuner/portable/untrusted.py", "os.open(name, flags)"): "the reader itself (O_NONBLOCK, then fstat)",
    ("tuner/actuators/files.py", "os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)"): "a directory, for fsync",
    ("tuner/rollout/journal.py", "os.open(path, os.O_RDONLY | os.O_DIRECTORY)"): "a directory, for fsync",
    ("tuner/rollout/journal.py", "os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 416)"):
        "O_RDWR never waits for a FIFO's other end; its bytes are then read through the reader",
    ("tuner/rollout/locks.py", "os.open(target, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 420)"):
        "O_RDWR never waits for a FIFO's other end; only flock'd, never read",
    ("tuner/daemon/preflight.py", "os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)"):
        "non-blocking; only flock'd and 32 bytes pread",
    ("tuner/actuators/process.py",
     "os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 416)"):
        "the engine log: non-blocking, then refused unless a regular file",
    ("tuner/actuators/process.py", "os.fdopen(fd, 'ab')"): "the descriptor just checked regular",
    ("tuner/actuators/process.py", "Path(f'/proc/{pid}/stat').read_text()"): "procfs: never blocks, one page",
    ("tuner/actuators/process.py", "Path(f'/proc/{pid}/cmdline').read_bytes()"): "procfs: never blocks",
    ("tuner/actuators/systemd.py", "(self._proc_root / str(pid) / 'cmdline').read_bytes()"): "procfs: never blocks",
    ("tuner/launcher/processes.py", "open(f'/proc/{pid}/stat', 'rb')"): "procfs: never blocks",
    ("tuner/cli/__init__.py", "os.open(os.devnull, os.O_WRONLY)"): "/dev/null",
    ("tuner/launcher/packaging.py", "p.read_bytes()"): "the package's own source files",
    ("tuner/launcher/packaging.py", "os.fdopen(fd, 'wb')"): "a file mkstemp just created",
    ("tuner/portable/pod_protocol.py", "os.fdopen(fd, 'w', encoding='utf-8')"): "a file mkstemp just created",
    # the live-knob protocol, the plugin's byte copy (the plugin reads control.json, the tuner never calls these)
    ("tuner/portable/live_protocol.py", "os.open(path, flags)"):
        "control.json after lstat says regular and small: O_NONBLOCK | O_NOFOLLOW, read bounded",
    ("tuner/portable/live_protocol.py", "os.fdopen(fd, 'rb')"): "the descriptor just opened non-blocking",
    ("tuner/portable/live_protocol.py", "os.fdopen(fd, 'w', encoding='utf-8')"): "a file mkstemp just created",
    ("tuner/portable/live_protocol.py", "open('/proc/sys/kernel/random/boot_id', encoding='ascii')"):
        "procfs: never blocks",
    ("tuner/portable/live_protocol.py", "open(f'/proc/{pid}/stat', 'rb')"): "procfs: never blocks",
    ("tuner/portable/live_protocol.py", "open('/proc/stat', 'rb')"): "procfs: never blocks",
    ("tuner/sim/server.py", "open(tmp, 'w', encoding='utf-8')"): "the simulator (imports nothing of the tuner)",
    ("tuner/sim/server.py", "open(path, encoding='utf-8')"): "the simulator, after os.stat of its own file",
}
OPENERS = {"open", "read_text", "read_bytes", "fdopen", "open_text", "load_verify_locations", "load_cert_chain"}


def file_opens() -> list[tuple[str, str]]:
    """Every call under tuner/ that opens or reads a file other than through ``untrusted``."""
    found = []
    for path in sorted((ROOT / "tuner").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name not in OPENERS:
                continue
            if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "untrusted":
                continue  # the one reader
            if rel == "tuner/portable/untrusted.py" and isinstance(func, ast.Name):
                continue  # read_json calling read_bytes
            if rel == "tuner/cli/inputs.py" and name == "read_text" and isinstance(func, ast.Name):
                continue  # inputs.read_text: the reader's wrapper
            found.append((rel, ast.unparse(node)))
    return found


def test_every_file_the_tuner_opens_goes_through_the_one_reader() -> None:
    found = file_opens()
    stray = [f"{f}: {call}" for f, call in found if (f, call) not in ALLOWED]
    assert not stray, "open a file through tuner.portable.untrusted (or say in ALLOWED why this cannot block):\n" \
        + "\n".join(stray)
    stale = set(ALLOWED) - set(found)
    assert not stale, f"ALLOWED names calls that are gone: {sorted(stale)}"


# --- every reader of a named path, against every kind of file that is not one ------------------------------------


def _settings(**scrape: Any) -> config.TunerSettings:
    return config.parse({"mode": "observe", "scrape": scrape,
                         "targets": [{"name": "a", "metrics_url": "http://127.0.0.1:1/metrics"}]})


def _preflight(field: str) -> Callable[[Path], object]:
    def run(path: Path) -> object:
        scrape: dict[str, Any] = {"bearer_token_file": str(path)} if field == "bearer_token_file" else \
            {"tls": {field: str(path)}}
        problems = preflight.preflight(_settings(**scrape), path.parent, serving=False)
        assert problems, f"preflight accepted {path} as scrape {field}"
        return problems
    return run


def _nginx(path: Path) -> object:
    return draining.NginxDrainer([], upstream_file=path, nginx=["true"], servers={"a": "127.0.0.1:1"})


def _journal(path: Path) -> object:
    return journal.Journal(path, lock=False, fsync=False)


def _records(path: Path) -> object:
    return journal.read_records(path)


def _metrics_file(path: Path) -> object:
    return inputs.read_text(path)


def _token(path: Path) -> object:
    return collecting.read_token(path)


def _engine_log(path: Path) -> object:
    act = process.ProcessActuator([base.Replica("a", "")], command=["true"], state_dir=path.parent)
    link = act.log_path("a")
    link.unlink(missing_ok=True)
    link.symlink_to(path)
    try:
        act.start("a", ["--port", "1"])
    finally:
        with contextlib.suppress(TunerError):
            act.stop("a", timeout_seconds=5)
    return None


READERS: dict[str, Callable[[Path], object]] = {
    "preflight tls.ca_file": _preflight("ca_file"),
    "preflight tls.client_cert_file": _preflight("client_cert_file"),
    "preflight bearer_token_file": _preflight("bearer_token_file"),
    "bearer token": _token,
    "nginx upstream file": _nginx,
    "journal": _journal,
    "journal records": _records,
    "metrics file": _metrics_file,
    "engine log": _engine_log,
}
KINDS = ("fifo", "directory", "device")
DEADLINE_SECONDS = 5.0


def _make(kind: str, where: Path) -> Path:
    path = where / "named"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")  # followed where links are (a Secret's files): a device, endless
    return path


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reader=st.sampled_from(sorted(READERS)), kind=st.sampled_from(KINDS))
def test_no_reader_of_a_named_path_waits_on_a_fifo_a_directory_or_a_device(tmp_path_factory: pytest.TempPathFactory,
                                                                           reader: str, kind: str) -> None:
    where = tmp_path_factory.mktemp("named")
    path = _make(kind, where)
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            outcome["value"] = READERS[reader](path)
        except (TunerError, untrusted.Untrusted, OSError) as exc:  # an OSError names its cause (EISDIR)
            outcome["error"] = exc
        except BaseException as exc:
            outcome["crash"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(DEADLINE_SECONDS)
    blocked = thread.is_alive()
    if blocked and kind == "fifo":  # free the reader: a writer that comes and goes
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(DEADLINE_SECONDS)
    assert not blocked, f"{reader}: still waiting on a {kind} after {DEADLINE_SECONDS:g}s"
    assert "crash" not in outcome, f"{reader}: a {kind} raised {outcome['crash']!r}, not a clear error"
    said = str(outcome.get("error", outcome.get("value")))
    assert any(why in said for why in ("not a regular file", "Is a directory", "No such device")), \
        f"{reader}: a {kind} gave {said!r}"
