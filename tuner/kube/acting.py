"""The leader's hands on Kubernetes: an ``Actuator`` and a ``Drainer`` (``tuner.actuators.base``) over the
pool's ConfigMap. They never touch a pod: they write the pod's desired state into the ConfigMap, and the
pod's own agent carries it out through its launcher (desired.json) and reports back (``report.<pod>``).

=============  ==================================================================================
contract       on Kubernetes
=============  ==================================================================================
``status``     the pod's agent's report: its launcher's state (starting, serving, draining, stopping →
               running; candidate-failed → failed; exited → stopped) and the command line it runs
``start``      desired overrides for the pod (the new command line as ``[flag, value]`` pairs on the pod's
               base command line); returns once the launcher runs (or failed to start) that generation.
               The launcher stops the old engine first: a *planned relaunch*, so ``stop`` has nothing to
               do on its own
``stop``       nothing (the relaunch at ``start`` stops the engine, SIGTERM → every process gone)
``adopt``      nothing to start: the pod runs what its launcher runs
``drain``      desired ``drain: true`` → the launcher's /readyz turns 503 → the kubelet marks the pod not
               Ready (seen in the API) → ``drain_grace_seconds`` for endpoints and routers to follow
``undrain``    desired ``drain: false``; returns once the launcher is ready again
=============  ==================================================================================

``Admission`` is the API server's view before each restart (machine Rule 2 holds over the rollout's own):
the pool's Ready pods, ``max_unavailable``, and the PodDisruptionBudget's ``disruptionsAllowed``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from tuner import config
from tuner.actuators import base
from tuner.errors import PermanentActuatorError, TemporaryActuatorError
from tuner.kube import documents
from tuner.kube import store as store_mod
from tuner.kube.api import ApiError, KubeApi, PodView
from tuner.model import live
from tuner.portable import argv as argvs
from tuner.rollout import machine

log = logging.getLogger("tuner.kube.acting")

RUNNING_STATES = documents.RUNNING_STATES


def overrides_for(base_argv: Sequence[str], argv: Sequence[str]) -> list[tuple[str, argvs.Value]]:
    """``argv`` as ``[flag, value]`` overrides of ``base_argv`` (what desired.json carries): every flag whose
    value differs or that ``base_argv`` lacks, and ``None`` for every flag ``argv`` drops. Raises
    ``ValueError`` when ``argv`` is not ``base_argv`` with flags changed (a positional moved, say)."""
    base_items, items = argvs.parse(base_argv), argvs.parse(argv)
    out: list[tuple[str, argvs.Value]] = []
    for item in items:
        if item.key is None or item in base_items:
            continue
        assert item.flag is not None
        if item.form == "bare":
            negated = item.key.startswith("--no-")
            out.append((("--" + item.key[5:]) if negated else item.key, not negated))
        else:
            out.append((item.flag, item.value))
    keys = {i.key for i in items if i.key is not None}
    for item in base_items:
        if item.key is not None and item.key not in keys and item.flag is not None:
            plain = "--" + item.key[5:] if item.key.startswith("--no-") else item.key
            if plain not in keys and "--no-" + plain[2:] not in keys:
                out.append((item.flag, None))
    if argvs.apply(base_argv, out) != list(argv):
        raise ValueError(f"{' '.join(argv)} is not the base command line with flags changed")
    return out


def report_of(data: Mapping[str, str], pod: str) -> dict[str, Any] | None:
    doc = store_mod.loads(data, store_mod.REPORT_PREFIX + pod, None)
    return doc if isinstance(doc, dict) else None


desired_of = documents.desired_of


def carried_out(report: Mapping[str, Any], serial: int) -> bool:
    """The agent wrote desired.json for ``serial`` (or a later one) and its launcher accepted it."""
    gen = report.get("generation")
    return int(report.get("serial") or 0) >= serial and gen is not None and report.get("launcher_generation") == gen


class PoolActions:
    """What the actuator and the drainer share: the ConfigMap, the leader's epoch, the pods of this cycle."""

    def __init__(self, store: store_mod.PoolStore, api: KubeApi, settings: config.KubernetesSettings, *,
                 epoch: int, leader: str, replicas: Sequence[base.Replica], stop: threading.Event | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store, self.api, self.settings = store, api, settings
        self.epoch, self.leader = epoch, leader
        self.replicas = {r.name: r for r in replicas}
        self.stop_event = stop or threading.Event()
        self._mono = monotonic

    def check(self, name: str) -> None:
        if name not in self.replicas:
            raise PermanentActuatorError(f"kubernetes: no pod named {name!r} in the pool "
                                         f"(pods: {', '.join(sorted(self.replicas)) or 'none'})")

    def report(self, name: str) -> dict[str, Any] | None:
        return report_of(self.store.data, name)

    def request(self, name: str, *, overrides: Sequence[tuple[str, argvs.Value]] | None = None,
                base_sha256: str | None = None, drain: bool | None = None) -> int:
        """Set the pod's desired state (what is not given stays); the serial the agent must carry out.
        Unchanged: no write, the current serial."""
        out: dict[str, int] = {}

        def change(data: dict[str, str]) -> dict[str, str] | None:
            desired = desired_of(data)
            report = report_of(data, name) or {}
            # No entry (a new pod, or the key deleted by hand): what the pod reports, its serial included —
            # a request under a serial the agent has passed already would be ignored, yet look carried out.
            reported = report.get("serial")
            now = desired.get(name) or {"serial": reported if isinstance(reported, int) and reported > 0 else 0,
                                        "overrides": report.get("overrides") or [],
                                        "base_sha256": report.get("base_sha256"), "drain": bool(report.get("drain"))}
            new = dict(now)
            if overrides is not None:
                new["overrides"] = [list(o) for o in overrides]
                new["base_sha256"] = base_sha256
            if drain is not None:
                new["drain"] = drain
            if name in desired and new == now:
                out["serial"] = int(now["serial"])
                return None
            new["serial"] = int(now.get("serial") or 0) + 1
            out["serial"] = new["serial"]
            desired = {k: v for k, v in desired.items() if k in self.replicas or k == name}
            desired[name] = new
            return {**data, "desired": store_mod.dumps(desired)}

        try:
            self.store.update(change, epoch=self.epoch, leader=self.leader)
        except ApiError as exc:
            raise TemporaryActuatorError(f"{name}: {exc}", delay=2.0) from exc
        return out["serial"]

    def request_live(self, name: str, *, seq: int, values: Mapping[str, int | None]) -> str | None:
        """Live request ``seq`` for the pod's engine-side plugin (``desired[name].live``, carried into the
        pod's control directory by its agent); None once written, else why not. Not a new serial: nothing
        is relaunched or drained."""
        def change(data: dict[str, str]) -> dict[str, str] | None:
            desired = desired_of(data)
            report = report_of(data, name) or {}
            now = desired.get(name) or {"serial": 0, "overrides": report.get("overrides") or [],
                                        "base_sha256": report.get("base_sha256"), "drain": bool(report.get("drain"))}
            new = {**now, "live": {"seq": seq, "values": dict(values)}}
            if new == now:
                return None
            return {**data, "desired": store_mod.dumps({**desired, name: new})}

        try:
            self.store.update(change, epoch=self.epoch, leader=self.leader)
        except ApiError as exc:
            return f"{name}: {exc}"
        return None

    def wait_report(self, name: str, ok: Callable[[Mapping[str, Any]], bool], what: str, *,
                    timeout: float | None = None,
                    fail: Callable[[Mapping[str, Any]], str | None] | None = None) -> Mapping[str, Any]:
        """Until the pod's report satisfies ``ok``; ``fail`` may say why waiting is pointless."""
        timeout = self.settings.report_timeout_seconds if timeout is None else timeout
        deadline = self._mono() + timeout
        while True:
            rv = self.store.resource_version
            report = self.report(name) or {}
            if ok(report):
                return report
            why = fail(report) if fail is not None else None
            if why:
                raise PermanentActuatorError(f"{name}: {why}")
            left = deadline - self._mono()
            if left <= 0 or self.stop_event.is_set():
                raise TemporaryActuatorError(f"{name}: {what} not reported by its agent within {timeout:g}s "
                                             f"(launcher: {report.get('state', 'no report')})", delay=2.0)
            self.store.wait_change(rv, min(left, 1.0))


class RelayedPlugin:
    """``live_knobs.Channel`` to a pod's engine-side plugin through its agent: the leader cannot reach a
    pod's files, its agent can. A request goes into ``desired[pod].live`` (fenced, as every leader write);
    the agent writes it to the control directory in the pod's emptyDir and reports what the plugin
    acknowledges in ``report.<pod>.live``."""

    def __init__(self, pool: PoolActions, name: str) -> None:
        self.pool, self.name = pool, name

    def read(self) -> live.LiveState:
        report = self.pool.report(self.name)
        if report is None:
            return live.LiveState(why_not="no report from the pod's agent yet")
        if "live" not in report:
            return live.LiveState(why_not="the pod's agent reports no live knobs (live.enabled in its configuration)")
        return live.LiveState.from_dict(report["live"])

    def request(self, seq: int, values: Mapping[str, int | None]) -> str | None:
        return self.pool.request_live(self.name, seq=seq, values=values)


class KubeActuator:
    """``base.Actuator`` over the pods' launchers (module docstring)."""

    def __init__(self, pool: PoolActions) -> None:
        self.pool = pool

    def replicas(self) -> Sequence[base.Replica]:
        return list(self.pool.replicas.values())

    def status(self, name: str) -> base.ReplicaStatus:
        self.pool.check(name)
        report = self.pool.report(name)
        if report is None:
            return base.ReplicaStatus(name, base.State.UNKNOWN, detail="no report from the pod's agent yet")
        state = str(report.get("state"))
        argv = report.get("argv")
        detail = f"launcher {state}: {report.get('ready_reason', '')}"
        if state in RUNNING_STATES:
            return base.ReplicaStatus(name, base.State.RUNNING, pid=report.get("pid"),
                                      argv=tuple(argv) if isinstance(argv, list) else None, detail=detail)
        if state == "candidate-failed":
            failure = report.get("candidate_failure") or {}
            return base.ReplicaStatus(name, base.State.FAILED, detail=f"the launcher's candidate failed: "
                                                                      f"{failure.get('reason', '?')}")
        return base.ReplicaStatus(name, base.State.STOPPED, detail=detail)

    def adopt(self, name: str, argv: Sequence[str]) -> base.ReplicaStatus:
        return self.status(name)

    def stop(self, name: str, *, timeout_seconds: float, force_after_seconds: float | None = None) -> base.ReplicaStatus:
        self.pool.check(name)
        status = self.status(name)
        return base.ReplicaStatus(name, base.State.STOPPED, pid=status.pid, argv=status.argv,
                                  detail="the launcher stops the engine when it relaunches it (start)")

    def start(self, name: str, argv: Sequence[str]) -> None:
        self.pool.check(name)
        report = self.pool.report(name)
        if report is None or not isinstance(report.get("base_argv"), list):
            raise TemporaryActuatorError(f"{name}: no report from the pod's agent yet", delay=2.0)
        try:
            overrides = overrides_for(report["base_argv"], argv)
        except ValueError as exc:
            raise PermanentActuatorError(f"{name}: {exc}") from exc
        serial = self.pool.request(name, overrides=overrides, base_sha256=report.get("base_sha256"))
        wanted = list(argv)

        def started(r: Mapping[str, Any]) -> bool:
            if not carried_out(r, serial):
                return False
            if r.get("state") == "candidate-failed":
                return True  # status() says failed; the driver sees it at the health wait
            return r.get("running_generation") == r.get("generation") and r.get("argv") == wanted

        def dropped(r: Mapping[str, Any]) -> str | None:
            if carried_out(r, serial) and r.get("overrides_dropped"):
                return f"the launcher dropped the overrides: {r['overrides_dropped']}"
            if carried_out(r, serial) and r.get("overrides_refused"):  # not an allowed flag, or out of bounds
                return f"the launcher refused the overrides: {r['overrides_refused']}"
            return None

        # The old engine stops first (its --shutdown-timeout at most), then the new one is spawned.
        self.pool.wait_report(name, started, f"the relaunch for request {serial}", fail=dropped,
                              timeout=self.pool.settings.report_timeout_seconds
                              + self.pool.settings.shutdown_timeout_seconds + 30)


class KubeDrainer:
    """``base.Drainer``: a pod is drained when its engine container is not ready (the launcher's /readyz)."""

    def __init__(self, pool: PoolActions, *, sleep: Callable[[float], None] | None = None) -> None:
        self.pool = pool
        self._sleep = sleep or (lambda s: self.pool.stop_event.wait(s))

    def drain(self, name: str) -> None:
        self.pool.check(name)
        serial = self.pool.request(name, drain=True)
        self.pool.wait_report(name, lambda r: carried_out(r, serial) and r.get("ready") is False,
                              f"drain (request {serial})")
        self._wait_pod_ready(name, False)
        if self.pool.settings.drain_grace_seconds:
            self._sleep(self.pool.settings.drain_grace_seconds)

    def undrain(self, name: str) -> None:
        self.pool.check(name)
        serial = self.pool.request(name, drain=False)
        self.pool.wait_report(name, lambda r: carried_out(r, serial) and r.get("ready") is True,
                              f"undrain (request {serial})")

    def _wait_pod_ready(self, name: str, ready: bool) -> None:
        """Until the API server shows the pod's Ready condition as ``ready`` (the kubelet's probe saw it);
        a pod already gone is not routed to either."""
        deadline = time.monotonic() + self.pool.settings.report_timeout_seconds
        while True:
            try:
                pod = self.pool.api.get_pod(name)
            except ApiError as exc:
                if exc.code == 404:
                    return
                pod = None
                log.warning("%s: %s", name, exc)
            if pod is not None and pod.ready is ready:
                return
            if time.monotonic() > deadline or self.pool.stop_event.is_set():
                raise TemporaryActuatorError(f"{name}: the API server does not show the pod "
                                             f"{'Ready' if ready else 'not Ready'} yet", delay=2.0)
            self.pool.stop_event.wait(0.5)


class DisruptionCheck:
    """The API server's view before a replica is drained (driver hook): a reason to hold, or None."""

    def __init__(self, api: KubeApi, settings: config.KubernetesSettings, *, allow_downtime: bool = False) -> None:
        self.api, self.settings, self.allow_downtime = api, settings, allow_downtime
        self._pdb_warned = False

    def __call__(self, rollout: machine.Rollout, candidate: str) -> str | None:
        try:
            pods = [p for p in self.api.list_pods() if not p.deleting]
        except ApiError as exc:
            return f"{candidate} waits: cannot list the pool's pods ({exc})"
        ready = {p.name for p in pods if p.ready}
        unavailable = ({p.name for p in pods} - ready) | {candidate}
        if len(unavailable) > self.settings.max_unavailable:
            busy = sorted(unavailable - {candidate})
            return (f"{candidate} waits: the API server shows {', '.join(busy)} not Ready "
                    f"(kubernetes.max_unavailable={self.settings.max_unavailable})")
        if not (ready - {candidate}) and not self.allow_downtime:
            return f"{candidate} waits: no other pod of the pool is Ready in the API server"
        try:
            allowed = self.api.disruptions_allowed()
        except ApiError as exc:
            if exc.code in (403, 404):
                if not self._pdb_warned:
                    log.warning("the PodDisruptionBudget is not readable (%s): rollouts go on without it", exc)
                    self._pdb_warned = True
                return None
            return f"{candidate} waits: cannot read the PodDisruptionBudget ({exc})"
        if allowed is not None and allowed < 1 and candidate in ready:
            return (f"{candidate} waits: the PodDisruptionBudget {self.settings.pod_disruption_budget} allows no "
                    "disruption now")
        return None


def departed(api: KubeApi, *, every_seconds: float = 2.0,
             monotonic: Callable[[], float] = time.monotonic) -> Callable[[Collection[str]], set[str]]:
    """The driver hook: which of the given replicas have no pod any more (or one being deleted). The pods
    are listed at most every ``every_seconds`` (the driver asks at every poll); when they cannot be
    listed, nobody is taken for gone."""
    seen: dict[str, Any] = {"at": None, "live": None}

    def gone(names: Collection[str]) -> set[str]:
        now = monotonic()
        if seen["at"] is None or now - seen["at"] >= every_seconds:
            try:
                seen["live"] = {p.name for p in api.list_pods() if not p.deleting}
                seen["at"] = now
            except ApiError as exc:
                log.warning("listing the pool's pods: %s", exc)
        return set() if seen["live"] is None else set(names) - seen["live"]

    return gone


def replica_of(pod: PodView, settings: config.KubernetesSettings) -> base.Replica:
    host = f"[{pod.ip}]" if pod.ip and ":" in pod.ip else pod.ip
    return base.Replica(pod.name, f"{settings.engine_scheme}://{host}:{settings.engine_port}")
