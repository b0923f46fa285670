"""The operator's switches on Kubernetes: pause the pool's tuner, pin one flag — annotations on the pool's
ConfigMap, the object the chart made for the pool's tuner (as KEDA pauses a ScaledObject with the annotation
``autoscaling.keda.sh/paused: "true"``, and VPA turns one container off with ``mode: Off``).

=================================  =====================================================================
annotation                         meaning
=================================  =====================================================================
``vllm-tuner.io/paused``           ``"true"``: hold every change (the tuner keeps observing and says what
                                   it would do); ``"false"``, or no annotation: not paused
``vllm-tuner.io/paused-reason``    why (optional): on ``/status``, in ``vllm-tuner status``, in the log
``pin.vllm-tuner.io/<flag>``       hold that engine flag where it is, e.g.
                                   ``pin.vllm-tuner.io/max-num-seqs`` (either engine's spelling, without
                                   the dashes); the value is why (may be empty)
=================================  =====================================================================

``kubectl annotate`` sets and removes them (docs/kubernetes.md). The leader reads them at every cycle from
the ConfigMap it reads anyway (no permission beyond the chart's Role), so a switch takes effect at the next
cycle; living on the ConfigMap, it survives a leader change and a restart of every pod, and the leader's
own writes keep it (``api``: a PUT carries the annotations it read). Through ``runtime.control`` they act as
``vllm-tuner pause``/``pin`` do under systemd: they add up with the configuration's ``decisions.paused``
and ``decisions.pins`` and reach the one decision path as its guards; ``/status`` shows them under
``control``, the leader's metrics as ``tuner_paused`` and ``tuner_pinned{flag}``.

**An annotation that does not read pauses the pool, and says why** — ``paused: "yes"``, a pin of a flag the
tuner does not change (a typo): a switch the operator set must not be lost to a typo, and holding every
change is the safe side (the rest of the tuner keeps observing). Reasons are shown on one line, at most
``MAX_REASON`` characters.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from tuner.model import knobs
from tuner.runtime import control

PAUSED = "vllm-tuner.io/paused"
PAUSED_REASON = "vllm-tuner.io/paused-reason"
PIN_PREFIX = "pin.vllm-tuner.io/"
MAX_REASON = 512
TRUE, FALSE = "true", "false"


def _one_line(text: str) -> str:
    """A reason as shown: one line of printable characters, at most ``MAX_REASON``."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= MAX_REASON else flat[:MAX_REASON - 1] + "…"


def pin_key(flag: str) -> str:
    """The annotation that pins ``flag`` (``--max-num-seqs`` → ``pin.vllm-tuner.io/max-num-seqs``)."""
    return PIN_PREFIX + control.pin_name(flag).lstrip("-")


def read(annotations: Mapping[str, str], *, configmap: str) -> control.Control:
    """The switches the pool's ConfigMap's annotations set, as ``runtime.control`` takes them (``configmap``
    names it in the reasons)."""
    problems: list[str] = []
    paused: str | None = None
    value = annotations.get(PAUSED)
    if value is not None:
        if value.strip().lower() == TRUE:
            paused = _one_line(annotations.get(PAUSED_REASON, ""))
        elif value.strip().lower() != FALSE:
            problems.append(f"{PAUSED} is {_one_line(value)[:40]!r}, expected \"true\" or \"false\"")
    pins: dict[str, control.Pin] = {}
    for key, why in sorted(annotations.items()):
        if not key.startswith(PIN_PREFIX):
            continue
        name = key[len(PIN_PREFIX):]
        try:
            flag = control.pin_name("--" + name.lstrip("-"))  # the flag's name, never the knob's
        except control.ControlFileError:
            problems.append(f"{key[:80]} pins no flag the tuner changes (one of "
                            f"{', '.join(f.lstrip('-') for f in knobs.known_flags())})")
            continue
        pins[flag] = control.Pin(_one_line(why) or f"annotation {key}")
    source = f"annotation {PAUSED}"
    if problems:
        why = (f"the annotations of ConfigMap {configmap} do not read ({'; '.join(problems)}): holding every "
               "change until they are fixed")
        return control.Control(paused=why, pins=pins, error=why, pause_source=source)
    return control.Control(paused=paused, pins=pins, pause_source=source)


def kubectl(command: str, *, namespace: str, configmap: str, flag: str | None = None, reason: str = "") -> str:
    """The ``kubectl annotate`` that does what ``vllm-tuner pause|resume|pin|unpin`` does under systemd, for
    the pool whose ConfigMap is ``configmap`` (a shell command line, quoted)."""
    head = f"kubectl -n {shlex.quote(namespace)} annotate configmap {shlex.quote(configmap)}"
    if command == "pause":
        return f"{head} --overwrite {PAUSED}=true" + (f" {shlex.quote(PAUSED_REASON + '=' + reason)}" if reason else "")
    if command == "resume":
        return f"{head} {PAUSED}- {PAUSED_REASON}-"
    assert flag is not None
    key = pin_key(flag)
    if command == "pin":
        return f"{head} --overwrite {shlex.quote(key + '=' + reason)}"
    return f"{head} {key}-"
