"""Logging: text lines by default, one JSON object per line with ``daemon.json_logs``."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from typing import Any


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


def configure(*, json_logs: bool, level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if json_logs else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("VLLM_TUNER_LOG_LEVEL", level))
    for chatty in ("httpx", "httpcore", "apscheduler"):  # one line per cycle is ours to say
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # "skipped: maximum number of running instances" is how a long rollout looks to APScheduler
    logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
