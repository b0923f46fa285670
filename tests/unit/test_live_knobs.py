"""``tuner.sources.live_knobs`` on its own: request validation and reading broken or partial acks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# --------------------------------------------------------------------------------------------------
# A request is a change to the state in force (control.json is the whole state)
# --------------------------------------------------------------------------------------------------


def _requested(path):
    return {k: v for k, v in json.loads((path / live_knobs.CONTROL_FILE).read_text()).items()
            if k in live_knobs.KNOBS}


def test_a_step_budget_change_keeps_the_cap_in_force(tmp_path):
    """Found on a lent H100 (h100-family-2026-124): a live step-budget change sent as {tokens} alone put the
    cap back to the startup envelope, 115 → 1024, while the tuner counted 115."""
    channel = live_knobs.Files(tmp_path)
    assert channel.request(1, {"max_num_seqs": 115}) is None
    assert channel.request(2, {"max_num_batched_tokens": 2692}) is None
    assert _requested(tmp_path) == {"max_num_active_seqs": 115, "max_num_batched_tokens": 2692}
    assert channel.request(3, {"max_num_batched_tokens": None}) is None  # put back: only that knob
    assert _requested(tmp_path) == {"max_num_active_seqs": 115, "max_num_batched_tokens": None}
    assert json.loads((tmp_path / live_knobs.CONTROL_FILE).read_text())["seq"] == 3


@pytest.mark.parametrize("existing", [None, b"{half", b'{"seq": 1, "max_num_active_seqs": 0}', b"[]"])
def test_without_a_readable_request_in_force_only_the_named_knobs_are_asked(tmp_path, existing):
    if existing is not None:
        (tmp_path / live_knobs.CONTROL_FILE).write_bytes(existing)
    assert live_knobs.Files(tmp_path).request(4, {"max_num_batched_tokens": 512}) is None
    assert _requested(tmp_path) == {"max_num_active_seqs": None, "max_num_batched_tokens": 512}


_KNOB_VALUES = st.one_of(st.none(), st.integers(1, 4096))


@given(st.lists(st.dictionaries(st.sampled_from(["max_num_seqs", "max_num_batched_tokens"]), _KNOB_VALUES,
                                min_size=1), min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_any_sequence_of_changes_leaves_their_fold_in_force(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("control")
    channel = live_knobs.Files(path)
    expected = dict.fromkeys(live_knobs.KNOBS)
    for seq, change in enumerate(changes):
        assert channel.request(seq, change) is None
        expected.update({live_knobs.live.LIVE_NAMES[k]: v for k, v in change.items()})
        assert _requested(path) == expected
