"""Issue 31, class 2: acknowledgements belong to a launch.

The control directory outlives the engine, and each data-parallel rank writes only its own
``ack-<rank>.json``: an ``ack-1.json`` left by an earlier launch with two ranks beside this single rank's
``ack-0.json`` made the acks disagree, so the tuner read no sequence number and every live change timed out
and was put back although the engine had applied it.

Generated: 0–3 earlier launches of 1–4 ranks (run through the plugin's own ``Controller`` on fake schedulers,
each with a launch of its own, some having handled a request of their own), a plugin from before launches,
an unreadable file and an ``ack-load.json`` of an earlier launch — each left in the directory either before
the current launch starts (the plugin removes it then) or after (a writer of an earlier launch that lingered:
the tuner ignores and removes it). The current launch runs 1–3 ranks on fake schedulers, MoE-shaped (the
rank count in vLLM's config) or not (on the command line, ``-dp N``). The promise: the tuner reads exactly
the current launch's acks, sees its request acknowledged by every rank with the values asked for, and no
file of an earlier launch is left. The tuner's side is ``live_knobs.Files`` — the daemon's control
directories and a pod agent's (``tuner/kube/podside.py``) alike.

Plus the held-out shape: a one-replica live rollout through the rollout driver over such a directory.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import fake_schedulers as fakes
from tests.support.fake_prober import FakeProber
from tests.support.plugin import live, protocol
from tuner.actuators import base, fake
from tuner.rollout import journal, machine
from tuner.runtime import driving, engineside
from tuner.sources import engines, live_knobs

V032 = "0.32.0"


def current_engines(control_dir: Path, ranks: int, *, moe: bool) -> list[Any]:
    """This launch's EngineCores: the plugin installed as vLLM loads it, one scheduler per rank."""
    cls = fakes.fresh(fakes.Scheduler032)
    live.install(cls, engine_version=V032, control_dir=str(control_dir))
    argv = ["vllm", "serve", "m"] + ([] if moe else ["-dp", str(ranks)])
    with mock.patch.object(sys, "argv", argv):
        return [cls(fakes.vllm_config(dp_rank=r, dp_size=ranks, moe=moe, max_num_seqs=64)) for r in range(ranks)]


def step(engines_: list[Any]) -> None:
    for s in engines_:
        s.__dict__[live.CONTROLLER_ATTR]._next_poll = 0.0
        s.step()


def leave_earlier_launch(control_dir: Path, launch: protocol.Launch, ranks: int, kept: list[int],
                         seq: int | None) -> None:
    """What an earlier launch of ``ranks`` ranks left: the plugin's own acks (of request ``seq`` if any),
    only the ranks in ``kept`` (a later launch overwrote or removed the rest)."""
    scratch = control_dir.parent / f"scratch-{launch.id}"
    scratch.mkdir(mode=0o700)
    if seq is not None:
        live_knobs.write_request(scratch, seq, max_num_active_seqs=3)
    for r in range(ranks):
        sched = fakes.Scheduler032(fakes.vllm_config(dp_rank=r, dp_size=ranks, moe=True, max_num_seqs=64))
        ctl = live.Controller(sched, control_dir=str(scratch), engine_version=V032, launch=launch)
        ctl._next_poll = 0.0
        ctl.before_step(sched)
    for r in kept:
        if r < ranks:
            os.replace(scratch / f"ack-{r}.json", control_dir / f"ack-{r}.json")


earlier = st.lists(st.fixed_dictionaries({
    "ranks": st.integers(1, 4),
    "kept": st.lists(st.integers(0, 3), max_size=4, unique=True),
    "seq": st.one_of(st.none(), st.integers(0, 10**6)),
    "after": st.booleans(),  # left after the current launch started (a lingering writer)
}), max_size=3)


@settings(max_examples=150, deadline=None)
@given(launches=earlier, ranks=st.integers(1, 3), moe=st.booleans(), legacy=st.booleans(), garbage=st.booleans(),
       load_ack=st.booleans(), cap=st.integers(1, 64), seq=st.integers(11, 10**6))
def test_only_the_current_launchs_acks_are_read_and_the_rest_removed(
        tmp_path_factory: Any, launches: list[dict[str, Any]], ranks: int, moe: bool, legacy: bool,
        garbage: bool, load_ack: bool, cap: int, seq: int) -> None:
    root = tmp_path_factory.mktemp("live")
    control_dir = live_knobs.prepare_control_dir(root / "control")
    now = protocol.this_launch()
    old = [protocol.Launch(f"{now.id.split('-')[0]}-{900 + i}-{i}", now.at - 3600 * (len(launches) - i))
           for i in range(len(launches))]

    def leave(i: int) -> None:
        spec = launches[i]
        # a later rank of this launch overwrites an earlier launch's file of its rank: left only beyond them
        kept = [r for r in spec["kept"] if not spec["after"] or r >= ranks]
        leave_earlier_launch(control_dir, old[i], spec["ranks"], kept, spec["seq"])

    def leave_others() -> None:
        if legacy:  # a plugin from before launches: no launch, no launched_at, no ranks
            (control_dir / "ack-5.json").write_text(json.dumps(_legacy_ack()))
        if garbage:
            (control_dir / "ack-6.json").write_bytes(b'{"protocol": 1, "seq": ')
            os.utime(control_dir / "ack-6.json", (now.at - 7200, now.at - 7200))
        if load_ack:
            doc = dict.fromkeys(protocol.ACK_FIELDS)
            doc.update(protocol=1, live=False, refused="vLLM's v1 scheduler cannot be imported", launch="x-1-1",
                       launched_at=now.at - 60)
            (control_dir / "ack-load.json").write_text(json.dumps(doc))

    for i in range(len(launches)):
        if not launches[i]["after"]:
            leave(i)
    leave_others()
    current = current_engines(control_dir, ranks, moe=moe)
    # the plugin removed, at its start, every file of an earlier launch that was there
    left = {p.name: json.loads(p.read_text()).get("launch") for p in control_dir.glob("ack-*.json")}
    assert left == {f"ack-{r}.json": now.id for r in range(ranks)}, left
    for i in range(len(launches)):
        if launches[i]["after"]:
            leave(i)
    leave_others()  # and again, after the start: only the tuner can set these aside now

    live_knobs.write_request(control_dir, seq, max_num_active_seqs=cap)
    step(current)
    state = live_knobs.Files(control_dir).read()
    assert state.available, state.why_not
    assert (state.seq, state.refused, state.values["max_num_seqs"]) == (seq, None, cap)
    assert len(state.pids) == ranks
    acks = live_knobs.read_acks(control_dir)  # the tuner removed every file of an earlier launch
    assert [(a.path.name, a.launch, a.ranks) for a in acks] == [(f"ack-{r}.json", now.id, ranks) for r in range(ranks)]


def _legacy_ack() -> dict[str, Any]:
    fields = [f for f in protocol.ACK_FIELDS if f not in ("launch", "launched_at", "ranks")]
    doc: dict[str, Any] = dict.fromkeys(fields)
    doc.update(protocol=1, live=True, seq=4, applied={"max_num_active_seqs": 2, "max_num_batched_tokens": None},
               effective={"max_num_active_seqs": 2}, envelope={"max_num_seqs": 64, "max_num_batched_tokens": 2048},
               not_live={}, at=1.0, pid=4242, dp_rank=5)
    return doc


def test_a_rank_of_the_current_launch_not_written_yet_leaves_the_request_unanswered(tmp_path: Path) -> None:
    control_dir = live_knobs.prepare_control_dir(tmp_path / "control")
    engines_ = current_engines(control_dir, 2, moe=False)
    live_knobs.write_request(control_dir, 12, max_num_active_seqs=5)
    step(engines_[:1])
    (control_dir / "ack-1.json").unlink()
    state = live_knobs.Files(control_dir).read()
    assert state.available and state.seq is None  # rank 1 of 2 has not answered: not acknowledged
    step(engines_[1:])
    assert live_knobs.Files(control_dir).read().seq == 12


def test_the_launch_is_inherited_by_the_processes_it_starts(tmp_path: Path) -> None:
    """The launch's first process names it; an EngineCore it starts (here: a child Python) reads the same."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != protocol.ENV_LAUNCH}
    env[protocol.ENV_LAUNCH] = "stale-1-1"  # someone else's value: not an ancestor, not believed
    code = ("import os, subprocess, sys; from vllm_tuner_plugin import protocol; first = protocol.this_launch(); "
            "child = subprocess.run([sys.executable, '-c', 'from vllm_tuner_plugin import protocol; "
            "print(protocol.this_launch().id)'], capture_output=True, text=True, check=True).stdout.strip(); "
            "print(first.id, child, protocol.this_launch().id)")
    from tests.support.plugin import PLUGIN_SRC
    env["PYTHONPATH"] = str(PLUGIN_SRC)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         timeout=60).stdout.split()
    assert out[0] == out[1] == out[2] and out[0] != "stale-1-1" and out[0].split("-")[1].isdigit()


def test_ranks_whose_first_process_named_no_launch_share_their_parents(tmp_path: Path) -> None:
    """Where the launch's first process did not load the plugin before it started its EngineCores, each rank
    takes its parent (the one that started them all) as the launch: the same for every rank."""
    import subprocess

    from tests.support.plugin import PLUGIN_SRC
    env = {k: v for k, v in os.environ.items() if k != protocol.ENV_LAUNCH}
    env["PYTHONPATH"] = str(PLUGIN_SRC)
    rank = ("from vllm_tuner_plugin import protocol; import os; "
            "print(protocol.this_launch(parent=True).id, os.getppid())")
    code = ("import subprocess, sys, os; "
            f"outs = [subprocess.run([sys.executable, '-c', {rank!r}], capture_output=True, text=True, check=True)"
            ".stdout.split() for _ in range(2)]; print(outs[0][0], outs[1][0], os.getpid(), outs[0][1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         timeout=60).stdout.split()
    assert out[0] == out[1] and out[0].split("-")[1] == out[2] == out[3]


# --- the held-out shape: a one-replica live rollout over a directory an earlier two-rank launch used ------


@pytest.fixture
def engine_loop() -> Iterator[list[Any]]:
    """The engine's busy loop: its schedulers step until the test ends."""
    schedulers: list[Any] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.01):
            for s in list(schedulers):
                s.step()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield schedulers
    stop.set()
    thread.join(timeout=5)


def test_a_live_rollout_over_an_earlier_launchs_directory_is_acknowledged(tmp_path: Path,
                                                                        engine_loop: list[Any]) -> None:
    control_dir = live_knobs.prepare_control_dir(tmp_path / "control")
    now = protocol.this_launch()
    # an earlier launch with two ranks; then this launch with one starts — and an ack-1.json is put back
    # there afterwards (restored from a backup, copied with the directory: anything the plugin did not see)
    leave_earlier_launch(control_dir, protocol.Launch("old-77-7", now.at - 600), 2, [0, 1], seq=5)
    kept = (control_dir / "ack-1.json").read_bytes()
    engine_loop.extend(current_engines(control_dir, 1, moe=False))
    (control_dir / "ack-1.json").write_bytes(kept)
    os.utime(control_dir / "ack-1.json", (now.at - 600, now.at - 600))

    argv = ("--max-num-seqs", "64")
    actuator = fake.FakeActuator([base.Replica("a", "http://127.0.0.1:9")], running={"a": argv})
    client = engines.EngineClient(deadline_seconds=2)
    j = journal.Journal(tmp_path / "journal.jsonl")
    driver = driving.RolloutDriver(
        actuator=actuator, drainer=fake.FakeDrainer(), prober=FakeProber(actuator), journal=j,
        poll_seconds=0.02, idle_settle_seconds=0,
        live_control=engineside.EngineLive(client, kind="vllm", plugin=lambda name: live_knobs.Files(control_dir)))
    rollout = driver.begin("live-1", {"a": ("--max-num-seqs", "64")}, live={"a": ({"max_num_seqs": None},
                                                                                  {"max_num_seqs": 16})},
                           limits=machine.Limits(ack_timeout_seconds=10, verify_seconds=0, allow_downtime=True))
    rollout = driver.run(rollout)
    j.close()
    assert machine.outcome(rollout) is machine.Outcome.DONE, (machine.describe(rollout), rollout.of("a").reason)
    assert engine_loop[0].max_num_active_reqs == 16
    assert sorted(p.name for p in control_dir.glob("ack-*.json")) == ["ack-0.json"]
