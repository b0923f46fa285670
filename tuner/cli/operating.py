"""Operating a running tuner: ``vllm-tuner status | history | pause | resume | pin | unpin``.

- ``status`` reads the daemon's ``/status`` (``daemon.listen_host:listen_port``, 127.0.0.1:9180): the
  pool, each engine's flags, the rollout in flight, the last decisions with their reasons, the switches.
- ``history`` reads the rollout journal (``rollout.journal_file``): every decision the tuner carried
  out, when, why, and how its rollout ended. Read-only, beside a running tuner.
- ``pause``/``resume``/``pin``/``unpin`` write the runtime switches (``runtime.control``): the daemon
  takes them at its next cycle, and they survive its restarts. A Kubernetes pool's switches are
  annotations on its ConfigMap (``kube.switches``): given its configuration, they say the ``kubectl
  annotate`` that does it (exit 2), rather than write a file its leader never reads.

Exit codes: 0 done; 1 the tuner (or its journal) could not be read; 2 a bad argument or configuration.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import sys
from pathlib import Path
from typing import Any

from tuner import config
from tuner.cli import arguments
from tuner.errors import TunerError

DEFAULT_CONFIG = "/etc/vllm-tuner/config.yaml"


class UnreachableError(TunerError):
    """The daemon's endpoint or its journal cannot be read (exit code 1)."""


def _when(at: Any) -> str:
    if not isinstance(at, int | float):
        return "?"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _settings(path: str) -> config.TunerSettings:
    return config.load(path, runnable=False)


# --- status ---------------------------------------------------------------------------------------------


def status_url(ns: argparse.Namespace) -> str:
    if ns.url:
        return str(ns.url).rstrip("/")
    if ns.config:
        d = _settings(ns.config).daemon
        host: str = "127.0.0.1" if d.listen_host in ("0.0.0.0", "::", "") else d.listen_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{d.listen_port}"
    return "http://127.0.0.1:9180"


def fetch_status(url: str, *, timeout_seconds: float) -> dict[str, Any]:
    import httpx

    try:
        r = httpx.get(f"{url}/status", timeout=timeout_seconds)
        r.raise_for_status()
        body = r.json()
    except httpx.HTTPError as exc:
        raise UnreachableError(f"cannot read the tuner's status at {url}/status: {exc or type(exc).__name__}; is it "
                          "running? (systemctl status vllm-tuner; --url or --config say where it listens)") from exc
    except ValueError as exc:
        raise UnreachableError(f"{url}/status did not answer JSON ({exc}); is that the tuner's status port?") from exc
    if not isinstance(body, dict):
        raise UnreachableError(f"{url}/status did not answer a JSON object; is that the tuner's status port?")
    return body


def status_text(body: dict[str, Any], *, url: str, now: float) -> list[str]:
    lines: list[str] = []
    age = f", {now - body['finished_at']:.0f}s ago" if isinstance(body.get("finished_at"), int | float) else ""
    lines.append(f"vllm-tuner at {url}: mode {body.get('mode', '?')}, cycle {body.get('cycle')}{age}")
    control = body.get("control") or {}
    paused = f"yes ({control.get('paused_reason')})" if control.get("paused") else "no"
    lines.append(f"paused: {paused}")
    pins = control.get("pins") or {}
    lines.append("pinned: " + (", ".join(f"{flag} ({p.get('reason') or 'no reason given'}; {p.get('from')})"
                                         for flag, p in pins.items()) or "none"))
    lines.append(f"last cycle: {body.get('summary', '')}")
    targets = body.get("targets") or {}
    lines.append("pool:" if targets else "pool: no target reported yet")
    for name, t in targets.items():
        window = t.get("window") or {}
        args = " ".join(f"{k} {v}" if v != "" else k for k, v in (t.get("current_args") or {}).items())
        state = f"scrape failed: {window['scrape_error']}" if window.get("scrape_error") else \
            f"{window.get('snapshots', 0)} snapshot(s)"
        lines.append(f"  {name}: {state}; flags: {args or '(the engine defaults)'}")
    rollout = body.get("rollout")
    if rollout:
        what = rollout.get("summary") or ", ".join(f"{k}={v}" for k, v in (rollout.get("replicas") or {}).items())
        lines.append(f"rollout: {rollout.get('id', '')} {rollout.get('outcome', '')} {what}".rstrip())
    else:
        lines.append("rollout: none in flight")
    pending = body.get("pending")
    if pending:
        lines.append(f"pending: {pending.get('plan', {}).get('summary', '')} ({pending.get('reason')})")
    decided = []
    for name, t in targets.items():
        plan = t.get("plan") or {}
        for rec in plan.get("recommendations", []):
            decided.append(f"  {name}: {rec['rule']}: {rec['flag']} {rec['from']}→{rec['to']} ({rec['reason']})")
        for held in plan.get("held", []):
            decided.append(f"  {name}: {held['rule']}: held by {held['guard']} ({held['reason']})")
    lines.append("last decisions:" if decided else "last decisions: none (mode observe, or no rule matched)")
    lines.extend(decided)
    return lines


def _unreachable(exc: UnreachableError) -> int:
    print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 1


def cmd_status(ns: argparse.Namespace) -> int:
    url = status_url(ns)
    try:
        body = fetch_status(url, timeout_seconds=ns.timeout_seconds)
    except UnreachableError as exc:
        return _unreachable(exc)
    if ns.format == "json":
        print(json.dumps(body, indent=1))
    else:
        from tuner.runtime import control

        print("\n".join(status_text(body, url=url, now=control.clock())))
    return 0


# --- history --------------------------------------------------------------------------------------------


def history_entries(records: list[Any]) -> list[dict[str, Any]]:
    """One entry per decision the tuner carried out, with how its rollout ended (from the journal)."""
    from tuner.rollout import journal, machine

    rollouts = journal.replay(records)
    out: list[dict[str, Any]] = []
    for r in journal.decisions(records):
        entry: dict[str, Any] = {"at": r.get("at"), "target": r.get("target")}
        if "action" in r:
            action = r["action"] or {}
            entry.update(kind="action", action=action.get("kind"), reason=action.get("reason"), error=r.get("error"))
        else:
            rollout = rollouts.get(str(r.get("rollout")))
            entry.update(kind="live" if r.get("live") else "restart", rollout=r.get("rollout"),
                         changes=[{k: c.get(k) for k in ("flag", "from", "to", "rule", "reason")}
                                  for c in r.get("changes", [])],
                         outcome=machine.outcome(rollout).value if rollout is not None else "unknown",
                         detail=machine.describe(rollout) if rollout is not None else None,
                         aborted=rollout.aborted if rollout is not None else None)
        out.append(entry)
    return out


def history_text(entries: list[dict[str, Any]]) -> list[str]:
    if not entries:
        return ["no decision carried out yet (the journal is empty: mode observe or recommend, or nothing to do)"]
    lines = []
    for e in entries:
        if e["kind"] == "action":
            lines.append(f"{_when(e['at'])}  {e['target']}: {e['action']} ({e['reason']})"
                         + (f" failed: {e['error']}" if e.get("error") else ""))
            continue
        changes = ", ".join(f"{c['flag']} {c['from']}→{c['to']} ({c['rule']}: {c['reason']})" for c in e["changes"])
        end = e["outcome"] + (f" ({e['aborted']})" if e.get("aborted") else "")
        lines.append(f"{_when(e['at'])}  {e['rollout']} {e['kind']}: {changes}: {end}")
    return lines


def cmd_history(ns: argparse.Namespace) -> int:
    from tuner.rollout import journal

    settings = _settings(ns.config)
    path = Path(settings.rollout.journal_file)
    path = path if path.is_absolute() else Path(ns.config).resolve().parent / path
    try:
        records = journal.read_records(path)
    except OSError as exc:
        return _unreachable(UnreachableError(f"cannot read the journal {path}: {exc.strerror or exc}"))
    except journal.JournalError as exc:
        return _unreachable(UnreachableError(str(exc)))
    entries = history_entries(records)[-ns.limit:] if ns.limit else history_entries(records)
    if ns.format == "json":
        print(json.dumps(entries, indent=1))
    else:
        print("\n".join(history_text(entries)))
    return 0


# --- the switches ---------------------------------------------------------------------------------------


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "?"


def cmd_switch(ns: argparse.Namespace) -> int:
    import dataclasses

    from tuner.runtime import control

    settings = _settings(ns.config)
    if settings.kubernetes is not None:
        raise control.ControlFileError(_on_kubernetes(ns, settings.kubernetes))
    path = control.path_for(settings, ns.config)
    now = control.load(path)
    base = control.Control() if now.error else now  # a garbled file is replaced by the switch asked for
    reason = " ".join((getattr(ns, "reason", None) or "").split())
    if ns.command == "pause":
        new = dataclasses.replace(base, paused=reason, paused_at=control.clock(), paused_by=_who())
        said = f"paused{': ' + reason if reason else ''}"
    elif ns.command == "resume":
        new = dataclasses.replace(base, paused=None, paused_at=None, paused_by="")
        said = "resumed" if now.paused is not None else "was not paused (by vllm-tuner pause)"
    elif ns.command == "pin":
        flag = control.pin_name(ns.flag)
        new = dataclasses.replace(base, pins={**base.pins, flag: control.Pin(reason, control.clock(), _who())})
        said = f"pinned {flag}{': ' + reason if reason else ''}"
    else:
        flag = control.pin_name(ns.flag)
        if flag not in base.pins:
            pinned = ", ".join(base.pins) or "none"
            raise control.ControlFileError(f"{flag} is not pinned at runtime (runtime pins: {pinned}); a pin in the "
                                           "configuration (decisions.pins) is removed there")
        new = dataclasses.replace(base, pins={k: v for k, v in base.pins.items() if k != flag})
        said = f"unpinned {flag}"
    control.save(path, new)
    print(f"{said} ({path}; the tuner takes it at its next cycle)")
    return 0


def _on_kubernetes(ns: argparse.Namespace, k: config.KubernetesSettings) -> str:
    """What to run instead, for a Kubernetes pool's configuration: its leader reads annotations, no file."""
    import os

    from tuner.kube import switches
    from tuner.runtime import control

    flag = control.pin_name(ns.flag) if ns.command in ("pin", "unpin") else None
    reason = " ".join((getattr(ns, "reason", None) or "").split())
    command = switches.kubectl(ns.command, namespace=k.namespace or os.environ.get("POD_NAMESPACE") or "<namespace>",
                               configmap=k.journal_configmap, flag=flag, reason=reason)
    return (f"{ns.config} is the configuration of the Kubernetes pool {k.pool}: its leader takes the pause and "
            f"pins from annotations on the pool's ConfigMap {k.journal_configmap}, not from a file; run: "
            f"{command} (docs/kubernetes.md, \"Pause and pins\")")


OWN_OPTIONS = frozenset({"--config", "--reason", "--help", "-h"})


def flag_as_positional(argv: list[str]) -> list[str]:
    """``pin --max-num-seqs --reason x`` as written: the engine flag is the positional argument, not an
    option of ``pin`` (argparse would refuse it), so it is moved behind ``--``."""
    if argv[:1] not in (["pin"], ["unpin"]) or "--" in argv:
        return argv
    for i, token in enumerate(argv[1:], start=1):
        if token.startswith("--") and token.split("=", 1)[0] not in OWN_OPTIONS and argv[i - 1] not in OWN_OPTIONS:
            return [*argv[:i], *argv[i + 1:], "--", token]
    return argv


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="what the running tuner sees and does: the pool, each engine's flags, the "
                                      "rollout in flight, the last decisions with reasons (reads its /status)")
    p.add_argument("--url", type=arguments.http_url,
                   help="the tuner's status endpoint, e.g. http://127.0.0.1:9180 (default: from --config, "
                        "else http://127.0.0.1:9180)")
    p.add_argument("--config", help="the tuner's configuration (for daemon.listen_host/listen_port)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--timeout-seconds", type=_positive, default=5.0, help="give up after this long (default 5)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("history", help="the decisions the tuner carried out and how each rollout ended (reads "
                                       "the rollout journal)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"the tuner's configuration (default {DEFAULT_CONFIG})")
    p.add_argument("--limit", type=_count, default=0, help="only the last N entries (default: all)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_history)

    for name, what in (("pause", "hold every change until `resume` (the tuner keeps observing); survives restarts"),
                       ("resume", "undo `pause`")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--config", default=DEFAULT_CONFIG, help=f"the tuner's configuration (default {DEFAULT_CONFIG})")
        if name == "pause":
            p.add_argument("--reason", help="why (shown on /status, in `status` and in the log)")
        p.set_defaults(func=cmd_switch)
    for name, what in (("pin", "hold one engine flag where it is (the tuner never changes it); survives restarts"),
                       ("unpin", "undo `pin`")):
        p = sub.add_parser(name, help=what)
        p.add_argument("flag", help="an engine flag the tuner changes, e.g. --max-num-seqs (or max-num-seqs)")
        p.add_argument("--config", default=DEFAULT_CONFIG, help=f"the tuner's configuration (default {DEFAULT_CONFIG})")
        if name == "pin":
            p.add_argument("--reason", help="why (shown on /status, in `status` and in the log)")
        p.set_defaults(func=cmd_switch)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, e.g. 5") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0, e.g. 5")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number, e.g. 20") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number ≥ 0, e.g. 20")
    return value

