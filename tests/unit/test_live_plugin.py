"""The engine-side plugin against fake schedulers shaped like vLLM 0.32's and 0.26's (no vLLM here).

The fakes keep vLLM's admission test and its end-of-step asserts, so a plugin that lowered 0.26's
``max_num_running_reqs`` below the running count would fail here the way it would kill a real engine.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import fake_schedulers as fakes
from tests.support.plugin import engines, live, protocol, vllm_tuner_plugin
from tuner.sources import live_knobs

V032, V026 = "0.32.0", "0.26.0"


@pytest.fixture
def control_dir(tmp_path):
    d = tmp_path / "control"
    d.mkdir(mode=0o700)
    return d


def make(control_dir, shape=fakes.Scheduler032, version=V032, **config):
    cls = fakes.fresh(shape)
    live.install(cls, engine_version=version, control_dir=str(control_dir))
    return cls(fakes.vllm_config(**config))


def controller(sched) -> live.Controller:
    return sched.__dict__[live.CONTROLLER_ATTR]


def request(control_dir, seq, **knobs):
    """Write control.json as the tuner does: a private temp file, then rename."""
    tmp = control_dir / ".control.tmp"
    tmp.write_text(json.dumps({"seq": seq, **knobs}))
    os.chmod(tmp, 0o600)
    os.replace(tmp, control_dir / protocol.CONTROL_FILE)


def step(sched, n=1, *, poll=True):
    for _ in range(n):
        if poll and live.CONTROLLER_ATTR in sched.__dict__:
            controller(sched)._next_poll = 0.0  # as if POLL_SECONDS had passed
        sched.step()


def ack(control_dir, rank=0):
    return json.loads((control_dir / f"ack-{rank}.json").read_text())


# --------------------------------------------------------------------------------------------------
# Inert unless configured
# --------------------------------------------------------------------------------------------------


def test_register_is_inert_without_the_control_dir(monkeypatch):
    monkeypatch.delenv(protocol.ENV_CONTROL_DIR, raising=False)
    monkeypatch.setattr(vllm_tuner_plugin, "_registered", False)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    vllm_tuner_plugin.register()
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)  # not even imported
    assert vllm_tuner_plugin._registered is False


def _fake_vllm(monkeypatch, version, scheduler_cls):
    """Install a fake ``vllm`` package whose v1 scheduler module holds ``scheduler_cls``."""
    parts = ["vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler"]
    for name in parts:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm"].__version__ = version
    sys.modules["vllm.v1.core.sched.scheduler"].Scheduler = scheduler_cls
    monkeypatch.setattr(vllm_tuner_plugin, "_registered", False)


def test_register_hooks_the_scheduler_when_configured(monkeypatch, control_dir):
    cls = fakes.fresh(fakes.Scheduler032)
    untouched = fakes.fresh(fakes.Scheduler032)
    _fake_vllm(monkeypatch, V032, cls)
    monkeypatch.setenv(protocol.ENV_CONTROL_DIR, str(control_dir))
    vllm_tuner_plugin.register()
    vllm_tuner_plugin.register()  # vLLM may call it again in the same process: no double wrap
    assert getattr(cls.schedule, live.WRAPPED_MARK) and not hasattr(untouched.schedule, live.WRAPPED_MARK)
    assert cls.schedule.__wrapped__ is fakes.Scheduler032.schedule
    sched = cls(fakes.vllm_config())
    startup = ack(control_dir)
    assert startup["seq"] is None and startup["refused"] is None
    assert startup["engine_version"] == V032 and startup["engine_known"] is True
    assert startup["mode"] == engines.ACTIVE_CAP and startup["pid"] == os.getpid()
    assert startup["envelope"] == {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_num_active_seqs": 64}
    assert startup["not_live"] == {}
    request(control_dir, 1, max_num_active_seqs=4)
    sched.fill(10)
    step(sched)
    assert len(sched.running) == 4 and ack(control_dir)["applied"] == {"max_num_active_seqs": 4,
                                                                         "max_num_batched_tokens": None}


def test_a_scheduler_that_cannot_be_imported_is_refused_in_ack_load(monkeypatch, control_dir):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    sys.modules["vllm"].__version__ = V032
    monkeypatch.setitem(sys.modules, "vllm.v1", None)  # import of vllm.v1.* fails
    monkeypatch.setattr(vllm_tuner_plugin, "_registered", False)
    monkeypatch.setenv(protocol.ENV_CONTROL_DIR, str(control_dir))
    vllm_tuner_plugin.register()  # must not raise
    doc = json.loads((control_dir / "ack-load.json").read_text())
    assert "cannot be imported" in doc["refused"] and tuple(doc) == protocol.ACK_FIELDS


# --------------------------------------------------------------------------------------------------
# The cap on 0.32: a separate admission attribute, drain-down without preemption
# --------------------------------------------------------------------------------------------------


def test_032_cap_changes_live_and_drains_down(control_dir):
    sched = make(control_dir)
    sched.fill(32)
    request(control_dir, 1, max_num_active_seqs=4)
    step(sched, 3)
    assert len(sched.running) == 4 and sched.max_num_running_reqs == 64  # the bound is never touched
    request(control_dir, 2, max_num_active_seqs=16)
    step(sched)
    assert len(sched.running) == 16  # raised: admitted at once
    request(control_dir, 3, max_num_active_seqs=8)
    step(sched)
    a = ack(control_dir)
    assert len(sched.running) == 16  # lowered: nobody is preempted ...
    assert a["seq"] == 3 and a["effective"]["draining"] is True and a["effective"]["admission_cap"] == 8
    sched.finish(5)
    step(sched)
    assert len(sched.running) == 11  # ... and nobody new is admitted while above the cap
    sched.finish(5)
    step(sched)
    assert len(sched.running) == 8  # 6 left + 2 admitted up to the new cap
    # written at the start of that step: 6 running, admission still to come
    assert ack(control_dir)["effective"] == {"seq": 3, "max_num_active_seqs": 8, "max_num_batched_tokens": 2048,
                                             "admission_cap": 8, "running": 6, "draining": False}
    request(control_dir, 4)  # null/absent = the startup value
    step(sched)
    assert sched.max_num_active_reqs == 64 and ack(control_dir)["applied"]["max_num_active_seqs"] is None


def test_032_startup_active_cap_is_the_default_and_may_be_raised_within_max_num_seqs(control_dir):
    sched = make(control_dir, max_num_active_seqs=8)
    assert ack(control_dir)["envelope"]["max_num_active_seqs"] == 8
    request(control_dir, 1, max_num_active_seqs=32)
    step(sched)
    assert sched.max_num_active_reqs == 32
    request(control_dir, 2, max_num_active_seqs=None)
    step(sched)
    assert sched.max_num_active_reqs == 8


# --------------------------------------------------------------------------------------------------
# The cap on 0.26: one attribute admits and bounds -> follow-down
# --------------------------------------------------------------------------------------------------


def test_026_lowering_follows_the_running_count_down(control_dir):
    sched = make(control_dir, fakes.Scheduler026, V026, with_active_field=False)
    assert ack(control_dir)["mode"] == engines.FOLLOW_DOWN
    sched.fill(40)
    step(sched)
    assert len(sched.running) == 40
    request(control_dir, 1, max_num_active_seqs=8)
    step(sched)  # would trip `assert len(running) <= max_num_running_reqs` if set to 8 here
    a = ack(control_dir)
    assert sched.max_num_running_reqs == 40 and a["effective"]["admission_cap"] == 40
    assert a["effective"]["max_num_active_seqs"] == 8 and a["effective"]["draining"] is True
    sched.fill(10)
    for left in (30, 12, 9, 8):
        sched.finish(len(sched.running) - left)
        step(sched)
        assert sched.max_num_running_reqs == left and len(sched.running) == left  # none admitted
    sched.finish(3)
    step(sched)
    assert sched.max_num_running_reqs == 8 and len(sched.running) == 8  # 5 left + 3 admitted
    assert ack(control_dir)["effective"]["draining"] is False
    sched.fill(20)
    request(control_dir, 2, max_num_active_seqs=20)
    step(sched)
    assert len(sched.running) == 20  # raising is immediate
    assert max(sched.step_running) <= 40


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["cap", "arrive", "finish", "step", "tokens"]),
                          st.integers(min_value=0, max_value=80)), max_size=60),
       st.sampled_from(["0.26", "0.32"]))
def test_no_sequence_of_requests_trips_the_engine_asserts(tmp_path_factory, ops, shape):
    """Whatever the tuner asks and whenever requests come and go, vLLM's end-of-step asserts hold, the
    running count never grows past the cap in force, and nothing outside the envelope is applied."""
    d = tmp_path_factory.mktemp("ctl")
    os.chmod(d, 0o700)
    cls, version = (fakes.Scheduler026, V026) if shape == "0.26" else (fakes.Scheduler032, V032)
    sched = make(d, cls, version, max_num_seqs=32, max_num_batched_tokens=256)
    seq = 0
    target = 32
    for op, n in ops:
        if op == "cap":
            seq += 1
            request(d, seq, max_num_active_seqs=n)
            if 1 <= n <= 32:
                target = n
        elif op == "tokens":
            seq += 1
            request(d, seq, max_num_batched_tokens=n * 4 or None, max_num_active_seqs=target)
        elif op == "arrive":
            sched.fill(n, prompt_len=1 + n % 50, output_len=1 + n % 7)
        elif op == "finish":
            sched.finish(n)
        before = len(sched.running)
        step(sched)  # the fake's asserts are vLLM's
        assert len(sched.running) <= max(target, before)
        assert 1 <= getattr(sched, sched.ADMISSION_ATTR) <= 32
        assert 32 <= sched.max_num_scheduled_tokens <= 256
    assert controller(sched).refusal is None


# --------------------------------------------------------------------------------------------------
# The envelope
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("knobs", "why"), [
    ({"max_num_active_seqs": 65}, "outside the startup envelope 1..64"),
    ({"max_num_active_seqs": 0}, "integer >= 1"),
    ({"max_num_active_seqs": True}, "integer >= 1"),
    ({"max_num_batched_tokens": 4096}, "outside the startup envelope 64..2048"),
    ({"max_num_batched_tokens": 32}, "outside the startup envelope 64..2048"),
    ({"max_num_active_seqs": 8, "max_num_batched_tokens": 99999}, "outside the startup envelope"),
])
def test_beyond_the_envelope_is_refused_and_nothing_applied(control_dir, knobs, why):
    sched = make(control_dir)
    request(control_dir, 1, max_num_active_seqs=16, max_num_batched_tokens=512)
    step(sched)
    request(control_dir, 2, **knobs)
    step(sched)
    a = ack(control_dir)
    assert a["seq"] == 2 and why in a["refused"] and a["applied"] is None
    assert a["effective"]["seq"] == 1  # the request in force is still seq 1
    assert sched.max_num_active_reqs == 16 and sched.max_num_scheduled_tokens == 512


def test_token_budget_lowered_and_restored_on_a_checked_engine(control_dir):
    sched = make(control_dir, max_num_batched_tokens=512)
    sched.fill(8, prompt_len=300, output_len=4)
    request(control_dir, 1, max_num_batched_tokens=64)
    step(sched, 6)
    assert max(sched.step_tokens) == 64  # prompts chunked to the lowered budget
    request(control_dir, 2, max_num_batched_tokens=None)
    sched.fill(4, prompt_len=300, output_len=4)
    step(sched)
    assert sched.max_num_scheduled_tokens == 512 and sched.step_tokens[-1] > 64


def test_the_tuners_step_budget_change_leaves_its_cap_in_force(control_dir):
    """The tuner's own channel into the plugin: a live change of the step budget after one of the cap. On a
    lent H100 the second request, sent as the one knob, put the cap back to the envelope (115 → 1024)."""
    channel = live_knobs.Files(control_dir)
    sched = make(control_dir, max_num_seqs=64, max_num_batched_tokens=512)
    assert channel.request(1, {"max_num_seqs": 8}) is None
    step(sched)
    assert ack(control_dir)["effective"]["max_num_active_seqs"] == 8
    assert channel.request(2, {"max_num_batched_tokens": 128}) is None
    sched.fill(20, prompt_len=300, output_len=4)
    step(sched, 3)
    effective = ack(control_dir)["effective"]
    assert effective["max_num_active_seqs"] == 8 and effective["max_num_batched_tokens"] == 128
    assert max(sched.step_running) <= 8


@pytest.mark.parametrize(("config", "attr", "why"), [
    ({"enable_chunked_prefill": False}, None, "chunked prefill is off"),
    ({"speculative": True}, None, "speculative decoding"),
    ({}, ("max_num_encoder_input_tokens", 4096), "encoder (multimodal)"),
    ({}, ("need_mamba_block_aligned_split", True), "Mamba"),
    ({}, ("connector", object()), "connector"),
    ({"max_num_scheduled_tokens": 1024}, None, "--max-num-scheduled-tokens differs"),
])
def test_token_budget_is_not_live_where_it_was_not_shown_safe(control_dir, config, attr, why):
    cls = fakes.fresh(fakes.Scheduler032)
    if attr is not None:
        original = cls.__init__

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            setattr(self, *attr)

        cls.__init__ = __init__
    live.install(cls, engine_version=V032, control_dir=str(control_dir))
    sched = cls(fakes.vllm_config(**config))
    assert why in ack(control_dir)["not_live"]["max_num_batched_tokens"]
    tokens_before = sched.max_num_scheduled_tokens
    request(control_dir, 1, max_num_active_seqs=4, max_num_batched_tokens=128)
    step(sched)
    a = ack(control_dir)
    assert "max_num_batched_tokens is not live on this engine" in a["refused"] and why in a["refused"]
    assert sched.max_num_scheduled_tokens == tokens_before and sched.max_num_active_reqs == 64
    request(control_dir, 2, max_num_active_seqs=4)  # the cap alone still works there
    step(sched)
    assert sched.max_num_active_reqs == 4 and ack(control_dir)["refused"] is None


# --------------------------------------------------------------------------------------------------
# The control channel: permissions, malformed files, rate limit, DP, alias
# --------------------------------------------------------------------------------------------------


def test_an_insecure_control_dir_or_file_is_refused(control_dir):
    sched = make(control_dir)
    request(control_dir, 1, max_num_active_seqs=8)
    step(sched)
    os.chmod(control_dir, 0o777)
    request(control_dir, 2, max_num_active_seqs=2)
    step(sched)
    a = ack(control_dir)
    assert a["seq"] == 2 and "writable by group or others (mode 0777)" in a["refused"]
    assert sched.max_num_active_reqs == 8 and a["applied"] is None
    os.chmod(control_dir, 0o700)
    os.chmod(control_dir / protocol.CONTROL_FILE, 0o622)  # a chmod alone is noticed too
    step(sched)
    assert "control file" in ack(control_dir)["refused"] and sched.max_num_active_reqs == 8
    os.chmod(control_dir / protocol.CONTROL_FILE, 0o600)
    step(sched)
    assert ack(control_dir)["refused"] is None and sched.max_num_active_reqs == 2


def test_a_control_file_of_another_uid_is_refused(control_dir):
    cls = fakes.fresh(fakes.Scheduler032)
    sched = cls(fakes.vllm_config())
    ctl = live.Controller(sched, control_dir=str(control_dir), engine_version=V032, uid=os.geteuid() + 1)
    request(control_dir, 1, max_num_active_seqs=8)
    ctl.before_step(sched)
    a = ack(control_dir)
    assert f"not by the engine's uid {os.geteuid() + 1}" in a["refused"] and sched.max_num_active_reqs == 64


def test_symlinks_and_fifos_are_refused_without_blocking(control_dir, tmp_path):
    sched = make(control_dir)
    target = tmp_path / "elsewhere.json"
    target.write_text('{"seq": 1, "max_num_active_seqs": 2}')
    os.symlink(target, control_dir / protocol.CONTROL_FILE)
    step(sched)
    assert "not a regular file" in ack(control_dir)["refused"]
    os.unlink(control_dir / protocol.CONTROL_FILE)
    os.mkfifo(control_dir / protocol.CONTROL_FILE, 0o600)
    done = threading.Event()
    threading.Thread(target=lambda: (step(sched), done.set()), daemon=True).start()
    assert done.wait(10), "a FIFO blocked the step"
    assert "not a regular file" in ack(control_dir)["refused"] and sched.max_num_active_reqs == 64


@pytest.mark.parametrize(("raw", "why"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"max_num_active_seqs": 4}', 'needs "seq"'),
    (b'{"seq": -1, "max_num_active_seqs": 4}', 'needs "seq"'),
    (b'{"seq": 3, "max_num_seqs": 4}', "unknown key 'max_num_seqs'"),
    (b'{"seq": 3, "max_num_active_seqs": "4"}', "integer >= 1 or null"),
    (b'{"seq": 3, "max_num_active_seqs": 4.0}', "integer >= 1 or null"),
    (b'{"seq": 3, "protocol": 2}', "speaks protocol 2"),
    (b'{"seq": 3, "max_num_active_seqs": 4, "max_num_running_seqs": 5}', "given twice"),
    (b" " * (protocol.MAX_CONTROL_BYTES + 1), "the limit is"),
])
def test_a_malformed_control_file_is_refused_with_a_reason(control_dir, raw, why):
    sched = make(control_dir)
    sched.fill(4)
    (control_dir / protocol.CONTROL_FILE).write_bytes(raw)
    os.chmod(control_dir / protocol.CONTROL_FILE, 0o600)
    step(sched)
    a = ack(control_dir)
    assert why in a["refused"] and a["applied"] is None
    assert len(sched.running) == 4 and controller(sched).refusal is None  # still stepping, still live


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=200),
                 st.dictionaries(st.sampled_from(["seq", "protocol", *protocol.KNOBS, "max_num_running_seqs", "x"]),
                                 st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.text(max_size=3),
                                           st.floats(allow_nan=False)), max_size=5).map(
                     lambda d: json.dumps(d).encode())))
def test_no_control_file_crashes_a_step(tmp_path_factory, raw):
    d = tmp_path_factory.mktemp("ctl")
    os.chmod(d, 0o700)
    sched = make(d)
    sched.fill(3)
    (d / protocol.CONTROL_FILE).write_bytes(raw)
    step(sched)
    a = ack(d)
    assert controller(sched).refusal is None
    assert (a["refused"] is None) == (a["applied"] is not None)
    assert 1 <= sched.max_num_active_reqs <= 64


def test_the_alias_from_upstream_pr_54816_is_accepted(control_dir):
    sched = make(control_dir)
    request(control_dir, 1, max_num_running_seqs=6)
    step(sched)
    assert sched.max_num_active_reqs == 6 and ack(control_dir)["applied"]["max_num_active_seqs"] == 6


def test_the_file_is_looked_at_no_more_than_every_poll_interval(control_dir, monkeypatch):
    now = [100.0]
    sched = make(control_dir)
    ctl = controller(sched)
    ctl._clock = lambda: now[0]
    stats = []
    real_lstat = os.lstat
    monkeypatch.setattr(live.os, "lstat", lambda p, *a, **k: (stats.append(p), real_lstat(p, *a, **k))[1])
    request(control_dir, 1, max_num_active_seqs=4)
    sched.step()
    assert sched.max_num_active_reqs == 4
    stats.clear()
    for _ in range(20):
        sched.step()  # within the same poll interval: no look at all
    assert stats == []
    now[0] += live.POLL_SECONDS
    for _ in range(20):
        sched.step()  # the next interval: one look, file unchanged, nothing read
    assert len(stats) == 1
    request(control_dir, 2, max_num_active_seqs=5)
    now[0] += live.POLL_SECONDS / 2
    sched.step()
    assert sched.max_num_active_reqs == 4  # not yet
    now[0] += live.POLL_SECONDS
    sched.step()
    assert sched.max_num_active_reqs == 5


def test_each_dp_rank_writes_its_own_ack(control_dir):
    a, b = make(control_dir, dp_rank=0), make(control_dir, dp_rank=1)
    request(control_dir, 7, max_num_active_seqs=3)
    step(a)
    step(b)
    assert ack(control_dir, 0)["seq"] == ack(control_dir, 1)["seq"] == 7
    assert ack(control_dir, 1)["dp_rank"] == 1
    assert sorted(p.name for p in control_dir.iterdir()) == ["ack-0.json", "ack-1.json", "control.json"]


def test_removing_the_control_file_keeps_what_is_in_force(control_dir):
    sched = make(control_dir)
    request(control_dir, 1, max_num_active_seqs=5)
    step(sched)
    os.unlink(control_dir / protocol.CONTROL_FILE)
    step(sched)
    assert sched.max_num_active_reqs == 5


def test_the_control_dir_is_created_private_when_missing(tmp_path):
    d = tmp_path / "new"
    make(d)
    assert (os.stat(d).st_mode & 0o777) == 0o700 and ack(d)["refused"] is None


# --------------------------------------------------------------------------------------------------
# Versions and internals that moved: refuse cleanly, apply nothing, say so
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "why"), [
    ("0.25.3", "older than 0.26"),
    ("0.11.0", "older than 0.26"),
    ("dev", "cannot be read"),
])
def test_a_refused_version_applies_nothing(monkeypatch, control_dir, version, why):
    cls = fakes.fresh(fakes.Scheduler032)
    _fake_vllm(monkeypatch, version, cls)
    monkeypatch.setenv(protocol.ENV_CONTROL_DIR, str(control_dir))
    vllm_tuner_plugin.register()
    assert not hasattr(cls.schedule, live.WRAPPED_MARK)  # schedule() left alone
    sched = cls(fakes.vllm_config())
    a = ack(control_dir)
    assert why in a["refused"] and a["not_live"] == dict.fromkeys(protocol.KNOBS, a["refused"])
    request(control_dir, 1, max_num_active_seqs=2)
    sched.fill(5)
    sched.step()
    assert len(sched.running) == 5 and ack(control_dir)["seq"] is None


def test_a_known_version_with_moved_internals_is_refused(control_dir):
    sched = make(control_dir, fakes.Scheduler026, V032)  # "0.32" without max_num_active_reqs
    a = ack(control_dir)
    assert "lacks max_num_active_reqs" in a["refused"]
    request(control_dir, 1, max_num_active_seqs=2)
    sched.fill(5)
    step(sched)
    assert len(sched.running) == 5 and sched.max_num_running_reqs == 64


@pytest.mark.parametrize(("attr", "value", "why"), [
    ("max_num_running_reqs", 32, "expected --max-num-seqs (64)"),
    ("max_num_running_reqs", 64.0, "expected --max-num-seqs"),
    ("max_num_active_reqs", "64", "scheduler.max_num_active_reqs is '64'"),
    ("max_num_active_reqs", 65, "max_num_active_reqs is 65"),
    ("running", (), "not a list"),
    ("max_num_scheduled_tokens", 4096, "no larger than it"),
    ("num_waiting_for_streaming_input", None, "expected an integer"),
])
def test_unexpected_attributes_are_refused(control_dir, attr, value, why):
    cls = fakes.fresh(fakes.Scheduler032)
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        setattr(self, attr, value)

    cls.__init__ = __init__
    live.install(cls, engine_version=V032, control_dir=str(control_dir))
    cls(fakes.vllm_config())
    assert why in ack(control_dir)["refused"]


@pytest.mark.parametrize(("shape", "mode"), [(fakes.Scheduler032, engines.ACTIVE_CAP),
                                             (fakes.Scheduler026, engines.FOLLOW_DOWN)])
def test_an_unknown_newer_version_gets_the_cap_by_its_attributes_and_no_token_budget(control_dir, shape, mode):
    sched = make(control_dir, shape, "0.40.1.dev7+g1234")
    a = ack(control_dir)
    assert a["refused"] is None and a["engine_known"] is False and a["mode"] == mode
    assert "not in the plugin's table" in a["not_live"]["max_num_batched_tokens"]
    sched.fill(10)
    request(control_dir, 1, max_num_active_seqs=3)
    step(sched)
    assert len(sched.running) == 3


def test_an_internal_error_restores_the_startup_values_and_stops(control_dir, monkeypatch):
    sched = make(control_dir, fakes.Scheduler026, V026)
    sched.fill(10)
    request(control_dir, 1, max_num_active_seqs=2)
    step(sched)
    assert sched.max_num_running_reqs == 2

    def broken(self, scheduler):
        raise RuntimeError("boom")

    monkeypatch.setattr(live.Controller, "_enforce", broken)
    step(sched)  # must not raise into the engine
    a = ack(control_dir)
    assert "internal error (RuntimeError: boom)" in a["refused"] and sched.max_num_running_reqs == 64
    monkeypatch.undo()
    request(control_dir, 2, max_num_active_seqs=3)
    step(sched)
    assert sched.max_num_running_reqs == 64  # stopped for good


def test_an_unwritable_ack_is_logged_once_and_the_engine_goes_on(control_dir, monkeypatch, caplog):
    sched = make(control_dir)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(live.protocol, "write_json_atomically", full)
    sched.fill(5)
    for seq in (1, 2, 3):
        request(control_dir, seq, max_num_active_seqs=seq)
        step(sched)
    assert sched.max_num_active_reqs == 3
    assert sum("cannot write the acknowledgement" in r.message for r in caplog.records) == 1


def test_acks_are_written_atomically(control_dir):
    sched = make(control_dir)
    for seq in range(1, 30):
        request(control_dir, seq, max_num_active_seqs=seq)
        step(sched)
    assert sorted(p.name for p in control_dir.iterdir()) == ["ack-0.json", "control.json"]  # no temp files
    assert ack(control_dir)["seq"] == 29
