"""Logging: text lines by default, one JSON object per line with ``daemon.json_logs``. Every line goes
out through the configuration's ``redactor`` (``redact``): a secret it holds never reaches the log,
whatever module wrote the message (an engine's log line, an error's text, an argv)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from typing import Any

from tuner.model import secrets


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record; a cycle's record carries ``views.record`` under ``cycle``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        cycle = getattr(record, "tuner_cycle", None)
        if cycle is not None:
            out["cycle"] = cycle
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class RedactingFormatter(logging.Formatter):
    """Another formatter's line with every secret masked (tracebacks and JSON records included)."""

    def __init__(self, inner: logging.Formatter, redactor: secrets.Redactor) -> None:
        super().__init__()
        self.inner, self.redactor = inner, redactor

    def format(self, record: logging.LogRecord) -> str:
        return self.redactor.text(self.inner.format(record))


def redact(redactor: secrets.Redactor) -> None:
    """Mask what ``redactor`` knows in every line of the root logger's handlers (call after ``configure``)."""
    for handler in logging.getLogger().handlers:
        inner = handler.formatter or logging.Formatter()
        if isinstance(inner, RedactingFormatter):
            inner = inner.inner
        handler.setFormatter(RedactingFormatter(inner, redactor))


def configure(*, json_logs: bool, level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter(JsonLogFormatter() if json_logs else
                                            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"),
                                            secrets.DEFAULT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("VLLM_TUNER_LOG_LEVEL", level))
    for chatty in ("httpx", "httpcore", "apscheduler"):  # one line per cycle is ours to say
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # "skipped: maximum number of running instances" is how a long rollout looks to APScheduler
    logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
