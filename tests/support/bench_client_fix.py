"""A fix for vLLM's benchmark client, loaded into the benchmark's own process (``vllm.py``'s script).

vLLM 0.32's request functions (``vllm/benchmarks/lib/endpoint_request_func.py``) ``strip()`` every
network chunk before ``StreamedResponseHandler.add_chunk`` sees it. Where the network splits a
server-sent event right after ``data:`` the next chunk loses the space (``data:{...``), and where it
splits inside the ``\\n\\n`` between events the separator is lost: the handler then hands
``data:{...}`` (or two events glued together) to ``json.loads``, and the request counts as *failed* with a
``JSONDecodeError`` although the server sent every byte. Reproduced with no engine at all in
``tests/integration/test_bench_client.py``; under load through nginx it cost 1 request in ~8,000.

The fix puts back what the strip took before the handler splits events: each event of an OpenAI stream
starts ``data: {"`` or ``data: [DONE]``, and ``{"`` cannot occur unescaped inside a JSON string, so a
``data:`` followed by one of them starts an event. Standard library only (it runs in vLLM's venv).
"""

from __future__ import annotations

import codecs
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


def install() -> None:
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
