"""The agent's image as ``make image`` builds it (deploy/image/build.sh), on a machine with no registry:
Debian bookworm's packages through mmdebstrap, ``podman import`` as the base, the tuner from wheels built
or downloaded on the host, ``podman build`` with no network. Built twice from two caches (two mmdebstrap
runs, two wheel downloads) it is the same image ID. Then the image itself: OCI labels, the agent's CLI
as its entrypoint under an arbitrary non-root UID with a read-only root, the launcher zipapp where the
agent looks for it, Debian's Python.

It needs root and nothing else: the build installs mmdebstrap and podman when they are missing
(``make test`` installs podman too). Its pod, with the agent under this image and vLLM under another
uid: tests/e2e/test_podman_pod.py."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from harness import required
from tests.support import podman as pm

# Scheduling (tests/conftest.py): its turn on the real-engine tests' worker (lower first).
ENGINE_WORKER_TURN = 60

pytestmark = pytest.mark.e2e


def test_make_image_builds_the_same_image_from_debian_packages_twice(tmp_path: Path) -> None:
    required.need(None if os.geteuid() == 0 else "the image build runs as root (mmdebstrap, podman)", "make image")
    podman = pm.Podman()
    podman.root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    cold = tmp_path / "cache"  # no root file system, no wheels: what a fresh clone starts from
    first = pm.Podman().prepare().build_image("localhost/vllm-tuner:test-cold", cache=cold)
    cold_seconds = time.monotonic() - start
    start = time.monotonic()
    second = podman.prepare().build_image("localhost/vllm-tuner:test-again")
    print(f"\nmake image: {cold_seconds:.0f} s from an empty cache, {time.monotonic() - start:.0f} s again; "
          f"image ID {first[:12]}")
    assert first == second, "the same tree built twice must give the same image ID"
    rootfs = sorted(cold.glob("rootfs-*.tar"))
    assert len(rootfs) == 1 and rootfs[0].stat().st_size > 50_000_000

    info = json.loads(podman.run("image", "inspect", first).stdout)[0]
    config, labels = info["Config"], info["Config"]["Labels"]
    assert config["User"] == "65532:0" and config["Entrypoint"] == ["vllm-tuner"]
    from tuner import __version__
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["org.opencontainers.image.title"] == "vllm-tuner"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert len(labels["org.opencontainers.image.revision"].split("-")[0]) == 40
    assert labels["org.opencontainers.image.created"].endswith("Z")
    assert "mmdebstrap" in labels["org.opencontainers.image.base.name"]
    assert info["Created"].startswith(labels["org.opencontainers.image.created"][:10]), \
        "the image's creation time is the commit's (SOURCE_DATE_EPOCH), not the build's"

    tag = "localhost/vllm-tuner:test-again"
    out = podman.run("run", "--rm", "--network", "none", "--user", "1000680000:0", "--read-only", tag, "inject",
                     "--help")
    assert "--image" in out.stdout
    out = podman.run("run", "--rm", "--network", "none", "--read-only", tag, "--version")
    assert __version__ in out.stdout + out.stderr
    out = podman.run("run", "--rm", "--network", "none", "--entrypoint", "python3", tag,
                     "/opt/vllm-tuner/launcher.pyz", "--help")
    assert "launcher.pyz" in out.stdout
    out = podman.run("run", "--rm", "--network", "none", "--entrypoint", "python3", tag, "-c",
                     "import sys, pydantic, yaml, lightkube; print(sys.executable, sys.version_info[:2], "
                     "sys.prefix)")
    assert "(3, 11)" in out.stdout and "/opt/vllm-tuner" in out.stdout
    podman.forget_images("localhost/vllm-tuner:test-cold")
    shutil.rmtree(cold, ignore_errors=True)
