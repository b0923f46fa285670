"""What a cycle keeps between cycles never changes what it decides (issue 29, item 5).

A cycle is cheap because it does not redo work: each snapshot is read once (``signals.engine.Reading``,
kept in the snapshot's memo while it stays in the target's window), the long window computes only the slow
signals when a decision window supplies the rest (``compute(only=)``), and the parser remembers the series
and HELP/TYPE lines it has read before (``model.snapshots``). Each is held here against the recomputation
from nothing, on generated sequences of scrapes: the signals a step computes over the windows it keeps
equal, value, reason and order, those recomputed from fresh copies of the same snapshots (nothing
remembered); a body parsed after others equals the same body parsed with every cache empty.
"""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz.test_fuzz_signals import vllm_body
from tuner.model import dialects, knobs, snapshots
from tuner.model import live as live_mod
from tuner.model.engines import EngineInfo
from tuner.model.gpus import GpuInputs
from tuner.planning import planner, stepping
from tuner.planning.history import FlagChange, History
from tuner.signals import engine as es

SETTINGS = settings(max_examples=60, deadline=None)


def fresh(snap: snapshots.Snapshot) -> snapshots.Snapshot:
    """The same scrape with nothing remembered about it."""
    return dataclasses.replace(snap, memo={})


def sglang(body: str) -> str:
    return (body.replace("vllm:num_requests_running", "sglang:num_running_reqs")
            .replace("vllm:num_requests_waiting", "sglang:num_queue_reqs")
            .replace("vllm:kv_cache_usage_perc", "sglang:token_usage")
            .replace("vllm:request_success_total", "sglang:num_requests_total")
            .replace("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"))


def scrapes(seed: int, n: int, *, kind: str, absurd: float, every: float) -> list[snapshots.Snapshot]:
    """``n`` scrapes of one engine, mostly ``every`` seconds apart, now and then a gap, a failure, a restart."""
    rnd = random.Random(seed)
    keep = dialects.DIALECTS[kind].parse_prefixes()
    out, t = [], 1_000_000.0
    for i in range(n):
        t += rnd.choice([every] * 6 + [every * 8, 1e-3])
        if rnd.random() < 0.06:
            out.append(snapshots.Snapshot.failed(t, "HTTP 500"))
            continue
        body = vllm_body(rnd, i + 1, absurd)
        out.append(snapshots.parse(sglang(body) if kind == "sglang" else body, t, keep_prefixes=keep))
    return out


@SETTINGS
@given(st.integers(0, 2**32), st.sampled_from(["vllm", "sglang"]), st.sampled_from([0.0, 0.0, 0.02, 0.2]),
       st.integers(2, 14), st.integers(1, 4), st.sampled_from([None, 3.0, 500.0]),
       st.sampled_from([None, stepping.SLOW_SIGNALS, stepping.FAST_SIGNALS, frozenset({"request_rate", "ttft_p95_s"})]))
def test_windows_folded_from_kept_readings_equal_the_recomputation(seed, kind, absurd, width, min_snaps,
                                                                   max_running, only):
    dialect = dialects.DIALECTS[kind]
    snaps = scrapes(seed, 24, kind=kind, absurd=absurd, every=5.0)
    info = EngineInfo(max_model_len=2048)
    for end in range(1, len(snaps) + 1):
        window = snaps[max(0, end - width):end]  # the snapshots are shared by the windows that hold them
        now = window[-1].scraped_at + 1
        kept = es.compute(window, dialect=dialect, info=info, now=now, min_snapshots=min_snaps,
                          max_running=max_running, only=only)
        full = es.compute([fresh(s) for s in window], dialect=dialect, info=info, now=now,
                          min_snapshots=min_snaps, max_running=max_running)
        assert list(kept) == list(full)  # every signal, in the same order
        for name, signal in full.items():
            if only is None or name in only or name not in es.WINDOW_SIGNALS:
                assert kept[name] == signal, name
            else:
                assert kept[name] in (signal, es.NOT_COMPUTED), name
    other = dialects.SGLANG if kind == "vllm" else dialects.VLLM  # what one dialect kept is not read for another
    assert (es.compute(snaps, dialect=other, min_snapshots=min_snaps)
            == es.compute([fresh(s) for s in snaps], dialect=other, min_snapshots=min_snaps))


def reference_step(state: stepping.TargetState, decision: stepping.Decision, *, dialect: dialects.Dialect,
                   window: stepping.WindowSettings, max_running: float | None, min_requests: int) -> dict:
    """A step's engine signals recomputed from nothing: every snapshot of its window fresh, the long window
    read in full, then the decision window's signals over all but the slow ones (rule 1a)."""
    kept, now = [fresh(s) for s in decision.state.window], decision.at
    args = {"dialect": dialect, "info": EngineInfo(max_model_len=2048), "now": now,
            "stale_after_seconds": window.stale_after_seconds, "min_snapshots": window.min_snapshots,
            "max_running": max_running}
    signals = es.compute(kept, **args)
    since, _ = stepping.decision_window(kept, state.history, now=now, window=window, dialect=dialect,
                                        min_requests=min_requests)
    assert since == decision.decided_since
    if since is not None:
        recent = es.compute([s for s in kept if s.scraped_at >= since], **args)
        signals.update({k: v for k, v in recent.items() if k not in stepping.SLOW_SIGNALS})
        if recent["kv_concurrency_observed"].value is not None:  # the KV bound of this regime (rule 1a)
            signals["kv_concurrency_observed"] = recent["kv_concurrency_observed"]
    stepping._kv_bound_unseen(signals)  # none finished anywhere: what the cache holds of max_model_len requests
    return signals


@SETTINGS
@given(st.integers(0, 2**32), st.sampled_from(["vllm", "sglang"]), st.sampled_from([0.0, 0.0, 0.02]),
       st.sampled_from([None, 10.0]), st.sampled_from([0, 5]), st.sampled_from([None, 30.0]),
       st.sampled_from([None, "4", "64"]), st.sampled_from([None, 0.3, 0.7]))
def test_a_steps_signals_equal_the_recomputation_from_nothing(seed, kind, absurd, decision_seconds, min_requests,
                                                             stale, max_num_seqs, changed_at):
    dialect = dialects.DIALECTS[kind]
    window = stepping.WindowSettings(window_seconds=60.0, min_snapshots=3, stale_after_seconds=stale,
                                     max_snapshots=40, decision_seconds=decision_seconds)
    settings_ = planner.DecisionSettings.model_validate({"idle": {"min_requests_per_window": min_requests}})
    args = knobs.EngineArgs.parse(["--max-num-seqs", max_num_seqs] if max_num_seqs else [])
    started = args if max_num_seqs else None
    max_running = stepping._engine_cap(started, live_mod.NONE, kind=kind)
    snaps = scrapes(seed, 60, kind=kind, absurd=absurd, every=2.0)
    history = History()
    if changed_at is not None:  # the tuner changed a flag part-way: the decision window restarts there
        at = snaps[int(len(snaps) * changed_at)].scraped_at
        history = History(changes={"max_num_seqs": FlagChange(at=at, direction=1, rule="r", from_value="8",
                                                               to_value="16")})
    state = stepping.TargetState(history=history)
    for snap in snaps:
        d = stepping.step(state, snap, info=EngineInfo(max_model_len=2048), gpus=GpuInputs(unavailable="none"),
                          now=snap.scraped_at, target="t", kind=kind, args=args, settings=settings_, window=window,
                          rules=(), decide=False, started_args=started)
        expected = reference_step(state, d, dialect=dialect, window=window, max_running=max_running,
                                  min_requests=min_requests)
        assert [(k, v) for k, v in d.signals.items() if k in es.ALL_SIGNALS] == list(expected.items())
        state = d.state


WEIRD_VALUES = ["1_000", "5\t", "\t5", "5 123", "5  ", "NaN", "+Inf", "-Inf", "1e400", "0x10", "", "5\r", "5\x0b",
                "7e-3", "-0", "+3", "inf"]


def bent(rnd: random.Random, body: str, twins: frozenset[str]) -> str:
    """``body`` with some sample lines bent: an odd value, a timestamp, a tab, junk; the series of the families in
    ``twins`` get a ``_created`` twin (the same lines in every body, so one parse can remember what another read)."""
    out, often = [], rnd.choice([0.0, 0.01, 0.1])  # some bodies stay on the fast path, some leave it
    for line in body.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in twins:
            out.append(line.replace(name, name.removesuffix("_total") + "_created", 1))
        roll = rnd.random() / often if often else 1.0
        if line and not line.startswith("#") and roll < 0.75:
            head, _, _ = line.rpartition(" ")
            line = f"{head} {rnd.choice(WEIRD_VALUES)}"
        elif line and not line.startswith("#") and roll < 0.9:
            head, _, value = line.rpartition(" ")
            line = f"{head}\t{value}"
        elif roll < 1.0:
            line = "# TYPE " + line
        out.append(line)
    return "\n".join(out) + "\n"


def typed(rnd: random.Random, body: str) -> str:
    """``body`` with HELP and TYPE lines before each run of a family's samples (a counter's written without
    ``_total``, which the TYPE line then restores), and now and then a comment or junk that starts with #."""
    out, family = [], ""
    for line in body.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        base = name.removesuffix("_total")
        for suffix in ("_bucket", "_sum", "_count"):
            base = base.removesuffix(suffix)
        kind = "counter" if name.endswith("_total") else "histogram" if base != name else "gauge"
        if base != family:
            family = base
            out += [f"# HELP {base} what {base} counts", f"# TYPE {base} {kind}"]
        if rnd.random() < 0.01:
            out.append(rnd.choice(["# a comment", "#junk", "# TYPE", "# HELP vllm:x", "# TYPE vllm:y bogus"]))
        out.append(line.replace(name, base, 1) if kind == "counter" else line)
    return "\n".join(out) + "\n"


def clear_parser_caches() -> None:
    for cache in (snapshots._LABELS_CACHE, snapshots._CANONICAL, snapshots._SERIES_CACHE, snapshots._COMMENTS,
                  snapshots._ALLOWED, snapshots._PREVIOUS, snapshots._ONCE):
        cache.clear()


@SETTINGS
@given(st.integers(0, 2**32), st.lists(st.sampled_from(["clean", "bent", "sglang", "typed"]), min_size=2, max_size=8),
       st.lists(st.booleans(), min_size=8, max_size=8))
def test_a_body_parsed_after_others_equals_it_parsed_with_nothing_remembered(seed, kinds, filtered):
    rnd = random.Random(seed)
    twins = frozenset(rnd.sample(["vllm:prompt_tokens_total", "vllm:num_requests_running", "http_requests_total",
                                  "vllm:request_success_total", "process_start_time_seconds"], 2))
    bodies = []
    for i, kind in enumerate(kinds):
        body = vllm_body(rnd, i + 1, 0.02)
        bodies.append(bent(rnd, body, twins) if kind == "bent" else sglang(body) if kind == "sglang"
                      else typed(rnd, body) if kind == "typed" else body)
    keeps = [dialects.VLLM.parse_prefixes() if f else None for f in filtered]
    warm = [snapshots.parse(b, 1.0, keep_prefixes=k) for b, k in zip(bodies, keeps, strict=False)]
    for body, keep, snap in zip(bodies, keeps, warm, strict=False):
        clear_parser_caches()
        assert snapshots.parse(body, 1.0, keep_prefixes=keep) == snap
    again = [snapshots.parse(b, 1.0, keep_prefixes=k) for b, k in zip(bodies, keeps, strict=False)]
    assert again == warm  # and read once more, every cache now holding all of them


def changed_in_place(rnd: random.Random, lines: list[str], *, mild: bool = False) -> list[str]:
    """``lines`` with a few of them changed in their places, as a target's next body changes: most often a value,
    sometimes what the line is (another series, a copy of another line, a HELP or TYPE line, a family not read, a
    counter written without ``_total``, junk, nothing). ``mild``: only values, and now and then a label."""
    out = list(lines)
    for _ in range(rnd.choice([1, 3, 10, 40])):
        i = rnd.randrange(len(out))
        line = out[i]
        name = line.partition("{")[0].partition(" ")[0]
        roll = rnd.random()
        if mild and line and not line.startswith("#"):
            value = rnd.choice(["0", "1.5", "27", "1e3", "4.0"])
            out[i] = (line.replace('model_name="m"', 'model_name="n"') if roll < 0.2
                      else f"{line.rpartition(' ')[0]} {value}")
            continue
        if roll < 0.55 and line and not line.startswith("#"):
            out[i] = f"{line.rpartition(' ')[0]} {rnd.choice([*WEIRD_VALUES, '0', '1.5', '27', '1e3', '4.0'])}"
        elif roll < 0.65:
            out[i] = rnd.choice(out)  # a line twice (the same series twice: refused), or the next family's line
        elif roll < 0.75:
            family = name.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").lstrip("# ")
            kind = rnd.choice(["counter", "gauge", "histogram", "untyped", "bogus"])
            out[i] = rnd.choice([f"# TYPE {family} {kind}", f"# HELP {family} what it is", "# a comment"])
        elif roll < 0.8:
            out[i] = line.replace("_total", "", 1)
        elif roll < 0.9:
            out[i] = rnd.choice(['python_gc_objects_collected_total{generation="0"} 14703.0',
                                 'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9', "", "junk"])
        else:
            out[i] = line.replace('model_name="m"', 'model_name="n"')
    return out


@SETTINGS
@given(st.integers(0, 2**32), st.lists(st.sampled_from(["in place", "in place", "mild", "mild", "new", "typed"]),
                                       min_size=2, max_size=12), st.booleans())
def test_a_body_parsed_after_the_last_from_its_source_equals_it_parsed_on_its_own(seed, steps, filtered):
    """``parse(source=)`` reads only the lines that differ from the last body from the same source (``_PREVIOUS``):
    each body of a generated sequence, most of them the last one with a few lines changed in their places, parses
    as it does without a source (which the test above holds to a parse with nothing remembered)."""
    rnd = random.Random(seed)
    keep = dialects.VLLM.parse_prefixes() if filtered else None
    source = f"http://target-{seed}/metrics"
    lines: list[str] = []
    read_before = False  # whether the fast parser read a body from this source before
    for i, how in enumerate(steps):
        if how in ("in place", "mild") and lines:
            lines = changed_in_place(rnd, lines, mild=how == "mild")
        else:
            body = vllm_body(rnd, i + 1, 0.02)
            lines = (typed(rnd, body) if how == "typed" else body).split("\n")
        body = "\n".join(lines)
        snap = snapshots.parse(body, 1.0, source=source, keep_prefixes=keep)
        alone = snapshots.parse(body, 1.0, keep_prefixes=keep)
        assert dataclasses.replace(snap, source="") == alone
        assert snap.error == alone.error
        # what the memo carried from the last snapshot (the label sets and values, where the mappings are the same)
        # is what reading this one's samples finds, and is carried to the next one
        for prefixes in (None, keep, ("vllm:",)):
            assert list(map(id, snap.label_sets(prefixes))) == list(map(id, fresh(snap).label_sets(prefixes)))
            for label in ("model_name", "engine", "le", "finished_reason"):
                assert snap.label_values(label, prefixes) == fresh(snap).label_values(label, prefixes)
        if fast_shape(body, keep):
            if read_before:
                assert (source, keep) in snapshots._PREVIOUS  # kept from its second body on: the path is taken
            read_before = True


def fast_shape(body: str, keep: tuple[str, ...] | None) -> bool:
    """Whether the fast parser reads ``body`` (else the reference parser does, and nothing is kept)."""
    if body.isspace() or not body.endswith("\n"):
        return False  # refused before any parser reads it
    try:
        return snapshots._fast_parse(body, keep) is not None
    except snapshots._Rejected:
        return False
