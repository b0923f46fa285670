"""Pre-flight: every check ``vllm-tuner run`` needs before it touches the world, in the one function that
``check-config`` and ``run`` both call.

``config.load`` proves the file well-formed; ``preflight`` proves that this host can run it *now*: the
rule files load, the maintenance windows and their time zone parse, the bearer-token and TLS files can
be read, the listen address can be bound, the state file and the journal can be read and their
directories written, no other tuner holds the journal, the engine command, systemctl, nginx or the drain
commands exist, an actuator's pid files can be read. Each check only reads — or writes a probe file it
removes at once (a read-only or full disk shows only when written) — and none starts an engine, takes
a lock it keeps, or leaves a file behind. A problem is ``(where, what)``: the field and what was wrong,
with what was expected; the CLI prints one line each and exits 2.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from tuner import config
from tuner.actuators import base, draining, process
from tuner.actuators import settings as actuator_settings
from tuner.errors import ConfigError, TunerError
from tuner.portable import untrusted
from tuner.rollout import journal as journaling
from tuner.rollout import locks
from tuner.rules import loading
from tuner.runtime import collecting, scheduling
from tuner.runtime.state import TunerState

Problem = tuple[str, str]
PROBE_BYTES = 64 * 1024  # a disk that cannot take this cannot take the state file and the journal either


def preflight(settings: config.TunerSettings, config_dir: Path, *, serving: bool = True,
              unchecked: list[str] | None = None) -> list[Problem]:
    """Everything that would stop ``run`` at start-up, or within its first cycle, for this configuration
    on this host; [] if nothing would. ``serving``: the status endpoint will listen (not ``run --once``).
    ``unchecked`` collects the checks that could not be made here, and why (``check-config`` lists them)."""
    unchecked = unchecked if unchecked is not None else []
    problems = list(settings.apply_problems())
    problems += _rules(settings, config_dir)
    problems += _maintenance(settings)
    problems += _scrape_files(settings, config_dir)
    if serving:
        problems += _listen(settings)
    problems += _state(settings, config_dir)
    problems += _gpus(settings)
    if settings.mode == "apply":
        problems += _journal(settings, config_dir)
        problems += _actuator(settings)
        problems += _host_systemd(settings, unchecked)
        problems += _drain(settings)
    elif isinstance(settings.actuator, actuator_settings.SystemdActuatorSettings):
        unchecked.append(f"the systemd actuator's host (PID 1, the engine units): mode is {settings.mode}, which "
                         "starts and stops nothing")
    return problems


def check(settings: config.TunerSettings, config_path: str | os.PathLike[str], *, serving: bool = True,
          unchecked: list[str] | None = None) -> None:
    """``preflight``, raising a ``ConfigError`` that names the configuration file."""
    problems = preflight(settings, Path(config_path).resolve().parent, serving=serving, unchecked=unchecked)
    if problems:
        raise ConfigError(str(config_path), problems)


def resolve(path: str, config_dir: Path) -> Path:
    """A path of the configuration as ``run`` reads it (``daemon.state_file``, ``rollout.journal_file``:
    relative to the configuration's directory)."""
    p = Path(path)
    return p if p.is_absolute() else config_dir / p


# --- the checks ------------------------------------------------------------------------------------------


def _from(error: ConfigError, where: str) -> list[Problem]:
    """Problems of another file (a rule file) as problems of the configuration field that names it."""
    return [(where, f"{error.file}{': ' + w if w else ''}: {what}") for w, what in error.problems]


def _rules(settings: config.TunerSettings, config_dir: Path) -> list[Problem]:
    missing = [p for p in loading.rule_paths(settings.rule_files, base_dir=config_dir) if not p.is_file()]
    if missing:
        return [("rule_files", f"{p} is not a file; expected a rule file, relative to the configuration's directory "
                 "or absolute, e.g. \"rules/site.yaml\" (rules/default.yaml shows the format)") for p in missing]
    try:
        loading.load_all(loading.rule_paths(settings.rule_files, base_dir=config_dir))
    except ConfigError as exc:
        return _from(exc, "rule_files")
    return []


def _maintenance(settings: config.TunerSettings) -> list[Problem]:
    daemon = settings.daemon
    problems: list[Problem] = []
    try:  # the time zone alone first, so that a bad one is not blamed on the expressions
        scheduling.MaintenanceWindows(["* * * * *"], timezone=daemon.maintenance_timezone)
    except ValueError:
        problems.append(("daemon.maintenance_timezone", f"{daemon.maintenance_timezone!r} is not a known time "
                         "zone; expected an IANA name, e.g. \"UTC\" or \"Europe/Berlin\""))
    for i, expr in enumerate(daemon.maintenance_windows):
        try:
            scheduling.MaintenanceWindows([expr], timezone="UTC")
        except ValueError as exc:
            problems.append((f"daemon.maintenance_windows[{i}]", str(exc)))
    return problems


def _scrape_files(settings: config.TunerSettings, config_dir: Path) -> list[Problem]:
    problems: list[Problem] = []
    try:
        collecting.http_settings(settings.scrape, config_dir=config_dir)
    except ConfigError as exc:
        problems += [(w, f"{exc.file}: {what}") for w, what in exc.problems]
    tls = settings.scrape.tls
    for where, name in (("scrape.tls.ca_file", tls.ca_file), ("scrape.tls.client_cert_file", tls.client_cert_file)):
        if name is not None and (why := _unreadable(Path(name))):
            problems.append((where, f"{name}: {why}; expected a PEM file"))
    return problems


def _listen(settings: config.TunerSettings) -> list[Problem]:
    host, port = settings.daemon.listen_host, settings.daemon.listen_port
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # what the status server binds (http.server)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            what = (f"{host}:{port} is already in use (another vllm-tuner, or this one still running?); pick a free "
                    "port, e.g. 9181, or stop what listens there")
        else:
            what = f"cannot listen on {host}:{port}: {exc.strerror or exc}; expected a local IPv4 address, e.g. 127.0.0.1"
        return [("daemon.listen_port" if exc.errno == errno.EADDRINUSE else "daemon.listen_host", what)]
    finally:
        sock.close()
    return []


def _kept(where: str, path: Path, example: str, read: Callable[[Path], list[Problem]]) -> list[Problem]:
    """A file the tuner keeps (state, journal): a file path, not a directory, in a directory it can
    write, and what ``read`` finds wrong with what is there."""
    if path.is_dir():
        return [(where, f"{path} is a directory; expected a file path, e.g. {example}")]
    return _writable(where, path.parent) + read(path)


def _state(settings: config.TunerSettings, config_dir: Path) -> list[Problem]:
    def read(path: Path) -> list[Problem]:
        try:
            TunerState.load(path, settings.targets, redactor=settings.redactor())
        except ConfigError as exc:
            return [("daemon.state_file", what) for _, what in exc.problems]
        return []

    return _kept("daemon.state_file", resolve(settings.daemon.state_file, config_dir),
                 "/var/lib/vllm-tuner/state.json", read)


def _journal(settings: config.TunerSettings, config_dir: Path) -> list[Problem]:
    def read(path: Path) -> list[Problem]:
        problems: list[Problem] = []
        try:
            journaling.unfinished(journaling.read_records(path))
        except (OSError, TunerError) as exc:
            problems.append(("rollout.journal_file", str(exc)))
        except (KeyError, TypeError, ValueError) as exc:  # readable lines that do not replay
            problems.append(("rollout.journal_file", f"{path}: a record does not replay "
                             f"({type(exc).__name__}: {exc}); move the file aside to start from an empty history"))
        holder = _lock_holder(locks.lock_path(path))
        if holder is not None:
            problems.append(("rollout.journal_file", str(locks.LockedError(str(locks.lock_path(path)), holder or None))))
        return problems

    return _kept("rollout.journal_file", resolve(settings.rollout.journal_file, config_dir),
                 "/var/lib/vllm-tuner/journal.jsonl", read)


def _lock_holder(path: Path) -> int | None:
    """The pid holding ``path``'s lock (0 if unknown), None if nobody does. Never creates the file: a
    lock file that does not exist is held by nobody (holders keep it, ``locks``)."""
    try:
        # non-blocking: a FIFO at the lock's path must not hold check-config (it is then nobody's lock)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _actuator(settings: config.TunerSettings) -> list[Problem]:
    act = settings.actuator
    problems: list[Problem] = []
    if isinstance(act, actuator_settings.ProcessActuatorSettings):
        path_env = (act.env or {}).get("PATH", os.environ.get("PATH", os.defpath))
        problems += _program("actuator.command[0]", act.command[0], path=path_env,
                             example='["/opt/vllm/bin/vllm", "serve"]')
        state_dir = Path(act.state_dir)
        problems += _writable("actuator.state_dir", state_dir)
        if act.log_dir is not None:
            problems += _writable("actuator.log_dir", Path(act.log_dir))
        if act.cwd is not None and not Path(act.cwd).is_dir():
            problems.append(("actuator.cwd", f"{act.cwd} is not a directory; expected the engines' working "
                             "directory, e.g. /var/lib/vllm"))
        for t in settings.targets:
            try:
                process.read_pidfile(state_dir / f"{t.name}.json")
            except TunerError as exc:
                problems.append(("actuator.state_dir", str(exc)))
    elif isinstance(act, actuator_settings.SystemdActuatorSettings):
        problems += _program("actuator.systemctl[0]", act.systemctl[0], example='["systemctl"]')
        problems += _writable("actuator.env_dir", Path(act.env_dir))
    return problems


SYSTEMD_BOOTED = Path("/run/systemd/system")  # sd_booted(3): PID 1 is systemd exactly when this exists


def _host_systemd(settings: config.TunerSettings, unchecked: list[str]) -> list[Problem]:
    """The systemd actuator on this host: PID 1 is systemd, and every target's unit is loaded (the template
    ``vllm@.service`` installed). Through ``actuator.systemctl`` as configured; where that is not this
    host's plain ``systemctl`` (``sudo``, ``nsenter``, ``--user``, ``-H``) PID 1 is not checked here."""
    act = settings.actuator
    if not isinstance(act, actuator_settings.SystemdActuatorSettings):
        return []
    plain = len(act.systemctl) == 1 and Path(act.systemctl[0]).name == "systemctl"
    if plain and not SYSTEMD_BOOTED.is_dir():
        return [("actuator", f"PID 1 is not systemd here ({SYSTEMD_BOOTED} is missing): the systemd actuator starts "
                 "vllm@<name>.service units; boot with systemd, or use the process actuator (kind: process)")]
    if not plain:
        unchecked.append(f"PID 1 is systemd: actuator.systemctl runs {' '.join(act.systemctl)!r}, not this host's "
                         "systemctl")
    if shutil.which(act.systemctl[0]) is None and not Path(act.systemctl[0]).is_file():
        return []  # _actuator said so
    units = {t.name: act.unit.format(name=t.name) for t in settings.targets}
    try:
        done = subprocess.run([*act.systemctl, "show", "-p", "Id,LoadState", "--", *units.values()],
                              capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        unchecked.append(f"the engine units exist: `{' '.join(act.systemctl)} show` did not run ({exc})")
        return []
    states: dict[str, str] = {}
    unit_id = ""
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key == "Id":
            unit_id = value
        elif key == "LoadState" and unit_id:
            states[unit_id] = value
    if done.returncode != 0 and not states:
        why = " ".join((done.stderr or done.stdout).split())[:300]
        unchecked.append(f"the engine units exist: `{' '.join(act.systemctl)} show` exited {done.returncode}: {why}")
        return []
    return [("actuator.unit", f"{unit} (target {name}) is {states.get(unit, 'not found')}; install "
             "deploy/systemd/vllm@.service (deploy/systemd/install.sh does) and run `systemctl daemon-reload`")
            for name, unit in units.items() if states.get(unit) != "loaded"]


def _gpus(settings: config.TunerSettings) -> list[Problem]:
    """A target that reads its GPUs through NVML: NVML loads here and has the GPUs asked for."""
    from tuner.sources import nvml

    problems: list[Problem] = []
    for i, t in enumerate(settings.targets):
        if isinstance(t.gpu, config.NvmlSettings):
            why = nvml.NvmlSource(t.gpu.devices).probe()
            if why is not None:
                problems.append((f"targets[{i}].gpu", f"NVML does not load here ({why}); the host needs the NVIDIA "
                                 "driver (libnvidia-ml.so.1) and, under systemd, the drop-in "
                                 "vllm-tuner.service.d/nvml.conf; or read the GPUs from dcgm-exporter "
                                 "(kind: dcgm), or none (kind: none)"))
    return problems


def _drain(settings: config.TunerSettings) -> list[Problem]:
    drain = settings.drain
    problems: list[Problem] = []
    replicas = [base.Replica(t.name, collecting.base_url(t)) for t in settings.targets]
    if isinstance(drain, actuator_settings.NginxDrainSettings):
        problems += _program("drain.nginx[0]", drain.nginx[0], example='["nginx"]')
        problems += _writable("drain.upstream_file", Path(drain.upstream_file).parent)
    elif isinstance(drain, actuator_settings.CommandDrainSettings):
        problems += _program("drain.drain[0]", drain.drain[0], example='["/usr/local/bin/lb", "drain", "{name}"]')
        problems += _program("drain.undrain[0]", drain.undrain[0], example='["/usr/local/bin/lb", "undrain", "{name}"]')
        try:
            draining.CommandDrainer(replicas, drain=drain.drain, undrain=drain.undrain)
        except TunerError as exc:
            problems.append(("drain", str(exc)))
    elif isinstance(drain, actuator_settings.HttpDrainSettings):
        try:
            draining.HttpDrainer(replicas, drain_url=drain.drain_url, undrain_url=drain.undrain_url).close()
        except TunerError as exc:
            problems.append(("drain", str(exc)))
    return problems


# --- helpers ------------------------------------------------------------------------------------------------


def _program(where: str, name: str, *, path: str | None = None, example: str) -> list[Problem]:
    if "/" in name:
        p = Path(name)
        if not p.is_file() or not os.access(p, os.X_OK):
            return [(where, f"{name} is not an executable file; expected a program, e.g. {example}")]
        return []
    if shutil.which(name, path=path) is None:
        return [(where, f"{name!r} is not found on PATH; expected a program (an absolute path is safest), "
                 f"e.g. {example}")]
    return []


PEM_MAX_BYTES = 16 * 1024 * 1024  # a CA bundle of every public root is ~0.2 MiB


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read as a small regular file (through the one bounded reader: a FIFO named as
    a CA file must not hang ``check-config``), or None."""
    try:
        untrusted.read_bytes(path, max_bytes=PEM_MAX_BYTES, follow_symlinks=True)
    except untrusted.Untrusted as exc:
        return exc.reason
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _writable(where: str, directory: Path) -> list[Problem]:
    """``directory`` (or, where it does not exist yet, the ancestor it would be created in) takes a file:
    a probe of ``PROBE_BYTES`` is written, fsync'd and removed (a read-only or full file system fails it)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [(where, f"{existing} is not a directory; expected a directory the tuner can write")]
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".vllm-tuner-probe-")
    except OSError as exc:
        return [(where, _cannot_write(existing, exc) if existing == directory else
                 f"cannot create {directory}: {_cannot_write(existing, exc)}")]
    try:
        try:
            view = memoryview(bytes(PROBE_BYTES))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return [(where, _cannot_write(existing, exc))]
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return []


def _cannot_write(directory: Path, exc: OSError) -> str:
    why = {errno.EROFS: "the file system is read-only", errno.ENOSPC: "the disk is full",
           errno.EDQUOT: "the disk quota is exhausted", errno.EACCES: "permission denied"}.get(
        exc.errno or 0, exc.strerror or str(exc))
    return f"cannot write in {directory}: {why}; expected a writable directory with free space"
