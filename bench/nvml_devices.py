#!/usr/bin/env python3
"""Which device nodes NVML opens while the tuner reads a GPU — the evidence for the systemd unit's
``DeviceAllow=`` lines (deploy/systemd/vllm-tuner.service.d/nvml.conf).

    python3 -m bench.nvml_devices [OUT.json]

Drives ``tuner.sources.nvml.NvmlSource`` (the reader the daemon uses) and lists, after ``nvmlInit`` and
again after a full reading of every GPU, the process's open files and memory mappings under ``/dev``
with their device numbers, next to ``/proc/devices``' names for those majors. Needs only pynvml.
Read-only: it reads, it changes no GPU setting.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from tuner.sources.nvml import NvmlSource


def char_majors() -> dict[int, str]:
    """``/proc/devices``' character-device section: major -> driver name (what DeviceAllow=char-NAME means)."""
    out: dict[int, str] = {}
    section = ""
    for line in Path("/proc/devices").read_text().splitlines():
        if line.endswith(":"):
            section = line
        elif section.startswith("Character") and line.strip():
            major, name = line.split(None, 1)
            out[int(major)] = name.strip()
    return out


def node(path: str, majors: dict[int, str]) -> dict[str, Any]:
    st = os.stat(path)
    kind = "char" if stat.S_ISCHR(st.st_mode) else "block" if stat.S_ISBLK(st.st_mode) else "other"
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    return {"path": path, "kind": kind, "major": major, "minor": minor, "driver": majors.get(major)}


def opened(majors: dict[int, str]) -> dict[str, Any]:
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/"):
            fds.add(target)
    maps = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/dev/"):
            maps.add(parts[5].strip())
    return {"open": [node(p, majors) for p in sorted(fds)], "mapped": [node(p, majors) for p in sorted(maps)]}


def main() -> int:
    majors = char_majors()
    present = sorted(str(p) for p in Path("/dev").glob("nvidia*"))
    present += sorted(str(p) for p in Path("/dev/nvidia-caps").glob("*")) if Path("/dev/nvidia-caps").is_dir() else []
    source = NvmlSource()
    import pynvml  # after NvmlSource, which imports it the same way

    baseline = opened(majors)
    pynvml.nvmlInit()
    after_init = opened(majors)
    driver = pynvml.nvmlSystemGetDriverVersion()
    readings = source.read()
    after_read = opened(majors)
    source.close()
    pynvml.nvmlShutdown()
    report = {
        "driver": driver,
        "present": [node(p, majors) for p in present if os.path.exists(p)],
        "nvidia_majors": {m: n for m, n in majors.items() if "nvidia" in n},
        "before_init": baseline, "after_init": after_init, "after_reading": after_read,
        "gpus_read": len(readings), "readings_ok": [r.error is None for r in readings],
        "names": [r.name for r in readings],
        "unread_fields": [sorted(k for k, v in dataclasses.asdict(r).items() if v is None) for r in readings],
    }
    text = json.dumps(report, indent=1, default=str)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
