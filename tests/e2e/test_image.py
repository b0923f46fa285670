"""The agent's image: ``podman build`` of the Containerfile (what ``make image`` runs), then the image
itself: the agent's CLI as its entrypoint, the launcher zipapp where the agent looks for it, a numeric
non-root user in group 0.

The Containerfile starts FROM ``python:3.12-slim``, which a machine without a registry cannot pull:
``VLLM_TUNER_IMAGE_BASE`` names a local image to build on instead (any Debian-like image with python3
>= 3.11 and its venv module; here, a debootstrap of bookworm with python3-venv, imported with ``podman
import``). The build installs the tuner's dependencies from PyPI (``--network host``): the build's own
pip must reach and trust it (on this project's machines PyPI is reached through a TLS-inspecting proxy
whose CA the base image does not carry, and the build fails there at its first download)."""

from __future__ import annotations

import os

import pytest

from harness import required
from tests.support import podman as pm

pytestmark = pytest.mark.e2e
TAG = "localhost/vllm-tuner:test"


def test_the_containerfile_builds_an_image_that_runs_the_agents_cli() -> None:
    required.need(pm.skip_reason(), "podman")
    base = os.environ.get("VLLM_TUNER_IMAGE_BASE")
    podman = pm.Podman().prepare()
    if not base or not podman.has_image(base):
        # A plain skip even under VLLM_TUNER_REQUIRE_E2E: no registry is reachable here or in CI, and building
        # a base (a debootstrap, ~270 MB, minutes) is not CI's to do. The Containerfile's text is tested
        # in tests/integration/test_deploy.py.
        pytest.skip(f"VLLM_TUNER_IMAGE_BASE ({base or 'unset'}) is not an image podman has: set it to a local base "
                    "with python3 >= 3.11 and its venv module (e.g. debootstrap --include=python3-venv bookworm, "
                    "podman import)")
    podman.run("build", "--network", "host", "-f", str(pm.REPO / "Containerfile"), "--build-arg",
               f"BASE_IMAGE={base}", "-t", TAG, str(pm.REPO), timeout=900)
    config = podman.run("image", "inspect", TAG, "--format", "{{.Config.User}} {{.Config.Entrypoint}}").stdout
    assert config.split()[0] == "65532:0" and "vllm-tuner" in config
    out = podman.run("run", "--rm", "--network", "none", "--user", "1000680000:0", "--read-only", TAG, "inject",
                     "--help")
    assert "--image" in out.stdout
    out = podman.run("run", "--rm", "--network", "none", "--entrypoint", "python3", TAG, "/opt/vllm-tuner/launcher.pyz",
                     "--help")
    assert "launcher.pyz" in out.stdout
