"""Logging set-up shared by every redbatch process.

Text by default; ``REDBATCH_LOG_FORMAT=json`` writes one JSON object per line (for Loki,
Elasticsearch, CloudWatch...) with ``ts``, ``level``, ``logger``, ``pid``, ``msg``, and,
for the batch line and other ``key=value`` messages, those pairs as fields too
(``model``, ``n``, ``wait_ms``, ``fwd_ms``, ``request_ids``...).
"""

from __future__ import annotations

import logging
import os
import re

import orjson

from redbatch.errors import ConfigError

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"
PAIR = re.compile(r"\b([a-z_]+)=(\S+)")
RESERVED = frozenset({"ts", "level", "logger", "pid", "msg", "exc"})
TEXT_KEYS = frozenset({"model", "request_ids"})  # names and ids: text even when numeric
NUMBER = re.compile(r"-?\d+(\.\d+)?")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the message's ``key=value`` pairs lifted out."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, object] = {"ts": round(record.created, 6), "level": record.levelname,
                                  "logger": record.name, "pid": record.process, "msg": message}
        for key, value in PAIR.findall(message):
            if key not in RESERVED:
                out[key] = value if key in TEXT_KEYS else _number(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


def _number(text: str) -> object:
    """A plain decimal as a number; anything else (a model named ``1e3`` or ``nan``
    among them) stays text."""
    if NUMBER.fullmatch(text) is None:
        return text
    return float(text) if "." in text else int(text)


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    level = (level or os.environ.get("REDBATCH_LOG_LEVEL") or "INFO").upper()
    fmt = (fmt or os.environ.get("REDBATCH_LOG_FORMAT") or "text").lower()
    if fmt not in {"text", "json"}:
        raise ConfigError(f"REDBATCH_LOG_FORMAT must be text or json, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
