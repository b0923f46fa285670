"""``tuner.sources.live_knobs`` on its own: request validation and reading broken or partial acks."""

from __future__ import annotations

import json

import pytest

from tuner.errors import SourceError
from tuner.sources import live_knobs


@pytest.mark.parametrize(("seq", "values", "why"), [
    (-1, {}, "seq must be an integer >= 0"),
    (True, {}, "seq must be an integer >= 0"),
    (1, {"max_num_seqs": 4}, "unknown live knob 'max_num_seqs'"),
    (1, {"max_num_active_seqs": 0}, "integer >= 1 or None"),
    (1, {"max_num_active_seqs": False}, "integer >= 1 or None"),
    (1, {"max_num_batched_tokens": 2.5}, "integer >= 1 or None"),
])
def test_bad_requests_are_refused_before_anything_is_written(tmp_path, seq, values, why):
    with pytest.raises(ValueError, match=why):
        live_knobs.write_request(tmp_path, seq, **values)
    assert list(tmp_path.iterdir()) == []


def test_writing_into_a_missing_directory_is_a_source_error(tmp_path):
    with pytest.raises(SourceError, match="cannot write a request"):
        live_knobs.write_request(tmp_path / "nope", 1, max_num_active_seqs=2)


def test_read_acks_reports_broken_files_and_sorts_by_rank(tmp_path):
    assert live_knobs.read_acks(tmp_path / "missing") == []
    good = {"protocol": 1, "live": True, "seq": 3, "applied": {"max_num_active_seqs": 4}, "refused": None,
            "effective": {"max_num_active_seqs": 4}, "dp_rank": 2, "at": 1.5}
    (tmp_path / "ack-2.json").write_text(json.dumps(good))
    (tmp_path / "ack-10.json").write_text(json.dumps({**good, "dp_rank": 10, "live": "yes"}))
    (tmp_path / "ack-0.json").write_text("{half")
    (tmp_path / "ack-1.json").write_text(json.dumps({**good, "protocol": 9}))
    (tmp_path / "ack-big.json").write_bytes(b" " * (live_knobs.MAX_ACK_BYTES + 1))
    (tmp_path / ".ack-3.json.x.tmp").write_text("ignored")
    acks = live_knobs.read_acks(tmp_path)
    assert [a.path.name for a in acks] == ["ack-2.json", "ack-10.json", "ack-0.json", "ack-1.json", "ack-big.json"]
    two, ten, half, other, big = acks
    assert two.answers(3) and two.is_applied and two.live and two.at == 1.5
    assert ten.live is False  # only JSON true counts
    assert "not valid JSON" in (half.problem or "") and not half.answers(3)
    assert "protocol 9" in (other.problem or "")
    assert "larger than" in (big.problem or "")
