"""Class 4 of issue 17: the decoded size of a body is bounded as it is produced, not only its wire size.

Generated answers stack 1–4 content encodings (gzip, deflate, identity, and ones the tuner does not
ask for: br, zstd) over payloads from a few bytes to compression bombs of up to 128 MiB; each goes
through ``scraping.fetch_text`` (every ``/metrics`` scrape and every engine JSON endpoint reads
through it). The promise: the body comes back exactly, when one layer of a known encoding holds at
most the limit; otherwise a ``SourceError`` — and never more than a few limits' worth of memory is
allocated on the way (``tracemalloc``'s peak), whatever the decoded size would have been.
"""

from __future__ import annotations

import functools
import gzip
import tracemalloc
import zlib

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.errors import SourceError
from tuner.sources import scraping
from tuner.sources.engines import EngineClient

LIMIT = 256 * 1024
MEMORY_BOUND = 8 * 1024 * 1024  # 32 limits: the bombs below decode to 16–512 times that


def _encode(payload: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.compress(payload, compresslevel=9, mtime=0)
    if encoding == "deflate":
        return zlib.compress(payload, 9)
    return payload  # identity; br and zstd are only named (refused before any byte is decoded)


@functools.lru_cache(maxsize=64)
def _wire(payload_size: int, layers: tuple[str, ...]) -> bytes:
    body = b"0" * payload_size
    for encoding in layers:
        body = _encode(body, encoding)
    return body


def _fetch(wire: bytes, layers: tuple[str, ...]) -> tuple[str | None, str | None, int]:
    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/plain"}
        if layers:
            headers["content-encoding"] = ", ".join(layers)
        return httpx.Response(200, stream=httpx.ByteStream(wire), headers=headers)  # as off a socket

    client = scraping.make_client(scraping.HttpSettings(), transport=httpx.MockTransport(handler))
    tracemalloc.start()
    try:
        text, error = scraping.fetch_text(client, "http://engine/metrics", max_body_bytes=LIMIT), None
    except SourceError as exc:
        text, error = None, exc.reason
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        client.close()
    return text, error, peak


ENCODINGS = st.sampled_from(["gzip", "deflate", "identity", "br", "zstd"])
SIZES = st.sampled_from([0, 17, LIMIT - 1, LIMIT, LIMIT + 1, 16 << 20, 128 << 20])


@settings(max_examples=120, deadline=None)
@given(layers=st.lists(ENCODINGS, min_size=1, max_size=4).map(tuple), size=SIZES)
def test_decoded_bytes_are_bounded_whatever_the_encodings(layers: tuple[str, ...], size: int) -> None:
    # the application order: the header lists them in the order they were applied
    wire = _wire(size, tuple(e for e in layers if e in ("gzip", "deflate", "identity")))
    if len(wire) > LIMIT and size > LIMIT:
        wire = wire[: LIMIT * 2]  # the wire limit is the older check; this one is about decoding
    text, error, peak = _fetch(wire, layers)
    real = [e for e in layers if e != "identity"]
    if len(real) <= 1 and all(e in ("gzip", "deflate") for e in real) and size <= LIMIT:
        assert error is None and text is not None and len(text) == size
    else:
        assert text is None and error is not None and "\n" not in error
    assert peak < MEMORY_BOUND, f"{peak} bytes allocated for a {len(wire)}-byte answer ({layers}, {size})"


@pytest.mark.parametrize("layers", [("gzip", "gzip"), ("gzip",), ("deflate",)])
def test_a_json_endpoint_reads_through_the_same_bound(layers: tuple[str, ...]) -> None:
    wire = _wire(128 << 20, layers)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(wire), headers={"content-encoding": ", ".join(layers)})

    with EngineClient(transport=httpx.MockTransport(handler)) as client:
        tracemalloc.start()
        try:
            info = client.info("http://engine", "vllm")
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert info.model is None and info.error is not None
    assert "limit" in info.error or "refused" in info.error
    assert peak < MEMORY_BOUND


def test_the_tuner_asks_for_one_layer_it_can_bound() -> None:
    client = scraping.make_client(scraping.HttpSettings())
    assert client.headers["accept-encoding"] == scraping.ACCEPT_ENCODING == "gzip, identity"
    client.close()
