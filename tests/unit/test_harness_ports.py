"""The harness's ports: never from the ephemeral range (an outgoing connection may hold one of those when a
relaunched engine wants its port back), never twice in a process, one block per xdist worker."""

from __future__ import annotations

import pytest

from harness import ports


def test_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low, high = ports._ephemeral()
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)
    assert all(not (low <= p <= high) and 1024 < p < 65536 for p in got)


@pytest.mark.parametrize("worker", ["", "gw0", "gw1", "gw2", "gw3", "gw4"])
def test_each_worker_has_its_own_block(worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = {}
    for w in ["", "gw0", "gw1", "gw2", "gw3", "gw4"]:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", w)
        blocks[w] = set(ports._block())
    mine = blocks.pop(worker)
    assert len(mine) > 1000 and all(not (mine & other) for other in blocks.values())
