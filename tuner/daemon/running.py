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
from tuner.daemon import collecting, cycle, logs, notify, results, rolling, scheduling, selfmetrics, verifying
from tuner.daemon.httpserver import TunerHttpServer
from tuner.daemon.state import TunerState
from tuner.errors import PermanentActuatorError, StorageError
from tuner.model import knobs, live, secrets
from tuner.planning import guards, pooling, verification
from tuner.planning import history as history_mod
from tuner.rollout import journal as journaling
from tuner.rollout import machine
from tuner.rules import loading
from tuner.signals import Signal
from tuner.sources import engines, live_knobs

log = logging.getLogger("tuner.run")


class Applying:
    """``cycle.Rollout``: carries a cycle's actions and the pool's change out, and books the outcome."""

    def __init__(self, settings: config.TunerSettings, state: TunerState, driver: rolling.RolloutDriver,
                 client: engines.EngineClient, replicas: Mapping[str, base.Replica], journal: journaling.JournalLike,
                 *, verifier: verifying.SignalVerifier | None = None, power: Any = None,
                 clock: Callable[[], float] | None = None, sleep: Callable[[float], Any] | None = None) -> None:
        self.settings, self.state, self.driver, self.client = settings, state, driver, client
        self.replicas, self.journal, self.verifier, self.power = replicas, journal, verifier, power
        self.kind = settings.targets[0].kind
        self.clock = clock or time.time
        # waits return early when the tuner is stopping
        self.sleep = sleep or (lambda seconds: self.driver.stop_event.wait(seconds))

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

    def book_unbooked(self) -> results.RolloutOutcome | None:
        """Book the journal's last finished rollout if the saved state does not include it yet: the tuner
        died between the rollout's last record and saving its booking. Once: the booking saves the
        rollout's id with it. A state that does not say what it booked (a first start, a state file
        from an older tuner) takes everything already in the journal as booked."""
        finished = [r for r in journaling.replay(self.journal.records).values()
                    if machine.outcome(r) is not machine.Outcome.RUNNING]
        last = finished[-1] if finished else None
        if self.state.booked_rollout is None:
            self.state.booked_rollout = last.id if last is not None else ""
            return None
        if last is None or last.id == self.state.booked_rollout:
            return None
        record = next((r for r in reversed(journaling.decisions(self.journal.records))
                       if r.get("rollout") == last.id), None)
        changes = [_change_from(c) for c in record.get("changes", [])] if record is not None else []
        outcome = self.book(self.driver.restored(last), changes)
        log.warning("booked %s, which finished before the tuner stopped", outcome.summary)
        return outcome

    def __call__(self, actions: Sequence[tuple[str, guards.Action]], change: pooling.PoolChange | None, *,
                 now: float, signals: Mapping[str, Mapping[str, Signal]],
                 should_stop: Callable[[], bool]) -> results.RolloutOutcome:
        notes = [self._act(name, action, now=now) for name, action in actions if name in self.replicas]
        if change is None or should_stop():
            return results.RolloutOutcome(summary="; ".join(notes))
        if change.live:
            return self._live(change, now=now, signals=signals, should_stop=should_stop, notes=notes)
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
        if self.settings.live.enabled and any(c.knob == "max_num_seqs" for c in change.changes):
            # a new envelope: the admission cap goes back to the startup value, or the restarted engine
            # would apply the old cap inside its new, larger envelope
            for name, replica in self.replicas.items():
                self.client.set_live(replica.base_url, self._live_dir(name), seq=int(now * 1000) % (2 ** 31),
                                     values={"max_num_seqs": None})
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
        self.state.booked_rollout = rollout.id  # saved with the booking, in one atomic write
        self.state.book(histories, args)
        return results.RolloutOutcome(summary="; ".join([*notes, machine.describe(rollout)]),
                                    results={n: o.result for n, o in outcomes.items()}, state=rollout_state(rollout))


    # --- live changes (no restart) -------------------------------------------------------------------

    def _live_dir(self, name: str) -> str:
        return self.settings.live.dir_for(name)

    def _live(self, change: pooling.PoolChange, *, now: float, signals: Mapping[str, Mapping[str, Signal]],
              should_stop: Callable[[], bool], notes: Sequence[str] = ()) -> results.RolloutOutcome:
        """Apply a live change to every replica's running engine, verify each over the same window
        machinery as a rollout, keep it or put the old values back — no drain, no restart, no warm-up."""
        values = change.values
        states = {name: self.client.live_state(r.base_url, self._live_dir(name)) for name, r in self.replicas.items()}
        before = {name: {k: st.values.get(k) for k in values} for name, st in states.items()}
        baselines = {name: verifying.values_of(signals.get(name, {})) for name in self.replicas}
        self.journal.append("decision", at=now, rollout=change.id, target=change.leader, live=True,
                            changes=[{**c.as_dict(), "knob": c.knob, "direction": c.direction}
                                     for c in change.changes],
                            summary=change.plan.summary(), values=values, before=before,
                            checks=[c.as_dict() for c in change.checks],
                            baselines={n: {k: v for k, v in b.items() if v is not None} for n, b in baselines.items()})
        if self.verifier is not None:
            self.verifier.expect(change.id, checks=change.checks, baselines=baselines)
        why = _contained("setting the values", lambda: self._set_live(values, states))
        started = self.clock()
        verdicts: dict[str, str] = {}
        if why is None:
            self.journal.append("live", at=started, id=change.id, phase="applied", values=values)
            why = _contained("verifying", lambda: self._verify_live(change.id, started, verdicts, should_stop))
        if why is None:
            self.journal.append("live", at=self.clock(), id=change.id, phase="verified", verdicts=verdicts)
            outcomes = {n: pooling.ReplicaOutcome("ok", self.state.args[n]) for n in self.replicas}
        else:
            undone = _contained("putting the old values back", lambda: self._set_live({}, states, restore=before))
            self.journal.append("live", at=self.clock(), id=change.id, phase="rolled_back", reason=why,
                                restore_error=undone, verdicts=verdicts)
            outcomes = {n: pooling.ReplicaOutcome("rolled_back", self._candidate(n, change), reason=why)
                        for n in self.replicas}
        histories, args = pooling.book(
            self.state.histories(), self.state.args, changes=change.changes, outcomes=outcomes,
            pool_new_args={n: self._candidate(n, change) for n in self.replicas}, rolled_back=why is not None,
            now=self.clock(), reject_seconds=self.settings.decisions.safety.reject_seconds)
        self.state.book(histories, args)
        text = f"live {change.text()}: " + ("kept on " + ", ".join(self.replicas) if why is None else
                                             f"put back ({why})")
        return results.RolloutOutcome(summary="; ".join([*notes, text]),
                                      results={n: o.result for n, o in outcomes.items()})

    def _candidate(self, name: str, change: pooling.PoolChange) -> knobs.EngineArgs:
        """The command line a live change stands for (crash and rejection memory key on it)."""
        args = self.state.args[name]
        for c in change.changes:
            args = knobs.with_knob(args, c.knob, c.to_value, kind=self.kind)
        return args

    def _set_live(self, values: Mapping[str, int | None], states: Mapping[str, live.LiveState],
                  *, restore: Mapping[str, Mapping[str, int | None]] | None = None) -> str | None:
        """Ask every replica's engine for ``values`` (``restore``: each its own old values) and wait for
        every engine core's acknowledgement; None once all applied, else why not."""
        seq = int(self.clock() * 1000) % (2 ** 31)
        wanted: dict[str, dict[str, int | None]] = {}
        failed: list[str] = []
        for name, replica in self.replicas.items():
            ask = dict(restore[name]) if restore is not None else dict(values)
            wanted[name] = ask
            error = self.client.set_live(replica.base_url, self._live_dir(name), seq=seq, values=ask,
                                         via=states[name].via)
            if error is not None and restore is None:
                return f"{name}: {error}"
            if error is not None:  # putting back: every other engine still gets its old values
                failed.append(f"{name}: {error}")
                wanted.pop(name)
        deadline = self.clock() + self.settings.live.ack_timeout_seconds
        poked: set[str] = set()
        pending = set(wanted)
        asked_at = self.clock()
        while pending:
            for name in sorted(pending):
                replica = self.replicas[name]
                st = self.client.live_state(replica.base_url, self._live_dir(name))
                if st.via == "runtime_config" or st.seq == seq:
                    if st.refused:
                        return f"{name} refused it: {st.refused}"
                    want = {k: v if v is not None else st.envelope.get(k) for k, v in wanted[name].items()}
                    if all(st.values.get(k) == v for k, v in want.items()):
                        pending.discard(name)
                        continue
                if name not in poked and self.clock() - asked_at > 2.0:
                    # an idle engine runs no step, and the plugin applies a request at the start of a step
                    self.client.warm(replica.base_url, self.kind, requests=1, max_tokens=1)
                    poked.add(name)
            if not pending:
                break
            if self.clock() >= deadline:
                return f"not acknowledged within {self.settings.live.ack_timeout_seconds:g}s by " + \
                    ", ".join(sorted(pending))
            self.sleep(0.2)
        return "; ".join(failed) or None

    def _verify_live(self, change_id: str, started: float, verdicts: dict[str, str],
                     should_stop: Callable[[], bool]) -> str | None:
        """Scrape every replica through the verification window, then judge each; None if all hold."""
        if self.verifier is None:
            return None
        end = started + self.settings.live.verify_seconds
        while self.clock() < end:
            if should_stop():
                return "the tuner was stopping before the verdict"
            for replica in self.replicas.values():
                try:
                    self.verifier.observe_window(change_id, replica, since=started)
                except Exception:  # a missed sample only thins the window
                    log.exception("live change %s: observing %s failed", change_id, replica.name)
            self.sleep(self.settings.rollout.poll_seconds)
        failed = []
        for name, replica in self.replicas.items():
            verdict = self.verifier.judge_window(change_id, replica, since=started)
            verdicts[name] = verdict.reason
            if not verdict.ok:
                failed.append(f"{name}: worse than before: {verdict.reason}")
        return "; ".join(failed) or None

    def recover_live(self) -> str | None:
        """A live change a killed tuner left unjudged is put back (the planner decides again); what was done."""
        records = list(self.journal.records)
        decided = [r for r in records if r.get("kind") == "decision" and r.get("live")]
        if not decided:
            return None
        last = decided[-1]
        ended = any(r.get("kind") == "live" and r.get("id") == last["rollout"] and r.get("phase") in
                    ("verified", "rolled_back") for r in records)
        if ended:
            return None
        states = {name: self.client.live_state(r.base_url, self._live_dir(name)) for name, r in self.replicas.items()}
        before = {n: dict(last.get("before", {}).get(n, {})) for n in self.replicas}
        error = self._set_live({}, states, restore=before)
        self.journal.append("live", at=self.clock(), id=last["rollout"], phase="rolled_back",
                            reason="the tuner restarted before judging it", restore_error=error)
        return f"live change {last['rollout']} put back: the tuner restarted before judging it" + \
            (f" ({error})" if error else "")


def _contained(what: str, call: Callable[[], str | None]) -> str | None:
    """``call()``'s answer; an exception it raises is the same kind of answer (why the step failed), so
    that a live change half-applied is still put back on every engine, journaled and booked."""
    try:
        return call()
    except Exception as exc:
        log.exception("live change: %s raised", what)
        return f"{what} raised {type(exc).__name__}: {str(exc)[:200]}"


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
    http = collecting.http_settings(settings.scrape, config_dir=config_dir)
    # Every secret the configuration holds is masked in whatever the tuner shows or stores from here on.
    redactor = settings.redactor(token=http.bearer_token)
    logs.redact(redactor)
    rules = loading.load_all(loading.rule_paths(settings.rule_files, base_dir=config_dir))
    log.info("effective configuration: %s", json.dumps(settings.redacted_dump(redactor)))
    client = engines.EngineClient(http, deadline_seconds=settings.scrape.deadline_seconds)
    sleep_mode = settings.decisions.idle.sleep_after_seconds is not None
    if settings.live.enabled:  # the engines' control directories, private to this uid
        for t in settings.targets:
            live_knobs.prepare_control_dir(settings.live.dir_for(t.name))
    collectors = [collecting.Collector(t, client=client, server_load=sleep_mode,
                                       live_dir=settings.live.dir_for(t.name) if settings.live.enabled else None,
                                       slow_every_seconds=settings.scrape.gpu_interval_seconds)
                  for t in settings.targets]
    state_path = Path(settings.daemon.state_file)
    state_path = state_path if state_path.is_absolute() else config_dir / state_path
    state = TunerState.load(state_path, settings.targets, redactor=redactor)
    metrics = selfmetrics.TunerMetrics()
    maintenance = (scheduling.MaintenanceWindows(settings.daemon.maintenance_windows,
                                                 timezone=settings.daemon.maintenance_timezone)
                   if settings.daemon.maintenance_windows else None)
    stop_event = threading.Event()
    notifier = _MaskedNotifier(redactor)
    gatherer = collecting.Gatherer(stop=stop_event)  # SIGTERM ends a gathering at once
    applying: Applying | None = None
    startup: list[Callable[[], None]] = []  # run once, at the start of the first cycle (again until it succeeds)
    loop_holder: dict[str, scheduling.Loop] = {}

    if settings.mode == "apply":
        applying = _build_applying(settings, state, client, config_dir, stop_event=stop_event,
                                   on_transition=lambda r: _show_rollout(state, notifier, r))
        startup.append(lambda: _start_up(applying, state))

    def step() -> results.CycleResult:
        loop = loop_holder.get("loop")
        should_stop = loop.should_stop if loop is not None else (lambda: False)
        while startup:
            startup[0]()  # a failure (a full disk) raises here and is tried again at the next cycle
            startup.pop(0)
        act = applying if applying is None or _resumed(applying, state) else None
        return cycle.run_cycle(state, settings=settings, collectors=collectors, rules=tuple(rules),
                               rollout=act, maintenance=maintenance, metrics=metrics, gatherer=gatherer,
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
    with server:  # starts it (once) and closes it
        log.info("status endpoint on %s", server.url)
        with contextlib.suppress(KeyboardInterrupt):
            return loop.run()
    return 0


class _MaskedNotifier(notify.Notifier):
    """systemd's STATUS= is shown to every user (``systemctl status``): masked like a log line."""

    def __init__(self, redactor: secrets.Redactor) -> None:
        super().__init__()
        self._redactor = redactor

    def send(self, **fields: str | int) -> bool:
        return super().send(**{k: self._redactor.text(v) if isinstance(v, str) else v for k, v in fields.items()})


def _build_applying(settings: config.TunerSettings, state: TunerState, client: engines.EngineClient,
                    config_dir: Path, *, stop_event: threading.Event,
                    on_transition: Callable[[machine.Rollout], None]) -> Applying:
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
        on_bad_args=lambda name, argv, why: log.warning("%s: arguments failed: %s (%s)", name,
                                                        " ".join(redactor.argv(argv)), why),
        on_transition=on_transition, stop_event=stop_event, drains=settings.drain.kind != "none", restore=restore,
    )
    power = None
    if settings.gpu_control.enabled:  # privileged, off by default
        from tuner.actuators import gpu_power

        power = gpu_power.GpuPowerControl(enabled=True, devices=settings.gpu_control.devices,
                                          power_limit_w=settings.gpu_control.power_limit_w)
    return Applying(settings, state, driver, client, replicas, journal, verifier=verifier, power=power)


def _journal_path(settings: config.TunerSettings, config_dir: Path) -> Path:
    path = Path(settings.rollout.journal_file)
    return path if path.is_absolute() else config_dir / path


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f" [errno {exc.errno}]" if exc.errno is not None else "")


def _resumed(applying: Applying, state: TunerState) -> bool:
    """The journal holds no unfinished rollout, or the one it holds was resumed now. A journal append
    that failed mid-rollout (a full or read-only disk) stopped the rollout at a safe step and left it
    unfinished in the journal: it is resumed (machine Rule 3) before anything else, at the first cycle
    whose journal takes records again. False while it cannot be: the cycle then starts no rollout."""
    records = applying.journal.records
    last = next((i for i in range(len(records) - 1, -1, -1) if records[i]["kind"] == "rollout"), None)
    if last is None or journaling.unfinished(records[last:]) is None:
        return True
    try:
        outcome = applying.recover()
    except journaling.JournalWriteError as exc:
        log.error("the unfinished rollout is not resumed yet: %s", exc)
        return False
    if outcome is not None:
        state.rollout_state = dict(outcome.state)
    return journaling.unfinished(applying.journal.records) is None


def _start_the_rest(applying: Applying, state: TunerState) -> None:
    """Before a rollout is resumed: every replica it does not hold in flight that is down (a host reboot
    took them all) is started now, on what it ran — the new arguments where the rollout is done, the old
    ones where it is pending or rolled back (or not part of it). Else they stayed down until the rollout
    ended, and Rule 2 held the next replica for want of serving ones until the hold timeout aborted it."""
    unfinished = journaling.unfinished(applying.journal.records)
    if unfinished is None:
        return  # nothing to resume: the take-over below starts what is down
    unfinished = applying.driver.restored(unfinished)
    actuator = applying.driver.actuator
    for name in applying.replicas:
        if name in unfinished.in_flight or actuator.status(name).state is base.State.RUNNING:
            continue
        argv: Sequence[str] = state.args[name].argv()
        where = "not part of it"
        if name in unfinished.order:
            p = unfinished.of(name)
            where = p.state.value
            argv = unfinished.new_argv[name] if p.state is machine.State.DONE else unfinished.old_argv[name]
        actuator.adopt(name, argv)
        log.warning("started %s (down at start; %s in the unfinished rollout %s): %s", name, where, unfinished.id,
                    " ".join(state.redactor.argv(argv)))


def _start_up(applying: Applying, state: TunerState) -> None:
    """A tuner killed mid-rollout finishes or rolls back that rollout before anything else. This runs
    inside the first cycle, so systemd has READY=1 and watchdog pings meanwhile, and /healthz and /status
    answer (/status shows the resumed rollout's progress). A rollout that finished but was not booked
    (killed in between) is booked first. Then every replica is taken over: what was never started is
    started, what runs is learnt."""
    booked = applying.book_unbooked()
    _start_the_rest(applying, state)
    for outcome in (booked, applying.recover()):
        if outcome is not None:
            state.rollout_state = dict(outcome.state)
    if applying.settings.live.enabled:
        said = applying.recover_live()
        if said:
            log.warning("%s", said)
    actuator = applying.driver.actuator
    names = list(applying.replicas)
    for i, name in enumerate(names):
        before = actuator.status(name)
        after = actuator.adopt(name, state.args[name].argv())
        shown = " ".join(state.redactor.argv(state.args[name].argv()))
        if before.state is not base.State.RUNNING and after.state is base.State.RUNNING:
            log.info("started %s: %s", name, shown)
            if applying.settings.rollout.start_one_at_a_time and i + 1 < len(names):
                _wait_started(applying, name)
        if after.state is base.State.RUNNING and after.argv is None:
            log.warning("%s: %s", name, after.detail)
        elif after.argv is not None and tuple(after.argv) != tuple(state.args[name].argv()):
            log.warning("%s runs %s, not the arguments the tuner owns (%s); a rollout rolls back to what runs",
                        name, " ".join(state.redactor.argv(after.argv)), shown)
    state.save()


def _wait_started(applying: Applying, name: str) -> None:
    """Until the engine the tuner just started answers /health, exits, or start_timeout_seconds pass (or
    the tuner is stopping); the next engine starts after it."""
    rollout = applying.settings.rollout
    deadline = applying.clock() + rollout.start_timeout_seconds
    replica, actuator = applying.replicas[name], applying.driver.actuator
    while not applying.driver.stop_event.is_set():
        if applying.driver.prober.is_healthy(replica):
            log.info("%s is healthy; starting the next engine", name)
            return
        if actuator.status(name).state is not base.State.RUNNING:
            log.warning("%s exited while starting; starting the next engine", name)
            return
        if applying.clock() >= deadline:
            log.warning("%s not healthy after %.0f s; starting the next engine", name, rollout.start_timeout_seconds)
            return
        applying.sleep(rollout.poll_seconds)


def _show_rollout(state: TunerState, notifier: notify.Notifier, rollout: machine.Rollout) -> None:
    """Every transition: /status shows the rollout as it stands, systemd's STATUS= too."""
    state.rollout_state = {**rollout_state(rollout), "summary": machine.describe(rollout)}
    notifier.status(state.rollout_state["summary"])
