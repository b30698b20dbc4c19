"""Structured logs: REDBATCH_LOG_FORMAT=json gives one object per line, batch fields lifted."""

from __future__ import annotations

import json
import logging

import pytest

from redbatch.errors import ConfigError
from redbatch.logs import FORMAT, JsonFormatter, TextFormatter, setup_logging


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


HOSTILE = ['x" level="CRITICAL', "x level=CRITICAL n=999", "a\nFAKE 2024-01-01 CRITICAL root ok",
           "x\\\" msg=\\\"", "x\u2028y"]


def _batch_record(name: str) -> logging.LogRecord:
    return logging.LogRecord("redbatch.worker", logging.INFO, __file__, 1,
                             "model=%s n=%d wait_ms=%.1f", (name, 7, 3.25), None)


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_value_forges_no_json_field(name: str) -> None:
    text = JsonFormatter().format(_batch_record(name))
    line = json.loads(text)
    assert len(text.splitlines()) == 1
    assert line["level"] == "INFO" and line["model"] == name and line["n"] == 7
    assert set(line) == {"ts", "level", "logger", "pid", "msg", "model", "n", "wait_ms"}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_value_is_quoted_in_text(name: str) -> None:
    text = TextFormatter(FORMAT).format(_batch_record(name))
    assert len(text.splitlines()) == 1
    assert f"model={json.dumps(name)} n=7 wait_ms=3.2" in text
    assert text.count(" INFO ") == 1 and "CRITICAL" not in text.split(" model=")[0]


def test_values_outside_pairs_keep_their_spaces_but_not_their_newlines() -> None:
    record = logging.LogRecord("redbatch.api", logging.ERROR, __file__, 1,
                               "unexpected error on POST %s (request id %s)",
                               ("/v1/models/a b/predict", "r\nx"), None)
    text = TextFormatter(FORMAT).format(record)
    assert text.endswith('unexpected error on POST /v1/models/a b/predict (request id "r\\nx")')
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "model=mlp n=%d 100%% done",
                              (3,), None)
    assert TextFormatter(FORMAT).format(plain).endswith("model=mlp n=3 100% done")


def _ghost_record() -> logging.LogRecord:
    ghost = b"\xff\xfe-ghost".decode(errors="surrogateescape")  # a foreign id, as read
    return logging.LogRecord("redbatch.worker", logging.WARNING, __file__, 1,
                             "model=%s reaped worker %s: requeued %d, worker=%s",
                             ("echo", ghost, 1, ghost), None)


def test_a_value_that_is_not_utf8_is_escaped_in_text() -> None:
    text = TextFormatter(FORMAT).format(_ghost_record())
    text.encode()  # valid UTF-8: a strict stream writes it
    assert r"reaped worker \xff\xfe-ghost: requeued 1" in text
    assert text.endswith(r'worker="\\xff\\xfe-ghost"')  # a keyed backslash is quoted


def test_a_value_that_is_not_utf8_is_escaped_in_json() -> None:
    line = json.loads(JsonFormatter().format(_ghost_record()))
    assert r"reaped worker \xff\xfe-ghost: requeued 1" in line["msg"]
    assert line["worker"] == r"\xff\xfe-ghost" and line["model"] == "echo"


def test_an_exception_that_is_not_utf8_is_escaped() -> None:
    ghost = b"\xff-key".decode(errors="surrogateescape")
    try:
        raise RuntimeError(f"WRONGTYPE {ghost}")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (),
                                   exc_info=__import__("sys").exc_info())
    assert r"WRONGTYPE \xff-key" in json.loads(JsonFormatter().format(record))["exc"]
    text = TextFormatter(FORMAT).format(record)
    text.encode()
    assert r"WRONGTYPE \xff-key" in text
