"""The trace family: traces drawn from a generator, so that a claim about the control law is judged on
traffic it was not tuned on (issue "Control that holds on traffic it has never seen").

A trace is a list of phases played one after the other on the whole pool. A phase is either open loop —
arrivals at a rate that steps or ramps from ``rate0`` to ``rate1`` requests/s, Poisson (``burstiness`` 1)
or gamma-clumped (below 1) — or closed loop (``users`` clients that each send their next request the
moment the previous one ends). Its requests draw their prompt and output lengths from a mixture of up to
two components (``mix``: weight, prompt tokens, output tokens; each length jittered ±25 %).

``draw(rng, mode=...)`` is the family:

- live mode: 2-5 phases of 10-180 s; steps, ramps and falls; rates from idle to about 1.2 × the pool's
  capacity for the phase's request sizes (``capacity``: the calibrated GPU model's, ``bench.family.engine``);
  prompts 64-3,072 and outputs 16-1,024 tokens (log-uniform), mixtures within a phase; Poisson and bursty
  arrivals; one phase in six closed loop;
- restart mode: 2-4 slow drifts of 10-60 minutes each (ramps), the same sizes and rates.

``from_profile`` turns an evaluation profile's trace (``bench/evaluation/profiles/*.yaml``) into the same
shape, request for request (``bench.evaluation.traces.build``). Standard library only, seeded, deterministic.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["live", "restart"]
MAX_MODEL_LEN = 4096  # the H200 profiles' --max-model-len: prompt + output always fit


@dataclass(frozen=True)
class Mix:
    weight: float
    prompt: int
    output: int


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate0: float = 0.0  # open loop: requests/s of the whole pool at the phase's start ...
    rate1: float = 0.0  # ... and at its end (a step: equal; a ramp or a fall: not)
    mix: tuple[Mix, ...] = (Mix(1.0, 512, 256),)
    burstiness: float = 1.0
    users: int = 0  # > 0: closed loop, this many clients (the rates are ignored)

    def describe(self) -> str:
        sizes = "+".join(f"{m.prompt}/{m.output}" for m in self.mix)
        if self.users:
            return f"{self.seconds:.0f}s closed×{self.users} {sizes}"
        rate = f"{self.rate0:.1f}" if math.isclose(self.rate0, self.rate1) else f"{self.rate0:.1f}→{self.rate1:.1f}"
        burst = "" if self.burstiness >= 1 else f" b{self.burstiness:.1f}"
        return f"{self.seconds:.0f}s {rate}/s {sizes}{burst}"


@dataclass(frozen=True)
class Request:
    at: float  # seconds since the trace's start
    prompt: int
    output: int


@dataclass(frozen=True)
class Trace:
    name: str
    seed: int
    phases: tuple[Phase, ...]
    requests: tuple[Request, ...] = ()  # the open-loop arrivals, in order
    spans: tuple[tuple[float, float], ...] = field(default=())  # each phase's (start, end)

    @property
    def duration(self) -> float:
        return sum(p.seconds for p in self.phases)

    def describe(self) -> str:
        return " | ".join(p.describe() for p in self.phases)

    def closed(self) -> list[tuple[float, float, Phase]]:
        """The closed-loop phases: (start, end, phase)."""
        return [(s, e, p) for (s, e), p in zip(self.spans, self.phases, strict=True) if p.users > 0]


def _jitter(rng: random.Random, mean: int) -> int:
    return max(1, round(mean * rng.uniform(0.75, 1.25)))


def sizes(rng: random.Random, mix: Sequence[Mix]) -> tuple[int, int]:
    """One request's (prompt, output) tokens drawn from the phase's mixture."""
    pick = rng.random() * sum(m.weight for m in mix)
    chosen = mix[-1]
    for m in mix:
        pick -= m.weight
        if pick <= 0:
            chosen = m
            break
    prompt, output = _jitter(rng, chosen.prompt), _jitter(rng, chosen.output)
    prompt = min(prompt, MAX_MODEL_LEN - 16)
    return prompt, max(1, min(output, MAX_MODEL_LEN - prompt))


def build(name: str, seed: int, phases: Sequence[Phase]) -> Trace:
    """The open-loop arrivals of ``phases`` (thinning for ramps), seeded."""
    rng = random.Random(seed * 7919 + 17)
    requests: list[Request] = []
    spans: list[tuple[float, float]] = []
    start = 0.0
    for p in phases:
        end = start + p.seconds
        spans.append((start, end))
        top = max(p.rate0, p.rate1)
        if p.users == 0 and top > 0:
            t = start
            shape = min(1.0, p.burstiness)
            while True:
                t += rng.gammavariate(shape, 1.0 / (top * shape))
                if t >= end:
                    break
                rate = p.rate0 + (p.rate1 - p.rate0) * (t - start) / p.seconds
                if rng.random() * top <= rate:  # thinning: the ramp's rate at t
                    prompt, output = sizes(rng, p.mix)
                    requests.append(Request(round(t, 6), prompt, output))
        start = end
    return Trace(name, seed, tuple(phases), tuple(requests), tuple(spans))


def _log_uniform(rng: random.Random, lo: float, hi: float) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _mix(rng: random.Random) -> tuple[Mix, ...]:
    first = Mix(1.0, _log_uniform(rng, 64, 3072), _log_uniform(rng, 16, 1024))
    if rng.random() < 0.35:  # a mixture within the phase: chats among long prompts, say
        second = Mix(rng.uniform(0.2, 1.0), _log_uniform(rng, 64, 3072), _log_uniform(rng, 16, 1024))
        return (first, second)
    return (first,)


def draw(rng: random.Random, *, index: int, mode: Mode = "live", capacity: Any) -> Trace:
    """One trace of the family (the module docstring). ``capacity(mix) -> requests/s`` of the whole pool
    for those sizes (the calibrated model's)."""
    n = rng.randint(2, 5) if mode == "live" else rng.randint(2, 4)
    phases: list[Phase] = []
    level = rng.uniform(0.0, 0.6)  # share of capacity the trace starts at
    for _ in range(n):
        seconds = rng.uniform(10, 180) if mode == "live" else rng.uniform(600, 3600)
        mix = _mix(rng) if not phases or rng.random() < 0.5 else phases[-1].mix
        cap = capacity(mix)
        if mode == "live" and rng.random() < 1 / 6:
            # closed loop: about the concurrency the pool runs at its capacity, from a few to twice that
            per_request = sum(m.weight * m.output for m in mix) / sum(m.weight for m in mix) * 0.03
            users = max(1, round(cap * per_request * rng.uniform(0.1, 2.0)))
            phases.append(Phase(seconds, mix=mix, users=users))
            continue
        target = 0.0 if rng.random() < 0.1 else rng.uniform(0.05, 1.2)
        ramp = mode == "restart" or rng.random() < 0.3
        start = level if ramp else target
        burst = 1.0 if rng.random() < 0.6 else rng.uniform(0.3, 0.9)
        phases.append(Phase(seconds, rate0=round(start * cap, 3), rate1=round(target * cap, 3), mix=mix,
                            burstiness=round(burst, 2)))
        level = target
    seed = rng.randrange(2**31)
    return build(f"{mode}-{index:03d}", seed, phases)


def from_profile(doc: dict[str, Any], *, name: str) -> Trace:
    """An evaluation trace (``bench.evaluation.traces.build``'s document) in this module's shape."""
    phases = tuple(Phase(float(p["seconds"]), rate0=float(p["rate"]), rate1=float(p["rate"]),
                         mix=(Mix(1.0, int(p["input_len"]), int(p["output_len"])),),
                         burstiness=float(p.get("burstiness", 1.0))) for p in doc["phases"])
    requests = tuple(Request(float(r["at"]), int(r["prompt_tokens"]), int(r["output_tokens"]))
                     for r in doc["requests"])
    spans = tuple((float(p["start"]), float(p["end"])) for p in doc["phases"])
    return Trace(name, int(doc.get("seed", 0)), phases, requests, spans)
