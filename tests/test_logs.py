"""Structured logs: REDBATCH_LOG_FORMAT=json gives one object per line, batch fields lifted."""

from __future__ import annotations

import json
import logging

import pytest

from redbatch.errors import ConfigError
from redbatch.logs import JsonFormatter, setup_logging


def test_the_batch_line_becomes_fields() -> None:
    record = logging.LogRecord("redbatch.worker", logging.INFO, __file__, 1,
                               "model=%s n=%d wait_ms=%.1f fwd_ms=%.2f", ("mlp", 7, 3.25, 1.5),
                               None)
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "model=mlp n=7 wait_ms=3.2 fwd_ms=1.50"
    assert (line["model"], line["n"], line["fwd_ms"]) == ("mlp", 7, 1.5)
    assert line["level"] == "INFO" and line["logger"] == "redbatch.worker"


@pytest.mark.parametrize("name", ["123", "1e3", "nan", "inf"])
def test_a_model_name_stays_text(name: str) -> None:
    record = logging.LogRecord("redbatch.worker", logging.INFO, __file__, 1,
                               "model=%s n=%d tag=%s", (name, 2, name), None)
    line = json.loads(JsonFormatter().format(record))
    assert (line["model"], line["n"]) == (name, 2)
    assert line["tag"] == (123 if name == "123" else name)  # only plain decimals turn numbers


def test_exceptions_are_one_field() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (),
                                   exc_info=__import__("sys").exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert "RuntimeError: boom" in line["exc"] and "\n" not in JsonFormatter().format(record)


def test_a_bad_format_fails_loudly() -> None:
    with pytest.raises(ConfigError, match="REDBATCH_LOG_FORMAT"):
        setup_logging("INFO", "xml")
