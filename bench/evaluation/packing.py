"""A results directory → a compact copy to commit (tests/fixtures/evaluation/<profile>/).

Keeps what ``--report-only`` reads and what a reader wants to audit: the trace, run.json, every arm's
meta.json, its requests and samples (gzip'd), and for tuner arms the composed config, the journal, the
state and the cycle log (gzip'd); the rendered report, summary.json and plots. Leaves out the engines' own
logs and the harness's control directories. Paths inside this checkout are written relative to it (the
journal's argv, the composed config, the cycle log), so the copy names nothing outside the repository.
Standard library only.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ("run.json", "report.md", "summary.json")
GZIP = ("trace.json",)
ARM_PLAIN = ("meta.json", "tuner-settings.yaml", "tuner/config.yaml", "tuner/journal.jsonl", "tuner/state.json")
ARM_GZIP = ("requests.jsonl", "samples.jsonl", "gpu.jsonl", "tuner/tuner.log")


def pack(results: Path, dest: Path) -> list[Path]:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    written = []
    for name in PLAIN:
        if (results / name).exists():
            written.append(_copy(results / name, dest / name))
    for name in GZIP:
        if (results / name).exists():
            written.append(_gzip(results / name, dest / (name + ".gz")))
    if (results / "plots").is_dir():
        shutil.copytree(results / "plots", dest / "plots")
        written += sorted((dest / "plots").iterdir())
    for arm in sorted((results / "arms").iterdir()):
        if not (arm / "meta.json").exists():
            continue
        out = dest / "arms" / arm.name
        for name in ARM_PLAIN:
            if (arm / name).exists():
                written.append(_copy(arm / name, out / name))
        for name in ARM_GZIP:
            if (arm / name).exists():
                written.append(_gzip(arm / name, out / (name + ".gz")))
    return written


def portable(data: bytes) -> bytes:
    """Paths inside this checkout made relative to it."""
    root = str(ROOT).encode()
    return data.replace(root + b"/", b"").replace(root, b".")


def _copy(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(portable(source.read_bytes()))
    return target


def _gzip(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 and no file name: the same data gives the same bytes (no churn in git)
    with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        gz.write(portable(source.read_bytes()))
    return target
