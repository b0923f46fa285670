"""deploy/image/requirements.txt, the agent image's pinned wheels, against pyproject.toml: every
distribution the tuner needs at run time (its dependencies, theirs, with the extras they ask for, on
Linux x86_64 under CPython 3.11: the image's Debian bookworm Python) is pinned exactly once, at a version
every requirement on it accepts, with one sha256 per pin; nothing else is pinned. The image's build
runs ``pip install --require-hashes`` and ``pip check`` on these (tests/e2e/test_image.py); this catches
a lock that has fallen behind pyproject.toml before that slow test does."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "deploy" / "image" / "requirements.txt"
IMAGE_PYTHON = {"python_version": "3.11", "python_full_version": "3.11.2", "sys_platform": "linux",
                "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, tuple[Version, list[str]]]:
    text = LOCK.read_text().replace("\\\n", " ")
    out: dict[str, tuple[Version, list[str]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        spec, *hashes = line.split()
        name, _, version = spec.partition("==")
        assert version, f"{spec}: every line pins one version (NAME==VERSION)"
        assert canonical(name) not in out, f"{name} is pinned twice"
        out[canonical(name)] = (Version(version), [h.removeprefix("--hash=sha256:") for h in hashes])
    return out


def closure() -> dict[str, list[Requirement]]:
    """Each distribution the tuner needs at run time → the requirements on it (from the installed metadata)."""
    needed: dict[str, list[Requirement]] = {}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    todo = [(Requirement(r), "") for r in pyproject["project"]["dependencies"]]
    seen: set[tuple[str, str]] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**IMAGE_PYTHON, "extra": extra}):
            continue
        name = canonical(req.name)
        needed.setdefault(name, []).append(req)
        for want in ["", *sorted(req.extras)]:
            if (name, want) in seen:
                continue
            seen.add((name, want))
            todo.extend((Requirement(r), want) for r in md.requires(req.name) or [])
    return needed


def test_the_lock_pins_exactly_what_the_tuner_needs_at_run_time() -> None:
    locked, needed = pins(), closure()
    assert sorted(set(needed) - set(locked)) == [], "needed at run time but not pinned in the image's lock"
    assert sorted(set(locked) - set(needed)) == [], "pinned in the image's lock but needed by nothing"
    for name, reqs in needed.items():
        version = locked[name][0]
        refused = [str(r) for r in reqs if not r.specifier.contains(version, prereleases=True)]
        assert not refused, f"{name}=={version} does not satisfy {refused}"


def test_every_pin_has_one_sha256() -> None:
    for name, (_, hashes) in pins().items():
        assert len(hashes) == 1 and re.fullmatch(r"[0-9a-f]{64}", hashes[0]), f"{name}: {hashes}"
