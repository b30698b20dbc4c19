"""Every error the gateway returns: a status code and a JSON body, never a traceback."""

from __future__ import annotations

import logging
import math
import time

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from redbatch import defaults, errors

log = logging.getLogger("redbatch.api")

STATUS: dict[type[errors.RedbatchError], int] = {
    errors.InvalidPayload: 422,
    errors.InvalidKnob: 422,
    errors.UnknownModel: 404,
    errors.DeadlineExceeded: 504,
    errors.QueueFull: 503,
    errors.NoLiveWorkers: 503,
    errors.RedisUnavailable: 503,
    errors.ModelError: 500,
    errors.WorkerCrashed: 502,
}


STATUS[errors.BadRequest] = 400
STATUS[errors.BodyTooLarge] = 413
STATUS[errors.UnsupportedMediaType] = 415


class ErrorResponse(JSONResponse):
    """A JSON error answer that keeps its error ``code`` (the outcome metric reads it)."""

    def __init__(self, content: object, status: int, code: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, status_code=status, headers=headers)
        self.code = code


def error_response(status: int, code: str, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return ErrorResponse({"error": {"code": code, "message": message}}, status, code, headers)


def is_v2(path: str) -> bool:
    """Whether ``path`` is a KServe v2 route, whose errors are ``{"error": message}``."""
    return path == "/v2" or path.startswith("/v2/")


def error_for(path: str, status: int, code: str, message: str,
              headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the shape of the API ``path`` belongs to: v2's ``{"error": message}``
    (tritonclient reads a string there), else v1's ``{"error": {"code", "message"}}``."""
    if is_v2(path):
        return ErrorResponse({"error": message}, status, code,
                             {"x-redbatch-error-code": code, **(headers or {})})
    return error_response(status, code, message, headers)


def status_of(exc: errors.RedbatchError) -> int:
    return next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 500)


def retry_headers(exc: errors.RedbatchError, status: int) -> dict[str, str] | None:
    """``Retry-After`` for a 503: from the drain rate for a full queue, else 1 s."""
    if status != 503:
        return None
    retry_s = (exc.retry_after_s if isinstance(exc, errors.QueueFull)
               else defaults.RETRY_AFTER_S)
    return {"Retry-After": str(max(1, math.ceil(retry_s)))}


REDIS_DETAIL_EVERY_S = 5.0  # a Redis outage's detail: one log line per this, per process
_redis_logged_at = [-math.inf]


def public_message(exc: errors.RedbatchError) -> str:
    """What a caller reads of ``exc``: its message, but for ``RedisUnavailable``, whose
    message names the Redis address, user and options, a fixed one (the detail goes to
    the gateway log, once per ``REDIS_DETAIL_EVERY_S``)."""
    if not isinstance(exc, errors.RedisUnavailable):
        return str(exc)
    now = time.monotonic()
    if now - _redis_logged_at[0] >= REDIS_DETAIL_EVERY_S:
        _redis_logged_at[0] = now
        log.warning("answering 503 redis_unavailable: %s", exc)
    return "redis unavailable; see the gateway log"


def from_exception(exc: errors.RedbatchError) -> JSONResponse:
    status = status_of(exc)
    return error_response(status, exc.code, public_message(exc), retry_headers(exc, status))


async def on_redbatch_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.RedbatchError)
    return from_exception(exc)


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, method not allowed), in the route's shape."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers) if exc.headers else None
    return error_for(request.url.path, exc.status_code, "http_error", str(exc.detail), headers)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %r", request.method, request.url.path)
    return error_for(request.url.path, 500, "internal", "internal error; see the gateway log")
