"""The install path a new user takes: ``python -m build`` makes a wheel and an sdist of both distributions
(the tuner, ``vllm-tuner-sidecar``, and the engine-side plugin, ``vllm-tuner-plugin``), and ``pip install``
of either the wheel or the source tree into a NEW virtualenv gives the ``vllm-tuner`` command.

Offline: the build runs without isolation (the build backend is the dev venv's), pip installs with
``--no-index --no-deps``, and the new venv finds the tuner's dependencies through a ``.pth`` line naming the
dev venv's site-packages (a plain path: the dev venv's own editable install of the tuner is not loaded
from there, which the test checks). The tree built is a copy of the files git knows, as a fresh clone
would have them.

``pipx install .`` is the one exception, online as a user runs it: pipx is not a dependency of the tuner
nor of its tests, so the test installs it (``PIPX``, pinned) into a virtualenv of its own, and pipx builds
the tree in isolation and resolves the tuner's dependencies from the package index, as it does on a
user's machine (``make test`` needs the network anyway, for vLLM). Every path pipx writes (``PIPX_HOME``,
``PIPX_BIN_DIR``, ``PIPX_MAN_DIR``, ``HOME``) is under the test's temporary directory.
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
PIPX = "pipx==1.18.4"  # the latest when this test was written (2026-12); any pipx ≥ 1.0 installs the same way


def run(*cmd: str | Path, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """A command, outside the source tree unless ``cwd`` says otherwise (``python -c`` puts its working
    directory first on sys.path: the checkout's ``tuner`` would shadow the installed one); ``env`` is added
    to this process's environment, less its Python, pip and virtualenv variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "PIPX_"))}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd or tempfile.gettempdir(), capture_output=True, text=True, timeout=timeout,
                          env={**base, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **(env or {})})
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


def test_pipx_install_dot_puts_the_command_in_pipx_bin_dir(clone: Path, tmp_path: Path) -> None:
    """README's ``pipx install .``, from a fresh clone's files, with pipx's own defaults (an isolated build,
    the dependencies from the index) and every pipx path under ``tmp_path``."""
    tools = tmp_path / "tools"
    venv.EnvBuilder(with_pip=True, symlinks=True).create(tools)
    run(tools / "bin" / "pip", "install", "-q", PIPX, timeout=600)
    home, bin_dir = tmp_path / "home", tmp_path / "pipx-bin"
    home.mkdir()
    env = {"HOME": str(home), "PIPX_HOME": str(tmp_path / "pipx-home"), "PIPX_BIN_DIR": str(bin_dir),
           "PIPX_MAN_DIR": str(tmp_path / "pipx-man"), "XDG_DATA_HOME": str(home / ".local" / "share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local" / "state"),
           "USE_EMOJI": "0"}
    run(tools / "bin" / "pipx", "install", ".", cwd=clone, env=env, timeout=900)
    command = bin_dir / "vllm-tuner"
    assert command.exists(), sorted(p.name for p in bin_dir.iterdir()) if bin_dir.exists() else "no PIPX_BIN_DIR"
    assert run(command, "--version", env=env).strip() == f"vllm-tuner {__version__}"
    listed = run(tools / "bin" / "pipx", "list", "--short", env=env)
    assert f"{DIST} {__version__}" in listed.splitlines(), listed
    where = run(tmp_path / "pipx-home" / "venvs" / DIST / "bin" / "python", "-c", "import tuner; print(tuner.__file__)")
    assert where.strip().startswith(str(tmp_path / "pipx-home")), where  # pipx's venv, not the dev checkout
    out = run(command, "replay", clone / "examples" / "vllm" / "queue-bound", cwd=tmp_path, env=env)
    assert out.startswith(f"replay {clone / 'examples' / 'vllm' / 'queue-bound'} (vllm): 12 snapshots"), out
    assert not list(home.glob(".local/bin/*")), "pipx wrote outside PIPX_BIN_DIR"


def test_the_plugin_builds_and_installs_as_vllm_tuner_plugin(clone: Path, tmp_path: Path) -> None:
    wheel, _ = built(clone, clone / "plugin", tmp_path / "dist")
    assert wheel.name.startswith("vllm_tuner_plugin-"), wheel.name
    bin_dir = new_venv(tmp_path / "venv")
    run(bin_dir / "pip", "install", "-q", "--no-index", "--no-deps", wheel)
    found = run(bin_dir / "python", "-c", "import importlib.metadata as m; "
                                          "print([e.value for e in m.entry_points(group='vllm.general_plugins') "
                                          "if e.dist.name == 'vllm-tuner-plugin'])")
    assert found.strip() == "['vllm_tuner_plugin:register']", found
