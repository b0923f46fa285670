"""The evaluation trace: seeded, deterministic arrival times and lengths, phase after phase.

A phase is an open-loop arrival process at ``rate`` requests/s for ``seconds``: Poisson when
``burstiness`` is 1, gamma-distributed gaps otherwise (below 1: clumped, as vLLM's benchmark client
draws them with ``--burstiness``). Prompt and output lengths are uniform in ``len × [1 - r, 1 + r]``
(``range_ratio`` r, as the client's random dataset). The same profile always gives the same trace,
request for request (``random.Random(seed)``, one generator consumed in a fixed order).

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests per second, all replicas together
    input_len: int
    output_len: int
    burstiness: float = 1.0


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    if ratio <= 0:
        return mean
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def build(phases: Sequence[Phase], *, seed: int, range_ratio: float = 0.0) -> dict[str, Any]:
    """The trace as a JSON-able document: ``requests`` (index, phase, at, prompt_tokens, output_tokens),
    ``phases`` (with their start and end offsets), ``duration`` and a ``digest`` of all of it."""
    rng = random.Random(seed)
    requests: list[dict[str, Any]] = []
    spans = []
    start = 0.0
    for phase in phases:
        end = start + phase.seconds
        t = start
        while True:
            shape = phase.burstiness
            t += rng.gammavariate(shape, 1.0 / (phase.rate * shape))
            if t >= end:
                break
            requests.append({
                "index": len(requests), "phase": phase.name, "at": round(t, 6),
                "prompt_tokens": _length(rng, phase.input_len, range_ratio),
                "output_tokens": _length(rng, phase.output_len, range_ratio),
            })
        spans.append({**asdict(phase), "start": start, "end": end})
        start = end
    doc: dict[str, Any] = {"seed": seed, "range_ratio": range_ratio, "duration": start, "phases": spans,
                           "requests": requests}
    doc["digest"] = digest(doc)
    return doc


def digest(doc: dict[str, Any]) -> str:
    """A short hash of the trace's content (its requests and phases), to check arms share one trace."""
    body = json.dumps({k: doc[k] for k in ("seed", "range_ratio", "phases", "requests")}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]
