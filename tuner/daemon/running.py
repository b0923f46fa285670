"""`vllm-tuner run`: the systemd root. Builds the engine client, the collectors, the dispatcher
(``runtime.dispatching``) and the loop (``runtime.scheduling``) from one configuration, tells systemd
(``notify``), then runs cycles until SIGTERM. It wires and applies; it decides nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tuner import config
from tuner.actuators import base
from tuner.actuators import settings as actuator_settings
from tuner.daemon import notify
from tuner.errors import PermanentActuatorError, SourceError, StorageError, TunerError
from tuner.model import secrets
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rules import loading
from tuner.runtime import (
    clocks,
    collecting,
    control,
    cycle,
    dispatching,
    drained,
    logs,
    results,
    scheduling,
    selfmetrics,
)
from tuner.runtime.httpserver import TunerHttpServer
from tuner.runtime.state import TunerState
from tuner.sources import engines, live_knobs

log = logging.getLogger("tuner.run")


def build_and_run(config_path: str, *, once: bool = False) -> int:
    settings = config.load(config_path)
    config_dir = Path(config_path).resolve().parent
    http = collecting.http_settings(settings.scrape, config_dir=config_dir)
    # Every secret the configuration holds is masked in whatever the tuner shows or stores from here on.
    redactor = settings.redactor(token=http.bearer_token)
    logs.redact(redactor)
    rules = loading.load_all(loading.rule_paths(settings.rule_files, base_dir=config_dir))
    log.info("effective configuration: %s", json.dumps(settings.redacted_dump(redactor)))
    loop_clock = clocks.LoopClock()  # every time inside the loop: monotonic, labelled with wall time
    client = engines.EngineClient(http, deadline_seconds=settings.scrape.deadline_seconds, clock=loop_clock.now)
    if settings.live.enabled:  # the engines' control directories, private to this uid
        for t in settings.targets:
            live_knobs.prepare_control_dir(settings.live.dir_for(t.name))
    collectors = [collecting.collector_for(t, settings, client=client, stamp=loop_clock.now) for t in settings.targets]
    state_path = Path(settings.daemon.state_file)
    state_path = state_path if state_path.is_absolute() else config_dir / state_path
    state = TunerState.load(state_path, settings.targets, redactor=redactor, now=loop_clock.now())
    state.started_at = loop_clock.now()
    metrics = selfmetrics.TunerMetrics()
    maintenance = (scheduling.MaintenanceWindows(settings.daemon.maintenance_windows,
                                                 timezone=settings.daemon.maintenance_timezone)
                   if settings.daemon.maintenance_windows else None)
    stop_event = threading.Event()
    notifier = _MaskedNotifier(redactor)
    gatherer = collecting.Gatherer(stop=stop_event, clock=loop_clock.now)  # SIGTERM ends a gathering at once
    control_path = control.path_for(settings, config_path)
    reloadable = [(settings, tuple(rules))]  # the configuration the cycles decide with; SIGHUP replaces it
    dispatcher: dispatching.Dispatcher | None = None
    startup: list[Callable[[], None]] = []  # run once, at the start of the first cycle (again until it succeeds)
    loop_holder: dict[str, scheduling.Loop] = {}

    if settings.mode == "apply":
        dispatcher = _build_dispatcher(settings, state, client, config_dir, stop_event=stop_event,
                                   on_transition=lambda r: _show_rollout(state, notifier, r, metrics),
                                   clock=loop_clock.now)
        startup.append(lambda: dispatching.start_up(dispatcher, state))

    watch = drained.LeftDrainedWatch(ask_after_seconds=settings.rollout.left_drained_ask_after_seconds,
                                     metrics=metrics)

    def step() -> results.CycleResult:
        loop = loop_holder.get("loop")
        should_stop = loop.should_stop if loop is not None else (lambda: False)
        while startup:
            startup[0]()  # a failure (a full disk) raises here and is tried again at the next cycle
            startup.pop(0)
        act = dispatcher if dispatcher is None or dispatching.resumed(dispatcher, state) else None
        running, rules_now = reloadable[0]  # what SIGHUP last loaded (one tuple: swapped at once)
        switches = control.load(control_path)  # the operator's pause and pins, read every cycle
        effective = running.model_copy(update={"decisions": control.take(running.decisions, switches, state=state,
                                                                         metrics=metrics)})
        result = cycle.run_cycle(state, settings=effective, collectors=collectors, rules=rules_now,
                                 dispatcher=act, maintenance=maintenance, metrics=metrics, gatherer=gatherer,
                                 should_stop=should_stop, clock=loop_clock)
        if dispatcher is not None:  # a replica a failed rollout left drained: shown, measured, a person asked
            state.left_drained = watch.check(dispatcher.journal.records, now=loop_clock.now())
        if dispatcher is not None and not should_stop():
            dispatching.tend(dispatcher, state, result, now=loop_clock.now())
        return result

    def between() -> None:  # the rollout in flight goes on between cycles
        if dispatcher is not None:
            dispatching.carry_on(dispatcher, state, metrics)

    if once:
        result = step()
        print(result.summary)
        while dispatcher is not None and dispatcher.busy:  # the rollout it began is carried to its end
            between()
            dispatcher.sleep(settings.rollout.poll_seconds)
        state.save()
        unread = [f"{name}: {t.scrape_error}" for name, t in result.targets.items() if t.scrape_error]
        if result.targets and len(unread) == len(result.targets):  # the CLI's exit code 1: it ran, read nothing
            raise SourceError("run --once", redactor.text(f"no target could be read ({'; '.join(unread)[:400]})"))
        return 0

    def reload() -> str:
        """SIGHUP: re-read and validate the configuration and its rule files; keep the running one if they
        do not load. The rules and ``decisions`` take effect at the next cycle; any other section that
        changed waits for a restart, and the log says which."""
        running = reloadable[0][0]
        try:
            new = config.load(config_path)
            new_rules = tuple(loading.load_all(loading.rule_paths(new.rule_files, base_dir=config_dir)))
        except TunerError as exc:
            problems, file = getattr(exc, "problems", None), getattr(exc, "file", config_path)
            why = "; ".join(f"{file}: {w + ': ' if w else ''}{what}" for w, what in problems) if problems else str(exc)
            log.error("reload: the configuration does not load (%s); keeping the running configuration",
                      " ".join(why.split()))
            return "reload failed: the running configuration is kept (see the log)"
        waiting = [k for k in type(new).model_fields if k not in RELOADABLE and getattr(new, k) != getattr(running, k)]
        reloadable[0] = (running.model_copy(update={k: getattr(new, k) for k in RELOADABLE}), new_rules)
        log.info("effective configuration: %s", json.dumps(reloadable[0][0].redacted_dump(redactor)))
        said = f"reloaded {config_path}: {len(new_rules)} rule(s), the decisions section"
        if waiting:
            said += f"; changed but not applied until a restart (systemctl restart vllm-tuner): {', '.join(waiting)}"
        log.warning("%s", said)
        return said

    loop = scheduling.Loop(step, interval_seconds=settings.scrape.interval_seconds, on_stop=state.save,
                           notifier=notifier, watchdog_seconds=notify.watchdog_seconds(), between=between,
                           between_seconds=settings.rollout.poll_seconds,
                           on_reload=reload)
    loop_holder["loop"] = loop

    def relay_stop() -> None:  # SIGTERM stops the loop; the driver finishes its current step, then stops
        loop.stop_event.wait()
        stop_event.set()

    threading.Thread(target=relay_stop, daemon=True).start()
    server = TunerHttpServer(
        metrics=metrics, state=state,
        max_age_seconds=settings.daemon.health_max_age_seconds or 3 * settings.scrape.interval_seconds,
        is_alive=loop.is_alive, is_busy=loop.is_busy, clock=loop_clock.now,
        host=settings.daemon.listen_host, port=settings.daemon.listen_port,
        status_from_network=settings.daemon.status_from_network,
        allowed_hosts=settings.daemon.allowed_hosts,
    )
    with server:  # starts it (once) and closes it
        log.info("status endpoint on %s", server.url)
        with contextlib.suppress(KeyboardInterrupt):
            return loop.run()
    return 0


RELOADABLE = ("rule_files", "decisions")  # what a SIGHUP applies; every other section needs a restart


class _MaskedNotifier(notify.Notifier):
    """systemd's STATUS= is shown to every user (``systemctl status``): masked like a log line."""

    def __init__(self, redactor: secrets.Redactor) -> None:
        super().__init__()
        self._redactor = redactor

    def send(self, **fields: str | int) -> bool:
        return super().send(**{k: self._redactor.text(v) if isinstance(v, str) else v for k, v in fields.items()})


def _build_dispatcher(settings: config.TunerSettings, state: TunerState, client: engines.EngineClient,
                    config_dir: Path, *, stop_event: threading.Event,
                    on_transition: Callable[[machine.Rollout], None],
                    clock: Callable[[], float] = time.time) -> dispatching.Dispatcher:
    assert settings.actuator is not None  # validated
    kind = settings.targets[0].kind
    redactor = state.redactor
    replicas = {t.name: base.Replica(t.name, collecting.base_url(t)) for t in settings.targets}
    actuator_config = settings.actuator
    if settings.live.enabled and isinstance(actuator_config, actuator_settings.ProcessActuatorSettings):
        env = {**actuator_config.env, live_knobs.ENV_CONTROL_DIR: settings.live.control_dir}
        actuator_config = actuator_config.model_copy(update={"env": env})
    actuator = actuator_settings.build_actuator(actuator_config, list(replicas.values()), redactor=redactor)
    drainer = actuator_settings.build_drainer(settings.drain, list(replicas.values()))
    journal_path = _journal_path(settings, config_dir)
    try:
        journal = journaling.Journal(journal_path, redactor=redactor)
    except OSError as exc:
        raise StorageError(str(journal_path), "rollout.journal_file", _why(exc)) from exc
    configured = {t.name: list(t.args or ()) for t in settings.targets}

    def restore(rollout: machine.Rollout) -> machine.Rollout:
        """A journaled rollout's masked secrets, back from targets[].args (the tuner never changes one)."""
        try:
            return journaling.restored(rollout, lambda name, argv: redactor.restore(argv, configured.get(name, [])))
        except ValueError as exc:
            raise PermanentActuatorError(
                f"rollout {rollout.id} cannot be resumed: {exc} (a secret flag removed from targets[].args?); put "
                f"it back to resume the rollout, or move {journal.path} aside once every engine runs what it "
                "should") from exc

    # The idle check before a stop also counts what vLLM's HTTP server still holds (GET /load), where the
    # engines track it: the engine core's own gauges miss a response still being streamed.
    tracked = kind == "vllm" and all("--enable-server-load-tracking" in (t.args or ()) for t in settings.targets)
    if not tracked and settings.drain.kind != "none":
        log.warning("the engines run without --enable-server-load-tracking: before a stop the tuner sees only "
                    "the requests the engine core holds, not a response still being streamed; add the flag to "
                    "targets[].args (docs/reliability.md)")
    power = None
    if settings.gpu_control.enabled:  # privileged, off by default
        from tuner.actuators import gpu_power

        power = gpu_power.GpuPowerControl(enabled=True, devices=settings.gpu_control.devices,
                                          power_limit_w=settings.gpu_control.power_limit_w)
    return dispatching.build(settings, state, client, actuator=actuator, drainer=drainer, journal=journal, kind=kind,
                      stop_event=stop_event, server_load=tracked, drains=settings.drain.kind != "none",
                      plugin=(lambda name: live_knobs.Files(settings.live.dir_for(name))) if settings.live.enabled
                      else lambda name: None,
                      on_transition=on_transition, restore=restore, power=power, clock=clock)

def _journal_path(settings: config.TunerSettings, config_dir: Path) -> Path:
    path = Path(settings.rollout.journal_file)
    return path if path.is_absolute() else config_dir / path


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f" [errno {exc.errno}]" if exc.errno is not None else "")

def _show_rollout(state: TunerState, notifier: notify.Notifier, rollout: machine.Rollout,
                  metrics: selfmetrics.TunerMetrics | None = None) -> None:
    """Every transition: /status shows the rollout as it stands, systemd's STATUS= too, and
    ``tuner_rollout_in_flight`` whether one is (the RolloutStuck alert's input)."""
    state.rollout_state = {**dispatching.rollout_state(rollout), "summary": machine.describe(rollout)}
    notifier.status(state.rollout_state["summary"])
    if metrics is not None:
        running = machine.outcome(rollout) is machine.Outcome.RUNNING
        metrics.set_rollout(started_at=rollout.created_at if running else None)
