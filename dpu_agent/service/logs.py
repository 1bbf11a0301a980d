"""Structured logging: JSON lines when systemd runs the agent (journald keeps the fields),
readable lines on a terminal; every record carries the id of the RPC it belongs to."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping

from dpu_agent.service.interceptors import RequestIdFilter

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message",
                                                                          "request_id"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, and any ``extra`` keys."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname,
               "logger": record.name, "msg": record.getMessage(),
               "request_id": getattr(record, "request_id", "-")}
        out.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def resolve_format(fmt: str, env: Mapping[str, str] | None = None) -> str:
    """'auto' is JSON under systemd (JOURNAL_STREAM or INVOCATION_ID set), else text."""
    env = os.environ if env is None else env
    if fmt != "auto":
        return fmt
    return "json" if env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID") else "text"


def configure(fmt: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(RequestIdFilter())
    if resolve_format(fmt) == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)-7s [%(request_id)s] %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
