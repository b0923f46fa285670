"""Shared by the fuzz suite: the Hypothesis profiles and a count of the cases tried.

Two profiles, chosen by ``VLLM_TUNER_FUZZ``:

- ``ci`` (default, part of ``make test``): a few thousand generated cases over the whole suite, no
  deadline (a loaded 2-core CI box must not turn slowness into failures), bounded by ``max_examples``
  so the suite adds about a minute.
- ``long`` (``bench/fuzz_long.py``): 25× the cases, for a benchmark run that prints how many it tried.

Each test asks for ``fuzz(weight)``: its share of the examples (weight 1 = ``BASE`` examples in ci).
The bar is zero tracebacks: every input either parses/validates or is refused with the project's own
error value (an invalid ``Snapshot``, a ``None`` signal with a reason, a ``ConfigError``).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("VLLM_TUNER_FUZZ", "ci")
BASE = {"ci": 250, "long": 250 * 25}.get(PROFILE)
if BASE is None:
    raise RuntimeError(f"VLLM_TUNER_FUZZ={PROFILE!r}: expected 'ci' or 'long'")

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

# cases tried per test (read by bench/fuzz_long.py)
CASES: Counter[str] = Counter()


def fuzz(weight: float = 1.0) -> settings:
    return settings(
        max_examples=max(1, int(BASE * weight)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )


def tried(name: str) -> None:
    CASES[name] += 1
