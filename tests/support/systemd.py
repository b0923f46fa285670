"""A real systemd, booted as PID 1 of a private PID + mount namespace, for tests.

The safe recipe: ``unshare --pid --fork --mount --mount-proc --propagation private``, then *first*
fresh tmpfs on /tmp and /run (otherwise systemd-tmpfiles would clean the machine's real /tmp), then
``exec systemd --system --unit=basic.target``. The network namespace is shared with the host, so
units listening on 127.0.0.1 are reachable from the tests. ``/etc`` and ``/var`` are the host's, except
``/var/tmp``, a fresh tmpfs too: at boot systemd-tmpfiles removes every ``/var/tmp/systemd-private-*``
(``R!`` in systemd-tmp.conf), so a shared /var/tmp let each booting namespace delete the PrivateTmp
directories of units running in the others, and on the host (a unit's next ExecReload then failed with
226/NAMESPACE). Test files go under a fresh ``/var/tmp/vllm-tuner-sd-*`` directory of the host, bound
onto the same path inside, so it is visible on both sides.

    with PrivateSystemd() as sd:
        sd.install_unit("vllm@.service", text)       # into the namespace's /run/systemd/system
        sd.systemctl("daemon-reload")
        sd.systemctl_prefix  # ["nsenter", "-t", PID, "-m", "-p", "systemctl"] for SystemdActuator
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from tuner.actuators import children

SYSTEMD = Path("/lib/systemd/systemd")
REPO = Path(__file__).resolve().parents[2]


def _boot_script(overlays: dict[str, Path] | None = None, shared: Path | None = None) -> str:
    """Fresh tmpfs on /tmp and /run first. A checkout that itself lives under /tmp (a CI clone) would
    vanish under the new /tmp, so it is bound aside onto /mnt first and moved back on top (inside the
    private mount namespace only; the host sees nothing). ``overlays``: directories (``/etc``, ``/var/lib``)
    given a writable overlay whose upper layer is the directory mapped to: what the namespace writes there
    (an installer's users, units, rules) lands in that layer, never on the host. ``shared``: a directory
    under /var/tmp kept visible on both sides once /var/tmp is the namespace's own tmpfs (held on /tmp's
    fresh tmpfs while /var/tmp is replaced, then moved to its own path)."""
    overlay = ""
    for target, layer in (overlays or {}).items():
        upper, work = shlex.quote(str(layer / "upper")), shlex.quote(str(layer / "work"))
        overlay += (f"mkdir -p {upper} {work} && mount -t overlay overlay -o "
                    f"lowerdir={shlex.quote(target)},upperdir={upper},workdir={work} {shlex.quote(target)} && ")
    keep = overlay
    restore = ""
    if REPO.is_relative_to("/tmp"):
        q = shlex.quote(str(REPO))
        keep += f"mount --bind {q} /mnt && "
        restore = f"mkdir -p {q} && mount --move /mnt {q} && "
    var_tmp = "mount -t tmpfs -o mode=1777 tmpfs /var/tmp && "
    if shared is not None:
        q = shlex.quote(str(shared))
        var_tmp = (f"mkdir /tmp/.shared && mount --bind {q} /tmp/.shared && " + var_tmp
                   + f"mkdir -p {q} && mount --move /tmp/.shared {q} && rmdir /tmp/.shared && ")
    return (keep + "mount -t tmpfs -o mode=1777 tmpfs /tmp && " + restore + var_tmp
            + "mount -t tmpfs -o mode=755 tmpfs /run && "
            "mkdir -p /run/systemd/system && " + MASK_PODMAN
            + "exec /lib/systemd/systemd --system --unit=basic.target")


# Debian's podman package enables podman.socket (sockets.target) and podman-auto-update.timer
# (timers.target), which basic.target pulls in: inside this namespace they would start a podman API
# against the machine's real /var/lib/containers. Masked here, in the namespace's own /run only, so the
# systemd tests boot the same units with or without podman installed (tests/support/podman.py).
MASK_PODMAN = ("for u in /lib/systemd/system/podman*; do "
               '[ -e "$u" ] && ln -sf /dev/null "/run/systemd/system/${u##*/}"; done; ')


def _children(pid: int) -> list[int]:
    """``pid``'s children (unshare's one child: the namespace's PID 1)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "booting a private systemd needs root (unshare --pid --mount)"
    for tool in ("unshare", "nsenter", "systemctl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / systemd)"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} is missing: install the systemd package"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                           capture_output=True, text=True, timeout=10, check=False)
    if probe.returncode != 0:
        return f"unshare --pid --mount is not allowed here: {probe.stderr.strip()}"
    return None


class PrivateSystemd:
    def __init__(self, *, boot_timeout_seconds: float = 60, overlays: tuple[str, ...] = ()) -> None:
        self._boot_timeout = boot_timeout_seconds
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0  # systemd's PID in the host's namespace
        self.shared_dir = Path(tempfile.mkdtemp(prefix="vllm-tuner-sd-", dir="/var/tmp"))
        # what the namespace wrote to each overlaid directory: <shared_dir>/overlay/<n>/upper
        self.overlays = {d: self.shared_dir / "overlay" / str(i) for i, d in enumerate(overlays)}

    @property
    def root(self) -> Path:
        """The namespace's file system, seen from the host (its private /run and /tmp included)."""
        return Path(f"/proc/{self.pid}/root")

    @property
    def nsenter(self) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-m", "-p"]

    @property
    def systemctl_prefix(self) -> list[str]:
        return [*self.nsenter, "systemctl"]

    def systemctl(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.systemctl_prefix, *args], capture_output=True, text=True,
                              timeout=timeout, check=check)

    def written(self, directory: str) -> set[str]:
        """The files the namespace created or changed under an overlaid ``directory`` (relative paths)."""
        upper = self.overlays[directory] / "upper"
        return {str(p.relative_to(upper)) for p in upper.rglob("*") if not p.is_dir()}

    def run(self, *argv: str, timeout: float = 120, user: str | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the namespace (its mounts, its PID 1), as root or as ``user``."""
        as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"] if user else []
        return subprocess.run([*self.nsenter, *as_user, *argv], capture_output=True, text=True, timeout=timeout,
                              check=False)

    def install_unit(self, name: str, text: str) -> None:
        target = self.root / "run/systemd/system" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def start(self) -> None:
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount", "--mount-proc",
                                      "--propagation", "private", "sh", "-c",
                                      _boot_script(self.overlays, self.shared_dir)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self._boot_timeout
        while time.monotonic() < deadline:
            pids = _children(self.proc.pid)
            if pids and Path(f"/proc/{pids[0]}/exe").resolve() == SYSTEMD.resolve():
                self.pid = pids[0]
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"unshare exited {self.proc.returncode} before systemd started")
            time.sleep(0.05)
        while time.monotonic() < deadline:
            state = self.systemctl("is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"private systemd (pid {self.pid}) did not finish booting in {self._boot_timeout:g}s")

    def stop(self) -> None:
        """``systemctl poweroff``, 30 s for it; then SIGKILL to the namespace's PID 1 (it takes the rest with
        it) and to unshare. ``unshare`` is reaped in every case (``children.stop``), also when poweroff
        itself hangs or systemd never came up (PID 1 is then the boot script)."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                if self.pid:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.systemctl("poweroff", check=False)
                children.stop(self.proc, timeout_seconds=30, signal_first=None, before_kill=self._kill_namespace)
        finally:
            shutil.rmtree(self.shared_dir, ignore_errors=True)

    def _kill_namespace(self) -> None:
        assert self.proc is not None
        init = [self.pid] if self.pid else _children(self.proc.pid)
        for pid in init:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> PrivateSystemd:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
