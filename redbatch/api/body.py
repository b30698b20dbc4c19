"""Reading and checking a predict request's body."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from redbatch.api.directory import ModelInfo
from redbatch.errors import BadRequest, BodyTooLarge, InvalidPayload

TIMEOUT_HEADER = "x-redbatch-timeout-ms"
TIMEOUT_FIELD = "timeout_ms"


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The whole body, or ``BodyTooLarge`` as soon as it passes ``limit_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise BodyTooLarge(f"body of {declared} bytes is over the {limit_bytes}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise BodyTooLarge(f"body is over the {limit_bytes}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("empty body: send a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a JSON object, got {type(data).__name__}")
    return data


def model_input(data: dict[str, Any], info: ModelInfo) -> Any:
    """The model's input field, checked against its tensor spec when it has one."""
    if info.input_name not in data:
        raise InvalidPayload(f"body has no {info.input_name!r} field (model {info.name!r} "
                             f"reads its input from {info.input_name!r})")
    value = data[info.input_name]
    return info.spec.check(value) if info.spec else value


def _positive_ms(raw: Any, where: str) -> float:
    if isinstance(raw, bool):
        raise BadRequest(f"{where} must be a number of milliseconds, not a boolean")
    try:
        value = float(raw)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{where} must be a number of milliseconds") from exc
    if not value > 0 or value == float("inf"):
        raise BadRequest(f"{where} must be a positive number of milliseconds")
    return value


def timeout_s(request: Request, data: dict[str, Any], default_s: float, max_s: float) -> float:
    """The client may shorten its deadline (header or field), never lengthen it."""
    chosen = default_s
    if TIMEOUT_HEADER in request.headers:
        chosen = min(chosen, _positive_ms(request.headers[TIMEOUT_HEADER], TIMEOUT_HEADER) / 1000)
    if TIMEOUT_FIELD in data:
        chosen = min(chosen, _positive_ms(data[TIMEOUT_FIELD], TIMEOUT_FIELD) / 1000)
    return min(chosen, max_s)
