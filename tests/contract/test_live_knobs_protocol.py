"""Both sides of the live-knob file protocol against the same files: the tuner's
``tuner.sources.live_knobs`` writes requests and reads acknowledgements, the plugin's
``vllm_tuner_plugin`` (run on a fake 0.32-shaped scheduler) reads the requests and writes the acks.

The format is defined once, in ``tuner/portable/live_protocol.py``, which the plugin carries byte for byte
as its ``protocol.py``; the tuner's reader takes its names from there. This suite keeps the copy equal and
the two sides' readings of the same files the same.
"""

from __future__ import annotations

import filecmp
import json
import os
from pathlib import Path

import pytest

from tests.support import fake_schedulers as fakes
from tests.support.plugin import PLUGIN_SRC, live, protocol, vllm_tuner_plugin
from tuner.errors import SourceError
from tuner.portable import live_protocol
from tuner.sources import live_knobs


@pytest.fixture
def control_dir(tmp_path):
    return live_knobs.prepare_control_dir(tmp_path / "control")


def engine(control_dir, *, dp_rank=0, version="0.32.0"):
    cls = fakes.fresh(fakes.Scheduler032)
    live.install(cls, engine_version=version, control_dir=str(control_dir))
    return cls(fakes.vllm_config(dp_rank=dp_rank, max_num_seqs=64, max_num_batched_tokens=2048))


def step(sched):
    sched.__dict__[live.CONTROLLER_ATTR]._next_poll = 0.0
    sched.step()


def test_the_plugin_carries_the_one_protocol_file_byte_for_byte():
    """Edit tuner/portable/live_protocol.py, then copy it to plugin/src/vllm_tuner_plugin/protocol.py."""
    assert filecmp.cmp(Path(live_protocol.__file__), PLUGIN_SRC / "vllm_tuner_plugin" / "protocol.py", shallow=False)
    assert Path(protocol.__file__).resolve() == (PLUGIN_SRC / "vllm_tuner_plugin" / "protocol.py").resolve()


def test_the_two_sides_name_the_same_things():
    assert live_knobs.PROTOCOL == protocol.PROTOCOL
    assert live_knobs.CONTROL_FILE == protocol.CONTROL_FILE
    assert live_knobs.ENV_CONTROL_DIR == protocol.ENV_CONTROL_DIR
    assert live_knobs.KNOBS == protocol.KNOBS
    assert live_knobs.REQUEST_FIELDS == protocol.REQUEST_FIELDS
    assert live_knobs.ACK_FIELDS == protocol.ACK_FIELDS
    assert f"{protocol.ACK_PREFIX}*{protocol.ACK_SUFFIX}" == live_knobs.ACK_GLOB


@pytest.mark.parametrize("values", [
    {},
    {"max_num_active_seqs": 16},
    {"max_num_active_seqs": None, "max_num_batched_tokens": 512},
    {"max_num_active_seqs": 1, "max_num_batched_tokens": None},
])
def test_a_request_the_tuner_writes_is_the_request_the_plugin_reads(control_dir, values):
    path = live_knobs.write_request(control_dir, 41, **values)
    assert live_knobs.request_document(41, **values) == protocol.request_document(41, **values)
    request = protocol.read_control(str(control_dir), uid=os.geteuid())  # includes the permission checks
    assert request == protocol.Request(seq=41, **values)
    assert (os.stat(path).st_mode & 0o777) == 0o640  # written by its owner only, readable by a group-shared engine
    assert [p.name for p in control_dir.iterdir()] == ["control.json"]  # no temp file left


def test_the_acks_the_plugin_writes_are_what_the_tuner_reads(control_dir):
    a, b = engine(control_dir, dp_rank=0), engine(control_dir, dp_rank=1)
    startup = live_knobs.read_acks(control_dir)
    assert [(x.dp_rank, x.seq, x.live, x.refused) for x in startup] == [(0, None, True, None), (1, None, True, None)]
    a.fill(20)
    b.fill(20)
    live_knobs.write_request(control_dir, 7, max_num_active_seqs=16, max_num_batched_tokens=256)
    step(a)
    step(b)
    acks = live_knobs.read_acks(control_dir)
    for ack in acks:
        raw = json.loads(ack.path.read_text())
        assert tuple(raw) == live_knobs.ACK_FIELDS
        assert ack.answers(7) and ack.is_applied and ack.live and ack.problem is None
        assert ack.applied == {"max_num_active_seqs": 16, "max_num_batched_tokens": 256}
        assert ack.effective["max_num_active_seqs"] == 16 and ack.effective["max_num_batched_tokens"] == 256
        assert ack.envelope == {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_num_active_seqs": 64}
        assert ack.pid == os.getpid() and ack.engine_version == "0.32.0" and ack.engine_known
        assert ack.mode == "active-cap" and ack.plugin_version == vllm_tuner_plugin.__version__
        assert ack.at == raw["at"] and ack.not_live == {}
    live_knobs.write_request(control_dir, 8, max_num_active_seqs=65)
    step(a)
    refused = live_knobs.read_acks(control_dir)[0]
    assert refused.answers(8) and not refused.is_applied and refused.live
    assert "outside the startup envelope 1..64" in (refused.refused or "")
    assert refused.effective["seq"] == 7  # still in force


def test_a_plugin_refused_as_a_whole_reads_as_not_live(control_dir):
    engine(control_dir, version="0.20.0")
    (ack,) = live_knobs.read_acks(control_dir)
    assert not ack.live and "older than 0.26" in (ack.refused or "") and ack.seq is None
    assert set(ack.not_live) == set(live_knobs.KNOBS)


def test_the_tuner_prepares_a_directory_the_plugin_accepts_and_refuses_one_it_refuses(tmp_path):
    good = live_knobs.prepare_control_dir(tmp_path / "a" / "b")
    live_knobs.write_request(good, 1)
    protocol.read_control(str(good), uid=os.geteuid())  # does not raise
    bad = tmp_path / "shared"
    bad.mkdir()
    os.chmod(bad, 0o777)  # what an emptyDir looks like
    with pytest.raises(SourceError, match="writable by group or others"):
        live_knobs.prepare_control_dir(bad)
    live_knobs.write_request(bad, 2)
    with pytest.raises(protocol.ProtocolError, match="writable by group or others"):
        protocol.read_control(str(bad), uid=os.geteuid())


def test_the_readmes_ack_is_one_the_tuner_reads_whole(tmp_path):
    """plugin/README.md's example acknowledgement has every field of the protocol, and the tuner reads it."""
    import re
    from pathlib import Path

    readme = (Path(protocol.__file__).resolve().parents[2] / "README.md").read_text()
    example = re.search(r"\*\*`ack-<dp_rank>\.json`\*\*.*?```json\n(.*?)```", readme, re.S).group(1)
    doc = json.loads(example)
    assert tuple(doc) == protocol.ACK_FIELDS
    ack = live_knobs.parse_ack(tmp_path / "ack-0.json", example.encode())
    assert ack.problem is None and (ack.launch, ack.ranks, ack.seq) == (doc["launch"], 1, 7)
