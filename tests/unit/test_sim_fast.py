"""The simulated engine's fast paths hold to its exact ones: the lazily advanced decodes
(``queueing._Decoding``) schedule, finish, preempt and observe exactly as a pass over every request does, and
the templated exposition (``VllmMetrics.exposition``) is prometheus_client's own text."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from tuner.sim import queueing
from tuner.sim.config import H200, config_from_args


def _run(exact: bool, *, seqs: int, blocks: int, budget: int, rate: float, prompt: int, output: int,
         context: bool, seed: int) -> tuple[list[tuple[object, ...]], list[str]]:
    gpu = H200 if not context else type(H200)(step_per_context_token_seconds=2e-8)
    cfg = config_from_args(["--max-num-seqs", str(seqs), "--max-model-len", "4096", "--max-num-batched-tokens",
                            str(budget), "--num-gpu-blocks-override", str(blocks)], gpu=gpu)
    engine = queueing.SimEngine(cfg, started_at=0.0)
    if exact:
        engine._step = engine._step_exact  # type: ignore[method-assign]
    rng = random.Random(seed)
    sent, t = [], 0.0
    while t < 20.0:
        t += rng.expovariate(rate)
        engine.advance(t)
        if rng.random() < 0.05:
            engine.admission_cap = rng.randint(1, seqs)  # the live cap moves too
        if rng.random() < 0.05:
            engine.step_budget = rng.randint(seqs, 2 * budget)  # and the live step budget (clamped to the envelope)
        p, o = max(1, int(prompt * rng.uniform(0.5, 1.5))), max(1, int(output * rng.uniform(0.5, 1.5)))
        sent.append(engine.submit(prompt_tokens=min(p, 3000), max_tokens=o, output_tokens=o, wait=False))
    engine.advance(60.0)
    engine.abort_all()  # what still runs, counted as far as it got
    outcome = [(r.finish_reason, r.generated, r.preemptions, r.first_token, r.finished_at, r.last_token)
               for r in sent]
    engine.metrics.flush()
    text = generate_latest(engine.registry).decode()
    return outcome, [line for line in text.splitlines() if "_created" not in line]  # wall-clock stamps


@settings(max_examples=60, deadline=None)
@given(seqs=st.sampled_from([1, 4, 16, 64]), blocks=st.sampled_from([260, 400, 2000]),
       budget=st.sampled_from([512, 2048, 8192]), rate=st.floats(1.0, 40.0), prompt=st.sampled_from([16, 300, 1500]),
       output=st.sampled_from([1, 20, 200]), context=st.booleans(), seed=st.integers(0, 1000))
def test_the_lazy_decodes_step_as_the_pass_over_every_request(seqs: int, blocks: int, budget: int, rate: float,
                                                              prompt: int, output: int, context: bool,
                                                              seed: int) -> None:
    kw = dict(seqs=seqs, blocks=blocks, budget=budget, rate=rate, prompt=prompt, output=output, context=context,
              seed=seed)
    exact, fast = _run(True, **kw), _run(False, **kw)  # type: ignore[arg-type]
    assert fast[0] == exact[0]
    assert _values(fast[1]) == pytest.approx(_values(exact[1]), rel=1e-12)  # sums added in another order
    assert [line.rpartition(" ")[0] for line in fast[1]] == [line.rpartition(" ")[0] for line in exact[1]]


def _values(lines: list[str]) -> list[float]:
    return [float(line.rpartition(" ")[2]) for line in lines if not line.startswith("#")]


def test_a_kv_bound_engine_preempts_on_the_fast_path_too() -> None:
    """Small KV, long requests: the steps that run short of blocks take the exact path and preempt."""
    outcome, _ = _run(False, seqs=64, blocks=260, budget=2048, rate=20.0, prompt=1500, output=200,
                         context=True, seed=3)
    assert any(preempted for _, _, preempted, *_ in outcome)
    assert outcome == _run(True, seqs=64, blocks=260, budget=2048, rate=20.0, prompt=1500, output=200,
                           context=True, seed=3)[0]


def test_the_templated_exposition_is_the_registry_text() -> None:
    cfg = config_from_args(["--max-num-seqs", "8", "--sim-arrival-rate", "30"])
    engine = queueing.SimEngine(cfg, started_at=0.0)
    for t in (0.0, 1.5, 7.0, 30.0):
        engine.advance(t)
        fast = engine.metrics.exposition()
        engine.metrics.flush()
        assert fast == generate_latest(engine.registry)
    assert b"vllm:generation_tokens_total" in fast and b'le="+Inf"' in fast


@pytest.mark.parametrize(("live", "steps"), [(None, 1), (512, 4), (1000, 3), (100_000, 1)])
def test_the_step_budget_is_live_inside_the_envelope(live: int | None, steps: int) -> None:
    """vLLM pull request 55018's live ``max_num_batched_tokens``: a 2,048-token prompt alone is prefilled in
    ⌈2048 / budget⌉ steps; a budget past the start-up envelope (``--max-num-batched-tokens 2048``) is the envelope."""
    cfg = config_from_args(["--max-num-seqs", "8", "--max-model-len", "4096", "--max-num-batched-tokens", "2048"],
                           gpu=H200)
    engine = queueing.SimEngine(cfg, started_at=0.0)
    engine.step_budget = live
    req = engine.submit(prompt_tokens=2048, max_tokens=4, output_tokens=4, wait=False)
    while req.first_token is None:
        engine.advance(engine.now + 1e-4)
    assert engine.steps == steps and engine.budget == min(live or 2048, 2048)
