"""The engines' own live-knob APIs as data: for each path its routes, the request that carries the tuner's
values and what the engine's answers mean. No HTTP here: the engine client (``sources.engines``) sends and
reads, probes which path an engine offers and keeps what it found; this module only says what to send and
how to read what comes back. Every answer is the engine's and is read like any untrusted body
(``portable.untrusted``): a number out of its range, a field of the wrong type, is not believed.

The paths, in the order the client tries them (docs/engine-contract.md §8 has the shapes and their sources):

vLLM
  1. ``trimtab``: vLLM pull request 55018 ("[Core] Hot scheduler knobs through an EngineCore utility method and
     dev router"; ``vllm/entrypoints/serve/dev/trimtab/api_router.py`` and ``EngineCore.trimtab_set_knobs`` /
     ``trimtab_get_knobs`` in ``vllm/v1/engine/core.py``), registered only with ``VLLM_SERVER_DEV_MODE=1``.
     ``POST /trimtab/set_knobs`` ``{knob: value}`` answers 200 ``{"ok": true, "applied": {...}, "rejected": {}}``
     or 400 ``{"ok": false, "applied": {...}, "rejected": {knob: reason}}``; a valid knob beside a rejected one is
     applied all the same. ``GET /trimtab/knobs`` answers ``{"max_num_seqs"`` (the target: a cap below the
     running count is held pending and tightened as requests finish), ``"max_num_seqs_effective"``,
     ``"max_num_batched_tokens"``, ``"long_prefill_token_threshold"``, ``"running"``, ``"ceilings"}``;
     ``ceilings`` (the boot values, the upper bounds) is empty until the first set, so until then the values it
     reports are the startup values.
  2. ``runtime_config``: vLLM pull request 54816 ("[RFC][Core] Prototype runtime scheduler sequence cap";
     ``vllm/entrypoints/serve/dev/runtime_config/api_router.py``), dev mode too. ``GET /v1/runtime_config``
     answers ``{"max_num_running_seqs", "max_num_seqs_capacity"}``; ``PATCH /v1/runtime_config``
     ``{"max_num_running_seqs": n}`` (a strict integer >= 1, no other field) answers 200 with the new config,
     400 ``{"detail": ...}`` above the capacity, 422 for another field or a non-integer, 501 where the scheduler
     has no live cap.
  3. the engine-side plugin (``sources.live_knobs``) where neither answers.
SGLang
  1. ``set_internal_state``: ``POST /set_internal_state`` ``{"server_args": {...}}`` answers 200 with one
     ``updated`` boolean per data-parallel rank (``TokenizerManager.set_internal_state``); ``GET /get_server_info``
     reads back, per rank, in ``internal_states``. Stock SGLang accepts only ``STOCK_SGLANG_KEYS`` (none is a
     tuner knob; ``Scheduler.set_internal_state``'s ``args_allow_update``), any other key makes the rank answer
     false. SGLang pull request 37661 ("Extend set_internal_state to hot scheduler knobs") adds
     ``max_running_requests`` (1..the boot value), ``chunked_prefill_size`` (> 0), ``max_prefill_tokens``
     (1..the KV pool), ``schedule_policy`` … and reports them, with ``ceilings``, under
     ``internal_states[rank]["trimtab"]``: that block is how the client tells the two apart.

The tuner's knobs on each path (``None`` in a request: the engine's startup value, sent explicitly):

============================  =====================  ======================  ======================================
tuner knob                    trimtab                runtime_config          set_internal_state (pull request 37661)
============================  =====================  ======================  ======================================
max_num_seqs                  max_num_seqs           max_num_running_seqs    max_running_requests
max_num_batched_tokens        max_num_batched_tokens (not live)              chunked_prefill_size and
                                                                             max_prefill_tokens, both (read: the
                                                                             smaller of the two)
long_prefill_token_threshold  same name              (not live)              (not live: SGLang has no such knob)
============================  =====================  ======================  ======================================

SGLang's step budget is two limits: ``chunked_prefill_size`` bounds one request's prefill chunk and
``max_prefill_tokens`` the prefill tokens of one batch (``PrefillAdder``); vLLM's ``max_num_batched_tokens``
bounds the whole step, so a live budget sets both and reads back the smaller. Its envelope is the smaller of
the two startup values (the top-level ``chunked_prefill_size`` / ``max_prefill_tokens`` of ``/get_server_info``,
which the pull request leaves alone); with chunked prefill off (``-1``) the budget is not live.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tuner.model import live
from tuner.portable import untrusted

TRIMTAB, RUNTIME_CONFIG, SET_INTERNAL_STATE, PLUGIN = "trimtab", "runtime_config", "set_internal_state", "plugin"
ORDER: Mapping[str, tuple[str, ...]] = {"vllm": (TRIMTAB, RUNTIME_CONFIG, PLUGIN), "sglang": (SET_INTERNAL_STATE,)}
"""The order the client tries the paths in, per engine kind: an engine's own API first (the one that moves the
most knobs first), the plugin last (vLLM only: it runs inside vLLM's scheduler)."""

READ = {TRIMTAB: "/trimtab/knobs", RUNTIME_CONFIG: "/v1/runtime_config", SET_INTERNAL_STATE: "/get_server_info"}
WRITE = {TRIMTAB: ("POST", "/trimtab/set_knobs"), RUNTIME_CONFIG: ("PATCH", "/v1/runtime_config"),
         SET_INTERNAL_STATE: ("POST", "/set_internal_state")}
WHERE = {TRIMTAB: "vLLM pull request 55018 with VLLM_SERVER_DEV_MODE=1",
         RUNTIME_CONFIG: "vLLM pull request 54816 with VLLM_SERVER_DEV_MODE=1",
         SET_INTERNAL_STATE: "SGLang"}

TRIMTAB_NAMES: Mapping[str, str] = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                                    "long_prefill_token_threshold": "long_prefill_token_threshold"}
"""tuner knob → its name in ``/trimtab/set_knobs`` (the same)."""
SGLANG_SEQS = "max_running_requests"
SGLANG_BUDGET = ("chunked_prefill_size", "max_prefill_tokens")
STOCK_SGLANG_KEYS = ("pp_max_micro_batch_size", "speculative_accept_threshold_single",
                     "speculative_accept_threshold_acc", "dspark_force_budget_frac", "dspark_clear_info_records")
"""What stock SGLang's ``set_internal_state`` accepts (sgl-project/sglang ``python/sglang/srt/managers/
scheduler.py``, ``args_allow_update``; older releases: the two ``speculative_*`` keys and
``max_micro_batch_size``)."""

_MAX = 1 << 30  # no engine's cap or budget comes near a billion; anything larger is not believed
_REASON = 300  # an engine's reason is kept to this many characters


@dataclass(frozen=True)
class Reading:
    """What one read of a path says: the state in the tuner's terms, and the startup values in the API's own
    names (what a request puts back for ``None``)."""

    state: live.LiveState
    startup: Mapping[str, int] = field(default_factory=dict)


def _count(value: Any, what: str, *, lo: int = 1) -> int:
    return untrusted.integer(value, what=what, lo=lo, hi=_MAX)


def _opt_count(value: Any, what: str, *, lo: int = 1) -> int | None:
    try:
        return _count(value, what, lo=lo)
    except untrusted.Untrusted:
        return None


def _reason(value: Any) -> str:
    """An engine's reason as one short line (a string, or a JSON value described)."""
    text = value if isinstance(value, str) else untrusted.describe(value)
    line = " ".join(text.split())
    return line if len(line) <= _REASON else line[:_REASON - 1] + "…"


# --- vLLM pull request 55018: /trimtab ----------------------------------------------------------------------


def read_trimtab(doc: Any, remembered: Mapping[str, int]) -> Reading | None:
    """``GET /trimtab/knobs``'s answer (None: not that API's). ``remembered``: the startup values read earlier
    from this engine (they are the values it reports while ``ceilings`` is empty, i.e. before any set)."""
    if not isinstance(doc, dict):
        return None
    try:
        seqs = _count(doc.get("max_num_seqs"), "max_num_seqs")
        budget = _count(doc.get("max_num_batched_tokens"), "max_num_batched_tokens")
    except untrusted.Untrusted:
        return None
    threshold = _opt_count(doc.get("long_prefill_token_threshold"), "long_prefill_token_threshold", lo=0)
    found = doc.get("ceilings")
    ceilings: dict[str, Any] = found if isinstance(found, dict) else {}
    startup = dict(remembered)
    if not ceilings:  # nothing set since this engine started: what it runs now is its startup value
        startup = {"max_num_seqs": seqs, "max_num_batched_tokens": budget}
        if threshold is not None:
            startup["long_prefill_token_threshold"] = threshold
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        ceiling = _opt_count(ceilings.get(name), f"ceilings.{name}")
        if ceiling is not None:
            startup[name] = ceiling
    envelope = {k: startup[k] for k in TRIMTAB_NAMES if k in startup}
    values = {"max_num_seqs": seqs, "max_num_batched_tokens": budget}
    not_live: dict[str, str] = {}
    if threshold is None:
        not_live["long_prefill_token_threshold"] = "this engine's /trimtab/knobs does not report it"
    else:
        values["long_prefill_token_threshold"] = threshold
        if "long_prefill_token_threshold" not in envelope:
            not_live["long_prefill_token_threshold"] = ("its startup value is unknown (the tuner first saw this engine "
                                                        "after a live change), so it could not be put back")
    return Reading(live.LiveState(available=True, envelope=envelope, values=values, not_live=not_live, via=TRIMTAB),
                   startup=envelope)


def trimtab_request(values: Mapping[str, int | None], reading: Reading) -> dict[str, Any] | str:
    """The ``POST /trimtab/set_knobs`` body for these values, or why they cannot be sent."""
    body: dict[str, Any] = {}
    for knob, value in values.items():
        if knob not in TRIMTAB_NAMES:
            return f"{knob} is not a knob of /trimtab/set_knobs"
        name = TRIMTAB_NAMES[knob]
        if value is None:
            if name not in reading.startup:
                if knob in reading.state.not_live:
                    continue  # never moved live through this path: it runs its startup value
                return f"the startup value of {knob} is unknown: it cannot be put back live"
            value = reading.startup[name]
        body[name] = value
    return body


def trimtab_refusal(doc: Any) -> str:
    """Why a 400 from ``/trimtab/set_knobs`` refused (its ``rejected`` map)."""
    rejected = doc.get("rejected") if isinstance(doc, dict) else None
    if isinstance(rejected, dict) and rejected:
        return "; ".join(f"{_reason(k)}: {_reason(v)}" for k, v in list(rejected.items())[:8])
    return "the engine answered ok: false without a reason"


# --- vLLM pull request 54816: /v1/runtime_config -------------------------------------------------------------


def read_runtime_config(doc: Any) -> Reading | None:
    """``GET`` (or ``PATCH``) ``/v1/runtime_config``'s answer (None: not that API's, or a scheduler without
    the live cap: no ``max_num_seqs_capacity``)."""
    if not isinstance(doc, dict):
        return None
    try:
        running = _count(doc.get("max_num_running_seqs"), "max_num_running_seqs")
        capacity = _count(doc.get("max_num_seqs_capacity"), "max_num_seqs_capacity")
    except untrusted.Untrusted:
        return None
    not_live = {"max_num_batched_tokens": "not in vLLM's /v1/runtime_config (pull request 54816 moves the cap only)",
                "long_prefill_token_threshold": "not in vLLM's /v1/runtime_config (pull request 54816 moves the cap "
                                                "only)"}
    return Reading(live.LiveState(available=True, envelope={"max_num_seqs": capacity},
                                  values={"max_num_seqs": running}, not_live=not_live, via=RUNTIME_CONFIG),
                   startup={"max_num_running_seqs": capacity})


def runtime_config_request(values: Mapping[str, int | None], reading: Reading) -> dict[str, Any] | str:
    """The ``PATCH /v1/runtime_config`` body (the cap, always explicit: the API has no "startup value")."""
    body: dict[str, Any] = {}
    for knob, value in values.items():
        if knob != "max_num_seqs":
            if value is None:
                continue  # never moved live through this path: it runs its startup value
            return f"{knob} cannot move live through vLLM's /v1/runtime_config (only the admission cap does)"
        body["max_num_running_seqs"] = value if value is not None else reading.startup["max_num_running_seqs"]
    return body


def detail(doc: Any) -> str:
    """FastAPI's error body: ``{"detail": "text"}`` or ``{"detail": [{"loc": [...], "msg": ...}, ...]}``."""
    found = doc.get("detail") if isinstance(doc, dict) else None
    if isinstance(found, list):
        parts = []
        for item in found[:4]:
            if isinstance(item, dict):
                loc = item.get("loc")
                where = ".".join(str(p) for p in loc[1:]) if isinstance(loc, list) and len(loc) > 1 else ""
                parts.append(f"{_reason(where)}: {_reason(item.get('msg'))}" if where else _reason(item.get("msg")))
        return "; ".join(parts) or "no reason given"
    return _reason(found) if found is not None else "no reason given"


# --- SGLang: /set_internal_state (stock keys; pull request 37661's) --------------------------------------------


def read_sglang(doc: Any) -> Reading | None:
    """``GET /get_server_info``'s answer (None: not SGLang's). Stock SGLang reads as not available (its
    ``set_internal_state`` moves none of the tuner's knobs); pull request 37661's as available."""
    if not isinstance(doc, dict) or not isinstance(doc.get("internal_states"), list):
        return None
    ranks = [r for r in doc["internal_states"][:256] if isinstance(r, dict)]
    if not ranks:
        return None
    blocks = [r.get("trimtab") for r in ranks]
    if not all(isinstance(b, dict) for b in blocks):
        return Reading(live.LiveState(
            why_not=(f"SGLang's stock /set_internal_state accepts only {', '.join(STOCK_SGLANG_KEYS)}: none of the "
                     "tuner's knobs (max_running_requests, chunked_prefill_size and max_prefill_tokens need SGLang "
                     "pull request 37661)"), via=SET_INTERNAL_STATE))
    startup_chunk = doc.get("chunked_prefill_size")
    startup_prefill = _opt_count(doc.get("max_prefill_tokens"), "max_prefill_tokens")
    first = blocks[0]
    assert isinstance(first, dict)

    def agreed(name: str) -> int | None:
        seen = {_opt_count(b.get(name), name) for b in blocks if isinstance(b, dict)}
        return seen.pop() if len(seen) == 1 else None  # ranks that disagree (or do not say) give no value

    envelope: dict[str, int] = {}
    startup: dict[str, int] = {}
    not_live: dict[str, str] = {"long_prefill_token_threshold": "SGLang has no long_prefill_token_threshold"}
    found = first.get("ceilings")
    ceilings: dict[str, Any] = found if isinstance(found, dict) else {}
    seqs = agreed(SGLANG_SEQS)
    seqs_top = _opt_count(ceilings.get(SGLANG_SEQS), "ceilings.max_running_requests")
    seqs_top = seqs_top if seqs_top is not None else seqs  # no ceiling yet: nothing set, the value is the boot one
    if seqs_top is not None:
        envelope["max_num_seqs"] = startup[SGLANG_SEQS] = seqs_top
    chunk = _opt_count(startup_chunk, "chunked_prefill_size")
    if chunk is None or startup_prefill is None:
        not_live["max_num_batched_tokens"] = (
            "chunked prefill is off on this engine (--chunked-prefill-size -1): the step budget is not live"
            if isinstance(startup_chunk, int) and not isinstance(startup_chunk, bool) and startup_chunk <= 0
            else "/get_server_info reports no startup chunked_prefill_size and max_prefill_tokens")
    else:
        startup["chunked_prefill_size"], startup["max_prefill_tokens"] = chunk, startup_prefill
        envelope["max_num_batched_tokens"] = min(chunk, startup_prefill)
    values: dict[str, int] = {}
    if seqs is not None:
        values["max_num_seqs"] = seqs
    live_chunk, live_prefill = agreed("chunked_prefill_size"), agreed("max_prefill_tokens")
    if "max_num_batched_tokens" not in not_live and live_chunk is not None and live_prefill is not None:
        values["max_num_batched_tokens"] = min(live_chunk, live_prefill)
    return Reading(live.LiveState(available=True, envelope=envelope, values=values, not_live=not_live,
                                  via=SET_INTERNAL_STATE), startup=startup)


def sglang_request(values: Mapping[str, int | None], reading: Reading) -> dict[str, Any] | str:
    """The ``POST /set_internal_state`` body: ``{"server_args": {...}}`` in SGLang's names."""
    args: dict[str, Any] = {}
    for knob, value in values.items():
        if knob == "max_num_seqs":
            if value is None and SGLANG_SEQS not in reading.startup:
                return "the startup max_running_requests is unknown: it cannot be put back live"
            args[SGLANG_SEQS] = value if value is not None else reading.startup[SGLANG_SEQS]
        elif knob == "max_num_batched_tokens" and knob not in reading.state.not_live:
            for name in SGLANG_BUDGET:
                args[name] = value if value is not None else reading.startup[name]
        elif value is not None:
            return f"{knob} cannot move live through SGLang's /set_internal_state: " + reading.state.not_live.get(
                knob, "not one of its knobs")
    return {"server_args": args}


def sglang_refusal(doc: Any) -> str | None:
    """None when every rank answered ``updated: true``, else why not (SGLang logs its reason, the HTTP answer
    carries none)."""
    entries = doc if isinstance(doc, list) else [doc]
    flags = [e if isinstance(e, bool) else (e.get("updated") if isinstance(e, dict) else None) for e in entries]
    if flags and all(f is True for f in flags):
        return None
    bad = [str(i) for i, f in enumerate(flags) if f is not True] or ["0"]
    return (f"data-parallel rank{'s' if len(bad) > 1 else ''} {', '.join(bad[:16])} answered updated=false "
            "(a key or value this SGLang does not accept; its log says which)")


# --- any path ------------------------------------------------------------------------------------------------


def _runtime_config(doc: Any, _remembered: Mapping[str, int]) -> Reading | None:
    return read_runtime_config(doc)


def _sglang(doc: Any, _remembered: Mapping[str, int]) -> Reading | None:
    return read_sglang(doc)


READERS: Mapping[str, Callable[[Any, Mapping[str, int]], Reading | None]] = {
    TRIMTAB: read_trimtab, RUNTIME_CONFIG: _runtime_config, SET_INTERNAL_STATE: _sglang}
"""path → its reader: (the read route's answer, the startup values remembered) → ``Reading`` or None."""
REQUESTS: Mapping[str, Callable[[Mapping[str, int | None], Reading], dict[str, Any] | str]] = {
    TRIMTAB: trimtab_request, RUNTIME_CONFIG: runtime_config_request, SET_INTERNAL_STATE: sglang_request}
"""path → its request builder: (values, the last reading) → the body, or why it cannot be sent."""


def wanted(values: Mapping[str, int | None], state: live.LiveState) -> dict[str, int | None]:
    """What the engine should report after these values: each value, or its startup value for None."""
    return {k: v if v is not None else state.envelope.get(k) for k, v in values.items()}


def mismatch(values: Mapping[str, int | None], state: live.LiveState) -> str | None:
    """None when the engine reports every asked value (read-back verification), else what it reports instead.
    A knob the path does not carry and that was asked back to its startup value is not checked."""
    want = wanted(values, state)
    wrong = [f"{k} {state.values.get(k, 'nothing')} (asked {v})" for k, v in want.items()
             if not (values.get(k) is None and k in state.not_live) and state.values.get(k) != v]
    return "the engine reports " + ", ".join(wrong) + " after the set" if wrong else None


def taken(values: Mapping[str, int | None], state: live.LiveState) -> str:
    """The asked values the engine reports (after a refusal: what it applied all the same), as text."""
    want = wanted(values, state)
    return ", ".join(f"{k} {v}" for k, v in want.items() if values.get(k) is not None and state.values.get(k) == v)
