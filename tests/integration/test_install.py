"""The install path a new user takes: ``python -m build`` makes a wheel and an sdist of both distributions
(the tuner, ``vllm-tuner-sidecar``, and the engine-side plugin, ``vllm-tuner-plugin``), and ``pip install``
of either the wheel or the source tree into a NEW virtualenv gives the ``vllm-tuner`` command.

Offline: the build runs without isolation (the build backend is the dev venv's), pip installs with
``--no-index --no-deps``, and the new venv finds the tuner's dependencies through a ``.pth`` line naming the
dev venv's site-packages (a plain path: the dev venv's own editable install of the tuner is not loaded
from there, which the test checks). The tree built is a copy of the files git knows, as a fresh clone
would have them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

import pytest

from tuner import __version__

ROOT = Path(__file__).resolve().parents[2]
DIST = "vllm-tuner-sidecar"


def run(*cmd: str | Path, cwd: Path | None = None, timeout: float = 300) -> str:
    """A command, outside the source tree unless ``cwd`` says otherwise (``python -c`` puts its working
    directory first on sys.path: the checkout's ``tuner`` would shadow the installed one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd or tempfile.gettempdir(), capture_output=True, text=True, timeout=timeout,
                          env={**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files git knows (tracked, and new ones not ignored), copied as a fresh clone has them."""
    out = tmp_path_factory.mktemp("clone")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / rel)
    return out


def new_venv(where: Path) -> Path:
    """A new venv (pip included) that sees the dev venv's packages after its own, as a plain path."""
    venv.EnvBuilder(with_pip=True, symlinks=True).create(where)
    purelib = Path(subprocess.run([where / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                   "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "zz-dev-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where / "bin"


def built(clone: Path, project: Path, out: Path) -> tuple[Path, Path]:
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, project, cwd=clone)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return wheels[0], sdists[0]


def test_the_wheel_and_sdist_build_and_install_the_command(clone: Path, tmp_path: Path) -> None:
    wheel, sdist = built(clone, clone, tmp_path / "dist")
    assert wheel.name == f"vllm_tuner_sidecar-{__version__}-py3-none-any.whl"
    assert sdist.name == f"vllm_tuner_sidecar-{__version__}.tar.gz" or sdist.name == f"{DIST}-{__version__}.tar.gz"
    shipped = run(sys.executable, "-m", "zipfile", "-l", wheel)
    assert "tuner/data/rules/default.yaml" in shipped  # the default rule set travels in the wheel

    bin_dir = new_venv(tmp_path / "venv")
    run(bin_dir / "pip", "install", "-q", "--no-index", "--no-deps", wheel)
    assert run(bin_dir / "vllm-tuner", "--version").strip() == f"vllm-tuner {__version__}"
    where = run(bin_dir / "python", "-c", "import tuner, importlib.metadata as m; "
                                          f"print(tuner.__file__); print(m.version({DIST!r}))")
    assert where.split()[0].startswith(str(tmp_path / "venv")), where  # the wheel's tuner, not the dev checkout's
    assert where.split()[1] == __version__
    # the installed command does its job on a shipped example, away from the source tree
    out = run(bin_dir / "vllm-tuner", "replay", clone / "examples" / "vllm" / "queue-bound", cwd=tmp_path)
    assert out.startswith(f"replay {clone / 'examples' / 'vllm' / 'queue-bound'} (vllm): 12 snapshots"), out


def test_pip_install_dot_from_the_source_tree(clone: Path, tmp_path: Path) -> None:
    bin_dir = new_venv(tmp_path / "venv")
    run(bin_dir / "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", ".", cwd=clone)
    assert run(bin_dir / "vllm-tuner", "--version").strip() == f"vllm-tuner {__version__}"


def test_the_plugin_builds_and_installs_as_vllm_tuner_plugin(clone: Path, tmp_path: Path) -> None:
    wheel, _ = built(clone, clone / "plugin", tmp_path / "dist")
    assert wheel.name.startswith("vllm_tuner_plugin-"), wheel.name
    bin_dir = new_venv(tmp_path / "venv")
    run(bin_dir / "pip", "install", "-q", "--no-index", "--no-deps", wheel)
    found = run(bin_dir / "python", "-c", "import importlib.metadata as m; "
                                          "print([e.value for e in m.entry_points(group='vllm.general_plugins') "
                                          "if e.dist.name == 'vllm-tuner-plugin'])")
    assert found.strip() == "['vllm_tuner_plugin:register']", found
