"""The evaluation harness's pure parts (bench/evaluation): the trace, the numbers, the report.

The harness itself runs against real engines in tests/e2e/test_evaluation.py; these tests pin the
definitions (goodput, restarts, convergence) on hand-made records, so that a change of meaning shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bench.evaluation import analysis, packing, profiles, reporting, traces
from bench.evaluation import arms as arms_mod
from harness.fake_nvml import FakeNvml
from tuner import config
from tuner.model import gpus as gpu_model
from tuner.sources.nvml import NvmlSource

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "bench" / "evaluation" / "profiles"
SLO = {"ttft_seconds": 1.0, "itl_mean_seconds": 0.1}
PHASES = [traces.Phase("steady", 10, 5, 64, 16), traces.Phase("burst", 5, 20, 64, 16, burstiness=0.5)]


def test_the_trace_is_seeded_and_deterministic() -> None:
    a = traces.build(PHASES, seed=3, range_ratio=0.2)
    b = traces.build(PHASES, seed=3, range_ratio=0.2)
    c = traces.build(PHASES, seed=4, range_ratio=0.2)
    assert a == b and a["digest"] == b["digest"]
    assert a["digest"] != c["digest"]
    assert a["duration"] == 15
    ats = [r["at"] for r in a["requests"]]
    assert ats == sorted(ats) and ats[0] > 0 and ats[-1] < 15
    assert {r["phase"] for r in a["requests"]} == {"steady", "burst"}
    assert all(51 <= r["prompt_tokens"] <= 76 and 12 <= r["output_tokens"] <= 19 for r in a["requests"])
    # Phases keep their rates: about 50 requests in the steady 10 s, about 100 in the 5 s burst.
    steady = sum(r["phase"] == "steady" for r in a["requests"])
    assert 25 < steady < 80, steady


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES.glob("*.yaml")))
def test_the_shipped_profiles_load(name: str) -> None:
    profile, base = profiles.load(PROFILES / f"{name}.yaml")
    assert profile.replicas == 2
    assert profile.bad_start < min(profile.sweep.values)
    assert profile.path(profile.tuner.config, base).exists()
    assert profile.trace.build()["requests"]


def test_a_bad_profile_is_one_line_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("name: x\nbad_start: 4\nsweep: {values: [8]}\ntrace: {phases: []}\ntuner: {config: t.yaml}\nfoo: 1\n")
    with pytest.raises(profiles.ProfileError) as err:
        profiles.load(bad)
    message = str(err.value)
    assert "\n" not in message and str(bad) in message and "trace.phases" in message and "1 more" in message


def req(i: int, *, start: float, ttft: float | None, itl: float | None = 0.01, ok: bool = True,
        tokens: int = 16, replica: str = "a") -> dict:
    return {"index": i, "phase": "steady", "arrival": start, "start": start, "ttft": ttft, "itl_mean": itl,
            "e2e": (ttft or 0) + (itl or 0) * (tokens - 1), "ok": ok, "output_tokens": tokens if ok else None,
            "max_tokens": tokens, "error": None if ok else "boom", "replica": replica}


def test_goodput_counts_requests_meeting_both_bounds_per_second_of_the_trace() -> None:
    t0 = 1000.0
    requests = [
        req(0, start=t0 + 1, ttft=0.5),  # meets
        req(1, start=t0 + 2, ttft=1.5),  # TTFT too long
        req(2, start=t0 + 3, ttft=0.2, itl=0.2),  # ITL too long
        req(3, start=t0 + 4, ttft=0.2, ok=False),  # failed
        req(4, start=t0 + 5, ttft=1.0, itl=0.1),  # on both bounds: meets
    ]
    meta = {"arm": "bad", "kind": "static", "mode": "plugin", "start_at": t0}
    s = analysis.summarize(meta, requests, slo=SLO, duration=10.0)
    assert (s.requests, s.completed, s.failed, s.met_slo) == (5, 4, 1, 2)
    assert s.goodput == pytest.approx(0.2)
    assert s.errors == {"boom": 1}
    assert s.ttft_p50 == pytest.approx(0.75)  # of 0.2, 0.5, 1.0, 1.5 (completed only)
    b = analysis.bins(requests, start_at=t0, duration=10.0, width=5.0, slo=SLO)
    assert [x["met_slo"] for x in b] == [1, 1] and [x["requests"] for x in b] == [4, 1]


def journal(t0: float) -> list[dict]:
    """One rollout 4 → 8: a restarted and verified, b restarted and rolled back (its back leg restarts it)."""
    old = {n: ["--model", "m", "--max-num-seqs", "4"] for n in "ab"}
    new = {n: ["--model", "m", "--max-num-seqs", "8"] for n in "ab"}

    def ev(at: float, replica: str, event: str, to: str, leg: str = "forward") -> dict:
        return {"kind": "event", "at": t0 + at, "rollout_id": "r1", "replica": replica, "event": event, "to": to,
                "leg": leg}

    return [
        {"kind": "decision", "at": t0 + 20, "rollout": "r1", "summary": "--max-num-seqs 4→8"},
        {"kind": "rollout", "at": t0 + 20, "rollout": {"id": "r1", "old_argv": old, "new_argv": new,
                                                         "order": ["a", "b"]}},
        ev(21, "a", "go", "draining"), ev(30, "a", "stopped", "starting"), ev(31, "a", "started", "waiting_healthy"),
        ev(80, "a", "undrained", "verifying"), ev(90, "a", "verified", "done"),
        ev(91, "b", "go", "draining"), ev(95, "b", "started", "waiting_healthy"),
        ev(150, "b", "undrained", "verifying"), ev(160, "b", "failed", "rolling_back"),
        ev(170, "b", "started", "waiting_healthy", "back"), ev(230, "b", "undrained", "rolled_back", "back"),
    ]


def test_restarts_flags_and_convergence_come_from_the_journal() -> None:
    t0 = 5000.0
    changes, restarts, facts = analysis.journal_flags(journal(t0), start_at=t0, initial={"a": 4, "b": 4})
    assert facts["restarts"] == {"a": 1, "b": 2}  # the back leg is a restart too
    assert facts["in_flight_at_end"] == []
    assert [(c.replica, c.at, c.value) for c in changes if c.source == "journal"] == [
        ("a", 80, 8), ("b", 150, 8), ("b", 230, 4)]
    assert [(r.replica, r.out_at, r.back_at, r.leg) for r in restarts] == [
        ("a", 21, 80, "forward"), ("b", 91, 150, "forward"), ("b", 160, 230, "back")]
    conv = analysis.convergence(changes, decisions_at=facts["decisions_at"], in_flight=[], duration=300, quiet_s=60)
    assert conv == {"converged": True, "changed": True, "converge_s": 230, "decided_s": 20}
    late = analysis.convergence(changes, decisions_at=facts["decisions_at"], in_flight=[], duration=70, quiet_s=60)
    assert late["converged"] is False


def test_a_rollout_in_flight_is_not_converged() -> None:
    t0 = 0.0
    records = journal(t0)[:5]  # a is starting when the tuner stops
    changes, restarts, facts = analysis.journal_flags(records, start_at=t0, initial={"a": 4, "b": 4})
    assert facts["in_flight_at_end"] == ["r1"]
    assert restarts[0].back_at is None
    conv = analysis.convergence(changes, decisions_at=facts["decisions_at"], in_flight=facts["in_flight_at_end"],
                                duration=300, quiet_s=60)
    assert conv["converged"] is False and conv["decided_s"] == 20 and conv["converge_s"] is None


def test_live_caps_come_from_the_acknowledgements() -> None:
    samples = [{"t": 10.0, "replica": "a", "cap": 4}, {"t": 11.0, "replica": "a", "cap": 4},
               {"t": 40.0, "replica": "a", "cap": 64}, {"t": 41.0, "replica": "a", "ack_problem": "x", "cap": 1}]
    changes = analysis.ack_flags(samples, start_at=10.0)
    assert [(c.at, c.value) for c in changes] == [(0.0, 4), (30.0, 64)]
    conv = analysis.convergence([analysis.FlagChange("a", 0.0, 4, "start"), *changes], decisions_at=[],
                                in_flight=[], duration=120, quiet_s=60)
    assert conv == {"converged": True, "changed": True, "converge_s": 30.0, "decided_s": 30.0}


def test_goals_compare_the_tuner_with_the_oracle_and_the_bad_start() -> None:
    def s(arm: str, goodput: float, **kw: object) -> analysis.ArmSummary:
        base = dict(arm=arm, kind="static", mode="plugin", flags="", requests=10, completed=10, failed=0,
                    met_slo=10, goodput=goodput, throughput=1, output_tokens_per_s=1, ttft_p50=0.1, ttft_p99=0.2,
                    itl_p50=0.01, itl_p99=0.02)
        return analysis.ArmSummary(**{**base, **kw})  # type: ignore[arg-type]

    arms = {"bad": s("bad", 2.0), "sweep-64": s("sweep-64", 9.0), "sweep-128": s("sweep-128", 10.0),
            "tuner": s("tuner", 9.5, kind="tuner", restarts={"a": 1, "b": 1}, converged=True, converge_s=180.0,
                       decided_s=100.0)}
    got = {g.name: g for g in analysis.goals(arms, tuner_arm="tuner", replicas=2)}
    assert got["goodput vs the oracle"].met is True and "0.95" in got["goodput vs the oracle"].measured
    assert "sweep-128" in got["goodput vs the oracle"].measured
    assert got["goodput vs the bad start"].met is True and "4.75" in got["goodput vs the bad start"].measured
    assert got["restarts"].met is True and got["failed requests"].met is True
    assert got["time to converge"].met is True
    arms["tuner"] = s("tuner", 5.0, kind="tuner", restarts={"a": 2, "b": 0}, failed=3, converged=False)
    got = {g.name: g for g in analysis.goals(arms, tuner_arm="tuner", replicas=2)}
    assert [got[n].met for n in ("goodput vs the oracle", "restarts", "failed requests", "time to converge")] == [
        False, False, False, False]


def results_dir(tmp: Path) -> Path:
    """A results directory as the harness leaves it, with hand-made raw data for three arms."""
    out = tmp / "results"
    trace = traces.build(PHASES, seed=1)
    (out / "arms").mkdir(parents=True)
    (out / "trace.json").write_text(json.dumps(trace))
    (out / "run.json").write_text(json.dumps({
        "profile": "unit", "replicas": 2, "slo": SLO, "engine_args": ["--x"], "commands": ["python -m bench.evaluate"],
        "timings": {"bin_seconds": 5, "converge_quiet_seconds": 5}}))
    t0 = 100.0
    for arm, kind, ttft in (("bad", "static", 3.0), ("sweep-8", "static", 0.2), ("tuner", "tuner", 0.4)):
        d = out / "arms" / arm
        (d / "tuner").mkdir(parents=True)
        meta = {"arm": arm, "kind": kind, "mode": "restart" if kind == "tuner" else "plugin", "start_at": t0,
                "replicas": {"a": "u", "b": "u"}, "initial_flags": {"a": 4, "b": 4} if arm != "sweep-8" else
                {"a": 8, "b": 8}, "flags_label": arm}
        (d / "meta.json").write_text(json.dumps(meta))
        rows = [req(r["index"], start=t0 + r["at"], ttft=ttft, replica="ab"[r["index"] % 2]) for r in trace["requests"]]
        (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if kind == "tuner":
            (d / "tuner" / "journal.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in journal(t0 - 15)[:7]))  # a back at 65 s: after the trace
    return out


def test_the_report_renders_from_raw_data_and_report_only_rerenders_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = results_dir(tmp_path)
    report = reporting.render(out)
    text = report.read_text()
    for png in ("flags.png", "goodput.png", "ttft_p99.png"):
        assert (out / "plots" / png).stat().st_size > 5000
        assert f"plots/{png}" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arms"]["bad"]["goodput"] == 0
    assert summary["arms"]["sweep-8"]["met_slo"] == summary["arms"]["sweep-8"]["requests"]
    assert summary["arms"]["tuner"]["restarts"] == {"a": 1, "b": 0}
    goals = {g["name"]: g for g in summary["goals"]["tuner"]}
    assert goals["goodput vs the oracle"]["met"] is True and goals["goodput vs the bad start"]["met"] is True
    assert "| tuner |" in text and "SLO: TTFT ≤ 1 s and mean ITL ≤ 0.1 s" in text
    (out / "report.md").unlink()
    rc = subprocess.run([sys.executable, "-m", "bench.evaluate", "--report-only", str(out), "--no-plots"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert rc.returncode == 0, rc.stderr
    assert (out / "report.md").read_text().split("## Plots")[0] == text.split("## Plots")[0]
    # The committed form: gzip'd records, the same report from them.
    packed = tmp_path / "packed"
    written = packing.pack(out, packed)
    assert (packed / "trace.json.gz") in written and (packed / "arms" / "bad" / "requests.jsonl.gz") in written
    assert not (packed / "arms" / "bad" / "requests.jsonl").exists()
    assert packing.pack(out, tmp_path / "again") and all(
        (tmp_path / "again" / p.relative_to(packed)).read_bytes() == p.read_bytes() for p in written)  # no churn
    (packed / "report.md").unlink()
    reporting.render(packed, plots=False)
    assert (packed / "report.md").read_text().split("## Plots")[0] == text.split("## Plots")[0]


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bench.evaluate", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=False)

    r = run("--report-only", str(tmp_path))
    assert r.returncode == 2 and "not a results directory" in r.stderr and "Traceback" not in r.stderr
    r = run("--profile", str(PROFILES / "cpu-ci.yaml"), "--out", str(tmp_path / "o"), "--sweep-values", "3")
    assert r.returncode == 2 and "not all in the profile's sweep" in r.stderr
    r = run("--profile", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "cannot read the profile" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("live", [False, True], ids=["restarts", "live"])
@pytest.mark.parametrize("settings", ["cpu.yaml", "defaults.yaml"])
def test_the_tuner_settings_compose_into_a_valid_apply_configuration(settings: str, live: bool,
                                                                     tmp_path: Path) -> None:
    """The harness writes targets, actuator, drain, daemon endpoint, state and journal around the arm's
    settings; the result is what `vllm-tuner run` accepts (`tuner.config.load`, apply mode)."""
    from bench.evaluation import arms

    profile, base = profiles.load(PROFILES / "cpu-ci.yaml")
    ctx = arms.Context(profile=profile, base=base, out=tmp_path, trace={}, trace_path=tmp_path / "trace.json",
                       model=tmp_path / "model", vocab_size=1024, engine_python=Path(sys.executable),
                       player_python=Path(sys.executable))
    pool = arms.TunerPool(ctx, tmp_path / "work", template=ROOT / "bench" / "evaluation" / "tuner" / settings, live=live)
    try:
        composed = arms.compose(pool.template, pool=pool)
    finally:
        pool.lb.stop()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(composed))
    settings_obj = config.load(path)
    assert settings_obj.mode == "apply" and [t.name for t in settings_obj.targets] == ["a", "b"]
    args = settings_obj.targets[0].args or []
    assert ("--max-num-seqs" in args) is not live
    if not live:
        assert args[args.index("--max-num-seqs") + 1] == str(profile.bad_start)
    else:  # the tuner's live knobs, each replica its own control directory (VLLM_TUNER_CONTROL_DIR, set by the tuner)
        assert settings_obj.live.enabled
        assert settings_obj.live.dir_for("a") == str(pool.control["a"]) != settings_obj.live.dir_for("b")
    assert settings_obj.actuator is not None and settings_obj.actuator.command[-2:] == [
        "-m", "vllm.entrypoints.openai.api_server"]
    assert settings_obj.daemon.listen_host == "127.0.0.1" and settings_obj.daemon.json_logs
    assert settings_obj.rollout.journal_file == str(tmp_path / "work" / "journal.jsonl")
    assert settings_obj.drain.kind == "nginx"
    if settings == "defaults.yaml":  # nothing but the wiring: the shipped defaults
        assert settings_obj.scrape == config.ScrapeSettings() and settings_obj.rule_files is None
    else:
        assert all(Path(f).is_absolute() and Path(f).exists() for f in settings_obj.rule_files or [])


def test_the_report_says_which_gpu_measured_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile's description names the GPU it was written for; run.json records the one it ran on (NVML's
    names, read-only calls), and the report prints it — an H200 profile run on an H100 says so."""
    import types

    from bench.evaluation import arms

    class Nvml(types.ModuleType):
        def __init__(self) -> None:
            super().__init__("pynvml")
            self.calls: list[str] = []

        def nvmlInit(self) -> None:
            self.calls.append("init")

        def nvmlDeviceGetCount(self) -> int:
            return 2

        def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
            return i

        def nvmlDeviceGetName(self, handle: int) -> bytes | str:
            return b"NVIDIA H100 80GB HBM3" if handle == 0 else "NVIDIA H100 80GB HBM3"

        def nvmlShutdown(self) -> None:
            self.calls.append("shutdown")

    fake = Nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert arms.gpu_names() == ["NVIDIA H100 80GB HBM3"] * 2
    assert fake.calls == ["init", "shutdown"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML here: unknown, not an error
    assert arms.gpu_names() == []
    out = results_dir(tmp_path)
    run = json.loads((out / "run.json").read_text())
    text = reporting.render(out, plots=False).read_text()
    assert "Measured on" not in text  # a run from before the record says nothing rather than guess
    (out / "run.json").write_text(json.dumps({**run, "gpus": ["NVIDIA H100 80GB HBM3"] * 2}))
    text = reporting.render(out, plots=False).read_text()
    assert "Measured on: 2 × NVIDIA H100 80GB HBM3." in text


def _rerendered(tmp_path: Path, run: str) -> tuple[Path, str]:
    """A committed GPU run's report rendered anew from its raw data: it must be the committed one."""
    import shutil

    src = ROOT / "tests" / "fixtures" / "evaluation" / run
    out = tmp_path / run
    shutil.copytree(src, out)
    (out / "report.md").unlink()
    text = reporting.render(out, plots=False).read_text()
    assert text.split("## Plots")[0] == (src / "report.md").read_text().split("## Plots")[0]
    return src, text


@pytest.mark.parametrize("run", ["h100-rise", "h100-rise-run2", "h100-rise-run3", "h100-rise-run4", "h100-family-2026-5",
                                 "h100-family-2026-5-run2", "h100-family-2026-124", "h100-family-2026-124-run2",
                                 "h100-family-2026-124-run3", "h100-family-2026-124-run4", "h100-rise-run5"])
def test_the_committed_h100_runs_rerender_to_their_reports(tmp_path: Path, run: str) -> None:
    """tests/fixtures/evaluation/h100-* (the H200 profiles on a lent H100, docs/evaluation.md): each report
    is what its raw data says, the tuner within 0.95 × the best static beside it, no failure, no restart."""
    src, text = _rerendered(tmp_path, run)
    assert "Measured on: NVIDIA H100 80GB HBM3." in text
    summary = json.loads((src / "summary.json").read_text())
    live = summary["arms"]["tuner-live"]
    best = max(a["goodput"] for name, a in summary["arms"].items() if name != "tuner-live")
    assert live["goodput"] >= 0.95 * best and live["failed"] == 0
    assert all(n == 0 for n in live["restarts"].values())


@pytest.mark.parametrize(("run", "band"), [("h200-rise-run2", (0.95, 1.05)), ("h200-family-2026-5-run2", (0.95, 1.05)),
                                           ("h200-family-2026-124-run3", (0.70, 0.72))])
def test_the_shipped_law_on_the_h200_rerenders_to_its_reports(tmp_path: Path, run: str,
                                                              band: tuple[float, float]) -> None:
    """tests/fixtures/evaluation/h200-*-run{2,3} (docs/evaluation.md, "The H200 at last"): the shipped law's live
    arm on the H200 beside the static arms measured there before (the same trace digests). Each report is what
    its raw data says; the bar is what was measured — draw 124's 0.71 × is the miss the docs explain (8 → 304,
    the cache's bound, where the ITL broke and no rule lowered the cap while the TTFT broke too)."""
    src, text = _rerendered(tmp_path, run)
    assert "Measured on: NVIDIA H200." in text
    summary = json.loads((src / "summary.json").read_text())
    live = summary["arms"]["tuner-live"]
    digests = {json.loads((src / "arms" / a / "meta.json").read_text())["trace_digest"] for a in summary["arms"]}
    assert len(digests) == 1  # the static arms beside it played the same trace
    best = max(a["goodput"] for name, a in summary["arms"].items() if name != "tuner-live")
    assert band[0] <= live["goodput"] / best <= band[1], live["goodput"] / best
    assert live["failed"] == 0 and all(n == 0 for n in live["restarts"].values())


def test_issue_30s_kv_example_on_a_lent_h100_favours_the_cap_above_the_cache(tmp_path: Path) -> None:
    """tests/fixtures/evaluation/h100-kv-long (docs/evaluation.md, "A lent H100, seventh time"): a cap near what
    the cache holds (32; about 40 of these requests fit a replica) served the long phase about half as well as 256
    on real vLLM, and the live tuner raised 8 → 1,024 once, within seconds, with no failure and no restart; its
    0.87 × is what was measured (the band), not a bar it met."""
    src, text = _rerendered(tmp_path, "h100-kv-long")
    assert "Measured on: NVIDIA H100 80GB HBM3." in text
    summary = json.loads((src / "summary.json").read_text())
    arms = summary["arms"]
    assert arms["sweep-32"]["goodput"] < 0.6 * arms["sweep-256"]["goodput"]
    live = arms["tuner-live"]
    assert 0.85 <= live["goodput"] / arms["sweep-256"]["goodput"] <= 0.89
    assert live["failed"] == 0 and all(n == 0 for n in live["restarts"].values())
    assert "--max-num-seqs 8→1024 (queue-slot-bound, live)" in text


def test_the_restarting_arm_on_a_lent_h100_cost_nothing_the_bad_start_met(tmp_path: Path) -> None:
    """tests/fixtures/evaluation/h100-family-2026-124-run2 (docs/evaluation.md, "A lent H100, fourth time"): the
    restarting arm's only restart was decided after the last request the bad start met had arrived, and after
    the decision neither arm met any; before it they differ by the timing of the trace's first seconds."""
    import gzip

    src = ROOT / "tests" / "fixtures" / "evaluation" / "h100-family-2026-124-run2"
    summary = json.loads((src / "summary.json").read_text())
    bad, tuner = summary["arms"]["bad"], summary["arms"]["tuner"]
    assert sum(tuner["restarts"].values()) == 1 and max(tuner["restarts"].values()) == 1
    slo = {"ttft_s": summary["slo"]["ttft_seconds"], "itl_mean_s": summary["slo"]["itl_mean_seconds"]}

    def met_arrivals(arm: str) -> list[float]:
        meta = json.loads((src / "arms" / arm / "meta.json").read_text())
        with gzip.open(src / "arms" / arm / "requests.jsonl.gz", "rt") as f:
            rows = [json.loads(line) for line in f]
        return [r["arrival"] - meta["start_at"] for r in rows if analysis.meets_slo(r, **slo)]

    decided, bad_met = tuner["decided_s"], met_arrivals("bad")
    assert bad_met and max(bad_met) < decided
    assert [t for t in met_arrivals("tuner") if t >= decided] == []
    assert tuner["met_slo"] >= bad["met_slo"] - 1


def test_each_arm_records_the_gpu_and_the_report_says_when_it_was_held_for_power() -> None:
    """Two leases of "an H200" ran draw 124's steps 15-30 % apart at the same running count: every arm records
    the card's clock and power (the real H200's NVML recording replayed here) and the report says, per arm, how
    often the driver held the clock for power or heat while the card was busy."""
    recording = json.loads((ROOT / "tests" / "fixtures" / "nvml" / "h200-matmul.json").read_text())
    fake = FakeNvml.from_recording(recording)
    source = NvmlSource([recording["meta"]["gpu"]], nvml=fake, clock=lambda: 0.0)
    rows = []
    for i in range(len(recording["samples"])):
        fake.load_sample(i)
        rows += arms_mod.sample_gpus(source)
    source.close()
    assert rows and set(rows[0]) == {"gpu", *arms_mod.GPU_FIELDS}
    busy = [r for r in rows if (r["gpu_util"] or 0) >= 0.5]
    assert busy, "the recording has a loaded part"
    capped = [dict(r, clocks_event_reasons=gpu_model.SW_POWER_CAP) for r in busy]
    free = [dict(r, clocks_event_reasons=0) for r in busy]
    idle = [dict(r, gpu_util=0.0, clocks_event_reasons=gpu_model.SW_POWER_CAP) for r in busy]
    lines = reporting._gpu_lines([SimpleNamespace(name="a", gpu=capped[:1] + free[:3] + idle),
                                  SimpleNamespace(name="b", gpu=[]), SimpleNamespace(name="c", gpu=free[:2])])
    table = [line for line in lines if line.startswith("| a ") or line.startswith("| c ")]
    assert len(table) == 2 and not any(line.startswith("| b ") for line in lines)
    assert table[0].endswith("| 25 % |") and table[1].endswith("| 0 % |")
    assert reporting._gpu_lines([SimpleNamespace(name="a", gpu=idle)]) == []
