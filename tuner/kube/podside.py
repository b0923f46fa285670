"""The agent's own pod: it carries out the pod's desired state through the pod's launcher and reports the
launcher's status back. Every agent does this, leader or not; it never acts on another pod.

Start-up (before the native sidecar's startupProbe passes, so before the engine container starts):

1. ``launcher.pyz`` into the shared directory (built from this package: reproducible, so the file says
   which version runs), atomically;
2. ``allowed-flags.json``: the flags the agent's own rules may change, with their bounds
   (``allow_list``); the launcher lets no other override pass, whatever the pool's ConfigMap says;
3. with ``live.enabled``, the live knobs' control directory (``control/``), shared with the engine
   through a group (02770, ``live_knobs.shared_group``: the pod's fsGroup, else the agent's gid 0, which
   root engines have), never writable by others: the engine-side plugin refuses that (and links, and
   files of other owners); the launcher points the engine's ``VLLM_TUNER_CONTROL_DIR`` at it;
4. ``desired.json``, unless one is there already (a restarted agent keeps what it asked for last): the
   pod's own entry in the pool's ConfigMap if the leader wrote one, else the pool's **verified arguments**
   (``pool``: overrides + the base hash they were computed for; the launcher drops them when this pod's
   base differs: the user wins). When the ConfigMap cannot be read within ``startup_timeout`` seconds
   (at once when waiting cannot help: 401, 403, 404), the engine starts on its own command line (no
   overrides): safe, and reported (``prepare`` says why; ``running`` raises the agent's degraded gauge).

An agent that cannot start at all (``running.run_agent``: its configuration invalid or missing, no pod
name...) still does 1 and writes ``desired.json`` with no overrides (``start_on_own_args``): whatever goes
wrong on the agent's side, the engine starts.

Then, at every change of the ConfigMap (and every ``poll`` seconds): a newer ``desired[<pod>].serial`` is
written to desired.json (generation + 1, the serial kept in the file), a new live request
(``desired[<pod>].live``: ``{"seq", "values"}``, the leader's ``acting.RelayedPlugin``) to the control
directory's ``control.json``, and the launcher's status.json, condensed, with what the plugin acknowledges
(``live``), is written to ``report.<pod>`` whenever it changed (a merge patch of that one key).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tuner.errors import SourceError
from tuner.kube import acting, reporting
from tuner.kube import store as store_mod
from tuner.kube.api import ApiError
from tuner.launcher import packaging
from tuner.model import knobs
from tuner.planning import guards
from tuner.portable import pod_protocol, untrusted
from tuner.rules.schema import Rule
from tuner.sources import live_knobs

log = logging.getLogger("tuner.kube.pod")

REPORTED = ("state", "ready", "ready_reason", "running_generation", "pid", "argv", "base_argv", "base_sha256",
            "overrides", "drain", "overrides_dropped", "overrides_refused", "desired_error", "planned_restarts",
            "last_relaunch")


def allow_list(rules: Sequence[Rule], *, kind: knobs.EngineKind,
               thermal: guards.ThermalSettings | None = None) -> pod_protocol.Allowed:
    """The flags the tuner may change on this engine, each within the widest bounds any enabled rule (or
    the thermal step-down) could take it to: the rule's ``min``/``max``, else the knob's hard range (a
    dynamic bound, ``max_from``, is not known here: the hard range stands in). Every spelling vLLM
    accepts for the flag is listed."""
    spans: dict[str, tuple[float | None, float | None]] = {}  # knob → (low, high), None: its hard bound

    def widen(knob: knobs.Knob, low: float | None, high: float | None) -> None:
        if knob.range is not None:
            low = knob.range.low if low is None else low
            high = knob.range.high if high is None else high
        if knob.name in spans:
            lo, hi = spans[knob.name]
            low = None if low is None or lo is None else min(low, lo)
            high = None if high is None or hi is None else max(high, hi)
        spans[knob.name] = (low, high)

    for rule in rules:
        if rule.enabled and kind in rule.engines:
            widen(rule.then.knob, rule.then.min, rule.then.max)
    if thermal is not None and thermal.step_down:
        widen(knobs.KNOBS["max_num_seqs"], thermal.step_down_min, None)
    flags: dict[str, pod_protocol.Bound] = {}
    sglang_chunking = kind == "sglang" and "chunked_prefill" in spans
    for name, (low, high) in spans.items():
        knob = knobs.KNOBS[name]
        flag = knob.flag(kind)
        if flag is None or (sglang_chunking and name == "chunked_prefill"):
            continue
        if knob.type == "bool":
            bound = pod_protocol.Bound("bool")
        else:
            low_open = knob.range is not None and knob.range.low_open and low == knob.range.low
            bound = pod_protocol.Bound(knob.type, low, high, low_open)
        for spelling in (flag, *(knob.aliases if kind == "vllm" else ())):
            flags[spelling] = bound
    if sglang_chunking:  # SGLang's chunked prefill: --chunked-prefill-size -1 (off), or the flag removed (on)
        flag = "--chunked-prefill-size"
        budget = flags.get(flag, pod_protocol.Bound("int"))
        flags[flag] = pod_protocol.Bound("int", budget.low, budget.high, also=("-1",), removable=True)
    return pod_protocol.Allowed(flags)


def condensed(status: Mapping[str, Any]) -> dict[str, Any]:
    """What the leader needs of status.json (no log lines, no timestamps that change every 5 s)."""
    out = {k: status.get(k) for k in REPORTED}
    out["launcher_generation"] = status.get("generation")
    failure = status.get("candidate_failure")
    out["candidate_failure"] = ({k: failure.get(k) for k in ("generation", "reason", "exit_code")}
                                if isinstance(failure, dict) else None)
    last_exit = status.get("last_exit")
    out["last_exit"] = ({k: last_exit.get(k) for k in ("code", "planned", "reason")}
                        if isinstance(last_exit, dict) else None)
    return out


OWN_ARGS: Mapping[str, Any] = {"serial": 0, "overrides": [], "base_sha256": None, "drain": False}
"""The desired state of an engine on its own command line (no overrides, not drained)."""


ZIPAPP_MAX_BYTES = 64 * 1024 * 1024  # launcher.pyz is ~40 KiB


def _read(path: Path) -> bytes | None:
    try:
        return untrusted.read_bytes(path, max_bytes=ZIPAPP_MAX_BYTES)
    except (OSError, untrusted.Untrusted):
        return None  # not ours as it is: replaced


def install_launcher(state_dir: Path, zipapp: Path | None) -> None:
    """``launcher.pyz`` into the shared directory, atomically (``zipapp``: the image's copy; else built
    from this package, reproducibly)."""
    target = state_dir / pod_protocol.ZIPAPP
    fd, tmp = tempfile.mkstemp(prefix=".launcher.", suffix=".pyz", dir=str(state_dir))
    os.close(fd)
    try:
        if zipapp is not None:
            Path(tmp).write_bytes(untrusted.read_bytes(zipapp, max_bytes=ZIPAPP_MAX_BYTES, follow_symlinks=True))
        else:
            packaging.build_zipapp(Path(tmp))
        if (old := _read(target)) is not None and old == _read(Path(tmp)):
            return
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_desired(state_dir: Path) -> pod_protocol.Desired | None:
    try:
        return pod_protocol.read_desired(state_dir / pod_protocol.DESIRED)
    except pod_protocol.ProtocolError as exc:
        log.warning("desired.json is unreadable (%s): writing it again", exc)
        return None


def start_on_own_args(state_dir: Path, *, zipapp: Path | None) -> str:
    """What any start-up problem of the agent leaves: ``launcher.pyz`` and, unless a readable desired.json is
    there already (a restarted agent: the engine keeps what it was asked for), one with no overrides. The
    launcher then starts the engine's own command line. Says what it did."""
    state_dir.mkdir(parents=True, exist_ok=True)
    install_launcher(state_dir, zipapp)
    existing = read_desired(state_dir)
    if existing is not None:
        return f"desired.json generation {existing.generation} is kept"
    pod_protocol.write_json(state_dir / pod_protocol.DESIRED, {**pod_protocol.Desired(1).document(), "serial": 0})
    return "desired.json written with no overrides: the engine starts on its own command line"


class PodAgent:
    def __init__(self, store: store_mod.PoolStore, *, pod: str, state_dir: Path, zipapp: Path | None = None,
                 allowed: pod_protocol.Allowed | None = None, live: bool = False) -> None:
        self.store, self.pod, self.state_dir, self.zipapp = store, pod, Path(state_dir), zipapp
        self.allowed = allowed  # written at start-up, before desired.json
        # live knobs: the plugin's control directory in the shared emptyDir, and the last request carried there
        self.control = live_knobs.Files(self.state_dir / pod_protocol.CONTROL_DIR) if live else None
        self.live_seq: int | None = None
        self.serial = 0  # the last desired serial carried out
        self.generation = 0  # the last desired.json generation written
        self._reported: dict[str, Any] | None = None
        self.reports = 0

    # --- start-up ------------------------------------------------------------------------------------

    def prepare(self, *, startup_timeout: float = 15.0, stop: threading.Event | None = None) -> str | None:
        """The start-up (module docstring). None when the engine starts on what the pool says; else why it
        starts on its own command line."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        install_launcher(self.state_dir, self.zipapp)
        if self.allowed is not None:  # before desired.json: the launcher reads it before its first start
            pod_protocol.write_allowed(self.state_dir, self.allowed)
        if self.control is not None:  # before desired.json too: the engine finds it when it starts
            try:
                live_knobs.prepare_control_dir(self.control.control_dir,
                                               group=live_knobs.shared_group(self.state_dir))
                self.live_seq = live_knobs.request_seq(self.control.control_dir)  # a restarted agent's
            except SourceError as exc:
                log.warning("no live knobs: %s", exc)
        existing = self._read_desired()
        if existing is not None:
            self.generation = existing.generation
            serial = existing.extra.get("serial")
            self.serial = serial if isinstance(serial, int) else 0
            log.info("desired.json generation %d is in place (a restarted agent keeps it)", self.generation)
            return None
        stop = stop or threading.Event()
        deadline = time.monotonic() + startup_timeout
        data: Mapping[str, str] | None = None
        while data is None:
            try:
                data = self.store.refresh()
            except ApiError as exc:
                hopeless = exc.code in (401, 403, 404)  # no token, no permission, no ConfigMap: waiting cannot help
                if hopeless or time.monotonic() > deadline or stop.is_set():
                    self._write(OWN_ARGS)
                    return f"the pool's ConfigMap is not readable ({exc})"  # said by the caller, once
                log.warning("reading the pool's ConfigMap: %s; again in 2s", exc)
                stop.wait(2.0)
        entry = acting.desired_of(data).get(self.pod)
        if entry is not None:
            self._write(entry)
            return None
        pool = store_mod.loads(data, "pool", {})
        pool = pool if isinstance(pool, dict) else {}
        self._write({"serial": 0, "overrides": pool.get("overrides") or [], "base_sha256": pool.get("base_sha256"),
                     "drain": False})
        log.info("the engine starts on the pool's verified arguments: %s", pool.get("overrides") or "its own")
        return None

    def _read_desired(self) -> pod_protocol.Desired | None:
        return read_desired(self.state_dir)

    def _write(self, entry: Mapping[str, Any]) -> None:
        overrides = [tuple(o) for o in entry.get("overrides") or []]
        base = entry.get("base_sha256") if overrides else None
        generation = self.generation + 1
        desired = pod_protocol.parse_desired(json.dumps(pod_protocol.Desired(
            generation, tuple((str(f), v) for f, v in overrides), base, bool(entry.get("drain"))).document()))
        pod_protocol.write_json(self.state_dir / pod_protocol.DESIRED, {**desired.document(), "serial": int(entry.get("serial") or 0)})
        self.generation, self.serial = generation, int(entry.get("serial") or 0)
        log.info("desired.json generation %d (request %d): %d override(s), drain=%s", generation, self.serial,
                 len(overrides), desired.drain)

    # --- the loop ------------------------------------------------------------------------------------

    def step(self) -> None:
        """Carry out a newer desired state; report the launcher's status when it changed."""
        entry = acting.desired_of(self.store.data).get(self.pod)
        if entry is not None and int(entry.get("serial") or 0) > self.serial:
            self._write(entry)
        if entry is not None and self.control is not None:
            self._carry_live(entry.get("live"))
        status = pod_protocol.read_status(self.state_dir)
        if status is None:
            return
        report = {**condensed(status), "serial": self.serial, "generation": self.generation}
        if self.control is not None:
            report["live"] = self.control.read().as_dict()
        if report != self._reported:
            self.store.report(self.pod, {**report, "at": round(time.time(), 3)})
            self._reported = report
            self.reports += 1

    def _carry_live(self, request: Any) -> None:
        """A live request of the leader not carried out yet → ``control.json`` (once per ``seq``)."""
        if not isinstance(request, dict) or not isinstance(request.get("values"), dict):
            return
        seq = request.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq == self.live_seq:
            return
        assert self.control is not None
        why = self.control.request(seq, request["values"])
        self.live_seq = seq  # a refused request is not retried: the leader sees it unanswered and decides
        if why is not None:
            log.warning("live request %d not handed to the engine: %s", seq, why)
        else:
            log.info("live request %d: %s", seq, request["values"])

    def run(self, stop: threading.Event, *, poll: float = 0.5, reporter: reporting.Reporter | None = None) -> None:
        rv = None
        while not stop.is_set():
            try:
                self.step()
                if reporter is not None and self.store.resource_version is not None:
                    reporter.resolved("api")  # the ConfigMap answers: a start-up without it is behind us
            except ApiError as exc:
                log.warning("reporting %s's status: %s", self.pod, exc)
                self._reported = None  # report again
            except Exception:  # the pod's loop must outlive any surprise
                log.exception("the pod's loop failed")
            if reporter is not None:
                reporter.flush()
            rv = self.store.wait_change(rv, poll)
