"""``vllm-tuner agent``: the composition root of the Kubernetes agent (one per pod, a native sidecar).

Threads, each with one job:

- **watch**: the pool's ConfigMap, cached (``store.PoolStore.watch``);
- **election**: the Lease, tried or renewed every ``retry_period_seconds`` (``electing.Elector``);
- **pod**: this pod's desired state → desired.json, status.json → the ConfigMap (``podside.PodAgent``);
- **main**: while this agent leads, the pool's cycles (``leading.Leader``); a lost leadership stops the
  leader's work at its next step (and its writes are refused by the ConfigMap's epoch anyway).

SIGTERM (the pod is stopping): the leader stops between two steps of its rollout (the journal keeps the
rest for the next leader) and releases the Lease; the pod loop stops. The engine keeps running until
the kubelet stops its container.

**Fail open.** No start-up problem of the agent keeps the engine from starting or serving: a
configuration that is missing or does not validate, no pod name or namespace, no way to reach the API
server, a state directory it cannot write. The agent then still installs ``launcher.pyz`` and writes
``desired.json`` with no overrides (``podside.start_on_own_args``), so the startupProbe passes and the
engine starts on its own command line; it stays up **degraded**: the problem in its log, on ``/metrics``
(``tuner_agent_degraded{reason}``) and as an Event on its pod where the API server can be reached. It
reads its configuration again every ``RECHECK_SECONDS`` and starts properly once the file changed. A
ConfigMap it cannot read at start-up (``podside.PodAgent.prepare``) is the same, and clears once the API
server answers.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner import config
from tuner.errors import ConfigError, TunerError
from tuner.kube import electing, leading, podside, reporting
from tuner.kube import store as store_mod
from tuner.kube.api import KubeApi
from tuner.portable import untrusted
from tuner.rules import loading
from tuner.rules.schema import Rule
from tuner.runtime import clocks, collecting, selfmetrics
from tuner.runtime.httpserver import DEFAULT_HOST, DEFAULT_PORT, TunerHttpServer
from tuner.runtime.state import TunerState
from tuner.sources import engines

log = logging.getLogger("tuner.kube")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_STATE_DIR = "/var/run/vllm-tuner"
RECHECK_SECONDS = 10.0  # a degraded agent reads its configuration again this often


class StartupProblem(TunerError):
    """The agent cannot start as configured; ``reason`` is the metric label (a short word)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason, self.message = reason, message
        super().__init__(message)


@dataclass(frozen=True)
class Wiring:
    """What a start-up that succeeded has: everything the agent's threads are built from."""

    settings: config.TunerSettings
    k: config.KubernetesSettings
    config_dir: Path
    rules: tuple[Rule, ...]
    pod: str
    namespace: str
    api: KubeApi


def namespace_of(settings: config.KubernetesSettings) -> str:
    if settings.namespace:
        return settings.namespace
    env = os.environ.get("POD_NAMESPACE")
    if env:
        return env
    try:
        return untrusted.read_bytes(SERVICE_ACCOUNT_NAMESPACE, max_bytes=256, follow_symlinks=True).decode().strip()
    except (OSError, ValueError):
        raise ConfigError("<kubernetes>", [("kubernetes.namespace", "not given, $POD_NAMESPACE is not set and the "
                                            "service account's namespace file is missing")]) from None


def start_up(config_path: str, *, pod: str | None) -> Wiring:
    """The configuration, the rules, the pod's name and namespace, the API client: ``StartupProblem`` naming
    the first that fails."""
    def problem(reason: str, exc: Exception) -> StartupProblem:
        if isinstance(exc, ConfigError):  # one line: FILE: WHERE: WHAT; WHERE: WHAT
            text = f"{exc.file}: " + "; ".join(f"{where + ': ' if where else ''}{' '.join(what.split())}"
                                               for where, what in exc.problems)
        else:
            text = " ".join(str(exc).split()) if isinstance(exc, TunerError) else f"{type(exc).__name__}: {exc}"
        return StartupProblem(reason, text)

    try:
        settings = config.load(config_path)
        k = settings.kubernetes
        if k is None:
            raise ConfigError(config_path, [("kubernetes", "`vllm-tuner agent` needs a `kubernetes:` section "
                                             "(docs/kubernetes.md), e.g. kubernetes: {pool: vllm, selector: "
                                             "{matchLabels: {vllm-tuner.io/pool: vllm}}, lease: vllm-tuner-vllm, "
                                             "journal_configmap: vllm-tuner-journal-vllm}")])
        config_dir = Path(config_path).resolve().parent
        rules = tuple(loading.load_all(loading.rule_paths(settings.rule_files, base_dir=config_dir)))
    except (TunerError, OSError, ValueError) as exc:
        raise problem("config", exc) from exc
    try:
        pod = pod or os.environ.get("POD_NAME")
        if not pod:
            raise ConfigError(config_path, [("POD_NAME", "the agent needs its pod's name: --pod or $POD_NAME (the "
                                             "component sets it from the downward API)")])
        namespace = namespace_of(k)
    except TunerError as exc:
        raise problem("identity", exc) from exc
    try:
        api = KubeApi(k, namespace=namespace)
    except (TunerError, OSError, ValueError) as exc:
        raise problem("api-config", exc) from exc
    return Wiring(settings, k, config_dir, rules, pod, namespace, api)


def run_agent(config_path: str, *, state_dir: str | None = None, pod: str | None = None,
              stop: threading.Event | None = None, startup_timeout: float = 15.0, prepare_only: bool = False) -> int:
    """The agent until SIGTERM (or ``stop``); 0. A start-up problem never ends it (module docstring)."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        seen = _fingerprint(config_path)
        try:
            wiring = start_up(config_path, pod=pod)
        except StartupProblem as exc:
            degraded(config_path, exc, state_dir=state_dir, pod=pod, stop=stop, prepare_only=prepare_only,
                     seen=seen)
            if prepare_only:
                return 0
            continue  # the configuration changed (or we are stopping): start again
        return _run(wiring, state_dir=state_dir, stop=stop, startup_timeout=startup_timeout, prepare_only=prepare_only)
    return 0


def _run(w: Wiring, *, state_dir: str | None, stop: threading.Event, startup_timeout: float,
         prepare_only: bool) -> int:
    settings, k, api = w.settings, w.k, w.api
    identity = f"{w.pod}_{uuid.uuid4().hex[:8]}"
    store = store_mod.PoolStore(api)
    log.info("agent %s of pool %s in %s (mode %s)", identity, k.pool, w.namespace, settings.mode)
    metrics = selfmetrics.TunerMetrics()
    agent_metrics = reporting.AgentMetrics(metrics.registry)
    reporter = reporting.Reporter(agent_metrics, pod=w.pod, api=api, pod_uid=os.environ.get("POD_UID"))

    # The image's own copy of the launcher (deploy/docker/Dockerfile), else one built from this package.
    allowed = podside.allow_list(w.rules, kind=k.engine_kind, thermal=settings.decisions.thermal)
    agent = podside.PodAgent(store, pod=w.pod, state_dir=Path(state_dir or k.state_dir), zipapp=shipped_zipapp(),
                             allowed=allowed, live=settings.live.enabled)
    try:
        unread = agent.prepare(startup_timeout=startup_timeout, stop=stop)
    except OSError as exc:  # the state directory: nothing the engine could start from was written
        reporter.problem("state-dir", f"cannot prepare {agent.state_dir}: {exc.strerror or exc}")
        unread = None
    if unread is not None:
        reporter.problem("api", f"{unread}: the engine starts on its own command line")
    if prepare_only:  # an init container's job where native sidecars are not available (Kubernetes < 1.29)
        reporter.flush()
        api.close()
        return 0
    threads = [threading.Thread(target=store.watch, args=(stop,), name="watch", daemon=True),
               threading.Thread(target=agent.run, args=(stop,), kwargs={"reporter": reporter}, name="pod",
                                daemon=True)]

    lead_stop = threading.Event()
    changed = threading.Event()

    def on_change(leadership: electing.Leadership | None) -> None:
        if leadership is None:
            lead_stop.set()
        changed.set()

    elector = electing.Elector(api, identity, lease_seconds=k.lease_duration_seconds,
                               renew_deadline_seconds=k.renew_deadline_seconds, retry_seconds=k.retry_period_seconds,
                               on_change=on_change, metrics=metrics)
    threads.append(threading.Thread(target=elector.run, args=(stop,), name="election", daemon=True))
    for t in threads:
        t.start()

    http = collecting.http_settings(settings.scrape, config_dir=w.config_dir)
    loop_clock = clocks.LoopClock()  # the leader's cycles: monotonic, labelled with wall time (issue 28)
    client = engines.EngineClient(http, deadline_seconds=settings.scrape.deadline_seconds, clock=loop_clock.now)
    leader = leading.Leader(settings, api=api, store=store, identity=identity, rules=w.rules, client=client,
                            metrics=metrics, clock=loop_clock.now, loop_clock=loop_clock)
    agent_metrics.watch(reporting.Pool(
        is_leader=elector.is_leader, leader_epoch=lambda: (lambda ld: ld.epoch if ld else None)(elector.leadership),
        pool_epoch=lambda: store_mod.epoch_floor(store.data), refused_writes=lambda: store.refused,
        conflicts=lambda: store.conflicts))
    # /metrics, /status, /recommendations: the leader's cycles (a follower has none; it is healthy while it runs)
    server = TunerHttpServer(metrics=metrics, state=leader.state, is_alive=lambda: not stop.is_set(), clock=loop_clock.now,
                             is_busy=lambda: not elector.is_leader(),
                             max_age_seconds=settings.daemon.health_max_age_seconds or 3 * settings.scrape.interval_seconds,
                             host=settings.daemon.listen_host, port=settings.daemon.listen_port,
                             status_from_network=settings.daemon.status_from_network,
                             allowed_hosts=settings.daemon.allowed_hosts).start()

    def relay() -> None:
        stop.wait()
        lead_stop.set()
        changed.set()

    threading.Thread(target=relay, daemon=True).start()
    try:
        while not stop.is_set():
            leadership = elector.leadership
            if leadership is None:
                changed.wait(k.retry_period_seconds)
                changed.clear()
                continue
            lead_stop.clear()
            if elector.leadership is None:
                continue
            try:
                leader.lead(leadership, lead_stop, advance=elector.advance)
            except Exception:  # the pod's loop and the election go on; the next leadership starts afresh
                log.exception("leading the pool failed")
                stop.wait(k.retry_period_seconds)
    finally:
        stop.set()
        server.close()
        # The pod's loop and the election finish what they write (the pod's report, the Lease's release);
        # the watch only reads, and may sit in a long poll for up to its server timeout (30 s): it is not
        # waited for, and closing the client ends it (a daemon thread either way).
        for t in threads:
            t.join(timeout=0 if t.name == "watch" else k.request_timeout_seconds + 5)
        client.close()
        api.close()
    log.info("agent %s stopped", identity)
    return 0


def shipped_zipapp() -> Path | None:
    """The image's own copy of the launcher (deploy/docker/Dockerfile), if there is one."""
    shipped = os.environ.get("VLLM_TUNER_LAUNCHER_ZIPAPP")
    return Path(shipped) if shipped and Path(shipped).is_file() else None


# --- degraded: the agent could not start, the engine must --------------------------------------------------


def degraded(config_path: str, exc: StartupProblem, *, state_dir: str | None, pod: str | None,
             stop: threading.Event, prepare_only: bool, seen: str | None) -> None:
    """Fail open (module docstring): the engine starts on its own command line; the problem is said; until
    the configuration file changes (or SIGTERM)."""
    raw = _raw(config_path)
    directory = Path(state_dir or _picked(raw, ("kubernetes", "state_dir"), str)
                     or os.environ.get("VLLM_TUNER_STATE_DIR") or DEFAULT_STATE_DIR)
    pod = pod or os.environ.get("POD_NAME")
    metrics = selfmetrics.TunerMetrics()
    api = _salvaged_api(raw)
    reporter = reporting.Reporter(reporting.AgentMetrics(metrics.registry), pod=pod, api=api,
                                  pod_uid=os.environ.get("POD_UID"))
    reporter.problem(exc.reason, f"{exc.message}; the engine starts on its own command line")
    try:
        log.warning("%s", podside.start_on_own_args(directory, zipapp=shipped_zipapp()))
    except OSError as err:
        reporter.problem("state-dir", f"cannot write {directory}: {err.strerror or err}")
    server = None
    if not prepare_only:
        host = _picked(raw, ("daemon", "listen_host"), str) or DEFAULT_HOST
        port = _picked(raw, ("daemon", "listen_port"), int)
        try:
            # Healthy while it runs (max age unbounded): degraded is the agent doing its job (fail open,
            # the problem said), and its liveness probe must not restart it in a loop.
            server = TunerHttpServer(metrics=metrics, state=TunerState(targets={}, args={}, config_args={}),
                                     max_age_seconds=math.inf, host=host,
                                     port=DEFAULT_PORT if port is None else port,
                                     is_alive=lambda: not stop.is_set()).start()
            log.warning("degraded: /metrics on %s; the configuration is read again every %gs", server.url,
                        RECHECK_SECONDS)
        except OSError as err:
            log.error("degraded: no /metrics (%s:%s: %s)", host, port, err.strerror or err)
    try:
        reporter.flush()
        while not prepare_only and not stop.wait(RECHECK_SECONDS):
            reporter.flush()
            if _fingerprint(config_path) != seen:
                log.warning("%s changed: starting again", config_path)
                return
    finally:
        if server is not None:
            server.close()
        if api is not None:
            api.close()


def _fingerprint(path: str) -> str | None:
    try:
        return hashlib.sha256(untrusted.read_bytes(path, max_bytes=64 * 1024 * 1024, follow_symlinks=True)).hexdigest()
    except (OSError, ValueError):
        return None


def _raw(config_path: str) -> Any:
    """The configuration's data, unvalidated (None when unreadable): what a degraded agent salvages from it."""
    try:
        return loading.read_yaml(config_path, what="configuration file")
    except TunerError:
        return None


def _picked(raw: Any, keys: Sequence[str], kind: type) -> Any:
    value = raw
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


_PLACEHOLDERS = {"pool": "unknown", "selector": {"matchLabels": {"vllm-tuner.io/pool": "unknown"}},
                 "lease": "unknown", "journal_configmap": "unknown"}


def _salvaged_api(raw: Any) -> KubeApi | None:
    """An API client for Events from what the configuration's ``kubernetes:`` connection keys say (each
    checked alone: the rest of the file did not validate), else the in-cluster defaults. None when there is
    no API server to talk to."""
    picked: dict[str, Any] = {}
    section = raw.get("kubernetes") if isinstance(raw, dict) else None
    for key in ("api_server", "token_file", "ca_file", "namespace", "request_timeout_seconds"):
        if isinstance(section, dict) and key in section:
            try:
                config.KubernetesSettings.model_validate({**_PLACEHOLDERS, key: section[key]})
            except ValueError:
                continue
            picked[key] = section[key]
    try:
        k = config.KubernetesSettings.model_validate({**_PLACEHOLDERS, **picked})
        return KubeApi(k, namespace=namespace_of(k))
    except (TunerError, OSError, ValueError) as exc:
        log.warning("degraded: no Events (%s)", exc)
        return None
