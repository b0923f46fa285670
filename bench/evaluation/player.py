"""The trace player: open loop, every request streamed, TTFT and inter-token gaps recorded per request.

Runs as its own process under the engine's Python (``.venv-vllm`` here, vLLM's environment on a GPU
machine): standard library plus ``aiohttp``, which vLLM depends on and its own benchmark client uses.
It imports nothing of the tuner, so it runs wherever vLLM runs.

    python bench/evaluation/player.py --trace trace.json --url http://127.0.0.1:8080 --model NAME \\
        --vocab-size 1024 --salt bad --start-at 1796060000.0 --shard 0/1 --out requests-0.jsonl

Each request of the trace is sent at ``start_at + at`` (wall clock; one shared start lets several
player processes split one trace: shard ``k/n`` plays the requests whose index is ``k`` modulo ``n``).
Prompts are token ids (the completions API takes them), so a request has exactly its trace's prompt
length without a tokenizer; they are drawn from a generator seeded by (salt, request index), so two
arms replaying one trace on the same engines never hit each other's prefix cache. ``ignore_eos`` and
``max_tokens`` fix the output length.

Timing is measured the way ``vllm.benchmarks.lib.endpoint_request_func.async_request_openai_completions``
measures it: TTFT = first chunk carrying ``choices`` minus the send time; each later such chunk adds one
inter-chunk gap (``itl_p99``, ``itl_max``). ``itl_mean`` is per token, as the client's TPOT: (last chunk −
first chunk) / (tokens − 1), since a server that falls behind packs several tokens into one chunk. One
JSON line per request, written when it ends (also when it failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

UPSTREAM_HEADER = "X-Upstream-Addr"  # harness/nginx.py adds it: which engine served the request


def prompt_ids(salt: str, index: int, length: int, vocab_size: int) -> list[int]:
    """A deterministic prompt of ``length`` token ids, away from the low ids where special tokens live."""
    rng = random.Random(f"{salt}/{index}")
    low = min(16, vocab_size // 4)
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def _one(session: aiohttp.ClientSession, url: str, model: str, req: dict[str, Any], *, salt: str,
               vocab_size: int, start_at: float, timeout_s: float) -> dict[str, Any]:
    payload = {
        "model": model,
        "prompt": prompt_ids(salt, req["index"], req["prompt_tokens"], vocab_size),
        "max_tokens": req["output_tokens"],
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record: dict[str, Any] = {
        "index": req["index"], "phase": req["phase"], "arrival": start_at + req["at"],
        "prompt_tokens": req["prompt_tokens"], "max_tokens": req["output_tokens"],
        "start": None, "ttft": None, "e2e": None, "itl_mean": None, "itl_p99": None, "itl_max": None,
        "chunks": 0, "output_tokens": None, "ok": False, "error": None, "upstream": None, "status": None,
    }
    gaps: list[float] = []
    wait = start_at + req["at"] - time.time()
    if wait > 0:
        await asyncio.sleep(wait)
    sent = time.time()
    t0 = time.perf_counter()
    record["start"] = sent
    last = t0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=payload) as resp:
                record["status"] = resp.status
                record["upstream"] = resp.headers.get(UPSTREAM_HEADER)
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    record["error"] = f"HTTP {resp.status}: {body}"
                else:
                    buffer = b""
                    async for chunk in resp.content.iter_any():
                        buffer += chunk
                        while b"\n\n" in buffer:
                            message, buffer = buffer.split(b"\n\n", 1)
                            for line in message.split(b"\n"):
                                line = line.strip()
                                if not line.startswith(b"data:"):
                                    continue  # SSE comments (pings) and blank lines
                                data = line[5:].strip()
                                if data == b"[DONE]":
                                    continue
                                doc = json.loads(data)
                                if doc.get("choices"):
                                    now = time.perf_counter()
                                    if record["chunks"] == 0:
                                        record["ttft"] = now - t0
                                    else:
                                        gaps.append(now - last)
                                    last = now
                                    record["chunks"] += 1
                                elif doc.get("usage"):
                                    record["output_tokens"] = doc["usage"].get("completion_tokens")
                                elif doc.get("error"):
                                    record["error"] = f"stream error: {str(doc['error'])[:300]}"
                    if record["error"] is None:
                        if record["chunks"] == 0:
                            record["error"] = "the stream ended without a token"
                        elif record["output_tokens"] is not None and record["output_tokens"] < req["output_tokens"]:
                            record["error"] = (f"{record['output_tokens']} of {req['output_tokens']} tokens "
                                               "(the stream was cut)")
                        else:
                            record["ok"] = True
    except TimeoutError:
        record["error"] = f"no complete response within {timeout_s:g}s"
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if record["chunks"]:
        record["e2e"] = last - t0  # send → last token
        tokens = record["output_tokens"] or record["chunks"]
        if tokens > 1 and record["ttft"] is not None:
            # Per token, like vLLM's TPOT: a server that falls behind sends several tokens in one chunk,
            # and the mean of the chunk gaps would then overstate the gap between tokens.
            record["itl_mean"] = (record["e2e"] - record["ttft"]) / (tokens - 1)
    if gaps:
        record["itl_p99"] = _percentile(gaps, 0.99)  # between chunks, as vLLM's benchmark client's ITL
        record["itl_max"] = max(gaps)
    for key in ("arrival", "start", "ttft", "e2e", "itl_mean", "itl_p99", "itl_max"):
        if record[key] is not None:
            record[key] = round(record[key], 6)  # microseconds: more would be noise, and bytes
    return record


async def play(trace: dict[str, Any], *, url: str, model: str, vocab_size: int, salt: str, start_at: float,
               shard: tuple[int, int], out: Path, timeout_s: float) -> tuple[int, int]:
    k, n = shard
    mine = [r for r in trace["requests"] if r["index"] % n == k]
    endpoint = url.rstrip("/") + "/v1/completions"
    done = failed = 0
    # No connection limit (open loop: a slow engine must not slow the arrivals down); nginx closes
    # client connections after each response (harness/nginx.py: keep-alive off).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    with open(out, "w", encoding="utf-8") as f:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            tasks = [asyncio.create_task(_one(session, endpoint, model, r, salt=salt, vocab_size=vocab_size,
                                              start_at=start_at, timeout_s=timeout_s)) for r in mine]
            for task in asyncio.as_completed(tasks):
                record = await task
                done += 1
                failed += not record["ok"]
                f.write(json.dumps(record) + "\n")
                f.flush()
    return done, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, type=Path)
    p.add_argument("--url", required=True, help="the load balancer, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--vocab-size", required=True, type=int)
    p.add_argument("--salt", required=True, help="varies the prompts' token ids (one per arm)")
    p.add_argument("--start-at", required=True, type=float, help="wall-clock time of the trace's t=0")
    p.add_argument("--shard", default="0/1", help="k/n: play the requests whose index is k modulo n")
    p.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    try:
        k, n = (int(x) for x in a.shard.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        print(f"player: --shard must be k/n with 0 <= k < n, got {a.shard!r}", file=sys.stderr)
        return 2
    # Open loop: a slow engine can have thousands of requests open at once, one socket each.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    trace = json.loads(a.trace.read_text())
    done, failed = asyncio.run(play(trace, url=a.url, model=a.model, vocab_size=a.vocab_size, salt=a.salt,
                                    start_at=a.start_at, shard=(k, n), out=a.out, timeout_s=a.timeout))
    print(f"player {k}/{n}: {done} requests, {failed} failed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
