"""Class 6 of issue 17: impossible exposition is refused, not summed.

Generated windows of vLLM bodies, each bent in one of the ways a proxy, a cache or a merged scrape
bends them: a second ``model_name`` (or ``instance``) in one body, more requests running than the
engine's ``--max-num-seqs``, a histogram that went back down inside the window and came back above
its first value by the end, samples carrying timestamps far from the scrape's time. The promise: the
signals computed from such a window are unknown with the reason, never a number made of the bent
data; and the same windows without the bend still give numbers.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.model import dialects, snapshots
from tuner.signals import engine

SETTINGS = settings(max_examples=150, deadline=None)
BOUNDS = (0.1, 0.5, 1.0, 5.0)


def body(*, running: float, count: int, model: str = "m", extra_labels: str = "", stamp: int | None = None) -> str:
    labels = f'model_name="{model}",engine="0"{extra_labels}'
    ts = f" {stamp}" if stamp is not None else ""
    buckets = [min(count, int(count * (i + 1) / len(BOUNDS))) for i in range(len(BOUNDS))]
    lines = [f"vllm:num_requests_running{{{labels}}} {running}{ts}",
             f"vllm:num_requests_waiting{{{labels}}} 0{ts}",
             f"vllm:request_success_total{{{labels},finished_reason=\"stop\"}} {count}{ts}"]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{b}"}} {c}{ts}' for b, c in zip(BOUNDS, buckets,
                                                                                                     strict=True)]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {count}{ts}',
              f"vllm:time_to_first_token_seconds_sum{{{labels}}} {count * 0.3}{ts}",
              f"vllm:time_to_first_token_seconds_count{{{labels}}} {count}{ts}"]
    return "\n".join(lines) + "\n"


def window(texts: list[str], start: float = 1_000_000.0) -> list[snapshots.Snapshot]:
    return [snapshots.parse(t, start + 10 * i, source="e") for i, t in enumerate(texts)]


def compute(snaps: list[snapshots.Snapshot], *, max_running: float | None = None) -> dict:
    return engine.compute(snaps, dialect=dialects.VLLM, now=snaps[-1].scraped_at, min_snapshots=2,
                          max_running=max_running)


counts = st.lists(st.integers(0, 10_000), min_size=3, max_size=8).map(sorted)


@SETTINGS
@given(counts=counts, running=st.integers(0, 64), other=st.sampled_from(["model_name", "instance"]),
       at=st.integers(0, 7))
def test_two_engines_in_one_body_are_refused_not_added(counts: list[int], running: int, other: str, at: int) -> None:
    texts = [body(running=running, count=c) for c in counts]
    assert compute(window(texts))["requests_running"].value == running  # one engine: believed
    i = min(at, len(texts) - 1)
    if other == "model_name":
        texts[i] += body(running=running, count=counts[i], model="m2")
    else:
        texts[i] = body(running=running, count=counts[i], extra_labels=',instance="h1:8000"') + body(
            running=running, count=counts[i], model="m", extra_labels=',instance="h2:8000"').replace("engine=\"0\"",
                                                                                                 "engine=\"1\"")
    snaps = window(texts)
    assert not snaps[i].ok or engine.impossible(snaps[i], dialects.VLLM) is not None
    signals = compute(snaps)
    for name in ("requests_running_max", "request_rate", "ttft_p95_s"):
        s = signals[name]
        # the bent body is out of the window: either unknown, or read from the good bodies after it only
        assert s.value is None or i < len(texts) - 1, (name, s)
    if i == len(texts) - 1:
        assert signals["requests_running"].value is None and "one engine" in (signals["requests_running"].reason or "")


@SETTINGS
@given(counts=counts, cap=st.integers(1, 256), over=st.integers(1, 1000))
def test_running_above_max_num_seqs_is_not_believed(counts: list[int], cap: int, over: int) -> None:
    good = [body(running=cap, count=c) for c in counts]
    assert compute(window(good), max_running=cap)["requests_running"].value == cap
    bent = [*good[:-1], body(running=cap + over, count=counts[-1])]
    latest = compute(window(bent), max_running=cap)["requests_running"]
    assert latest.value is None and "--max-num-seqs" in (latest.reason or "")


@SETTINGS
@given(counts=st.lists(st.integers(1, 10_000), min_size=3, max_size=8, unique=True).map(sorted),
       at=st.integers(1, 6),
       low=st.integers(0, 100))
def test_a_histogram_reset_inside_the_window_voids_it_as_for_counters(counts: list[int], at: int, low: int) -> None:
    assert compute(window([body(running=1, count=c) for c in counts]))["ttft_p95_s"].value is not None
    i = min(at, len(counts) - 2)  # inside the window: the last body is back above the first
    reset = [*counts]
    reset[i] = min(low, counts[i - 1] - 1) if counts[i - 1] > 0 else 0
    if reset[i] >= counts[i - 1]:
        return  # nothing went down
    signals = compute(window([body(running=1, count=c) for c in reset]))
    for name in ("ttft_p95_s", "ttft_mean_s", "request_rate"):
        assert signals[name].value is None and "reset" in (signals[name].reason or ""), (name, signals[name])


@SETTINGS
@given(offset=st.one_of(st.integers(-10**9, -601), st.integers(601, 10**9), st.integers(-600, 600)),
       count=st.integers(0, 1000))
def test_sample_timestamps_far_from_now_are_not_read_as_now(offset: int, count: int) -> None:
    at = 1_700_000_000.0
    snap = snapshots.parse(body(running=3, count=count, stamp=int((at + offset) * 1000)), at, source="e")
    far = abs(offset) > snapshots.MAX_TIMESTAMP_SKEW_SECONDS
    assert snap.ok is not far, (offset, snap.error)
    if far:
        assert "timestamps" in (snap.error or "")
