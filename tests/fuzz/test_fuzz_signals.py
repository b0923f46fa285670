"""Fuzzing signal computation: windows of generated vLLM/SGLang expositions whose values run from
plausible to absurd (NaN, ±Inf, negative, 1e308, past 2^53), counters that reset, histograms that are not
cumulative, failed scrapes, times out of order. Whatever the window, ``compute`` returns every signal,
each ``None`` with a reason or a finite value inside its domain; the reports render it, and the planner
with the shipped rules decides over it without a traceback."""

from __future__ import annotations

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.support import REPO, fuzz, tried
from tuner.model import dialects, knobs, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuReading
from tuner.planning import planner
from tuner.planning.history import History
from tuner.rules import loading
from tuner.signals import DOMAINS, Signal, reports
from tuner.signals import engine as es
from tuner.signals import gpu as gs

RULES = tuple(r.model_copy(update={"enabled": True})
              for r in loading.load_all([REPO / "rules" / "default.yaml", REPO / "rules" / "seed-h100.yaml"]))

ABSURD = [math.nan, math.inf, -math.inf, -1.0, -1e-9, 1e308, 2.0**53 + 2, 2.0**64, 1e-300, 57.0]


def num(x: float) -> str:
    return repr(x) if math.isfinite(x) else {math.inf: "+Inf", -math.inf: "-Inf"}.get(x, "NaN")


BOUNDS = [0.3, 0.5, 1.0, 2.5, 10.0]
HISTOGRAMS = ["vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_params_max_tokens"]
COUNTERS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
            "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"]
CONFIG_VALUES = ["16", "128", "0", "-5", "1e9", "0.92", "3", "nan", "inf", "x", ""]


def vllm_body(rnd: random.Random, step: int, absurd: float) -> str:
    """One exposition. Values come from ``rnd``, seeded by Hypothesis (replayable from the failing
    example, and far cheaper than one Hypothesis draw per value); ``absurd`` is the chance of each value being one of ``ABSURD``; ``step`` grows the
    counters so that windows mostly move forward."""

    def v(plausible: float) -> float:
        return rnd.choice(ABSURD) if rnd.random() < absurd else plausible

    engines = rnd.sample(["0", "1", "2"], rnd.randint(1, 3))
    lines = [f"process_start_time_seconds {num(v(rnd.choice([1000.0, 1000.0, 2000.0])))}"]
    for e in engines:
        lab = f'engine="{e}",model_name="m"'
        for gauge, plausible in (("vllm:num_requests_running", float(rnd.randint(0, 300))),
                                 ("vllm:num_requests_waiting", float(rnd.randint(0, 300))),
                                 ("vllm:kv_cache_usage_perc", rnd.random())):
            if rnd.random() < 0.9:
                lines.append(f"{gauge}{{{lab}}} {num(v(plausible))}")
        for c in COUNTERS:
            if rnd.random() < 0.9:
                lines.append(f"{c}{{{lab}}} {num(v(float(step * rnd.randint(0, 500))))}")
        for reason in ("stop", "length"):
            lines.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} '
                         f"{num(v(float(step * rnd.randint(0, 9))))}")
        for h in HISTOGRAMS:
            if rnd.random() < 0.2:
                continue
            counts, acc = [], 0.0
            for _ in range(len(BOUNDS) + 1):
                acc += step * rnd.randint(0, 20)
                counts.append(v(acc) if rnd.random() < 0.9 else float(rnd.randint(0, 50)))
            for bound, c in zip([*map(str, BOUNDS), "+Inf"], counts, strict=True):
                lines.append(f'{h}_bucket{{{lab},le="{bound}"}} {num(c)}')
            lines.append(f"{h}_sum{{{lab}}} {num(v(acc * 0.3))}")
            lines.append(f"{h}_count{{{lab}}} {num(v(counts[-1]) if rnd.random() < 0.8 else float(rnd.randint(0, 99)))}")
        for state in ("awake", "weights_offloaded", "discard_all"):
            if rnd.random() < 0.3:
                lines.append(f'vllm:engine_sleep_state{{{lab},sleep_state="{state}"}} {num(v(float(rnd.randint(0, 1))))}')
    for status in ("2xx", "4xx"):
        lines.append(f'http_requests_total{{handler="/v1/completions",method="POST",status="{status}"}} '
                     f"{num(v(float(step * rnd.randint(0, 5))))}")
    if rnd.random() < 0.5:
        labels = {k: rnd.choice(CONFIG_VALUES) for k in ("block_size", "num_gpu_blocks", "gpu_memory_utilization",
                                                         "kv_cache_size_tokens", "kv_cache_max_concurrency")}
        lines.append("vllm:cache_config_info{" + ",".join(f'{k}="{x}"' for k, x in labels.items()) + "} 1.0")
    return "\n".join(lines) + "\n"


@st.composite
def windows(draw):
    rnd = random.Random(draw(st.integers(0, 2**32)))  # a seed: one draw, not one per value
    absurd = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5]))
    out = []
    t = draw(st.floats(0, 1e9, allow_nan=False))
    for i in range(draw(st.integers(0, 6))):
        t += draw(st.sampled_from([30.0, 30.0, 15.0, 0.0, -5.0, 1e-9]))
        if draw(st.integers(0, 7)) == 0:
            out.append(snapshots.Snapshot.failed(t, draw(st.sampled_from(["HTTP 500", "timed out"]))))
        else:
            out.append(snapshots.parse(vllm_body(rnd, i + 1, absurd), t, keep_prefixes=dialects.VLLM.parse_prefixes()))
    return out


def check(signals: dict[str, Signal]) -> None:
    for name, s in signals.items():
        if s.value is None:
            assert isinstance(s.reason, str) and s.reason, name
            continue
        assert isinstance(s.value, float | int) and math.isfinite(s.value), (name, s)
        assert DOMAINS[name].problem(s.value) is None, (name, s)
        if s.bounds is not None:
            assert s.bounds[0] <= s.bounds[1], (name, s)
        if s.resolution is not None:
            assert math.isfinite(s.resolution) and s.resolution >= 0, (name, s)


@fuzz(3)
@given(windows(), st.sampled_from([None, 75.0]), st.integers(2, 4), st.sampled_from([None, 0, 2048, 10**9]))
def test_engine_signals_over_fuzzed_windows(window, stale, min_snapshots, mml):
    tried("engine window")
    now = (window[-1].scraped_at + 10) if window else None
    signals = es.compute(window, info=EngineInfo(max_model_len=mml), now=now, stale_after_seconds=stale,
                         min_snapshots=min_snapshots)
    assert set(signals) == set(es.ALL_SIGNALS)
    check(signals)
    reports.report(signals)
    reports.table(signals)


_GPU_VALUE = st.none() | st.floats() | st.integers(-10, 10**6).map(float)


@st.composite
def readings(draw):
    out = []
    for i in range(draw(st.integers(0, 4))):
        fields = {f: draw(_GPU_VALUE) for f in ("gpu_temp_c", "mem_temp_c", "slowdown_temp_c", "sm_clock_mhz",
                                                 "sm_clock_max_mhz", "power_w", "power_limit_w", "gpu_util",
                                                 "dram_active", "sm_active")}
        out.append(GpuReading(index=i, source=draw(st.sampled_from(["nvml", "dcgm"])), read_at=0.0,
                              clocks_event_reasons=draw(st.none() | st.integers(-1, 2**64)),
                              error=draw(st.sampled_from([None, None, None, "NVML_ERROR_GPU_IS_LOST"])), **fields))
    return out


@fuzz(2)
@given(readings(), st.sampled_from([None, 1e9]))
def test_gpu_signals_over_fuzzed_readings(rs, now):
    tried("gpu readings")
    signals = gs.compute(rs, now=now, stale_after_seconds=60.0 if now else None)
    assert set(signals) == set(gs.GPU_SIGNALS)
    check(signals)


ARGS = st.lists(st.sampled_from(["--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size",
                                 "--gpu-memory-utilization", "--no-enable-chunked-prefill", "--enable-chunked-prefill",
                                 "8", "256", "0", "-1", "auto", "4000000000", "9" * 40, "1e308", "nan", "16", "0.9",
                                 "8k", "2K", "x"]), max_size=8)


@fuzz(3)
@given(windows(), ARGS, st.sampled_from([None, "cuda", "cpu", "cuda-flashinfer"]), st.sampled_from(["vllm", "sglang"]))
def test_the_planner_decides_over_fuzzed_signals_without_a_traceback(window, argv, platform, kind):
    tried("plan")
    signals = es.compute(window, dialect=dialects.DIALECTS[kind], min_snapshots=2)
    signals.update(gs.compute([]))
    settings = planner.DecisionSettings.model_validate({"engine": {"platform": platform}})
    history = History()
    args = knobs.EngineArgs.parse(argv)
    for i in range(3):  # a few cycles: streaks, cooldowns and hysteresis come into play
        p = planner.plan("t", signals, args, history, settings, rules=RULES, kind=kind, now=1000.0 + 30 * i)
        history = p.history
        assert all(h.reason for h in p.held)
        if p.changes:  # whatever it changes stays inside the knobs' hard ranges
            for c in p.changes:
                r = knobs.KNOBS[c.knob].range
                assert r is None or isinstance(c.to_value, bool) or r.contains(c.to_value), c
        p.summary()
        p.as_dict()
