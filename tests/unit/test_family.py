"""The trace-family benchmark (``bench.family``) in the fast tier: a draw of 20 traces of the live family through the
whole loop in virtual time, asserting no harm (the tuner never serves fewer requests within the SLO than
staying at the flags it started from), and the calibrated twin against the committed H200 static arms
(goodput within ±10 %). The full draw's figures are in docs/evaluation.md."""

from __future__ import annotations

import gzip
import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.family import calibration, pool, runs, traces

DRAW_SEED = 11  # any seed: the generator, not this number, is what is tested
MAX_SECONDS = 240.0  # the shorter traces of the draw keep this file under a minute on one core (52 s, 2026-12-07)
DRAW = 20  # the issue's "a 20-trace draw is in make check"


def small_draw(n: int) -> list[traces.Trace]:
    rng = random.Random(DRAW_SEED)
    out: list[traces.Trace] = []
    for i in range(200):
        t = traces.draw(rng, index=i, mode="live", capacity=calibration.capacity)
        if t.duration <= MAX_SECONDS:
            out.append(t)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("trace", small_draw(DRAW), ids=lambda t: t.name)
def test_the_tuner_does_no_harm_on_traffic_it_has_not_seen(trace: traces.Trace) -> None:
    result = runs.evaluate(trace, mode="live", gpu=calibration.GPU, sweep=())
    print(f"{trace.name}: {trace.describe()}: tuner/best static {result['ratio']:.3f} "
          f"(from the defaults {result['ratio_default']:.3f}), statics {result['statics']}")
    assert result["harm"] == [], result
    bad = result["tuner_bad"]
    assert bad["restarts"] == 0 and bad["failed"] <= result["statics"]["8"] * trace.duration  # live: no restart


def test_the_generator_draws_the_family_the_issue_describes() -> None:
    rng = random.Random(3)
    drawn = [traces.draw(rng, index=i, mode="live", capacity=calibration.capacity) for i in range(60)]
    phases = [p for t in drawn for p in t.phases]
    assert all(2 <= len(t.phases) <= 5 for t in drawn)
    assert all(10 <= p.seconds <= 180 for p in phases)
    assert any(p.users for p in phases) and any(p.rate0 != p.rate1 for p in phases)  # closed loops, ramps
    assert any(p.burstiness < 1 for p in phases) and any(len(p.mix) == 2 for p in phases)
    assert any(p.rate1 == 0 for p in phases)  # idle phases
    sizes = [(m.prompt, m.output) for p in phases for m in p.mix]
    assert min(s[0] for s in sizes) >= 64 * 0.99 and max(s[0] for s in sizes) <= 3072 * 1.01
    assert min(s[1] for s in sizes) >= 16 * 0.99 and max(s[1] for s in sizes) <= 1024 * 1.01
    loads = [p.rate1 / calibration.capacity(p.mix) for p in phases if not p.users]
    assert max(loads) <= 1.2 + 1e-6 and max(loads) > 1.0  # up to ~1.2 × the pool's capacity
    again = traces.draw(random.Random(3), index=0, mode="live", capacity=calibration.capacity)
    assert again == drawn[0]  # seeded: the same draw, request for request


@pytest.mark.parametrize("run", [r for r in calibration.RUNS if (calibration.FIXTURES / r).is_dir()])
def test_the_twin_serves_the_committed_h200_static_arms_within_ten_percent(run: str) -> None:
    """Every committed H200 run's static arms, the ones the twin was not fitted on when they came in
    (``h200-family-2026-124-run2``'s cap 256: +71 % on the twin of the day) included."""
    d = calibration.FIXTURES / run
    summary = json.loads((d / "summary.json").read_text())
    trace = traces.from_profile(json.load(gzip.open(d / "trace.json.gz")), name=run)
    for arm, real in summary["arms"].items():
        if real.get("kind") != "static":
            continue
        sim = runs.static(trace, calibration._cap(real.get("flags")), gpu=calibration.GPU)
        assert sim.goodput == pytest.approx(real["goodput"], rel=0.10), (run, arm, sim.goodput, real["goodput"])
        if real.get("itl_p50"):  # the step time at the arm's batch: what put cap 256 past the ITL SLO
            assert sim.itl_p50 == pytest.approx(real["itl_p50"], rel=0.10), (run, arm, sim.itl_p50, real["itl_p50"])


def test_the_twin_alone_on_the_gpu_serves_the_real_kv_bound_capture_within_ten_percent() -> None:
    """Issue 30 asks for the twin's KV and preemption model to be checked against the real KV-bound H200 run
    first: the benchmark replayed request for request on one engine with the family's calibrated costs. The
    single-GPU model without the context cost (what the check ran on before) is 22 % fast: the check tells."""
    real, sim = calibration.KV_BOUND_REAL, calibration.kv_bound_run()
    for key in ("req_s", "output_tokens_s", "tpot_mean_s"):
        assert sim[key] == pytest.approx(real[key], rel=0.10), (key, sim[key], real[key])
    assert sim["ttft_mean_s"] == pytest.approx(real["ttft_mean_s"], rel=0.15)
    low, high = real["running"]
    assert low - 5 <= sim["running"][0] and sim["running"][1] <= high + 5, sim["running"]  # what the cache holds
    assert sim["kv_usage"][1] >= 0.97 and sim["preemptions"] > 0  # full, and recomputing
    plain = calibration.kv_bound_run(calibration.H200)
    assert plain["req_s"] > 1.10 * real["req_s"], plain["req_s"]


def test_a_queue_of_long_outputs_is_raised_before_the_first_request_finishes() -> None:
    """live-013 of seed 7 (907-token outputs at 6 requests/s on a cap of 8): no request finishes for 10 s, and
    the raise waited for one (0.81 × the best static); read off the queue that grows at the cap, it goes out on
    the second scrape, bounded by what the cache holds of max_model_len requests (docs/rules.md#nothing-finished-yet)."""
    rng = random.Random(7)
    trace = [traces.draw(rng, index=i, mode="live", capacity=calibration.capacity) for i in range(14)][13]
    arm = runs.tuner(trace, runs.BAD_START, gpu=calibration.GPU)
    best = runs.static(trace, 64, gpu=calibration.GPU)
    first = min(at for at, _, what in arm.changes if what.startswith("cap"))
    print(f"{trace.name}: {trace.describe()}: first raise at {first:g} s, {arm.goodput:.3f} vs {best.goodput:.3f}")
    assert first <= 4.0 and arm.goodput >= 0.95 * best.goodput


MAX_STEP = 0.5  # the longest engine step of these mixes: a full 8,192-token budget of prefill is about 0.2 s


@settings(max_examples=12, deadline=None)
@given(users=st.lists(st.integers(1, 60), min_size=1, max_size=3), open_rate=st.floats(0.0, 20.0),
       seconds=st.floats(4.0, 15.0), cap=st.sampled_from([2, 8, 64]), seed=st.integers(0, 2**16))
def test_each_closed_loop_client_keeps_one_request_in_flight(users: list[int], open_rate: float, seconds: float,
                                                              cap: int, seed: int) -> None:
    """The pool's clients (``Pool._clients``, told of finished requests by the engines): every client of a closed
    phase sends at the phase's start, then its next request within a tick of the last one's end and never while
    one is in flight, and stops with its phase; open-loop phases between them change nothing of that."""
    phases: list[traces.Phase] = []
    for n in users:
        phases.append(traces.Phase(seconds, users=n, mix=(traces.Mix(1.0, 96, 24), traces.Mix(1.0, 600, 8))))
        phases.append(traces.Phase(2.0, rate0=open_rate, rate1=open_rate))
    trace = traces.build("clients", seed, phases)
    p = pool.Pool(trace, runs.bad_argv(trace, cap=None), gpu=calibration.GPU, cap=cap)
    p.advance_to(trace.duration)
    by_client: dict[int, list[pool.Sent]] = {}
    for s in p.sent:
        if s.user is not None:
            by_client.setdefault(s.user, []).append(s)
    spans = [(start, end, ph.users) for (start, end), ph in zip(trace.spans, trace.phases, strict=True) if ph.users]
    assert len(by_client) == sum(n for _, _, n in spans)  # every client of every closed phase sent
    for start, end, n in spans:
        clients = [sent for key, sent in by_client.items() if key // 100_000 == int(start * 1000)]
        assert len(clients) == n
        for sent in clients:
            assert sent[0].at - start <= pool.TICK + 1e-9  # at the phase's start
            for before, after in itertools.pairwise(sent):
                assert before.req is not None and before.req.finished_at is not None
                # seen at the tick the engine reached it: a step begun before a tick runs to its end, so the
                # finish may be stamped up to one step past the tick that saw it
                assert before.req.finished_at - MAX_STEP <= after.at <= before.req.finished_at + pool.TICK + 1e-9
                assert after.at < end  # not past its phase
            last = sent[-1].req
            assert last is not None
            if last.finished_at is not None and last.finished_at + pool.TICK + MAX_STEP < min(end, trace.duration):
                raise AssertionError(f"client stopped at {last.finished_at} inside its phase ({start}-{end})")


def test_a_harmed_run_is_shown_with_how_much_it_lost_against_staying() -> None:
    from bench.family import __main__ as family

    row = {"harm": ["tuner-live-from-8", "tuner-live-from-default"], "statics": {"8": 0.1211, "default": 2.0},
           "tuner_bad": {"arm": "tuner-live-from-8", "goodput": 0.0751},
           "tuner_default": {"arm": "tuner-live-from-default", "goodput": 1.9}}
    assert family._harmed(row) == ["tuner-live-from-8 (0.62 × staying)", "tuner-live-from-default (0.95 × staying)"]
    assert family._harmed({**row, "harm": ["tuner-live-from-default"], "statics": {"8": 1.0, "default": 0.0}}) == \
        ["tuner-live-from-default"]


def test_the_first_scrape_falls_where_the_scrape_phase_puts_it() -> None:
    """``--scrape-phases``: the same trace with the tuner's scrapes shifted inside their interval (where a rise
    falls between two scrapes, which a tuner started at any moment does not choose: the issue's 0.39 × and 0.98 ×
    on one trace). live-013 of seed 7 is raised on its second scrape; shifted by half an interval, every cycle
    and so the raise falls on the odd seconds; a phase outside [0, 1) is refused."""
    rng = random.Random(7)
    trace = [traces.draw(rng, index=i, mode="live", capacity=calibration.capacity) for i in range(14)][13]
    first = {phase: min(at for at, _, what in runs.tuner(trace, runs.BAD_START, gpu=calibration.GPU,
                                                         scrape_phase=phase).changes if what.startswith("cap"))
             for phase in (0.0, 0.5)}
    assert first[0.0] % 2.0 == pytest.approx(0.0, abs=1e-6) and first[0.5] % 2.0 == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="scrape_phase"):
        runs.tuner(trace, runs.BAD_START, gpu=calibration.GPU, scrape_phase=1.0)


def test_the_scrape_phases_summary_reads_the_worst_phase_and_the_spread() -> None:
    from bench.family import __main__ as family

    rows = [{"trace": "live-000", "ratio_phases": [0.98, 0.39, 0.97], "harm_phases": ["tuner-live-from-8@1/3"]},
            {"trace": "live-001", "ratio_phases": [1.0, 1.0, 0.99], "harm_phases": []}]
    out = family._phases_summary(rows, 3)
    assert out["worst_min"] == 0.39 and out["spread_max"] == pytest.approx(0.59)
    assert out["spread_max_trace"] == "live-000" and out["harm"] == 1 and out["phases"] == 3
