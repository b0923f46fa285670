"""vLLM's benchmark client counts a request as failed when the network splits an SSE event in the wrong
place, or when it sends a request on a pooled connection the server has closed — no engine needed to show
either — and the fix the test harness loads into it (harness/bench_client_fix.py) gets both right.

A server streams one OpenAI completion in pieces that split events right after ``data:``, after
``data: ``, inside the ``\\n\\n`` between events and inside a multi-byte character. vLLM's own
``async_request_openai_completions`` (in .venv-vllm) reads it once as shipped and once with the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import bench_client_fix, vllm

# Scheduling (tests/conftest.py): one of the longest files, started first on a worker of its own;
# its rank by measured length (--durations=0), 1 the longest.
START_FIRST = 11

FIX = Path(vllm.__file__).with_name("bench_client_fix.py")

# Both scripts take "shipped" or "fixed" and the fix's path; "fixed" loads the fix before anything runs.
LOAD_FIX = r"""
import importlib.util, sys
if sys.argv[1] == "fixed":
    _spec = importlib.util.spec_from_file_location("bench_client_fix", sys.argv[2])
    _fix = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_fix)
    _fix.install()
"""

SCRIPT = LOAD_FIX + r'''
import asyncio, json
import aiohttp
from aiohttp import web
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

def event(obj):
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"

TEXTS = ["a", " b", "é c", " d"]
STREAM = "".join(event({"id": "x", "choices": [{"index": 0, "text": t}]}) for t in TEXTS)
STREAM += event({"id": "x", "choices": [], "usage": {"completion_tokens": len(TEXTS)}}) + "data: [DONE]\n\n"
raw = STREAM.encode()
cuts = sorted({raw.index(b"data:", 10) + 5,                   # right after "data:"
               raw.index(b"data: ", 200) + 6,                 # right after "data: "
               raw.index(b"\n\n", 300) + 1,                   # inside the separator
               raw.index("é".encode()) + 1})                  # inside a character
PIECES = [raw[i:j] for i, j in zip([0, *cuts], [*cuts, len(raw)])]

async def handler(request):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in PIECES:
        await resp.write(piece)
        await asyncio.sleep(0.05)  # one network chunk each
    return resp

async def main():
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    async with aiohttp.ClientSession() as session:
        out = await async_request_openai_completions(RequestFuncInput(
            prompt="x", api_url=f"http://127.0.0.1:{port}/v1/completions", prompt_len=1, output_len=4,
            model="m"), session=session)
    await runner.cleanup()
    print(json.dumps({"success": out.success, "text": out.generated_text, "tokens": out.output_tokens,
                      "error": out.error.strip().splitlines()[-1:] , "pieces": len(PIECES)}))

asyncio.run(main())
'''


def read(mode: str, python: Path) -> dict:
    proc = subprocess.run([str(python), "-c", SCRIPT, mode, str(FIX)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_benchmark_client_fails_a_split_event_and_the_fix_reads_it() -> None:
    python = vllm.vllm_python()
    if python is None:
        pytest.skip("needs .venv-vllm (make vllm-env)")
    shipped = read("shipped", python)
    assert shipped["pieces"] == 5
    # As shipped: a request the server answered in full counts as failed (vLLM 0.32). Should a later vLLM
    # fix its client, this says so and the fix can go.
    assert shipped["success"] is False and "JSONDecodeError" in " ".join(shipped["error"]), shipped
    fixed = read("fixed", python)
    assert fixed == {"success": True, "text": "a bé c d", "tokens": 4, "error": [], "pieces": 5}, fixed


# The keep-alive race. A uvicorn server (vLLM's) in a thread closes a connection idle for 0.3 s; the client
# (vLLM's request function, on a session whose connector is built the way vllm.benchmarks.serve builds it)
# sends one request, then its event loop is busy for 1 s — a CPU-starved benchmark client — and sends the
# next: the server's FIN has arrived but the client has not read it yet.
KEEP_ALIVE_SCRIPT = LOAD_FIX + r"""
import asyncio, json, socket, threading, time
import aiohttp, uvicorn
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

BODY = (b'data: {"id": "x", "choices": [{"index": 0, "text": "a"}]}\n\n'
        b'data: {"id": "x", "choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n')
seen = []

async def app(scope, receive, send):
    seen.append(scope["client"][1])
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": BODY})

async def main():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", timeout_keep_alive=0.3, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.01)
    connector = aiohttp.TCPConnector(limit=2, keepalive_timeout=60, force_close=False)  # as serve.py has it
    request = RequestFuncInput(prompt="x", api_url=f"http://127.0.0.1:{port}/v1/completions", prompt_len=1,
                               output_len=1, model="m")
    outs = []
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(2):
            outs.append(await async_request_openai_completions(request, session=session))
            time.sleep(1.0)  # the loop is busy: the server's keep-alive ends, its FIN waits unread
    server.should_exit = True
    thread.join(10)
    print(json.dumps({"success": [o.success for o in outs], "requests_seen": len(seen),
                      "connections": len(set(seen)), "error": outs[1].error.strip().splitlines()[-1:]}))

asyncio.run(main())
"""


def test_the_benchmark_client_sends_on_a_connection_the_server_closed_and_the_fix_does_not() -> None:
    python = vllm.vllm_python()
    if python is None:
        pytest.skip("needs .venv-vllm (make vllm-env)")
    runs = {}
    for name, mode, keep in (("shipped", "shipped", ""), ("fixed", "fixed", ""), ("kept", "fixed", "1")):
        env = {k: v for k, v in os.environ.items() if k != bench_client_fix.KEEP_CONNECTIONS}
        if keep:
            env[bench_client_fix.KEEP_CONNECTIONS] = keep
        proc = subprocess.run([str(python), "-c", KEEP_ALIVE_SCRIPT, mode, str(FIX)], capture_output=True,
                              text=True, timeout=300, check=False, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    # As shipped: the second request goes out on the pooled connection and never reaches the server.
    # The harness can ask for that pool (KEEP_CONNECTIONS=1) to measure keep-alive clients.
    for name in ("shipped", "kept"):
        run = runs[name]
        assert run["success"] == [True, False] and run["requests_seen"] == 1, (name, run)
        assert any(why in " ".join(run["error"]) for why in ("ServerDisconnectedError", "Can not write")), run
    assert runs["fixed"] == {"success": [True, True], "requests_seen": 2, "connections": 2, "error": []}, runs
