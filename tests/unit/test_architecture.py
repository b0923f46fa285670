"""The shape of the code, held by tests: every module has a layer, one decision path, one engine client,
and nothing points outside the repository."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUNER = ROOT / "tuner"
STANDALONE = {"tuner.sim", "tuner.launcher"}  # held by their own forbidden contracts
ROOT_MODULES = {"tuner", "tuner.__main__", "tuner.data"}


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def top_level_modules() -> set[str]:
    out = set()
    for p in TUNER.iterdir():
        if p.name.startswith((".", "_")) and p.name != "__main__.py":
            continue
        if p.is_dir() and (p / "__init__.py").exists():
            out.add(f"tuner.{p.name}")
        elif p.suffix == ".py":
            out.add(f"tuner.{p.stem}")
    return out


def test_every_module_of_tuner_sits_in_a_layer_or_stands_alone() -> None:
    (layers,) = [c for c in contracts() if c["type"] == "layers"]
    layered = {m.strip() for layer in layers["layers"] for m in layer.split("|")}
    standalone = {m for c in contracts() if c["type"] == "forbidden" for m in c["source_modules"]} & STANDALONE
    missing = top_level_modules() - layered - standalone - ROOT_MODULES
    assert not missing, f"modules in no import-linter contract: {sorted(missing)}"
    assert any(c["type"] == "acyclic_siblings" and c["ancestors"] == ["tuner"] for c in contracts())


def test_the_two_roots_share_the_runtime_not_each_other() -> None:
    """``vllm-tuner run`` (daemon/) and ``vllm-tuner agent`` (kube/) run the same runtime/ and never import
    each other: a contract that says so, and the layers put both above the runtime."""
    assert any(c["type"] == "independence" and sorted(c["modules"]) == ["tuner.daemon", "tuner.kube"]
               for c in contracts())
    (layers,) = [c for c in contracts() if c["type"] == "layers"]
    names = [[m.strip() for m in layer.split("|")] for layer in layers["layers"]]
    assert sorted(names[names.index(["tuner.runtime"]) - 1]) == ["tuner.daemon", "tuner.kube"]


def test_the_ground_floor_is_the_bottom_layer_and_the_launcher_stands_on_it() -> None:
    """``tuner.portable`` (issue 29): below ``tuner.errors``, forbidden the rest of the tuner and every module
    outside the standard library; the launcher imports it and nothing else of the tuner."""
    (layers,) = [c for c in contracts() if c["type"] == "layers"]
    assert layers["layers"][-2:] == ["tuner.errors", "tuner.portable"]
    forbidden = {(tuple(c["source_modules"]), tuple(c["forbidden_modules"])) for c in contracts() if c["type"] == "forbidden"}
    assert {(("tuner.portable",), ("tuner.*",)), (("tuner.portable",), ("*",)),
            (("tuner.launcher",), ("tuner.*",)), (("tuner.launcher",), ("*",))} <= forbidden
    launcher_ignores = {i for c in contracts() if c["type"] == "forbidden" and c["source_modules"] == ["tuner.launcher"]
                        for i in c.get("ignore_imports", []) if "tuner." in i.split("->")[1]}
    assert launcher_ignores == {"tuner.launcher.** -> tuner.launcher.**", "tuner.launcher.** -> tuner.portable.**"}


def _grep(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    hits = []
    for p in TUNER.rglob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if rx.search(code) and not code.lstrip().startswith(('"', "'")) and "``" not in code:
                hits.append(f"{p.relative_to(ROOT)}:{i}")
    return hits


def test_one_decision_path() -> None:
    """The planner, the engine signals and the GPU signals are called by the step alone (the rollout's
    verification computes the signals of its own window after a change)."""
    assert [h.split(":")[0] for h in _grep(r"\bplanner\.plan\(")] == ["tuner/planning/stepping.py"]
    assert sorted({h.split(":")[0] for h in _grep(r"\bengine_signals\.compute\(")}) == [
        "tuner/planning/stepping.py", "tuner/runtime/verifying.py"]
    assert {h.split(":")[0] for h in _grep(r"\bgpu_signals\.compute\(")} == {"tuner/planning/stepping.py"}
    assert not _grep(r"def timeline\(")


def test_one_engine_client() -> None:
    """Only tuner/sources speaks HTTP as a client (the http drainer talks to a load balancer, not an engine;
    tuner/kube/api.py talks to the Kubernetes API server, through lightkube; `vllm-tuner status` reads the
    running tuner's own /status, tuner/cli/operating.py)."""
    users = {h.split(":")[0] for h in _grep(r"^\s*(import httpx|from httpx|import httpcore|import urllib\.request)")}
    assert users <= {"tuner/sources/engines.py", "tuner/sources/scraping.py", "tuner/sources/transport.py",
                     "tuner/actuators/draining.py", "tuner/kube/api.py", "tuner/cli/operating.py"}, users


OUTSIDE = re.compile("/" + "work/|[.][.]/shared\\b|shared/(reference|gpu)")  # spelled so it does not match itself


def test_no_project_file_points_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for name in files:
        path = ROOT / name
        if path.is_symlink() or not path.is_file() or path.suffix in (".prom", ".whl"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line) and name != "tests/unit/test_architecture.py":
                bad.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", ["rules/default.yaml"])
def test_the_checkout_paths_users_read_lead_to_the_shipped_files(path: str) -> None:
    assert (ROOT / path).resolve() == (TUNER / "data" / "rules" / "default.yaml").resolve()


def _imports(path: Path) -> set[str]:
    """The top-level packages a module imports (``import a.b`` and ``from a.b import c`` give ``a``)."""
    found = set()
    for line in path.read_text().splitlines():
        m = re.match(r"\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", line)
        if m:
            found.add((m.group(1) or m.group(2)).split(".")[0])
    return found


@pytest.mark.parametrize("package", ["harness", "bench", "tests"])
def test_the_shared_harness_is_the_only_bridge_between_tests_and_benchmarks(package: str) -> None:
    """harness/ imports neither tests/ nor bench/; bench/ never imports tests/; tests/ imports bench/ only
    in the tests of bench's own modules (never for support code), so one side cannot break the other."""
    forbidden = {"harness": {"tests", "bench"}, "bench": {"tests"}, "tests": {"bench"}}[package]
    # the tests of bench's own modules, and the benchmark that runs the fuzz tests with a long profile
    tests_of_bench = {"test_evaluation_harness.py", "test_evaluation.py", "fuzz_long.py", "test_family.py",
                      "test_phases.py", "test_cycle_cost.py"}
    bad = [str(p.relative_to(ROOT)) for p in sorted((ROOT / package).rglob("*.py"))
           if _imports(p) & forbidden and p.name not in tests_of_bench]
    assert not bad, f"{package}/ imports {sorted(forbidden)} in {bad}: move what both need into harness/"


def test_every_version_is_the_changelogs_last_release():
    """One release train: the package, the plugin, the chart, its appVersion (the image tag the agent
    runs) and the Helm plugin carry the version of CHANGELOG.md's newest release (0.3.0 shipped as
    0.1.0 everywhere but the chart, so ``vllm-tuner --version`` said 0.1.0)."""
    import yaml

    import tuner
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases, "CHANGELOG.md names no release"
    chart = yaml.safe_load((ROOT / "deploy/helm/vllm-tuner/Chart.yaml").read_text())
    plugin_init = (ROOT / "plugin/src/vllm_tuner_plugin/__init__.py").read_text()
    found = {
        "pyproject.toml": tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"],
        "tuner.__version__": tuner.__version__,
        "plugin/pyproject.toml": tomllib.loads((ROOT / "plugin/pyproject.toml").read_text())["project"]["version"],
        "vllm_tuner_plugin.__version__": re.search(r'^__version__ = "(.+)"$', plugin_init, re.M).group(1),
        "Chart.yaml version": str(chart["version"]),
        "Chart.yaml appVersion": str(chart["appVersion"]),
        "helm plugin.yaml": str(yaml.safe_load(
            (ROOT / "deploy/helm/plugins/vllm-tuner-inject/plugin.yaml").read_text())["version"]),
    }
    assert found == dict.fromkeys(found, releases[0])


def test_no_module_of_the_tuner_is_over_600_lines() -> None:
    """A module that outgrows one job is split by job (issue 29): the longest were the leader's injector (878
    lines), the knob table (650) and the launcher (632)."""
    root = Path(__file__).resolve().parents[2] / "tuner"
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long
