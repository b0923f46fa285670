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
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
from pathlib import Path

from tuner import config
from tuner.daemon import collecting, selfmetrics
from tuner.daemon.httpserver import TunerHttpServer
from tuner.errors import ConfigError
from tuner.kube import electing, leading, podside
from tuner.kube import store as store_mod
from tuner.kube.api import KubeApi
from tuner.rules import loading
from tuner.sources import engines

log = logging.getLogger("tuner.kube")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def namespace_of(settings: config.KubernetesSettings) -> str:
    if settings.namespace:
        return settings.namespace
    env = os.environ.get("POD_NAMESPACE")
    if env:
        return env
    try:
        return Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip()
    except OSError:
        raise ConfigError("<kubernetes>", [("kubernetes.namespace", "not given, $POD_NAMESPACE is not set and the "
                                            "service account's namespace file is missing")]) from None


def run_agent(config_path: str, *, state_dir: str | None = None, pod: str | None = None,
              stop: threading.Event | None = None, startup_timeout: float = 120.0, prepare_only: bool = False) -> int:
    settings = config.load(config_path)
    k = settings.kubernetes
    if k is None:
        raise ConfigError(config_path, [("kubernetes", "`vllm-tuner agent` needs a `kubernetes:` section "
                                         "(docs/kubernetes.md), e.g. kubernetes: {pool: vllm, selector: "
                                         "{matchLabels: {vllm-tuner.io/pool: vllm}}, lease: vllm-tuner-vllm, "
                                         "journal_configmap: vllm-tuner-journal-vllm}")])
    pod = pod or os.environ.get("POD_NAME")
    if not pod:
        raise ConfigError(config_path, [("POD_NAME", "the agent needs its pod's name: --pod or $POD_NAME (the "
                                         "component sets it from the downward API)")])
    config_dir = Path(config_path).resolve().parent
    rules = loading.load_all(loading.rule_paths(settings.rule_files, base_dir=config_dir))
    namespace = namespace_of(k)
    identity = f"{pod}_{uuid.uuid4().hex[:8]}"
    api = KubeApi(k, namespace=namespace)
    store = store_mod.PoolStore(api)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    log.info("agent %s of pool %s in %s (mode %s)", identity, k.pool, namespace, settings.mode)

    # The image's own copy of the launcher (deploy/docker/Dockerfile), else one built from this package.
    shipped = os.environ.get("VLLM_TUNER_LAUNCHER_ZIPAPP")
    zipapp = Path(shipped) if shipped and Path(shipped).is_file() else None
    allowed = podside.allow_list(tuple(rules), kind=k.engine_kind, thermal=settings.decisions.thermal)
    agent = podside.PodAgent(store, pod=pod, state_dir=Path(state_dir or k.state_dir), zipapp=zipapp, allowed=allowed)
    agent.prepare(startup_timeout=startup_timeout, stop=stop)
    if prepare_only:  # an init container's job where native sidecars are not available (Kubernetes < 1.29)
        api.close()
        return 0
    threads = [threading.Thread(target=store.watch, args=(stop,), name="watch", daemon=True),
               threading.Thread(target=agent.run, args=(stop,), name="pod", daemon=True)]

    lead_stop = threading.Event()
    changed = threading.Event()

    def on_change(leadership: electing.Leadership | None) -> None:
        if leadership is None:
            lead_stop.set()
        changed.set()

    elector = electing.Elector(api, identity, lease_seconds=k.lease_duration_seconds,
                               renew_deadline_seconds=k.renew_deadline_seconds, retry_seconds=k.retry_period_seconds,
                               on_change=on_change)
    threads.append(threading.Thread(target=elector.run, args=(stop,), name="election", daemon=True))
    for t in threads:
        t.start()

    http = collecting.http_settings(settings.scrape, config_dir=config_dir)
    client = engines.EngineClient(http, deadline_seconds=settings.scrape.deadline_seconds)
    metrics = selfmetrics.TunerMetrics()
    leader = leading.Leader(settings, api=api, store=store, identity=identity, rules=tuple(rules), client=client,
                            metrics=metrics)
    # /metrics, /status, /recommendations: the leader's cycles (a follower has none; it is healthy while it runs)
    server = TunerHttpServer(metrics=metrics, state=leader.state, is_alive=lambda: not stop.is_set(),
                             is_busy=lambda: not elector.is_leader(),
                             max_age_seconds=settings.daemon.health_max_age_seconds or 3 * settings.scrape.interval_seconds,
                             host=settings.daemon.listen_host, port=settings.daemon.listen_port).start()

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
                leader.lead(leadership, lead_stop)
            except Exception:  # the pod's loop and the election go on; the next leadership starts afresh
                log.exception("leading the pool failed")
                stop.wait(k.retry_period_seconds)
    finally:
        stop.set()
        server.close()
        for t in threads:
            t.join(timeout=k.request_timeout_seconds + 5)
        client.close()
        api.close()
    log.info("agent %s stopped", identity)
    return 0
