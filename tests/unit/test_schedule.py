"""The schedule that tests/conftest.py reads from the test files themselves (issue 29: no registries in the
conftest): every real-engine module has a turn and the evaluation the last one, a file outside tests/e2e/
on the real-engine worker says why, and the longest files' ranks are distinct."""

from __future__ import annotations

from pathlib import Path

from tests import conftest

TESTS = Path(conftest.__file__).resolve().parent
FILES = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py"))


def test_every_e2e_module_has_a_turn_and_the_evaluation_goes_last() -> None:
    turns = {f: conftest.declared(f)["ENGINE_WORKER_TURN"] for f in FILES if "ENGINE_WORKER_TURN" in conftest.declared(f)}
    assert {f for f in FILES if f.startswith("e2e/")} <= set(turns)
    assert max(turns, key=lambda f: turns[f]) == "e2e/test_evaluation.py"
    assert len(set(turns.values())) == len(turns), turns  # no two modules share a turn: the order is total


def test_a_file_outside_e2e_on_the_engine_worker_says_why() -> None:
    joined = [f for f in FILES if not f.startswith("e2e/") and "ENGINE_WORKER_TURN" in conftest.declared(f)]
    assert joined == ["processes/test_podman_pod.py"]
    assert all(conftest.in_e2e_unit(f"tests/{f}::t") and conftest.declared(f).get("ENGINE_WORKER_WHY") for f in joined)
    assert not conftest.in_e2e_unit("tests/processes/test_launcher.py::t")


def test_the_longest_files_ranks_are_distinct_and_go_first() -> None:
    ranks = {f: conftest.declared(f)["START_FIRST"] for f in FILES if "START_FIRST" in conftest.declared(f)}
    assert sorted(ranks.values()) == list(range(1, len(ranks) + 1)), ranks
    first = min(ranks, key=lambda f: ranks[f])
    ids = [f"tests/{f}::t" for f in FILES]
    order = sorted(ids, key=conftest._order)
    engine = [i for i in order if conftest.in_e2e_unit(i)]
    assert order[:len(engine)] == engine  # the real-engine unit first: it has a worker from the start
    assert order[len(engine)] == f"tests/{first}::t"
