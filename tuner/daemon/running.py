"""`vllm-tuner run`: the composition root. Builds sources, the planner, the rollout and the loop from one
configuration, then runs cycles until SIGTERM.

Pools. The targets of one configuration are one pool of interchangeable replicas (same model, same
flags but their ports). The planner decides per replica; the rollout applies a decided change to
every replica of the pool, one at a time (``rollout.max_unavailable``), so the pool never ends up on
mixed arguments. Run one tuner per pool.

Owned state. The tuner owns each engine's command line in apply mode: ``targets[].args`` at first,
then what the last finished rollout left, persisted with the planner's history (cooldowns, hysteresis,
restart budget, crash memory) in ``daemon.state_file`` after every change (atomic write, fsync).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import httpx

from tuner import config
from tuner.actuators import base, sleeping
from tuner.actuators import settings as actuator_settings
from tuner.actuators.files import write_atomically
from tuner.daemon import collecting, cycle, notify, rolling, scheduling, selfmetrics, verifying
from tuner.daemon.httpserver import TunerHttpServer
from tuner.model import dialects, knobs
from tuner.planning import history as history_mod
from tuner.planning import planner, verification
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rules import loading
from tuner.signals import Signal
from tuner.signals import engine as engine_signals
from tuner.sources import scraping

log = logging.getLogger("tuner.run")


def rule_paths(settings: config.TunerSettings, config_dir: Path) -> list[Path]:
    if not settings.rule_files:
        from tuner.cli_decide import default_rules_path

        return [default_rules_path()]
    return [p if p.is_absolute() else config_dir / p for p in map(Path, settings.rule_files)]


# --- persisted state ----------------------------------------------------------------------------------


class TunerState:
    """Engine arguments the tuner owns and the planner's history, per target; saved as one JSON file."""

    def __init__(self, path: Path, targets: Sequence[config.Target]) -> None:
        self.path = path
        self.args: dict[str, knobs.EngineArgs] = {t.name: knobs.EngineArgs.parse(t.args or []) for t in targets}
        self.histories: dict[str, history_mod.History] = {t.name: history_mod.History() for t in targets}
        self.config_args = {t.name: list(t.args or []) for t in targets}
        if path.exists():
            data = json.loads(path.read_text(encoding="utf-8"))
            for name, saved in data.get("targets", {}).items():
                if name not in self.args:
                    continue  # a target removed from the config
                if saved.get("config_args") == self.config_args[name] and saved.get("args") is not None:
                    # the tuner's own changes survive a restart; an edited config wins over them
                    self.args[name] = knobs.EngineArgs.parse(saved["args"])
                if saved.get("history"):
                    self.histories[name] = history_mod.from_dict(saved["history"])

    def save(self) -> None:
        data = {"targets": {name: {"args": self.args[name].argv(), "config_args": self.config_args[name],
                                   "history": history_mod.to_dict(self.histories[name])}
                            for name in self.args}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, json.dumps(data, indent=1).encode(), mode=0o600)


# --- the planner adapter -----------------------------------------------------------------------------


class Planning:
    """``cycle.Planner``: calls the pure planner with the target's owned args and history."""

    def __init__(self, settings: config.TunerSettings, rules: loading.RuleSet, state: TunerState) -> None:
        self.settings, self.rules, self.state = settings, rules, state
        self._starts: dict[str, float] = {}

    def __call__(self, obs: cycle.Observation, *, now: float) -> planner.Plan:
        name, kind = obs.target.name, obs.target.kind
        restarted_at = None
        latest = obs.window[-1] if obs.window else None
        if latest is not None and latest.ok:
            start = engine_signals.gauge(latest, dialects.DIALECTS[kind], "process_start")
            if start is not None:
                if name in self._starts and self._starts[name] != start:
                    restarted_at = start
                self._starts[name] = start
        plan = planner.plan(name, obs.signals, self.state.args[name], self.state.histories[name],
                            self.settings.decisions, rules=self.rules, kind=kind, now=now,
                            restarted_at=restarted_at)
        self.state.histories[name] = plan.history
        return plan


# --- the rollout adapter -----------------------------------------------------------------------------


class Applying:
    """``cycle.Rollout``: turns the pool's plans into one rolling restart and books the outcome."""

    def __init__(self, settings: config.TunerSettings, state: TunerState, driver: rolling.RolloutDriver,
                 prober: rolling.HttpProber, replicas: Mapping[str, base.Replica],
                 journal: journaling.Journal, clock: Callable[[], float] = time.time,
                 verifier: verifying.SignalVerifier | None = None) -> None:
        self.settings, self.state, self.driver, self.prober = settings, state, driver, prober
        self.replicas, self.journal, self.clock = replicas, journal, clock
        self.verifier = verifier
        self.sleep_control: sleeping.SleepControl | None = None
        self._warmed_by_rollout: dict[str, float] = {}  # replica → when our rollout restarted and warmed it

    def recover(self) -> cycle.RolloutOutcome | None:
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
        new = {n: knobs.EngineArgs.parse(a) for n, a in done.new_argv.items()}
        outcome = self.book(done, changes, new)
        log.warning("%s", outcome.summary)
        return outcome

    def __call__(self, plans: Mapping[str, Any], *, now: float, maintenance_open: bool | None,
                 should_stop: Callable[[], bool],
                 signals: Mapping[str, Mapping[str, Signal]] | None = None) -> cycle.RolloutOutcome:
        notes: list[str] = []
        for name, plan in sorted(plans.items()):  # actions not tied to a restart: keep-warm, sleep, wake
            for action in plan.actions:
                if action.after_restart or name not in self.replicas:
                    continue
                recently = self._warmed_by_rollout.get(name)
                if action.kind in ("keep-warm", "warm-up") and recently is not None and now - recently < 600:
                    continue  # the rollout's WARMING step already warmed the engine it restarted
                if action.kind in ("sleep", "wake"):
                    control = self.sleep_control or sleeping.SleepControl()
                    self.sleep_control = control
                    replica = self.replicas[name]
                    error = control.sleep(replica, level=action.level or 1) if action.kind == "sleep" \
                        else control.wake(replica)
                    self.journal.append("decision", at=now, target=name, action=action.as_dict(), error=error)
                else:
                    error = self.prober.warm(self.replicas[name], requests=action.requests)
                notes.append(f"{name}: {action.label()}" + (f" failed: {error}" if error else ""))
        wanting = [(name, p) for name, p in sorted(plans.items()) if p.changes]
        if not wanting:
            return cycle.RolloutOutcome(summary="; ".join(notes))
        leader, plan = wanting[0]
        kind = self.settings.targets[0].kind
        new_args: dict[str, knobs.EngineArgs] = {}
        for name in self.state.args:
            args = self.state.args[name]
            for change in plan.changes:
                args = args.with_value(change.flag, change.to_value)
            problems = knobs.validate(args, kind, platform=self.settings.decisions.engine.platform)
            if problems:
                return cycle.RolloutOutcome(summary=f"not rolled out: {name}: {'; '.join(problems)}",
                                            results={name: "skipped"})
            new_args[name] = args
        rollout_id = f"r{int(now)}"
        checks = verification.checks_of(plan.changes)
        baselines = {name: verifying.values_of((signals or {}).get(name, {})) for name in new_args}
        self.journal.append("decision", at=now, rollout=rollout_id, target=leader,
                            changes=[{**c.as_dict(), "knob": c.knob, "direction": c.direction} for c in plan.changes],
                            summary=plan.summary(), checks=[c.as_dict() for c in checks],
                            baselines={name: {k: v for k, v in values.items() if v is not None}
                                       for name, values in baselines.items()})
        if self.verifier is not None:
            self.verifier.expect(rollout_id, checks=checks, baselines=baselines)
        rollout = self.driver.begin(rollout_id, {n: a.argv() for n, a in new_args.items()},
                                    limits=self.settings.rollout.limits())
        rollout = self.driver.run(rollout)
        return self.book(rollout, plan.changes, new_args, notes)

    def book(self, rollout: machine.Rollout, changes: Sequence[history_mod.Change],
             new_args: Mapping[str, knobs.EngineArgs], notes: Sequence[str] = ()) -> cycle.RolloutOutcome:
        """Record a finished rollout in the owned args and the planner's history. An interrupted one (the
        tuner is stopping) is left to the journal: the next start resumes it and books it then, once."""
        now = self.clock()
        reject_for = self.settings.decisions.safety.reject_seconds
        result = machine.outcome(rollout)
        if result is machine.Outcome.RUNNING:
            return cycle.RolloutOutcome(
                summary="; ".join([*notes, machine.describe(rollout) + " (interrupted: resumed at the next start)"]),
                state=_rollout_state(rollout))
        results: dict[str, str] = {}
        for p in rollout.progress:
            name = p.name
            if p.state in (machine.State.DONE, machine.State.ROLLED_BACK):
                self._warmed_by_rollout[name] = now
            if p.state is machine.State.DONE:
                self.state.args[name] = new_args.get(name, knobs.EngineArgs.parse(rollout.new_argv[name]))
                self.state.histories[name] = history_mod.applied(self.state.histories[name], changes, now=now)
                results[name] = "ok"
            elif p.state in (machine.State.ROLLED_BACK, machine.State.FAILED):
                bad = knobs.EngineArgs.parse(rollout.new_argv[name])
                hist = history_mod.restarted(self.state.histories[name], now=now)
                why = p.reason or rollout.aborted or "rolled back"
                hist = history_mod.failed_to_start(hist, bad, reason=why) if p.bad_args else \
                    history_mod.rejected(hist, bad, reason=why, now=now, for_seconds=reject_for)
                self.state.histories[name] = hist
                results[name] = "rolled_back" if p.state is machine.State.ROLLED_BACK else "failed"
        if result is machine.Outcome.ROLLED_BACK:  # one replica failed: the pool stays on the old args
            for name in self.state.histories:
                if name not in results:
                    bad = knobs.EngineArgs.parse(rollout.new_argv.get(name, ()))
                    self.state.histories[name] = history_mod.rejected(
                        self.state.histories[name], bad, reason="rolled back on another replica", now=now,
                        for_seconds=reject_for)
        self.state.save()
        return cycle.RolloutOutcome(summary="; ".join([*notes, machine.describe(rollout)]), results=results,
                                    state=_rollout_state(rollout))


def _change_from(data: Mapping[str, Any]) -> history_mod.Change:
    """A journaled decision's change, back as the value ``history_mod.applied`` books."""
    knob = str(data.get("knob", data["flag"]))
    return history_mod.Change(flag=str(data["flag"]), knob=knob,
                              from_value=knobs.parse_value(knob, str(data["from"])),
                              to_value=knobs.parse_value(knob, str(data["to"])),
                              rule=str(data.get("rule", "?")), reason=str(data.get("reason", "")),
                              direction=int(data.get("direction", 0)),
                              experimental=bool(data.get("experimental", False)))


def confirm_for(prober: rolling.HttpProber, actuator: base.Actuator) -> rolling.Confirmer:
    """The new values are live: the running process has exactly these arguments, and where the engine
    reports a value itself (/v1/models max_model_len) it agrees."""
    def confirm(replica: base.Replica, argv: Sequence[str]) -> str | None:
        status = actuator.status(replica.name)
        if status.argv is not None and tuple(status.argv) != tuple(argv):
            return f"the process runs {' '.join(status.argv)}"
        wanted = knobs.EngineArgs.parse(argv).get("--max-model-len")
        if wanted is not None:
            try:
                data = httpx.get(replica.base_url + "/v1/models", timeout=5).json()
                served = data["data"][0].get("max_model_len")
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                return f"/v1/models unreadable: {exc}"
            if served is not None and str(served) != str(knobs.parse_int(str(wanted))):
                return f"/v1/models says max_model_len {served}, expected {wanted}"
        return None

    return confirm


# --- running -----------------------------------------------------------------------------------------


def build_and_run(config_path: str, *, once: bool = False) -> int:
    settings = config.load(config_path)
    config_dir = Path(config_path).resolve().parent
    rules = loading.load_all(rule_paths(settings, config_dir))
    log.info("effective configuration: %s", json.dumps(settings.model_dump(mode="json")))
    http = collecting.http_settings(settings.scrape, config_dir=config_dir)
    client = scraping.make_client(http)
    sleep_mode = settings.decisions.idle.sleep_after_seconds is not None
    collectors = [collecting.Collector(t, client=client, max_body_bytes=http.max_body_bytes, server_load=sleep_mode)
                  for t in settings.targets]
    state_path = Path(settings.daemon.state_file)
    if not state_path.is_absolute():
        state_path = config_dir / state_path
    tstate = TunerState(state_path, settings.targets)
    planning = Planning(settings, rules, tstate) if settings.mode != "observe" else None
    metrics = selfmetrics.TunerMetrics()
    maintenance = (cycle.MaintenanceWindows(settings.daemon.maintenance_windows,
                                            timezone=settings.daemon.maintenance_timezone)
                   if settings.daemon.maintenance_windows else None)
    applying: Applying | None = None
    stop_event = threading.Event()
    loop_holder: dict[str, scheduling.Loop] = {}
    notifier = notify.Notifier()
    cstate = cycle.CycleState()
    startup: list[Callable[[], None]] = []  # run once, at the start of the first cycle

    if settings.mode == "apply":
        assert settings.actuator is not None  # validated
        replicas = {t.name: base.Replica(t.name, t.base_url or scraping.base_url(t.metrics_url))
                    for t in settings.targets}
        actuator = actuator_settings.build_actuator(settings.actuator, list(replicas.values()))
        drainer = actuator_settings.build_drainer(settings.drain, list(replicas.values()))
        journal_path = Path(settings.rollout.journal_file)
        journal = journaling.Journal(journal_path if journal_path.is_absolute() else config_dir / journal_path)
        prober = rolling.HttpProber()
        verifier = verifying.SignalVerifier(client, kind=settings.targets[0].kind,
                                            max_body_bytes=http.max_body_bytes)
        driver = rolling.RolloutDriver(
            actuator=actuator, drainer=drainer, prober=prober, journal=journal,
            poll_seconds=settings.rollout.poll_seconds, idle_settle_seconds=settings.rollout.idle_settle_seconds,
            hold_timeout_seconds=settings.rollout.hold_timeout_seconds,
            verifier=verifier, confirm=confirm_for(prober, actuator),
            on_bad_args=lambda name, argv, why: log.warning("%s: arguments failed: %s (%s)", name,
                                                            " ".join(argv), why),
            on_transition=lambda rollout: _show_rollout(cstate, notifier, rollout),
            stop_event=stop_event,
        )
        applying = Applying(settings, tstate, driver, prober, replicas, journal, verifier=verifier)

        def start_up() -> None:
            # A tuner killed mid-rollout finishes or rolls back that rollout before anything else. This
            # runs inside the first cycle, so systemd has READY=1 and watchdog pings meanwhile, and
            # /healthz and /status answer (/status shows the resumed rollout's progress).
            assert applying is not None
            outcome = applying.recover()
            if outcome is not None:
                cstate.rollout_state = dict(outcome.state)
            for name in replicas:  # take every replica over: start what was never started, learn what runs
                before = actuator.status(name)
                after = actuator.adopt(name, tstate.args[name].argv())
                if before.state is not base.State.RUNNING and after.state is base.State.RUNNING:
                    log.info("started %s: %s", name, tstate.args[name])
                if after.state is base.State.RUNNING and after.argv is None:
                    log.warning("%s: %s", name, after.detail)
                elif after.argv is not None and tuple(after.argv) != tuple(tstate.args[name].argv()):
                    log.warning("%s runs %s, not the arguments the tuner owns (%s); a rollout rolls back to "
                                "what runs", name, " ".join(after.argv), tstate.args[name])
            tstate.save()

        startup.append(start_up)

    power = None
    if settings.gpu_control.enabled:  # privileged, off by default
        from tuner.actuators import gpu_power

        power = gpu_power.GpuPowerControl(enabled=True, devices=settings.gpu_control.devices,
                                          power_limit_w=settings.gpu_control.power_limit_w)

    def step() -> cycle.CycleResult:
        loop = loop_holder.get("loop")
        should_stop = loop.should_stop if loop is not None else (lambda: False)
        while startup:
            startup.pop(0)()
        result = run_one(should_stop)
        if power is not None:
            from tuner.actuators import gpu_power

            for target in result.targets.values():
                decision = gpu_power.decide(target.signals, capped=power.capped,
                                            margin_c=settings.decisions.thermal.margin_c)
                if decision is not None:
                    power.apply(decision)
                    break
        return result

    def run_one(should_stop: Callable[[], bool]) -> cycle.CycleResult:
        return cycle.run_cycle(cstate, settings=settings, collectors=collectors, planner=cast(cycle.Planner | None, planning),
                               rollout=applying, maintenance=maintenance, metrics=metrics,
                               engine_args=lambda name: {f: str(v) for f in tstate.args[name].flags()
                                                         if (v := tstate.args[name].get(f)) is not None},
                               should_stop=should_stop)

    if once:
        result = step()
        print(result.summary)
        tstate.save()
        return 0

    loop = scheduling.Loop(step, interval_seconds=settings.scrape.interval_seconds, on_stop=tstate.save,
                           notifier=notifier)
    loop_holder["loop"] = loop

    def relay_stop() -> None:  # SIGTERM stops the loop; the driver finishes its current step, then stops
        loop.stop_event.wait()
        stop_event.set()

    threading.Thread(target=relay_stop, daemon=True).start()
    server = TunerHttpServer(
        metrics=metrics, state=cstate,
        max_age_seconds=settings.daemon.health_max_age_seconds or 3 * settings.scrape.interval_seconds,
        is_alive=loop.is_alive, is_busy=loop.is_busy,
        host=settings.daemon.listen_host, port=settings.daemon.listen_port,
    )
    with server.start():
        log.info("status endpoint on %s", server.url)
        with contextlib.suppress(KeyboardInterrupt):
            return loop.run()
    return 0


def _show_rollout(cstate: cycle.CycleState, notifier: notify.Notifier, rollout: machine.Rollout) -> None:
    """Every transition: /status shows the rollout as it stands, systemd's STATUS= too."""
    cstate.rollout_state = {**_rollout_state(rollout), "summary": machine.describe(rollout)}
    notifier.status(cstate.rollout_state["summary"])


def _rollout_state(rollout: machine.Rollout) -> dict[str, Any]:
    """The rollout as /status shows it: id, outcome and each replica's state."""
    return {"id": rollout.id, "outcome": machine.outcome(rollout).value,
            "replicas": {p.name: p.state.value for p in rollout.progress}}


def configure_logging(*, json_logs: bool, level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(cycle.JsonLogFormatter() if json_logs else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("VLLM_TUNER_LOG_LEVEL", level))
    for chatty in ("httpx", "httpcore", "apscheduler"):  # one line per cycle is ours to say
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # "skipped: maximum number of running instances" is how a long rollout looks to APScheduler
    logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
