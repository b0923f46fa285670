"""The launcher as one file: a zipapp (``python -m zipapp`` format: a shebang line, then a zip).

The agent sidecar copies it into the pod's shared ``emptyDir``; the engine container runs
``python3 /var/run/vllm-tuner/launcher.pyz -- vllm serve ...`` with the engine image's own Python.
Inside, the package is ``vllm_tuner_launcher``, holding this package (``launcher/``) and the ground floor it
imports (``portable/``) as ``tuner/`` holds them (relative imports only), so it cannot collide with an
installed ``tuner``. The archive is reproducible: fixed timestamps, sorted names.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "vllm_tuner_launcher"
SHEBANG = b"#!/usr/bin/env python3\n"
MAIN = f"import sys\nfrom {PACKAGE}.launcher.__main__ import main\nsys.exit(main())\n"
TOP = b'"""vllm-tuner\'s in-pod launcher and its ground floor (tuner/launcher, tuner/portable), as one zipapp."""\n'
_EPOCH = (1980, 1, 1, 0, 0, 0)


def sources() -> dict[str, bytes]:
    """The archive's members: this package's modules under ``vllm_tuner_launcher/launcher/``, the
    ``portable`` package's under ``vllm_tuner_launcher/portable/``, and a ``__main__.py``."""
    here = Path(__file__).resolve().parent
    members = {f"{PACKAGE}/__init__.py": TOP, "__main__.py": MAIN.encode()}
    for package in (here, here.parent / "portable"):
        members.update({f"{PACKAGE}/{package.name}/{p.name}": p.read_bytes() for p in sorted(package.glob("*.py"))})
    return members


def build_zipapp(out: Path) -> Path:
    """Write the zipapp to ``out`` atomically (mode 0644); returns ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=str(out.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(SHEBANG)
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as z:
                for name, data in sorted(sources().items()):
                    info = zipfile.ZipInfo(name, date_time=_EPOCH)
                    info.compress_type = zipfile.ZIP_DEFLATED
                    info.external_attr = 0o644 << 16
                    z.writestr(info, data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out
