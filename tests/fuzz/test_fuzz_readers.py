"""Fuzzing the readers of untrusted input (issue 17): the one bounded reader (``tuner.portable.untrusted``
and the plugin's byte-identical copy), the launcher's ``desired.json``, the plugin's ``control.json``,
the tuner's acknowledgements, the engine's JSON endpoints, the YAML reader's alias bound, and the
bounded body decoder. Inputs are random bytes, random JSON-ish text (deep, with non-finite constants),
mutated valid documents and stacked encodings. Every input is read or refused with the reader's own
error value: never any other exception."""

from __future__ import annotations

import contextlib
import gzip
import json
import tempfile
import zlib
from pathlib import Path

import httpx
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.support import fuzz, tried
from tests.support.plugin import protocol as plugin_protocol
from tuner.errors import ConfigError, SourceError
from tuner.portable import pod_protocol as launcher_protocol
from tuner.portable import untrusted
from tuner.rules import loading
from tuner.sources import live_knobs, scraping
from tuner.sources.engines import EngineClient

TOKENS = st.sampled_from(["{", "}", "[", "]", ",", ":", '"', '"v"', '"seq"', '"generation"', '"overrides"',
                          "NaN", "Infinity", "-Infinity", "1e999", "-0", "1" * 30, "true", "null", "0", "-1",
                          '"--max-num-seqs"', '"\\ud800"', "\\", " ", "\n", "é", "\x00"])
JSONISH = st.one_of(st.lists(TOKENS, max_size=60).map("".join), st.binary(max_size=200).map(
    lambda b: b.decode("latin-1")), st.integers(1, 5000).map(lambda n: "[" * n + "]" * (n // 2)))
VALID = [json.dumps({"v": 1, "generation": 3, "overrides": [["--max-num-seqs", "64"]], "base_sha256": "a" * 64,
                     "drain": False}),
         json.dumps({"protocol": 1, "seq": 7, "max_num_active_seqs": 16, "max_num_batched_tokens": None}),
         json.dumps({"protocol": 1, "live": True, "seq": 7, "applied": {"max_num_active_seqs": 16},
                     "effective": {"max_num_active_seqs": 16, "draining": False},
                     "envelope": {"max_num_seqs": 64}, "at": 1.0, "pid": 12, "dp_rank": 0})]


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(VALID))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(TOKENS) + text[i + draw(st.integers(0, 3)):]
    return text


INPUTS = st.one_of(JSONISH, mutated())


@fuzz(4)
@given(text=INPUTS)
def test_every_json_reader_reads_or_refuses(text: str) -> None:
    tried("json readers")
    for reader in (untrusted, plugin_protocol.untrusted):
        with contextlib.suppress(reader.Untrusted):
            reader.loads(text, what="fuzz")
    with contextlib.suppress(launcher_protocol.ProtocolError):
        launcher_protocol.parse_desired(text)
    with contextlib.suppress(plugin_protocol.ProtocolError):
        plugin_protocol.parse_request(text.encode("utf-8", "surrogatepass"))
    ack = live_knobs.parse_ack(Path("ack-0.json"), text.encode("utf-8", "surrogatepass"))
    live_knobs.state([ack])


@fuzz(2)
@given(models=INPUTS, config_=INPUTS)
def test_the_engine_client_reads_or_refuses_any_json_body(models: str, config_: str) -> None:
    tried("engine json endpoints")
    bodies = {"/v1/models": models, "/v1/runtime_config": config_, "/version": models, "/load": config_}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=bodies.get(request.url.path, "{}"))

    with EngineClient(transport=httpx.MockTransport(handler)) as client:
        client.info("http://e", "vllm", server_load=True)
        client.live_state("http://e", None)
        client.is_sleeping("http://e")


@fuzz(1)
@given(fan=st.integers(1, 30), levels=st.integers(1, 12), mapping=st.booleans(), junk=st.text(max_size=20))
def test_the_yaml_reader_reads_or_refuses_any_alias_structure(fan: int, levels: int, mapping: bool,
                                                               junk: str) -> None:
    tried("yaml aliases")
    lines = ["l0: &l0 [x]"]
    for i in range(1, levels + 1):
        refs = [f"*l{i - 1}"] * fan
        inner = "{" + ", ".join(f"k{j}: {r}" for j, r in enumerate(refs)) + "}" if mapping else f"[{', '.join(refs)}]"
        lines.append(f"l{i}: &l{i} {inner}")
    with tempfile.TemporaryDirectory() as tmp:  # no fixture: bench/fuzz_long.py calls the test bare
        path = Path(tmp) / "c.yaml"
        path.write_text("\n".join(lines) + f"\njunk: {json.dumps(junk)}\n")
        with contextlib.suppress(ConfigError):
            loading.read_yaml(path, what="fuzz")


ENCODERS = {"gzip": lambda b: gzip.compress(b, mtime=0), "deflate": zlib.compress, "identity": lambda b: b}


@fuzz(2)
@given(payload=st.binary(max_size=2000), layers=st.lists(st.sampled_from(["gzip", "deflate", "identity", "br"]),
                                                          max_size=3),
       cut=st.integers(0, 50), header=st.booleans())
def test_the_body_decoder_reads_or_refuses_any_encoding(payload: bytes, layers: list[str], cut: int,
                                                        header: bool) -> None:
    tried("body decoder")
    wire = payload
    for name in layers:
        wire = ENCODERS.get(name, lambda b: b)(wire)
    wire = wire[: max(0, len(wire) - cut)]  # truncated streams too

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"content-encoding": ", ".join(layers)} if header and layers else {}
        return httpx.Response(200, stream=httpx.ByteStream(wire), headers=headers)

    client = scraping.make_client(scraping.HttpSettings(), transport=httpx.MockTransport(handler))
    try:
        scraping.fetch_text(client, "http://e/metrics", max_body_bytes=1000)
    except SourceError:
        pass
    finally:
        client.close()
