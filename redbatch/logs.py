"""Logging set-up shared by every redbatch process.

Text by default; ``REDBATCH_LOG_FORMAT=json`` writes one JSON object per line (for Loki,
Elasticsearch, CloudWatch...) with ``ts``, ``level``, ``logger``, ``pid``, ``msg``, and,
for the batch line and other ``key=%s`` messages, those pairs as fields too
(``model``, ``n``, ``wait_ms``, ``fwd_ms``, ``request_ids``...).

Values can come from clients (a model name or path from a URL, an error's text), so
neither format lets them forge a field or a line: a value in ``key=`` position that
holds a space, ``=``, a quote, a backslash or a control character is written as a
JSON string (``model="x\\" level=\\"CRITICAL"``), any other value holding a control
character too; JSON fields are lifted from the message's template, never from what
its values say.  A value read from Redis that is not UTF-8 (a foreign worker's id, kept
with ``surrogateescape``) is written with its bytes escaped (``\\xff``), so that every
line stays valid UTF-8 for the stream and for JSON.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from typing import Any

import orjson

from redbatch import defaults
from redbatch.errors import ConfigError

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"
RESERVED = frozenset({"ts", "level", "logger", "pid", "msg", "exc"})
TEXT_KEYS = frozenset({"model", "request_ids"})  # names and ids: text even when numeric
NUMBER = re.compile(r"-?\d+(\.\d+)?")
# a %-conversion of a template, and the key=... right before it
CONVERSION = re.compile(r"%[#0 +-]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa%]")
KEY_BEFORE = re.compile(r"\b([a-z_]+)=$")
UNSAFE_VALUE = re.compile(r"[\s=\"'\\\x00-\x1f\x7f-\x9f\u2028\u2029]")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
LINE_BREAKS = re.compile("[\x85\u2028\u2029]")  # valid in JSON, yet lines to splitlines()
SURROGATES = re.compile("[\ud800-\udfff]")  # not UTF-8: a byte kept by surrogateescape


def _slots(template: str, count: int) -> list[tuple[str | None, str]] | None:
    """Each argument's conversion (``%s``, ``%.1f``...) and the key it stands for, if
    any; None when the template and the arguments do not line up."""
    slots: list[tuple[str | None, str]] = []
    for match in CONVERSION.finditer(template):
        if match.group() == "%%":
            continue
        key = KEY_BEFORE.search(template, 0, match.start())
        slots.append((key.group(1) if key else None, match.group()))
    return slots if len(slots) == count else None


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def utf8(text: str) -> str:
    """``text`` with its lone surrogates escaped: an undecodable byte as ``\\xNN``
    (``surrogateescape``'s), any other surrogate as ``\\uXXXX``."""
    return SURROGATES.sub(_escaped, text)


def _quoted(value: str, keyed: bool) -> str:
    unsafe = UNSAFE_VALUE if keyed else CONTROL
    return json.dumps(value) if unsafe.search(value) else value


def _render(record: logging.LogRecord) -> tuple[str, dict[str, str]]:
    """The message with unsafe values quoted, and its ``key=`` values (as text)."""
    template, args = record.msg, record.args
    if not isinstance(template, str) or not isinstance(args, tuple) or not args:
        return _quoted(utf8(record.getMessage()), keyed=False), {}
    slots = _slots(template, len(args))
    if slots is None:
        return _quoted(utf8(record.getMessage()), keyed=False), {}
    try:
        texts = [utf8(conversion % (arg,))
                 for (_, conversion), arg in zip(slots, args, strict=True)]
    except (TypeError, ValueError):  # logging reports the bad call as usual
        return _quoted(utf8(record.getMessage()), keyed=False), {}
    pairs = {key: text for (key, _), text in zip(slots, texts, strict=True) if key}
    safe = iter([_quoted(text, key is not None) for (key, _), text in
                 zip(slots, texts, strict=True)])
    return CONVERSION.sub(lambda m: "%" if m.group() == "%%" else next(safe), template), pairs


class TextFormatter(logging.Formatter):
    """``FORMAT``, with client-supplied values quoted (see the module's docstring)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        safe = copy.copy(record)
        safe.message = _render(record)[0]
        return super().formatMessage(safe)

    def formatException(self, ei: Any) -> str:
        return utf8(super().formatException(ei))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the template's ``key=`` values lifted out."""

    def format(self, record: logging.LogRecord) -> str:
        message, pairs = _render(record)
        out: dict[str, object] = {"ts": round(record.created, 6), "level": record.levelname,
                                  "logger": record.name, "pid": record.process, "msg": message}
        for key, value in pairs.items():
            if key not in RESERVED:
                out[key] = value if key in TEXT_KEYS else _number(value)
        if record.exc_info:
            out["exc"] = utf8(self.formatException(record.exc_info))
        line = orjson.dumps(out).decode()
        return LINE_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


def _number(text: str) -> Any:
    """A plain decimal as a number; anything else (a model named ``1e3`` or ``nan``
    among them) stays text."""
    if NUMBER.fullmatch(text) is None:
        return text
    return float(text) if "." in text else int(text)


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    level = (level or os.environ.get("REDBATCH_LOG_LEVEL") or defaults.LOG_LEVEL).upper()
    fmt = (fmt or os.environ.get("REDBATCH_LOG_FORMAT") or defaults.LOG_FORMAT).lower()
    if fmt not in {"text", "json"}:
        raise ConfigError(f"REDBATCH_LOG_FORMAT must be text or json, got {fmt!r}")
    if level not in LEVELS:
        raise ConfigError(f"the log level (--log-level, REDBATCH_LOG_LEVEL) must be one of "
                          f"{', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
