"""The command line's argument checking: one ``error: …`` line and exit code 2 for a bad argument.

argparse's own message is two lines of usage and ``PROG: error: …``; ``Parser`` says it in the form every
other failure of the CLI takes (``error: …``), with where to look. The ``type=`` functions below refuse
what no command can use — a negative, zero, NaN or infinite duration, a URL that is not http(s) — when the
command line is read, before anything waits or connects.
"""

from __future__ import annotations

import argparse
import math
import sys
import urllib.parse
from collections.abc import Callable
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, with a bad command line said in one ``error:`` line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())} (`{self.prog} --help` lists the options)\n")


def _number(text: str, convert: Callable[[str], float]) -> float:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """Seconds, GiB…: a finite number above 0."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number, 0 or above (0: at once)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of 0 or above, got {text!r}")
    return value


def finite_float(text: str) -> float:
    return _number(text, float)


def at_least(low: int) -> Callable[[str], int]:
    """An integer ``low`` or above."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number of {low} or above, got {text!r}")
        return value

    check.__name__ = f"integer ≥ {low}"
    return check


def http_url(text: str) -> str:
    """An http(s) URL with a host, e.g. ``http://127.0.0.1:8000/metrics``."""
    example = "e.g. http://127.0.0.1:8000/metrics"
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port  # a port that is not a number raises here
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a URL ({exc}): {text!r}; expected http(s)://HOST[:PORT]/PATH, "
                                         f"{example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL with a host, {example}; got {text!r}")
    if port == 0:
        raise argparse.ArgumentTypeError(f"port 0 cannot be scraped: {text!r}")
    return text


def say(line: str) -> None:
    """One line on stderr (progress and hints; results go to stdout)."""
    print(line, file=sys.stderr, flush=True)
