"""`vllm-tuner run`: the composition root. Builds the engine client, the collectors, the rollout and the
loop from one configuration, then runs cycles until SIGTERM. It wires and applies; it decides nothing
(``planning.stepping`` and ``planning.pooling`` do).

Owned state. In apply mode the tuner owns each engine's command line: ``targets[].args`` at first,
then what the last finished rollout left (``daemon.state``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tuner import config
from tuner.actuators import base
from tuner.actuators import settings as actuator_settings
from tuner.daemon import collecting, cycle, notify, results, rolling, scheduling, selfmetrics, verifying
from tuner.daemon.httpserver import TunerHttpServer
from tuner.daemon.state import TunerState
from tuner.model import knobs
from tuner.planning import guards, pooling, verification
from tuner.planning import history as history_mod
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rules import loading
from tuner.signals import Signal
from tuner.sources import engines

log = logging.getLogger("tuner.run")


class Applying:
    """``cycle.Rollout``: carries a cycle's actions and the pool's change out, and books the outcome."""

    def __init__(self, settings: config.TunerSettings, state: TunerState, driver: rolling.RolloutDriver,
                 client: engines.EngineClient, replicas: Mapping[str, base.Replica], journal: journaling.JournalLike,
                 *, verifier: verifying.SignalVerifier | None = None, power: Any = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.settings, self.state, self.driver, self.client = settings, state, driver, client
        self.replicas, self.journal, self.verifier, self.power = replicas, journal, verifier, power
        self.kind = settings.targets[0].kind
        self.clock = clock or time.time

    def recover(self) -> results.RolloutOutcome | None:
        """Finish (or roll back) the rollout a killed tuner left in the journal, judged by the checks and
        baselines journaled with its decision, and book it like any other. None if there was none."""
        unfinished = self.driver.recover()
        if unfinished is None:
            return None
        log.warning("resuming %s", machine.describe(unfinished))
        record = next((r for r in reversed(journaling.decisions(self.journal.records))
                       if r.get("rollout") == unfinished.id), None)
        changes: list[history_mod.Change] = []
        if record is not None:
            changes = [_change_from(c) for c in record.get("changes", [])]
            if self.verifier is not None:
                self.verifier.expect(unfinished.id, baselines=record.get("baselines", {}),
                                     checks=[verification.Check.from_dict(c) for c in record.get("checks", [])])
        done = self.driver.run(unfinished)
        outcome = self.book(done, changes)
        log.warning("%s", outcome.summary)
        return outcome

    def __call__(self, actions: Sequence[tuple[str, guards.Action]], change: pooling.PoolChange | None, *,
                 now: float, signals: Mapping[str, Mapping[str, Signal]],
                 should_stop: Callable[[], bool]) -> results.RolloutOutcome:
        notes = [self._act(name, action, now=now) for name, action in actions if name in self.replicas]
        if change is None or should_stop():
            return results.RolloutOutcome(summary="; ".join(notes))
        checks = change.checks
        baselines = {name: verifying.values_of(signals.get(name, {})) for name in change.new_args}
        self.journal.append("decision", at=now, rollout=change.id, target=change.leader,
                            changes=[{**c.as_dict(), "knob": c.knob, "direction": c.direction}
                                     for c in change.changes],
                            summary=change.plan.summary(), checks=[c.as_dict() for c in checks],
                            baselines={name: {k: v for k, v in values.items() if v is not None}
                                       for name, values in baselines.items()})
        if self.verifier is not None:
            self.verifier.expect(change.id, checks=checks, baselines=baselines)
        rollout = self.driver.begin(change.id, {n: a.argv() for n, a in change.new_args.items()},
                                    limits=self.settings.rollout.limits())
        rollout = self.driver.run(rollout)
        return self.book(rollout, change.changes, notes)

    def _act(self, name: str, action: guards.Action, *, now: float) -> str:
        """One action not tied to a restart: keep-warm, sleep, wake, a GPU power cap or restore."""
        url = self.replicas[name].base_url
        error: str | None
        if action.kind == "sleep":
            error = self.client.sleep(url, level=action.level or 1)
        elif action.kind == "wake":
            error = self.client.wake(url)
        elif action.kind in ("power-cap", "power-restore"):
            lines = self.power.apply(cap=action.kind == "power-cap", reason=action.reason) if self.power else []
            error = "; ".join(x for x in lines if "unchanged" in x) or (None if self.power else
                                                                         "gpu_control is not enabled")
        else:
            error = self.client.warm(url, self.kind, requests=action.requests, max_tokens=action.max_tokens)
        if action.kind in ("sleep", "wake", "power-cap", "power-restore"):
            self.journal.append("decision", at=now, target=name, action=action.as_dict(), error=error)
        return f"{name}: {action.label()}" + (f" failed: {error}" if error else "")

    def book(self, rollout: machine.Rollout, changes: Sequence[history_mod.Change],
             notes: Sequence[str] = ()) -> results.RolloutOutcome:
        """Record a finished rollout (``pooling.book``) and persist it. An interrupted one (the tuner is
        stopping) is left to the journal: the next start resumes it and books it then, once."""
        result = machine.outcome(rollout)
        if result is machine.Outcome.RUNNING:
            return results.RolloutOutcome(
                summary="; ".join([*notes, machine.describe(rollout) + " (interrupted: resumed at the next start)"]),
                state=rollout_state(rollout))
        outcomes: dict[str, pooling.ReplicaOutcome] = {}
        for p in rollout.progress:
            tried = knobs.EngineArgs.parse(rollout.new_argv[p.name])
            if p.state is machine.State.DONE:
                outcomes[p.name] = pooling.ReplicaOutcome("ok", tried)
            elif p.state in (machine.State.ROLLED_BACK, machine.State.FAILED):
                outcomes[p.name] = pooling.ReplicaOutcome(
                    "rolled_back" if p.state is machine.State.ROLLED_BACK else "failed", tried,
                    reason=p.reason or rollout.aborted or "rolled back", bad_args=p.bad_args)
        histories, args = pooling.book(
            self.state.histories(), self.state.args, changes=changes, outcomes=outcomes,
            pool_new_args={n: knobs.EngineArgs.parse(a) for n, a in rollout.new_argv.items()},
            rolled_back=result is machine.Outcome.ROLLED_BACK, now=self.clock(),
            reject_seconds=self.settings.decisions.safety.reject_seconds)
        self.state.book(histories, args)
        return results.RolloutOutcome(summary="; ".join([*notes, machine.describe(rollout)]),
                                    results={n: o.result for n, o in outcomes.items()}, state=rollout_state(rollout))


def _change_from(data: Mapping[str, Any]) -> history_mod.Change:
    """A journaled decision's change, back as the value ``history_mod.applied`` books."""
    knob = str(data.get("knob", data["flag"]))
    return history_mod.Change(flag=str(data["flag"]), knob=knob,
                              from_value=knobs.parse_value(knob, str(data["from"])),
                              to_value=knobs.parse_value(knob, str(data["to"])),
                              rule=str(data.get("rule", "?")), reason=str(data.get("reason", "")),
                              direction=int(data.get("direction", 0)),
                              experimental=bool(data.get("experimental", False)))


def confirm_for(client: engines.EngineClient, actuator: base.Actuator, *, kind: knobs.EngineKind
                ) -> rolling.Confirmer:
    """The new values are live: the running process has exactly these arguments, and where the engine
    reports a value itself (the served max_model_len) it agrees."""
    def confirm(replica: base.Replica, argv: Sequence[str]) -> str | None:
        status = actuator.status(replica.name)
        if status.argv is not None and tuple(status.argv) != tuple(argv):
            return f"the process runs {' '.join(status.argv)}"
        try:
            wanted = knobs.explicit(knobs.EngineArgs.parse(argv), "max_model_len", kind)
        except ValueError as exc:
            return f"--max-model-len: {exc}"
        if wanted is not None:
            served, why = client.served_max_model_len(replica.base_url, kind)
            if served is None:
                return f"the served max_model_len is unreadable: {why}"
            if served != wanted:
                return f"the engine serves max_model_len {served}, expected {wanted}"
        return None

    return confirm


def rollout_state(rollout: machine.Rollout) -> dict[str, Any]:
    """The rollout as /status shows it: id, outcome and each replica's state."""
    return {"id": rollout.id, "outcome": machine.outcome(rollout).value,
            "replicas": {p.name: p.state.value for p in rollout.progress}}


# --- running -----------------------------------------------------------------------------------------


def build_and_run(config_path: str, *, once: bool = False) -> int:
    settings = config.load(config_path)
    config_dir = Path(config_path).resolve().parent
    rules = loading.load_all(loading.rule_paths(settings.rule_files, base_dir=config_dir))
    log.info("effective configuration: %s", json.dumps(settings.model_dump(mode="json")))
    http = collecting.http_settings(settings.scrape, config_dir=config_dir)
    client = engines.EngineClient(http, deadline_seconds=settings.scrape.deadline_seconds)
    sleep_mode = settings.decisions.idle.sleep_after_seconds is not None
    collectors = [collecting.Collector(t, client=client, server_load=sleep_mode) for t in settings.targets]
    state_path = Path(settings.daemon.state_file)
    state = TunerState.load(state_path if state_path.is_absolute() else config_dir / state_path, settings.targets)
    metrics = selfmetrics.TunerMetrics()
    maintenance = (scheduling.MaintenanceWindows(settings.daemon.maintenance_windows,
                                                 timezone=settings.daemon.maintenance_timezone)
                   if settings.daemon.maintenance_windows else None)
    stop_event = threading.Event()
    notifier = notify.Notifier()
    gatherer = collecting.Gatherer()
    applying: Applying | None = None
    startup: list[Callable[[], None]] = []  # run once, at the start of the first cycle
    loop_holder: dict[str, scheduling.Loop] = {}

    if settings.mode == "apply":
        applying = _build_applying(settings, state, client, config_dir, stop_event=stop_event,
                                   on_transition=lambda r: _show_rollout(state, notifier, r))
        startup.append(lambda: _start_up(applying, state))

    def step() -> results.CycleResult:
        loop = loop_holder.get("loop")
        should_stop = loop.should_stop if loop is not None else (lambda: False)
        while startup:
            startup.pop(0)()
        return cycle.run_cycle(state, settings=settings, collectors=collectors, rules=tuple(rules),
                               rollout=applying, maintenance=maintenance, metrics=metrics, gatherer=gatherer,
                               should_stop=should_stop)

    if once:
        result = step()
        print(result.summary)
        state.save()
        return 0

    loop = scheduling.Loop(step, interval_seconds=settings.scrape.interval_seconds, on_stop=state.save,
                           notifier=notifier)
    loop_holder["loop"] = loop

    def relay_stop() -> None:  # SIGTERM stops the loop; the driver finishes its current step, then stops
        loop.stop_event.wait()
        stop_event.set()

    threading.Thread(target=relay_stop, daemon=True).start()
    server = TunerHttpServer(
        metrics=metrics, state=state,
        max_age_seconds=settings.daemon.health_max_age_seconds or 3 * settings.scrape.interval_seconds,
        is_alive=loop.is_alive, is_busy=loop.is_busy,
        host=settings.daemon.listen_host, port=settings.daemon.listen_port,
    )
    with server.start():
        log.info("status endpoint on %s", server.url)
        with contextlib.suppress(KeyboardInterrupt):
            return loop.run()
    return 0


def _build_applying(settings: config.TunerSettings, state: TunerState, client: engines.EngineClient,
                    config_dir: Path, *, stop_event: threading.Event,
                    on_transition: Callable[[machine.Rollout], None]) -> Applying:
    assert settings.actuator is not None  # validated
    kind = settings.targets[0].kind
    replicas = {t.name: base.Replica(t.name, collecting.base_url(t)) for t in settings.targets}
    actuator = actuator_settings.build_actuator(settings.actuator, list(replicas.values()))
    drainer = actuator_settings.build_drainer(settings.drain, list(replicas.values()))
    journal_path = Path(settings.rollout.journal_file)
    journal = journaling.Journal(journal_path if journal_path.is_absolute() else config_dir / journal_path)
    verifier = verifying.SignalVerifier(client, kind=kind)
    # The idle check before a stop also counts what vLLM's HTTP server still holds (GET /load), where the
    # engines track it: the engine core's own gauges miss a response still being streamed.
    tracked = kind == "vllm" and all("--enable-server-load-tracking" in (t.args or ()) for t in settings.targets)
    if not tracked and settings.drain.kind != "none":
        log.warning("the engines run without --enable-server-load-tracking: before a stop the tuner sees only "
                    "the requests the engine core holds, not a response still being streamed; add the flag to "
                    "targets[].args (docs/reliability.md)")
    driver = rolling.RolloutDriver(
        actuator=actuator, drainer=drainer, prober=rolling.EngineProber(client, kind=kind, server_load=tracked),
        journal=journal,
        poll_seconds=settings.rollout.poll_seconds, idle_settle_seconds=settings.rollout.idle_settle_seconds,
        hold_timeout_seconds=settings.rollout.hold_timeout_seconds,
        verifier=verifier, confirm=confirm_for(client, actuator, kind=kind),
        on_bad_args=lambda name, argv, why: log.warning("%s: arguments failed: %s (%s)", name, " ".join(argv), why),
        on_transition=on_transition, stop_event=stop_event, drains=settings.drain.kind != "none",
    )
    power = None
    if settings.gpu_control.enabled:  # privileged, off by default
        from tuner.actuators import gpu_power

        power = gpu_power.GpuPowerControl(enabled=True, devices=settings.gpu_control.devices,
                                          power_limit_w=settings.gpu_control.power_limit_w)
    return Applying(settings, state, driver, client, replicas, journal, verifier=verifier, power=power)


def _start_up(applying: Applying, state: TunerState) -> None:
    """A tuner killed mid-rollout finishes or rolls back that rollout before anything else. This runs
    inside the first cycle, so systemd has READY=1 and watchdog pings meanwhile, and /healthz and /status
    answer (/status shows the resumed rollout's progress). Then every replica is taken over: what was
    never started is started, what runs is learnt."""
    outcome = applying.recover()
    if outcome is not None:
        state.rollout_state = dict(outcome.state)
    actuator = applying.driver.actuator
    for name in applying.replicas:
        before = actuator.status(name)
        after = actuator.adopt(name, state.args[name].argv())
        if before.state is not base.State.RUNNING and after.state is base.State.RUNNING:
            log.info("started %s: %s", name, state.args[name])
        if after.state is base.State.RUNNING and after.argv is None:
            log.warning("%s: %s", name, after.detail)
        elif after.argv is not None and tuple(after.argv) != tuple(state.args[name].argv()):
            log.warning("%s runs %s, not the arguments the tuner owns (%s); a rollout rolls back to what runs",
                        name, " ".join(after.argv), state.args[name])
    state.save()


def _show_rollout(state: TunerState, notifier: notify.Notifier, rollout: machine.Rollout) -> None:
    """Every transition: /status shows the rollout as it stands, systemd's STATUS= too."""
    state.rollout_state = {**rollout_state(rollout), "summary": machine.describe(rollout)}
    notifier.status(state.rollout_state["summary"])
