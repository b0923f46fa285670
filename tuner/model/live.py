"""What an engine can change live, without a restart, and what it runs now: a frozen value the planner
reads, built by the engine client (``sources.engines``) from whichever live path the engine offers — its own
HTTP API (``sources.live_paths``: vLLM pull requests 55018 and 54816, SGLang pull request 37661) or the
engine-side plugin's acknowledgements (``sources.live_knobs``). ``via`` says which.

Three knobs can move live, each inside the envelope the engine was started with and never beyond it, where
the path carries them (``not_live`` says why not otherwise):

================================  =========================================================================
tuner knob                        range
================================  =========================================================================
``max_num_seqs``                  1 .. the startup value (admission cap; a lower cap drains down, nobody
                                  is preempted)
``max_num_batched_tokens``        the startup ``max_num_seqs`` .. the startup value (the step budget)
``long_prefill_token_threshold``  0 (off) .. the startup step budget (a prompt's share of one step); its
                                  ``envelope`` entry is the startup value to go back to, not a ceiling
================================  =========================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LIVE_NAMES: Mapping[str, str] = {"max_num_seqs": "max_num_active_seqs",
                                 "max_num_batched_tokens": "max_num_batched_tokens",
                                 "long_prefill_token_threshold": "long_prefill_token_threshold"}
"""tuner knob → the live knob's name in the plugin's protocol (each engine API's own names are in
``sources.live_paths``)."""

ZERO_MEANS_OFF = frozenset({"long_prefill_token_threshold"})
"""Live knobs whose 0 is a value (the threshold off), not a missing count."""

VIAS = ("plugin", "runtime_config", "trimtab", "set_internal_state")
"""The live paths (``via``): the engine-side plugin's control files, vLLM pull request 54816's
``/v1/runtime_config``, vLLM pull request 55018's ``/trimtab/set_knobs``, SGLang's ``/set_internal_state``
with pull request 37661's keys."""


@dataclass(frozen=True, slots=True)
class LiveState:
    """One engine's live knobs, as its engine cores acknowledge them (the plugin) or the engine reports them
    back (an engine API)."""

    available: bool = False
    why_not: str | None = None  # when not available at all
    envelope: Mapping[str, int] = field(default_factory=dict)  # tuner knob → startup value (the ceiling but for
    # ZERO_MEANS_OFF knobs)
    values: Mapping[str, int] = field(default_factory=dict)  # tuner knob → the value in force (live or startup)
    not_live: Mapping[str, str] = field(default_factory=dict)  # tuner knob → why it cannot move live
    seq: int | None = None  # the last request answered (every engine core agrees), None: none yet / they differ
    refused: str | None = None  # why request ``seq`` was refused (the plugin applies none of it; an engine API
    # may have taken part of it, as ``values`` then shows)
    pids: tuple[int, ...] = ()  # the engine-core processes that answered
    via: str = "plugin"  # which live path (``VIAS``) answered

    def can_move(self, knob: str, value: float) -> str | None:
        """None if ``knob`` can be set to ``value`` live now, else why not."""
        if not self.available:
            return self.why_not or "no live control on this engine"
        if knob not in LIVE_NAMES:
            return f"{knob} is fixed at engine start"
        if knob in self.not_live:
            return self.not_live[knob]
        ceiling = self.envelope.get(knob)
        if ceiling is None:
            return f"the engine reports no startup value for {knob}"
        if knob in ZERO_MEANS_OFF:  # the envelope holds the value to go back to; the step budget bounds it
            floor, ceiling = 0, self.envelope.get("max_num_batched_tokens", 0)
        else:
            floor = 1 if knob == "max_num_seqs" else self.envelope.get("max_num_seqs", 1)
        if not floor <= value <= ceiling:
            return f"{value:g} is outside the startup envelope {floor}..{ceiling} (a restart can widen it)"
        return None

    def as_dict(self) -> dict[str, Any]:
        """A JSON document (a pod's agent reports it to the leader: ``from_dict``)."""
        return {"available": self.available, "why_not": self.why_not, "envelope": dict(self.envelope),
                "values": dict(self.values), "not_live": dict(self.not_live), "seq": self.seq,
                "refused": self.refused, "pids": list(self.pids), "via": self.via}

    @classmethod
    def from_dict(cls, doc: Any) -> LiveState:
        """``as_dict``'s document back, every field checked (it came through the pool's ConfigMap): a knob
        not in ``LIVE_NAMES``, a count that is not a positive integer, an over-long text are dropped."""
        if not isinstance(doc, dict):
            return cls(why_not="no live state reported")

        def count(v: Any, knob: str = "") -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and (0 if knob in ZERO_MEANS_OFF else 1) <= v < 2**31

        def text(v: Any) -> str | None:
            return v[:300] if isinstance(v, str) else None

        def counts(v: Any) -> dict[str, int]:
            return {k: n for k, n in v.items() if k in LIVE_NAMES and count(n, k)} if isinstance(v, dict) else {}

        not_live = doc.get("not_live")
        seq, pids = doc.get("seq"), doc.get("pids")
        return cls(available=doc.get("available") is True, why_not=text(doc.get("why_not")),
                   envelope=counts(doc.get("envelope")), values=counts(doc.get("values")),
                   not_live={k: str(text(v)) for k, v in not_live.items() if k in LIVE_NAMES and text(v)}
                   if isinstance(not_live, dict) else {},
                   seq=seq if isinstance(seq, int) and not isinstance(seq, bool) and 0 <= seq < 2**63 else None,
                   refused=text(doc.get("refused")),
                   pids=tuple(p for p in pids[:64] if count(p)) if isinstance(pids, list) else (),
                   via=doc["via"] if doc.get("via") in VIAS else "plugin")


NONE = LiveState(why_not="live knobs not configured (live.enabled)")
