"""The engine client's live paths against servers written to each pull request's published API
(``tests/support/live_engines.py``: real HTTP on 127.0.0.1): which path an engine offers and when it is probed
again, the requests each path sends (SGLang's names included), the engine's refusals, and the read-back that
verifies a set. The rollout's live path (``engineside.EngineLive``) is the same interface on every path."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest

from tests.support import live_engines as fake
from tuner.actuators import base
from tuner.model import live
from tuner.runtime import engineside
from tuner.sources.engines import EngineClient


class Plugin:
    """A plugin channel that answers at once (the control-file protocol has its own contract tests)."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, dict[str, int | None]]] = []

    def read(self) -> live.LiveState:
        seq = self.asked[-1][0] if self.asked else None
        return live.LiveState(available=True, envelope={"max_num_seqs": 256}, values={"max_num_seqs": 256}, seq=seq)

    def request(self, seq: int, values: Mapping[str, int | None]) -> str | None:
        self.asked.append((seq, dict(values)))
        return None


@pytest.fixture
def client() -> Iterator[EngineClient]:
    with EngineClient(deadline_seconds=5.0) as c:
        yield c


def serve(engine: fake.Engine) -> fake.Server:
    return fake.Server(engine)


# --- which path, probed when -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("engine", "kind", "plugin", "via"), [
    (fake.Trimtab(), "vllm", True, "trimtab"),
    (fake.RuntimeConfig(), "vllm", True, "runtime_config"),
    (fake.Trimtab(dev_mode=False), "vllm", True, "plugin"),
    (fake.RuntimeConfig(dev_mode=False), "vllm", True, "plugin"),
    (fake.SGLang(pr=True), "sglang", False, "set_internal_state"),
])
def test_each_engine_is_driven_through_the_path_it_offers(client, engine, kind, plugin, via):
    with serve(engine) as server:
        channel = Plugin() if plugin else None
        assert client.live_path(server.url, kind, channel) == via
        state = client.live_state(server.url, channel, kind=kind)
        assert state.available and state.via == via


@pytest.mark.parametrize(("engine", "kind", "expected"), [
    (fake.Trimtab(dev_mode=False), "vllm", ["GET /trimtab/knobs answered 404: needs vLLM pull request 55018 with "
                                            "VLLM_SERVER_DEV_MODE=1", "GET /v1/runtime_config answered 404: needs "
                                            "vLLM pull request 54816", "no plugin channel"]),
    (fake.Trimtab(dev_mode=False, hidden=403), "vllm", ["GET /trimtab/knobs answered 403"]),
    (fake.RuntimeConfig(supported=False), "vllm", ["GET /v1/runtime_config answered 200 without the fields"]),
    (fake.SGLang(pr=False), "sglang", ["SGLang's stock /set_internal_state accepts only pp_max_micro_batch_size",
                                       "need SGLang pull request 37661"]),
])
def test_no_path_says_what_each_probe_answered(client, engine, kind, expected):
    with serve(engine) as server:
        assert client.live_path(server.url, kind) is None
        state = client.live_state(server.url, None, kind=kind)
        assert not state.available
        for words in expected:
            assert words in (state.why_not or ""), state.why_not
        assert client.set_live(server.url, None, seq=1, values={"max_num_seqs": 8}, kind=kind) == state.why_not
        assert server.count("POST", "/trimtab/set_knobs") == server.count("POST", "/set_internal_state") == 0


def test_the_path_is_probed_once_and_kept(client):
    with serve(fake.RuntimeConfig()) as server:
        for seq in range(3):
            client.live_state(server.url, None)
            assert client.set_live(server.url, None, seq=seq, values={"max_num_seqs": 8 + seq}) is None
        assert server.count("GET", "/trimtab/knobs") == 1  # tried once, before runtime_config answered


def test_a_plugin_or_nothing_is_probed_again_after_a_while():
    clock = [0.0]
    with EngineClient(deadline_seconds=5.0, clock=lambda: clock[0], live_reprobe_seconds=60.0) as client, \
            serve(fake.Trimtab(dev_mode=False)) as server:
        channel = Plugin()
        client.live_state(server.url, channel)
        client.live_state(server.url, channel)
        assert server.count("GET", "/trimtab/knobs") == 1
        server.engine.dev_mode = True  # restarted with dev mode, without the tuner seeing it down
        clock[0] = 61.0
        assert client.live_state(server.url, channel).via == "trimtab"


def test_a_restart_is_probed_again_and_a_vanished_route_falls_back(client):
    server = serve(fake.RuntimeConfig())
    port = server.port
    channel = Plugin()
    assert client.live_path(server.url, "vllm", channel) == "runtime_config"
    server.stop()
    assert "cannot be reached" in (client.live_state(server.url, None).why_not or "")  # down: forgotten
    assert client.live_state(server.url, channel).via == "plugin"  # its files still answer; nothing is kept
    with fake.Server(fake.Trimtab(), port=port) as again:  # restarted with pull request 55018's router
        assert client.live_state(again.url, channel).via == "trimtab"
        again.engine.dev_mode = False  # and once more, without dev mode
        why = client.set_live(again.url, channel, seq=1, values={"max_num_seqs": 8})
        assert why == "GET /trimtab/knobs answered 404: needs vLLM pull request 55018 with VLLM_SERVER_DEV_MODE=1"
        state = client.live_state(again.url, channel)
        assert state.via == "plugin"


def test_an_unhealthy_engine_is_probed_again(client):
    with serve(fake.RuntimeConfig()) as server:
        assert client.live_path(server.url) == "runtime_config"
        server.engine.answer = lambda method, path, body: (503, None)  # type: ignore[method-assign]
        assert not client.is_healthy(server.url, "vllm")
        del server.engine.answer
        client.live_path(server.url)
        assert server.count("GET", "/trimtab/knobs") == 2


# --- vLLM pull request 55018: /trimtab ----------------------------------------------------------------------------


def test_trimtab_sets_every_knob_and_puts_the_startup_values_back(client):
    with serve(fake.Trimtab(max_num_seqs=64, max_num_batched_tokens=8192, long_prefill_token_threshold=0)) as s:
        before = client.live_state(s.url, None)
        assert before.envelope == {"max_num_seqs": 64, "max_num_batched_tokens": 8192,
                                   "long_prefill_token_threshold": 0}
        assert before.can_move("long_prefill_token_threshold", 512) is None
        assert "outside" in (before.can_move("long_prefill_token_threshold", 9000) or "")
        values = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "long_prefill_token_threshold": 512}
        assert client.set_live(s.url, None, seq=1, values=values) is None
        assert s.bodies("POST", "/trimtab/set_knobs")[-1] == values
        after = client.live_state(s.url, None)
        assert after.seq == 1 and after.refused is None and dict(after.values) == values
        assert after.envelope == before.envelope  # the ceilings, now that one set was made
        assert client.set_live(s.url, None, seq=2, values=dict.fromkeys(values)) is None
        assert s.bodies("POST", "/trimtab/set_knobs")[-1] == before.envelope
        assert client.live_state(s.url, None).values == before.envelope


def test_trimtab_a_cap_below_the_running_count_reads_back_as_its_target(client):
    with serve(fake.Trimtab(max_num_seqs=64, running=20)) as s:
        assert client.set_live(s.url, None, seq=1, values={"max_num_seqs": 4}) is None
        state = client.live_state(s.url, None)
        assert state.refused is None and state.values["max_num_seqs"] == 4
        assert s.engine.max_num_seqs == 20  # enforced at the occupancy, tightened as requests finish


@pytest.mark.parametrize(("engine", "values", "refused"), [
    (fake.Trimtab(max_num_seqs=64), {"max_num_seqs": 65},
     "max_num_seqs: valid range is 1..64 (the boot allocation)"),
    (fake.Trimtab(), {"long_prefill_token_threshold": -1},
     "long_prefill_token_threshold: must be >= 0 (0 disables the threshold)"),
    (fake.Trimtab(knobs=("max_num_seqs", "max_num_batched_tokens")), {"max_num_batched_tokens": 1024},
     None),  # an older build: the threshold is not live there, the budget is
    (fake.Trimtab(max_num_seqs=64), {"max_num_seqs": 8, "max_num_batched_tokens": 0},
     "max_num_batched_tokens: valid range is 1..8192 (the boot allocation) (applied all the same: max_num_seqs 8)"),
    (fake.Trimtab(lie={"max_num_seqs": 16}), {"max_num_seqs": 8},
     "the engine reports max_num_seqs 16 (asked 8) after the set"),
])
def test_trimtab_refusals_are_the_engine_s_reasons(client, engine, values, refused):
    with serve(engine) as s:
        assert client.set_live(s.url, None, seq=3, values=values) is None  # handed over: the engine answered
        state = client.live_state(s.url, None)
        assert state.seq == 3 and state.refused == refused


def test_trimtab_without_the_threshold_says_it_is_not_live(client):
    with serve(fake.Trimtab(knobs=("max_num_seqs", "max_num_batched_tokens"))) as s:
        state = client.live_state(s.url, None)
        assert "does not report it" in (state.can_move("long_prefill_token_threshold", 256) or "")
        assert state.can_move("max_num_batched_tokens", 4096) is None


def test_trimtab_seen_first_after_a_change_keeps_the_ceilings_but_not_the_threshold(client):
    engine = fake.Trimtab(max_num_seqs=64)
    engine.set_knobs({"max_num_seqs": 8, "long_prefill_token_threshold": 128})  # before this tuner started
    with serve(engine) as s:
        state = client.live_state(s.url, None)
        assert state.envelope == {"max_num_seqs": 64, "max_num_batched_tokens": 8192}
        assert state.values["max_num_seqs"] == 8
        assert "startup value is unknown" in (state.can_move("long_prefill_token_threshold", 0) or "")


# --- vLLM pull request 54816: /v1/runtime_config -------------------------------------------------------------------


def test_runtime_config_moves_the_cap_and_reads_it_back(client):
    with serve(fake.RuntimeConfig(capacity=256, running_cap=256)) as s:
        state = client.live_state(s.url, None)
        assert state.envelope == {"max_num_seqs": 256} and "max_num_batched_tokens" in state.not_live
        assert client.set_live(s.url, None, seq=1, values={"max_num_seqs": 64}) is None
        assert s.bodies("PATCH", "/v1/runtime_config") == [{"max_num_running_seqs": 64}]
        assert client.live_state(s.url, None).values == {"max_num_seqs": 64}
        assert client.set_live(s.url, None, seq=2, values={"max_num_seqs": None, "max_num_batched_tokens": None}) is None
        assert s.bodies("PATCH", "/v1/runtime_config")[-1] == {"max_num_running_seqs": 256}  # explicit, never null
        back = client.live_state(s.url, None)
        assert back.seq == 2 and back.refused is None and back.values == {"max_num_seqs": 256}


@pytest.mark.parametrize(("value", "refused"), [
    (512, "max_num_running_seqs cannot exceed the startup capacity max_num_seqs (256)"),
    (0, "max_num_running_seqs: Input should be greater than or equal to 1"),
])
def test_runtime_config_refusals_are_the_engine_s_details(client, value, refused):
    with serve(fake.RuntimeConfig(capacity=256)) as s:
        assert client.set_live(s.url, None, seq=4, values={"max_num_seqs": value}) is None
        state = client.live_state(s.url, None)
        assert state.seq == 4 and state.refused is not None and state.refused.startswith(refused)


def test_runtime_config_does_not_send_a_knob_it_does_not_carry(client):
    with serve(fake.RuntimeConfig()) as s:
        why = client.set_live(s.url, None, seq=1, values={"max_num_seqs": 8, "max_num_batched_tokens": 1024})
        assert why == "max_num_batched_tokens cannot move live through vLLM's /v1/runtime_config (only the " \
                      "admission cap does)"
        assert s.count("PATCH", "/v1/runtime_config") == 0


# --- SGLang: /set_internal_state -----------------------------------------------------------------------------------


def test_sglang_maps_the_knobs_to_its_own_names_and_puts_the_startup_values_back(client):
    engine = fake.SGLang(max_running_requests=128, chunked_prefill_size=8192, max_prefill_tokens=16384)
    with serve(engine) as s:
        state = client.live_state(s.url, None, kind="sglang")
        assert state.envelope == {"max_num_seqs": 128, "max_num_batched_tokens": 8192}
        assert state.values == {"max_num_seqs": 128, "max_num_batched_tokens": 8192}
        assert "SGLang has no" in (state.can_move("long_prefill_token_threshold", 0) or "")
        assert client.set_live(s.url, None, seq=1, values={"max_num_seqs": 16, "max_num_batched_tokens": 2048},
                               kind="sglang") is None
        assert engine.received[-1] == {"max_running_requests": 16, "chunked_prefill_size": 2048,
                                       "max_prefill_tokens": 2048}
        after = client.live_state(s.url, None, kind="sglang")
        assert after.seq == 1 and after.refused is None
        assert after.values == {"max_num_seqs": 16, "max_num_batched_tokens": 2048}
        assert after.envelope == state.envelope  # the ceiling of max_running_requests, the startup budget
        assert client.set_live(s.url, None, seq=2, values={"max_num_seqs": None, "max_num_batched_tokens": None},
                               kind="sglang") is None
        assert engine.received[-1] == {"max_running_requests": 128, "chunked_prefill_size": 8192,
                                       "max_prefill_tokens": 16384}
        assert client.live_state(s.url, None, kind="sglang").values == state.values


@pytest.mark.parametrize(("engine", "values", "refused"), [
    (fake.SGLang(max_running_requests=128), {"max_num_seqs": 129},
     "data-parallel rank 0 answered updated=false"),
    (fake.SGLang(ranks=2, refuse_rank=1), {"max_num_seqs": 16}, "data-parallel rank 1 answered updated=false"),
    # a build whose keys stop short of max_prefill_tokens: the stock allowlist refuses that key, the rest applies
    (fake.SGLang(pr_keys=("max_running_requests", "chunked_prefill_size")), {"max_num_batched_tokens": 2048},
     "data-parallel rank 0 answered updated=false (a key or value this SGLang does not accept; its log says which) "
     "(applied all the same: max_num_batched_tokens 2048)"),  # chunked_prefill_size took: the smaller is 2048
])
def test_sglang_refusals_name_the_ranks(client, engine, values, refused):
    with serve(engine) as s:
        assert client.set_live(s.url, None, seq=5, values=values, kind="sglang") is None
        state = client.live_state(s.url, None, kind="sglang")
        assert state.seq == 5 and state.refused is not None and state.refused.startswith(refused)


def test_sglang_ranks_that_disagree_give_no_value(client):
    engine = fake.SGLang(ranks=2)
    engine.state[1].max_running_requests = 64
    with serve(engine) as s:
        state = client.live_state(s.url, None, kind="sglang")
        assert "max_num_seqs" not in state.values and state.values["max_num_batched_tokens"] == 8192


def test_sglang_with_chunked_prefill_off_keeps_the_budget_fixed(client):
    with serve(fake.SGLang(chunked_prefill_size=-1)) as s:
        state = client.live_state(s.url, None, kind="sglang")
        assert "chunked prefill is off" in (state.can_move("max_num_batched_tokens", 1024) or "")
        assert state.can_move("max_num_seqs", 16) is None
        why = client.set_live(s.url, None, seq=1, values={"max_num_batched_tokens": 1024}, kind="sglang")
        assert why is not None and "chunked prefill is off" in why


# --- one interface for the rollout ------------------------------------------------------------------------------


@pytest.mark.parametrize(("engine", "kind"), [
    (fake.Trimtab(max_num_seqs=64), "vllm"), (fake.RuntimeConfig(capacity=64, running_cap=64), "vllm"),
    (fake.SGLang(max_running_requests=64), "sglang"),
])
def test_the_rollout_s_live_control_is_the_same_on_every_path(client, engine, kind):
    with serve(engine) as s:
        replica = base.Replica(name="r", base_url=s.url)
        control = engineside.EngineLive(client, kind=kind, plugin=lambda name: None)
        assert control.answer(replica, seq=1, values={"max_num_seqs": 8}) == (False, None)  # not asked yet
        assert control.ask(replica, seq=1, values={"max_num_seqs": 8}) is None
        assert control.answer(replica, seq=1, values={"max_num_seqs": 8}) == (True, None)
        assert control.ask(replica, seq=2, values={"max_num_seqs": 65}) is None
        took, refused = control.answer(replica, seq=2, values={"max_num_seqs": 65})
        assert not took and refused
        assert control.ask(replica, seq=3, values={"max_num_seqs": None}) is None
        assert control.answer(replica, seq=3, values={"max_num_seqs": None}) == (True, None)


def test_a_live_state_read_through_an_engine_api_survives_the_pod_agent_s_relay(client):
    """A pod's agent reports its live state to the leader as a document (``LiveState.as_dict``/``from_dict``):
    the path and a threshold of 0 (off) come through."""
    with serve(fake.Trimtab()) as s:
        assert client.set_live(s.url, None, seq=9, values={"max_num_seqs": 8}) is None
        state = client.live_state(s.url, None)
        assert state.values["long_prefill_token_threshold"] == 0
        assert live.LiveState.from_dict(state.as_dict()) == state
