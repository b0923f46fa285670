"""A progress line on stderr for the CLI's waits (live sampling: ``inspect`` and ``recommend --config``).

Only for waits over ``MIN_SECONDS``. On a terminal, one line rewritten in place (``\\r``) and erased when the
wait is over; otherwise (a pipe, a log, CI) one plain line when the wait begins, so that a log says why
nothing came for a while without filling up with redraws. stdout keeps only the result.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

MIN_SECONDS = 2.0


class Sampling:
    """``samples`` rounds of scrapes, ``spacing_seconds`` apart: ``wait()`` between rounds, ``close()`` after."""

    def __init__(self, what: str, *, samples: int, spacing_seconds: float, stream: TextIO | None = None) -> None:
        self.what = what
        self.samples = samples
        self.spacing_seconds = spacing_seconds
        self.stream = stream if stream is not None else sys.stderr
        self.total_seconds = max(samples - 1, 0) * spacing_seconds
        self.shown = self.total_seconds > MIN_SECONDS
        self.tty = self.shown and _is_tty(self.stream)
        self.done = 0
        if self.shown and not self.tty:
            self._write(f"{what}: {samples} scrapes {spacing_seconds:g} s apart, about {self.total_seconds:.0f} s; "
                        "the result follows\n")

    def scraped(self) -> None:
        """One round of scrapes is done."""
        self.done += 1

    def wait(self) -> None:
        """Sleep until the next round, the line on a terminal counting down."""
        end = time.monotonic() + self.spacing_seconds
        while (left := end - time.monotonic()) > 0:
            if self.tty:
                remaining = left + (self.samples - self.done - 1) * self.spacing_seconds
                self._write(f"\r{self.what}: scrape {self.done}/{self.samples} done, next in {left:4.1f} s "
                            f"(about {remaining:.0f} s left)\x1b[K")
            time.sleep(min(left, 0.5 if self.tty else left))

    def close(self) -> None:
        if self.tty:
            self._write("\r\x1b[K")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed: the progress line is not worth failing for
            pass


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
