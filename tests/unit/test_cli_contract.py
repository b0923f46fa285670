"""The CLI's contract, over every subcommand (tuner/cli/__init__.py's docstring):

- exit 0 only when it did its job; 1 when it ran but could not read what it needed (every target failed,
  no file held a /metrics body); 2 for a usage or configuration error;
- a bad input is one ``error: …`` line on stderr (one per problem: a single bad value is one line), never a
  traceback, never ``internal error``, and nothing else on stderr.

Generated: each input slot of each subcommand (a path, a URL, a number) × bad values of its kind —
paths that are missing, a directory, a FIFO, binary, empty, of the wrong shape or too large; URLs that are
not http(s) with a host; numbers that are negative, zero, NaN, infinite or not numbers. In-process (the
real ``main``, stdout and stderr captured), plus a few cases as real subprocesses at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner import cli
from tuner.actuators import children
from tuner.cli import inputs, progress

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tuner" / "data" / "scenarios" / "queue-bound"
GOOD = [str(p) for p in sorted(SCENARIO.glob("*.prom"))[:3]]
DEAD_URL = "http://127.0.0.1:1/metrics"  # port 1: refused at once

PATH_KINDS = ("missing", "directory", "fifo", "binary", "empty", "wrong", "huge")


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One bad path of each kind (the huge one sparse: its size is refused before a byte is read)."""
    d = tmp_path_factory.mktemp("bad")
    (d / "directory").mkdir()
    os.mkfifo(d / "fifo")
    (d / "binary").write_bytes(bytes(range(256)) * 8)
    (d / "empty").write_bytes(b"")
    (d / "wrong").write_text("- 1\n")  # YAML and a text, but neither a mapping, JSON nor /metrics
    with open(d / "huge", "wb") as f:
        f.truncate(inputs.MAX_FILE_BYTES + 1)
    return {kind: str(d / kind) for kind in PATH_KINDS}


@pytest.fixture(scope="module")
def dead_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A valid observe-mode configuration whose one target never answers."""
    d = tmp_path_factory.mktemp("dead")
    path = d / "tuner.yaml"
    path.write_text(yaml.safe_dump({
        "mode": "observe", "targets": [{"name": "a", "metrics_url": DEAD_URL}],
        "scrape": {"min_snapshots": 2}, "daemon": {"state_file": str(d / "state.json")}}))
    return str(path)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One input of one subcommand: ``argv(value)`` is a whole command line with the bad value in it."""

    name: str
    argv: Callable[[str], list[str]]
    exit_for: Callable[[str], int | None] = lambda value: 2  # None: this value is not bad here

    def __repr__(self) -> str:
        return self.name


def metrics_file(kind: str) -> int:
    """A saved /metrics body: unreadable as a file is a bad argument (2); a readable file that holds no
    /metrics body is a scrape that failed, and when nothing else was given, nothing was read (1)."""
    return 1 if kind in ("empty", "wrong") else 2


def _e(*argv: str) -> Callable[[str], list[str]]:
    return lambda v: [a.replace("{}", v) for a in argv]


# `agent --config` has no path slot: the agent fails open by design (a bad configuration runs it degraded,
# said in its log, on /metrics and in an Event: docs/kubernetes.md), so the engine starts regardless.
PATH_SLOTS = [
    Slot("inspect --engine-metrics", _e("inspect", "--engine-metrics", "{}"), metrics_file),
    Slot("inspect --dcgm-metrics", _e("inspect", "--engine-metrics", GOOD[0], "--dcgm-metrics", "{}"),
         lambda k: 2),
    Slot("inspect --config", _e("inspect", "--config", "{}")),
    Slot("recommend --engine-metrics", _e("recommend", "--engine-metrics", "{}", "--engine-metrics", "{}",
                                          "--engine-metrics", "{}"), metrics_file),
    Slot("recommend --config", _e("recommend", "--config", "{}")),
    Slot("recommend --rules", _e("recommend", *[a for g in GOOD for a in ("--engine-metrics", g)], "--rules", "{}"),
         lambda k: None if k == "empty" else 2),  # an empty rule file: no rules, as documented
    Slot("recommend --decisions", _e("recommend", *[a for g in GOOD for a in ("--engine-metrics", g)],
                                     "--decisions", "{}"),
         lambda k: None if k == "empty" else 2),  # an empty decisions file: the defaults
    Slot("recommend --gpu-readings", _e("recommend", *[a for g in GOOD for a in ("--engine-metrics", g)],
                                        "--gpu-readings", "{}")),
    Slot("replay DIR", _e("replay", "{}")),
    Slot("replay --decisions", _e("replay", str(SCENARIO), "--decisions", "{}"),
         lambda k: None if k == "empty" else 2),
    Slot("replay --dcgm-metrics", _e("replay", str(SCENARIO), "--dcgm-metrics", "{}")),
    Slot("run --config", _e("run", "--config", "{}", "--once")),
    Slot("check-config", _e("check-config", "{}")),
    Slot("inject -f", _e("inject", "--image", "r/vllm-tuner:1", "--require", "-f", "{}")),
    Slot("status --config", _e("status", "--config", "{}")),
    Slot("history --config", _e("history", "--config", "{}")),
    Slot("pause --config", _e("pause", "--config", "{}")),
    Slot("resume --config", _e("resume", "--config", "{}")),
    Slot("pin --config", _e("pin", "--max-num-seqs", "--config", "{}")),
    Slot("unpin --config", _e("unpin", "--max-num-seqs", "--config", "{}")),
    Slot("launcher-zipapp OUT", _e("launcher-zipapp", "{}/launcher.pyz"),
         lambda k: 2 if k in ("binary", "empty", "wrong", "huge", "fifo") else None),  # a file where a dir must be
]

URLS = ["not-a-url", "ftp://127.0.0.1/metrics", "http://", "http:///metrics", "127.0.0.1:8000/metrics",
        "http://127.0.0.1:99999/metrics", "http://127.0.0.1:x/metrics", "http://exa mple/metrics", "",
        "http://[::1/metrics", "file:///etc/passwd", "http://127.0.0.1:0/metrics"]
URL_SLOTS = [
    Slot("status --url", _e("status", "--url", "{}")),
    Slot("inspect --engine-url", _e("inspect", "--engine-url", "{}", "--samples", "1")),
    Slot("inspect --dcgm-url", _e("inspect", "--engine-url", DEAD_URL, "--dcgm-url", "{}", "--samples", "1")),
]

NUMBERS = ["-5", "0", "-0.5", "nan", "inf", "-inf", "1e999", "abc", "", "1.5", "1_0", " 3 ", "0x10"]


def _float(v: str) -> float | None:
    try:
        x = float(v)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _int(v: str) -> int | None:
    try:
        return int(v)
    except ValueError:
        return None


def positive(v: str) -> bool:
    return (x := _float(v)) is not None and x > 0


def non_negative(v: str) -> bool:
    return (x := _float(v)) is not None and x >= 0


def finite(v: str) -> bool:
    return _float(v) is not None


def whole(low: int) -> Callable[[str], bool]:
    return lambda v: (n := _int(v)) is not None and n >= low


def index(v: str) -> bool:
    return _int(v) is not None


@dataclasses.dataclass(frozen=True)
class NumberSlot:
    """A number option: ``valid(text)`` says which values the command takes (those are not tested here)."""

    name: str
    argv: Callable[[str], list[str]]
    valid: Callable[[str], bool]

    def __repr__(self) -> str:
        return self.name


FILES = [a for g in GOOD for a in ("--engine-metrics", g)]
NUMBER_SLOTS = [
    NumberSlot("inspect --window-seconds", _e("inspect", *FILES, "--window-seconds", "{}"), positive),
    NumberSlot("inspect --samples", _e("inspect", "--engine-url", DEAD_URL, "--samples", "{}"), whole(1)),
    NumberSlot("inspect --min-snapshots", _e("inspect", *FILES, "--min-snapshots", "{}"), whole(1)),
    NumberSlot("inspect --max-model-len", _e("inspect", *FILES, "--max-model-len", "{}"), whole(1)),
    NumberSlot("inspect --slowdown-temp-c", _e("inspect", *FILES, "--slowdown-temp-c", "{}"), finite),
    NumberSlot("recommend --window-seconds", _e("recommend", *FILES, "--window-seconds", "{}"), positive),
    NumberSlot("recommend --span", _e("recommend", *FILES, "--span", "{}"), positive),
    NumberSlot("recommend --min-snapshots", _e("recommend", *FILES, "--min-snapshots", "{}"), whole(2)),
    NumberSlot("recommend --max-model-len", _e("recommend", *FILES, "--max-model-len", "{}"), whole(1)),
    NumberSlot("recommend --gpu-memory-gib", _e("recommend", *FILES, "--gpu-memory-gib", "{}"), positive),
    NumberSlot("recommend --samples", _e("recommend", "--config", "CONFIG", "--samples", "{}"), whole(1)),
    NumberSlot("replay --span", _e("replay", str(SCENARIO), "--span", "{}"), positive),
    NumberSlot("replay --window-seconds", _e("replay", str(SCENARIO), "--window-seconds", "{}"), positive),
    NumberSlot("replay --gpu-sample", _e("replay", str(SCENARIO), "--gpu-sample", "{}"), index),
    NumberSlot("inject --wait", _e("inject", "--image", "r/vllm-tuner:1", "--wait", "{}"), non_negative),
    NumberSlot("agent --startup-timeout", _e("agent", "--config", "CONFIG", "--startup-timeout", "{}"), non_negative),
    NumberSlot("demo --seconds", _e("demo", "--seconds", "{}"), positive),
]

# Subcommands without a slot above, and why.
NO_SLOT = {
    "config-schema": "takes no input",
    "launch": "the in-pod launcher's own parser (tuner/launcher), tested with it (tests/unit/test_launcher_argv.py)",
}


@dataclasses.dataclass
class Ran:
    rc: int
    out: str
    err: str


def run(argv: list[str]) -> Ran:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as exc:  # argparse: --help, --version, a bad command line
            rc = exc.code if isinstance(exc.code, int) else 2
    return Ran(rc, out.getvalue(), err.getvalue())


def holds_the_contract(ran: Ran, expected: int, argv: list[str]) -> None:
    shown = f"{argv} → {ran.rc}\nstderr:\n{ran.err}\nstdout (end):\n{ran.out[-800:]}"
    assert "Traceback" not in ran.err + ran.out, shown
    assert "internal error" not in ran.err, shown
    errors = [line for line in ran.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and ran.err.splitlines() == errors, shown
    assert ran.rc == expected, shown


def test_every_subcommand_has_its_inputs_checked() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    covered = {s.name.split()[0] for s in PATH_SLOTS + URL_SLOTS + NUMBER_SLOTS} | set(NO_SLOT)
    assert set(subparsers.choices) == covered, set(subparsers.choices) ^ covered


@pytest.mark.parametrize(("slot", "kind"), [pytest.param(s, k, id=f"{s.name}-{k}") for s in PATH_SLOTS
                                             for k in PATH_KINDS if s.exit_for(k) is not None])
def test_a_bad_path_is_one_error_line(bad: dict[str, str], slot: Slot, kind: str) -> None:
    """Every path slot × every kind of bad path for it (all of them, each a few milliseconds)."""
    argv = slot.argv(bad[kind])
    holds_the_contract(run(argv), slot.exit_for(kind) or 0, argv)


@settings(max_examples=60)
@given(slot=st.sampled_from(URL_SLOTS),
       url=st.sampled_from(URLS) | st.text(max_size=24).filter(lambda t: not t.startswith(("http://", "https://"))))
def test_a_bad_url_is_one_error_line(slot: Slot, url: str) -> None:
    argv = slot.argv(url)
    holds_the_contract(run(argv), 2, argv)


NUMBER_TEXTS = (st.sampled_from(NUMBERS) | st.floats().map(str) | st.integers(-10**6, 1).map(str)
                | st.text(max_size=8))


@settings(max_examples=300)
@given(slot=st.sampled_from(NUMBER_SLOTS), number=NUMBER_TEXTS)
def test_a_bad_number_is_one_error_line(dead_config: str, slot: NumberSlot, number: str) -> None:
    if slot.valid(number):
        return
    argv = [dead_config if a == "CONFIG" else a for a in slot.argv(number)]
    holds_the_contract(run(argv), 2, argv)


# --- nothing could be read: exit 1 ---------------------------------------------------------------------


def test_inspect_on_a_dead_engine_exits_1() -> None:
    argv = ["inspect", "--engine-url", DEAD_URL, "--samples", "1"]
    ran = run(argv)
    holds_the_contract(ran, 1, argv)
    assert "nothing could be read" in ran.err and "cannot connect" in ran.err


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_dead_engine_s_error_shows_no_password_of_its_url(fmt: str) -> None:
    ran = run(["inspect", "--engine-url", "http://user:pw-in-url-9f8e@127.0.0.1:1/metrics", "--samples", "1",
               "--format", fmt])
    assert ran.rc == 1 and "127.0.0.1:1" in ran.err
    assert "pw-in-url-9f8e" not in ran.out + ran.err


def test_inspect_and_recommend_config_on_a_dead_engine_exit_1(dead_config: str) -> None:
    for argv in (["inspect", "--config", dead_config, "--samples", "1"],
                 ["recommend", "--config", dead_config, "--samples", "2", "--window-seconds", "0.01"]):
        ran = run(argv)
        holds_the_contract(ran, 1, argv)
        assert "nothing could be read" in ran.err


def test_the_good_paths_exit_0() -> None:
    """The same commands with good inputs: exit 0 and nothing on stderr that looks like an error (the
    contract's other half: a test above that passed on 'always fails' would be worth nothing)."""
    for argv in (["inspect", *FILES], ["recommend", *FILES], ["replay", str(SCENARIO)], ["config-schema"],
                 ["replay", str(SCENARIO), "--format", "json"]):
        ran = run(argv)
        assert ran.rc == 0 and "error:" not in ran.err, (argv, ran.err)


def test_recommend_says_what_it_needs_to_decide() -> None:
    ran = run(["recommend", *FILES[:2]])  # one file: one snapshot, never a window
    assert ran.rc == 2 and "give --engine-metrics once per file" in ran.err
    ran = run(["recommend", "--min-snapshots", "3", *FILES[:4]])  # two files, three asked for
    needs = [line for line in ran.out.splitlines() if line.lstrip().startswith("NEEDS")]
    assert len(needs) == 1 and "--engine-metrics" in needs[0] and "--min-snapshots 2" in needs[0], ran.out


def test_replay_says_what_it_needs_when_nothing_changed(tmp_path: Path) -> None:
    for p in sorted(SCENARIO.glob("*.prom"))[:2]:  # two snapshots: never a window of three
        (tmp_path / p.name).write_bytes(p.read_bytes())
    ran = run(["replay", "--min-snapshots", "3", str(tmp_path)])
    assert ran.rc == 0 and ran.err == ""
    last = ran.out.splitlines()[-1]
    assert last.startswith("needs: at least 3 snapshots in the window to decide, got 2") and "--min-snapshots" in last


# --- the progress line --------------------------------------------------------------------------------


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_a_wait_over_two_seconds_shows_progress_on_stderr(tty: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    clock = iter(x * 0.5 for x in range(1000))
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(progress.time, "sleep", slept.append)
    stream = Stream(tty)
    waiting = progress.Sampling("inspect: 1 target(s)", samples=3, spacing_seconds=1.5, stream=stream)
    for i in range(3):
        if i:
            waiting.wait()
        waiting.scraped()
    waiting.close()
    text = stream.getvalue()
    if tty:  # redrawn in place, erased at the end: nothing left on the terminal
        assert "\r" in text and "next in" in text and text.endswith("\r\x1b[K")
    else:  # one plain line, at the start
        assert text == "inspect: 1 target(s): 3 scrapes 1.5 s apart, about 3 s; the result follows\n"


def test_a_short_wait_shows_nothing() -> None:
    stream = Stream(True)
    waiting = progress.Sampling("inspect", samples=2, spacing_seconds=1.0, stream=stream)
    waiting.close()
    assert stream.getvalue() == ""


# --- as a user runs it: real processes ------------------------------------------------------------------


def tuner(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize(("argv", "rc", "says"), [
    (["inspect", "--engine-url", "not-a-url"], 2, "--engine-url: expected an http:// or https:// URL"),
    (["inject", "-f", "/missing", "--image", "r/t:1"], 2, "/missing: cannot read the manifests"),
    (["replay", str(SCENARIO), "--span", "0"], 2, "--span: expected a number above 0"),
    (["inspect", *FILES, "--window-seconds", "-5"], 2, "--window-seconds: expected a number above 0"),
    (["inspect", "--engine-url", DEAD_URL, "--dcgm-url", "bad"], 2, "--dcgm-url: expected an http"),
    (["replay", str(SCENARIO), "--format", "production-stack"], 2, "invalid choice: 'production-stack'"),
])
def test_the_cases_the_issue_names(argv: list[str], rc: int, says: str) -> None:
    done = tuner(*argv)
    assert done.returncode == rc, done
    assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1 and says in done.stderr, done


def test_run_once_reading_no_target_exits_1_and_a_live_wait_says_so(dead_config: str) -> None:
    done = tuner("run", "--config", dead_config, "--once")
    assert done.returncode == 1, done
    assert "observed 0/1 target(s)" in done.stdout
    assert [line for line in done.stderr.splitlines() if line.startswith("error: ")] == [
        "error: run --once: no target could be read (a: cannot connect: [Errno 111] Connection refused)"], done.stderr
    waited = tuner("inspect", "--engine-url", DEAD_URL, "--samples", "2", "--window-seconds", "2.5")
    assert waited.returncode == 1
    lines = waited.stderr.splitlines()  # not a terminal: one plain progress line, then the error
    assert lines[0] == "inspect: 1 target(s): 2 scrapes 2.5 s apart, about 2 s; the result follows", lines
    assert lines[1].startswith("error: inspect: nothing could be read") and len(lines) == 2, lines


def test_on_a_terminal_the_progress_line_is_redrawn_and_erased() -> None:
    """A real pseudo-terminal as stderr: the line counts down in place and is gone at the end; only the
    error line stays."""
    import pty

    main_fd, term_fd = pty.openpty()
    try:
        inspect = subprocess.Popen([sys.executable, "-m", "tuner", "inspect", "--engine-url", DEAD_URL, "--samples",
                                    "2", "--window-seconds", "2.5"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=term_fd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        with children.stopped(inspect, timeout_seconds=0, signal_first=None) as proc:  # SIGKILL if a wait fails
            os.close(term_fd)
            chunks = []
            while True:
                try:
                    chunk = os.read(main_fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            assert proc.wait(timeout=60) == 1
    finally:
        os.close(main_fd)
    text = b"".join(chunks).decode()
    assert "\rinspect: 1 target(s): scrape 1/2 done, next in" in text, text
    erased = text.rsplit("\r\x1b[K", 1)
    assert len(erased) == 2 and erased[1].strip().startswith("error: inspect: nothing could be read"), text
