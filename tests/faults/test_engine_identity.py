"""Class 2 of issue 28: one target, one engine.

Before: a metrics URL that landed on two engines in turn (a Service in front of two pods, a port reused
after a restart elsewhere) read as an engine restart at every flip — 39 warm-ups planned in 40 cycles,
and no word that the target was two engines. Two targets with one ``metrics_url``, or a
``live.control_dir`` without ``{name}``, passed ``check-config``.

Generated: which of two engines answers at each cycle (and when either restarts for real). The
promise: a warm-up is planned only for an engine never seen before (a real restart), never for a flip
back to one seen before; from a flip back until the window no longer holds it, the target is held — no
plan — and the reason says "two engines behind one URL"; a URL that always reaches one engine (restarts
included) is never held.
And generated configurations: two targets whose URLs are spellings of one address, or a control
directory shared by two targets, are refused by ``config.parse`` (what ``check-config`` and ``run``
call) with one line that names both targets.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner import config
from tuner.errors import ConfigError
from tuner.model import knobs, snapshots
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import identities, planner, stepping

BODY = """\
# TYPE process_start_time_seconds gauge
process_start_time_seconds %(started)s
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} %(done)s
"""
WINDOW = stepping.WindowSettings(window_seconds=60, min_snapshots=2)
INTERVAL = 10.0

# each cycle: (which engine answers, whether that engine restarted just before)
schedules = st.lists(st.tuples(st.integers(0, 1), st.booleans()), min_size=2, max_size=40)


@settings(max_examples=300, deadline=None)
@given(schedule=schedules, two=st.booleans())
def test_a_flip_between_two_engines_is_held_and_never_read_as_a_restart(
        schedule: list[tuple[int, bool]], two: bool) -> None:
    started = [1_700_000_000.0, 1_700_000_500.0]
    done = [0, 0]
    state = stepping.TargetState()
    seen: list[float] = []
    flipped_at: float | None = None
    for n, (which, restarts) in enumerate(schedule, start=1):
        e = which if two else 0
        if restarts:
            started[e] += 1000.0 + n  # a new process: a start time never seen before
        done[e] += 3
        now = 1_790_000_000.0 + n * INTERVAL
        snap = snapshots.parse(BODY % {"started": started[e], "done": done[e]}, now, keep_prefixes=("vllm:", "process_"))
        decision = stepping.step(state, snap, info=EngineInfo(model="m"), gpus=GpuInputs(), now=now, target="t",
                                 kind="vllm", args=knobs.EngineArgs.parse([]), settings=planner.DecisionSettings(),
                                 window=WINDOW, rules=())
        state = decision.state
        new = started[e] not in seen
        if seen and not new and seen[-1] != started[e]:
            flipped_at = now
        if started[e] in seen:
            seen.remove(started[e])
        seen.append(started[e])
        del seen[:-identities.MEMORY]  # what the tuner remembers (a flip back past it reads as new once)
        warm = [a for a in (decision.plan.actions if decision.plan else ()) if a.kind == "warm-up"]
        if warm:
            assert new, f"cycle {n}: a warm-up planned for an engine seen before (a flip, not a restart)"
        if flipped_at is not None and now - flipped_at < WINDOW.window_seconds:  # the window still mixes two
            assert decision.held is not None and "two engines behind one URL" in decision.held, f"cycle {n}"
            assert decision.plan is None
        else:
            assert decision.held is None, f"cycle {n}: held though the URL reached one engine: {decision.held}"


def _spellings(port: int) -> st.SearchStrategy[str]:
    host = st.sampled_from(["127.0.0.1", "localhost", "LOCALHOST", "127.0.0.1", "[::1]"])
    tail = st.sampled_from(["/metrics", "/metrics/"])
    return st.tuples(host, tail).map(lambda ht: f"http://{ht[0]}:{port}{ht[1]}")


@settings(max_examples=100, deadline=None)
@given(port=st.integers(1024, 65535), data=st.data())
def test_two_targets_on_one_engine_are_refused(port: int, data: st.DataObject) -> None:
    a, b = data.draw(_spellings(port)), data.draw(_spellings(port))
    with pytest.raises(ConfigError, match="targets 'a' and 'b' have the same metrics_url"):
        config.parse({"targets": [{"name": "a", "metrics_url": a}, {"name": "b", "metrics_url": b}]})
    config.parse({"targets": [{"name": "a", "metrics_url": a},
                              {"name": "b", "metrics_url": a.replace(f":{port}", f":{port % 60000 + 1024 + 1}")}]})


@settings(max_examples=50, deadline=None)
@given(control_dir=st.from_regex(r"/[a-z]{1,8}(/[a-z]{1,8}){0,3}", fullmatch=True), enabled=st.booleans())
def test_one_control_directory_for_two_targets_is_refused(control_dir: str, enabled: bool) -> None:
    targets = [{"name": "a", "metrics_url": "http://127.0.0.1:8000/metrics"},
               {"name": "b", "metrics_url": "http://127.0.0.1:8001/metrics"}]
    with pytest.raises(ConfigError, match=r"live\.control_dir"):
        config.parse({"targets": targets, "live": {"enabled": enabled, "control_dir": control_dir}})
    config.parse({"targets": targets, "live": {"enabled": enabled, "control_dir": control_dir + "/{name}"}})
    config.parse({"targets": targets[:1], "live": {"enabled": enabled, "control_dir": control_dir}})
