"""``planning.stepping``'s decision window (rule 1a) and the long window's thinning (rule 1b), on synthetic
snapshot series."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tuner import config
from tuner.model import dialects, knobs, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import planner, stepping
from tuner.planning.history import FlagChange, History
from tuner.rules import loading

VLLM = dialects.VLLM
W = stepping.WindowSettings(window_seconds=300, min_snapshots=3, decision_seconds=20, max_snapshots=100_000)


def snap(t: float, *, done: float, running: float = 0, waiting: float = 0) -> snapshots.Snapshot:
    text = (f"vllm:num_requests_running{{engine=\"0\"}} {running}\nvllm:num_requests_waiting{{engine=\"0\"}} {waiting}\n"
            f"vllm:request_success_total{{engine=\"0\",finished_reason=\"stop\"}} {done}\n")
    return snapshots.parse(text, t)


def steady(n: int, *, every: float = 2.0, per_s: float = 5.0, t0: float = 0.0) -> list[snapshots.Snapshot]:
    return [snap(t0 + i * every, done=per_s * i * every) for i in range(n)]


FRESH = History()


def window(snaps, history=FRESH, *, settings=W, min_requests=0):
    return stepping.decision_window(snaps, history, now=snaps[-1].scraped_at, window=settings, dialect=VLLM,
                                    min_requests=min_requests)


def test_the_decision_window_is_the_last_decision_seconds_of_steady_traffic():
    snaps = steady(60)  # 118 s at 5/s
    assert window(snaps) == (118 - 20, None)
    assert window(snaps, settings=stepping.WindowSettings(decision_seconds=None)) == (None, None)


def test_it_restarts_at_the_tuners_last_change():
    snaps = steady(60)
    changed = History(changes={"max_num_seqs": FlagChange(at=110.0, direction=1, rule="r", from_value="8",
                                                           to_value="16"),
                               "block_size": FlagChange(at=50.0, direction=1, rule="r", from_value="16",
                                                        to_value="32")})
    assert window(snaps, changed) == (110.0, None)  # the latest change, even with fewer than min_snapshots after
    long_ago = History(changes={"block_size": FlagChange(at=5.0, direction=1, rule="r", from_value="16", to_value="32")})
    assert window(snaps, long_ago) == (98.0, None)


def test_it_restarts_at_a_change_point_of_the_arrivals():
    quiet = [snap(i * 2.0, done=2.0 * i) for i in range(50)]  # 1/s until t = 98
    base = quiet[-1].scraped_at
    busy = [snap(base + 2.0 * (i + 1), done=98 + 40.0 * (i + 1)) for i in range(5)]  # 20/s from t = 98
    since, point = window([*quiet, *busy])
    assert point is not None and point.at == base == since
    assert point.before_per_s < 2 and point.after_per_s == 20


def test_it_reaches_back_for_min_snapshots_when_scrapes_are_sparse():
    snaps = steady(20, every=15.0)  # 15 s apart: a 20 s span holds two
    since, _ = window(snaps)
    assert since == snaps[-3].scraped_at and snaps[-1].scraped_at - since == 30


def test_it_reaches_back_for_min_requests_on_a_slow_engine():
    snaps = steady(100, per_s=0.25)  # 5 finished per 20 s
    since, _ = window(snaps, min_requests=10)
    assert since == snaps[-1].scraped_at - 40  # where 10 had finished
    since, _ = window(snaps, min_requests=10_000)  # never enough: as far as kept reaches is not taken
    assert since == snaps[-1].scraped_at - 20
    # but never back past the tuner's own change: the engine before it is another engine
    changed = History(changes={"max_num_seqs": FlagChange(at=snaps[-1].scraped_at - 30, direction=1, rule="r",
                                                           from_value="8", to_value="16")})
    assert window(snaps, changed, min_requests=10)[0] == snaps[-1].scraped_at - 30


@given(n=st.integers(1, 400), failed=st.sets(st.integers(0, 399), max_size=20))
def test_thinning_keeps_the_recent_span_and_every_failed_scrape(n, failed):
    snaps = tuple(snapshots.Snapshot.failed(i * 2.0, "refused") if i in failed else snap(i * 2.0, done=i)
                  for i in range(n))
    now = snaps[-1].scraped_at
    snaps = tuple(s for s in snaps if s.scraped_at >= now - W.window_seconds)  # the long window, as step cuts it
    kept = stepping.thinned(snaps, now=now, window=W)
    recent = [s for s in snaps if s.scraped_at >= now - 2 * W.decision_seconds]
    assert all(s in kept for s in recent)  # two decision windows in full
    assert all(s in kept for s in snaps if not s.ok)  # a failed scrape voids the windows it falls in
    assert kept[0] == snaps[0] and list(kept) == sorted(kept, key=lambda s: s.scraped_at)
    old = [s.scraped_at for s in kept if s.ok and s.scraped_at < now - 2 * W.decision_seconds]
    spacing = W.window_seconds / stepping.THIN_TO
    assert all(b - a >= spacing for a, b in itertools.pairwise(old))
    assert len(old) <= stepping.THIN_TO + 1  # ~40 snapshots per target at 2 s, not 150


def test_without_a_decision_window_nothing_is_thinned_but_the_cap_holds():
    snaps = tuple(steady(50))
    assert stepping.thinned(snaps, now=98, window=stepping.WindowSettings()) == snaps
    assert stepping.thinned(snaps, now=98, window=stepping.WindowSettings(max_snapshots=8)) == snaps[-8:]


def _sized(t: float, done: float, prompt: float, generated: float) -> snapshots.Snapshot:
    lab = 'engine="0"'
    text = (f"vllm:num_requests_running{{{lab}}} 8\nvllm:num_requests_waiting{{{lab}}} 0\n"
            f'vllm:request_success_total{{{lab},finished_reason="stop"}} {done}\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="4096",kv_cache_size_tokens="65536"} 1\n')
    for name, total in (("prompt_tokens", prompt), ("generation_tokens", generated)):
        text += (f'vllm:request_{name}_bucket{{{lab},le="+Inf"}} {done}\n'
                 f"vllm:request_{name}_sum{{{lab}}} {total}\nvllm:request_{name}_count{{{lab}}} {done}\n")
    return snapshots.parse(text, t)


def test_the_kv_bound_is_the_regime_s_own_not_the_long_window_s():
    """Four minutes of 2,000/600-token requests, then 150/300-token ones: the cache's 65,536 tokens hold 28 of the
    old and 218 of the new (each the prompt and half the output at once). Over the 300 s window the old ones
    capped the new phase's raises (live-181 of seed 7: 132, 166, 186, 212… slots with the cache 16 % full); the
    bound a raise reads is the decision window's."""
    snaps, done, prompt, generated = [], 0.0, 0.0, 0.0
    for i in range(131):  # a scrape every 2 s, 10 requests finished per scrape
        big = i < 120
        done, prompt, generated = done + 10, prompt + 10 * (2000 if big else 150), generated + 10 * (600 if big else 300)
        snaps.append(_sized(2.0 * i, done, prompt, generated))
    window = config.ScrapeSettings().window_settings()
    state, rules = stepping.TargetState(), tuple(loading.load(loading.default_rules_path()))
    for s in snaps:
        d = stepping.step(state, s, info=EngineInfo(max_model_len=4096), gpus=GpuInputs(unavailable="none"),
                          now=s.scraped_at, target="t", kind="vllm", args=knobs.EngineArgs.parse(["--max-num-seqs", "8"]),
                          settings=planner.DecisionSettings(), window=window, rules=rules)
        state = d.state
    assert d.signals["kv_concurrency_observed"].value == 65536 / (150 + 300 / 2)  # this regime's sizes
    assert d.signals["prompt_tokens_mean"].value > 1000  # the sizes themselves stay the long window's


def test_with_no_request_finished_anywhere_the_kv_bound_is_what_the_cache_holds_of_the_longest():
    """No request finished in either window (an engine's first seconds under long outputs): no size is known, so
    the bound a raise is capped at is what the cache holds of max_model_len requests (65,536 / 4,096 = 16), the
    most it could ever need per request; once requests finish, their size bounds it."""
    window = config.ScrapeSettings().window_settings()
    state, rules = stepping.TargetState(), tuple(loading.load(loading.default_rules_path()))
    for t in (0.0, 2.0, 4.0):
        s = _sized(t, 0, 0, 0)
        d = stepping.step(state, s, info=EngineInfo(max_model_len=4096), gpus=GpuInputs(unavailable="none"),
                          now=t, target="t", kind="vllm", args=knobs.EngineArgs.parse(["--max-num-seqs", "8"]),
                          settings=planner.DecisionSettings(), window=window, rules=rules)
        state = d.state
    kv = d.signals["kv_concurrency_observed"]
    assert kv.value == 65536 / 4096 and "max_model_len requests" in (kv.reason or "")
    d = stepping.step(state, _sized(6.0, 10, 10 * 500, 10 * 300), info=EngineInfo(max_model_len=4096),
                      gpus=GpuInputs(unavailable="none"), now=6.0, target="t", kind="vllm",
                      args=knobs.EngineArgs.parse(["--max-num-seqs", "8"]), settings=planner.DecisionSettings(),
                      window=window, rules=rules)
    assert d.signals["kv_concurrency_observed"].value == 65536 / (500 + 300 / 2)
