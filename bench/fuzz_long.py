"""The fuzz suite (tests/fuzz) with its long profile: 25× the CI cases. Prints how many cases each
group tried, how many tests failed (Hypothesis stops a test at its first failure and shrinks it), and
the time taken. Exits 1 if any test failed. ``--profile ci`` counts what `make test` runs.

    python -m bench.fuzz_long [--profile long|ci] [-k SUBSTRING]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", choices=["long", "ci"], default="long")
    ap.add_argument("-k", default="", help="run only tests whose name contains this")
    args = ap.parse_args()
    os.environ["VLLM_TUNER_FUZZ"] = args.profile  # read when tests.fuzz.support is imported
    from tests.fuzz import (
        support,
        test_fuzz_config,
        test_fuzz_exposition,
        test_fuzz_readers,
        test_fuzz_signals,
    )

    modules = (test_fuzz_exposition, test_fuzz_signals, test_fuzz_config, test_fuzz_readers)
    failures: list[tuple[str, str]] = []
    t0 = time.monotonic()
    for module in modules:
        for name in sorted(n for n in dir(module) if n.startswith("test_") and args.k in n):
            started = time.monotonic()
            try:
                getattr(module, name)()
                outcome = "ok"
            except Exception as exc:  # a failing property: report it and go on with the others
                failures.append((name, "".join(traceback.format_exception_only(exc)).strip()))
                outcome = "FAILED"
            print(f"{module.__name__.rsplit('.', 1)[-1]}::{name}: {outcome} ({time.monotonic() - started:.0f} s)",
                  flush=True)
    total = sum(support.CASES.values())
    print(f"\nprofile {support.PROFILE}: {total} cases in {time.monotonic() - t0:.0f} s, "
          f"{len(failures)} failing test(s)")
    for group, n in sorted(support.CASES.items()):
        print(f"  {n:>8}  {group}")
    for name, what in failures:
        print(f"FAILED {name}: {what}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
