"""Class 1 of issue 17: one bounded reader for everything untrusted (``tuner.portable.untrusted``).

Generated hostile JSON — nesting past any recursion limit, ``NaN``/``Infinity``/``1e999``, integers
longer than Python converts, every wrong shape in every field — and hostile files (FIFO, symbolic
link, directory, oversized) go through the reader itself (both copies: the tuner's and the plugin's)
and through every reader built on it: the launcher's ``desired.json`` and ``status.json``, the
plugin's ``control.json``, the tuner's acknowledgements, the engine's JSON endpoints, the state file
and the pid file. Each either returns plain, finite data or refuses with its own error value; none
raises anything else, none blocks.
"""

from __future__ import annotations

import filecmp
import json
import math
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.plugin import PLUGIN_SRC
from tests.support.plugin import protocol as plugin_protocol
from tuner import config
from tuner.actuators import process
from tuner.errors import ConfigError, PermanentActuatorError
from tuner.portable import pod_protocol as launcher_protocol
from tuner.portable import untrusted
from tuner.runtime import state as state_mod
from tuner.sources import live_knobs
from tuner.sources.engines import EngineClient

# Scheduling (tests/conftest.py): one of the fast tier's longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 14

plugin_untrusted = plugin_protocol.untrusted  # the plugin's copy, as the plugin imports it
READERS = [untrusted, plugin_untrusted]
SETTINGS = settings(max_examples=150, deadline=None)


def test_the_plugin_carries_the_same_reader_byte_for_byte() -> None:
    assert filecmp.cmp(Path(untrusted.__file__), PLUGIN_SRC / "vllm_tuner_plugin" / "untrusted.py", shallow=False)


# -- generated hostile JSON -------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def deep(draw: st.DrawFn) -> str:
    """Nesting from just past the limit to far past Python's recursion limit, of arrays and objects."""
    n = draw(st.integers(untrusted.MAX_DEPTH + 1, 200_000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('[{"k":', "}]")]))
    return opener * n + "1" + closer * n


CONSTANTS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1" * 5000])


@st.composite
def hostile_documents(draw: st.DrawFn, keys: tuple[str, ...]) -> str:
    """An object with the reader's own keys, each holding any JSON value, a bad constant, or deep nesting."""
    doc = draw(st.dictionaries(st.sampled_from(keys), json_values, max_size=len(keys)))
    text = json.dumps(doc)
    if draw(st.booleans()) and keys:
        bad = draw(st.one_of(CONSTANTS, deep()))
        text = text[:-1] + (", " if doc else "") + f'"{draw(st.sampled_from(keys))}": {bad}}}'
    return text


def _plain_finite(value: Any, level: int = 0) -> None:
    assert level <= untrusted.MAX_DEPTH + 1
    if isinstance(value, float):
        assert math.isfinite(value)
    elif isinstance(value, dict):
        for v in value.values():
            _plain_finite(v, level + 1)
    elif isinstance(value, list):
        for v in value:
            _plain_finite(v, level + 1)
    else:
        assert value is None or isinstance(value, bool | int | str)


@pytest.mark.parametrize("reader", READERS, ids=["tuner", "plugin"])
@SETTINGS
@given(text=st.one_of(deep(), CONSTANTS, hostile_documents(("a", "b")), json_values.map(json.dumps), st.text()))
def test_loads_returns_plain_finite_data_or_refuses(reader: Any, text: str) -> None:
    try:
        value = reader.loads(text, what="case")
    except reader.Untrusted as exc:
        reason = exc.reason
    else:
        _plain_finite(value)
        return
    assert "\n" not in reason and len(reason) < 300  # one line, never the input


@pytest.mark.parametrize("reader", READERS, ids=["tuner", "plugin"])
@SETTINGS
@given(value=json_values, lo=st.integers(-5, 5))
def test_the_shape_checks_take_only_their_shape(reader: Any, value: Any, lo: int) -> None:
    try:
        got = reader.integer(value, what="n", lo=lo, hi=100)
        assert type(got) is int and lo <= got <= 100
    except reader.Untrusted:
        assert not (type(value) is int and lo <= value <= 100)
    try:
        number = reader.number(value, what="x", lo=0.0, hi=1e6)
        assert math.isfinite(number) and 0.0 <= number <= 1e6
    except reader.Untrusted:
        pass


# -- the readers built on it -------------------------------------------------------------------------

DESIRED_KEYS = ("v", "generation", "overrides", "base_sha256", "drain")


@SETTINGS
@given(text=hostile_documents(DESIRED_KEYS))
def test_desired_json_is_parsed_or_refused_with_protocol_error(text: str) -> None:
    try:
        desired = launcher_protocol.parse_desired(text)
    except launcher_protocol.ProtocolError:
        return
    assert desired.generation >= 0


@SETTINGS
@given(text=hostile_documents(("seq", "protocol", "max_num_active_seqs", "max_num_batched_tokens")))
def test_control_json_is_parsed_or_refused_with_protocol_error(text: str) -> None:
    try:
        request = plugin_protocol.parse_request(text.encode())
    except plugin_protocol.ProtocolError:
        return
    assert request.seq >= 0
    assert all(v is None or (type(v) is int and v >= 1) for v in request.knobs().values())


@SETTINGS
@given(text=hostile_documents(live_knobs.ACK_FIELDS))
def test_an_acknowledgement_is_an_ack_never_a_traceback(text: str) -> None:
    ack = live_knobs.parse_ack(Path("ack-0.json"), text.encode())
    if ack.problem is None:
        for value in (ack.seq, ack.pid, ack.dp_rank):
            assert value is None or (type(value) is int and value >= 0)
        assert all(v is None or type(v) in (int, bool) for v in ack.effective.values())
        live_knobs.state([ack])  # what the tuner makes of it does not raise either


ENGINE_ROUTES = {
    "/v1/models": ("data", "object"), "/version": ("version",), "/load": ("server_load",),
    "/v1/runtime_config": ("max_num_running_seqs", "max_num_seqs_capacity"), "/is_sleeping": ("is_sleeping",),
    "/trimtab/knobs": ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "ceilings"),
    "/get_server_info": ("internal_states", "chunked_prefill_size", "max_prefill_tokens"),
}


@SETTINGS
@given(bodies=st.fixed_dictionaries({route: hostile_documents(keys) for route, keys in ENGINE_ROUTES.items()}),
       models=st.lists(json_values, max_size=3))
def test_engine_json_never_raises_and_numbers_are_believed_only_in_range(bodies: dict[str, str],
                                                                         models: list[Any]) -> None:
    if models:  # a /v1/models whose data list holds anything
        bodies["/v1/models"] = json.dumps({"data": models})

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=bodies.get(request.url.path, "{}"),
                              headers={"content-type": "application/json"})

    with EngineClient(transport=httpx.MockTransport(handler)) as client:
        info = client.info("http://engine", "vllm", server_load=True)
        assert info.max_model_len is None or info.max_model_len >= 1
        assert info.server_load is None or info.server_load >= 0
        config_ = client.runtime_config("http://engine")
        for kind in ("vllm", "sglang"):  # each live path's reader: trimtab, runtime_config, set_internal_state
            live = client.live_state("http://engine", None, kind=kind)
            assert all(type(v) is int and v >= (0 if k == "long_prefill_token_threshold" else 1)
                       for k, v in live.values.items()), (config_, live)
            assert all(type(v) is int and v >= 0 for v in live.envelope.values()), (config_, live)
        assert client.is_sleeping("http://engine") in (True, False, None)


# -- hostile files -----------------------------------------------------------------------------------


def _hostile_file(tmp: Path, kind: str) -> Path:
    path = tmp / f"{kind}.json"
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes: a blocking open or read would hang here forever
    elif kind == "symlink":
        (tmp / "target.json").write_text('{"v": 1}')
        path.symlink_to(tmp / "target.json")
    elif kind == "directory":
        path.mkdir()
    elif kind == "oversized":
        path.write_bytes(b" " * (untrusted.MAX_BYTES + 1) + b"{}")
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    return path


KINDS = ["fifo", "symlink", "directory", "oversized", "deep"]


@pytest.mark.parametrize("reader", READERS, ids=["tuner", "plugin"])
@pytest.mark.parametrize("kind", KINDS)
def test_hostile_files_are_refused_without_blocking(tmp_path: Path, reader: Any, kind: str) -> None:
    with pytest.raises(reader.Untrusted):
        reader.read_json(_hostile_file(tmp_path, kind))
    with pytest.raises(FileNotFoundError):
        reader.read_json(tmp_path / "absent.json")


def test_a_secret_mount_link_is_followed_when_asked(tmp_path: Path) -> None:
    path = _hostile_file(tmp_path, "symlink")
    assert untrusted.read_json(path, follow_symlinks=True) == {"v": 1}


@pytest.mark.parametrize("kind", KINDS)
def test_every_file_reader_refuses_hostile_files_with_its_own_error(tmp_path: Path, kind: str) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    hostile = _hostile_file(tmp_path, kind)
    os.replace(hostile, state_dir / launcher_protocol.DESIRED)
    with pytest.raises(launcher_protocol.ProtocolError):
        launcher_protocol.read_desired(state_dir / launcher_protocol.DESIRED)
    os.replace(state_dir / launcher_protocol.DESIRED, state_dir / launcher_protocol.STATUS)
    assert launcher_protocol.read_status(state_dir) is None
    os.replace(state_dir / launcher_protocol.STATUS, state_dir / "ack-0.json")
    (ack,) = live_knobs.read_acks(state_dir)
    assert ack.problem is not None
    os.replace(state_dir / "ack-0.json", state_dir / "engine.pid")
    with pytest.raises(PermanentActuatorError):
        process.read_pidfile(state_dir / "engine.pid")
    os.replace(state_dir / "engine.pid", state_dir / "state.json")
    target = config.Target(name="a", metrics_url="http://127.0.0.1:1/metrics", args=["--model", "m"])
    if kind != "oversized":  # the state file's own limit is larger
        with pytest.raises(ConfigError):
            state_mod.TunerState.load(state_dir / "state.json", [target])


@pytest.mark.parametrize("pid", [0, -1, -4242, True, 2**40, 1.5, "12"])
def test_a_pid_file_never_names_a_process_group(tmp_path: Path, pid: Any) -> None:
    path = tmp_path / "engine.pid"
    path.write_text(json.dumps({"pid": pid, "argv": ["vllm"]}))
    with pytest.raises(PermanentActuatorError):
        process.read_pidfile(path)
