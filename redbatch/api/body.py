"""Reading and checking a predict request's body."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
from starlette.types import Message, Receive

from redbatch import codec, levels, protocol
from redbatch.api.directory import ModelInfo
from redbatch.errors import BadRequest, BodyTooLarge, InvalidPayload, UnsupportedMediaType

TIMEOUT_HEADER = b"x-redbatch-timeout-ms"
PRIORITY_HEADER = b"x-redbatch-priority"
PRIORITY_RE = re.compile(r"-?[0-9]{1,4}")  # an integer; its range is the model's
REQUEST_ID_HEADER = b"x-request-id"
TIMEOUT_FIELD = "timeout_ms"
JSON_MEDIA_TYPES = frozenset({b"application/json"})  # the predict body is JSON (parse_json)
# v2 infer also takes the binary tensor extension's body (a JSON header, then raw bytes)
INFER_MEDIA_TYPES = JSON_MEDIA_TYPES | {b"application/octet-stream"}
Headers = dict[bytes, bytes]  # ASGI header names are lower-case bytes


def check_content_type(headers: Headers, allowed: frozenset[bytes] = JSON_MEDIA_TYPES
                       ) -> None:
    """A predict body is JSON (v2 infer's also binary: ``INFER_MEDIA_TYPES``): another
    Content-Type is refused (415), so that a page on another site cannot post to a
    gateway from a visitor's browser with a "simple" type (``text/plain``, a form)
    that needs no CORS preflight.  None at all is fine."""
    raw = headers.get(b"content-type")
    if raw is not None and raw not in allowed and \
            raw.split(b";", 1)[0].strip().lower() not in allowed:
        names = " or ".join(sorted(t.decode() for t in allowed))
        raise UnsupportedMediaType(f"Content-Type {raw.decode('latin-1')!r} is not "
                                   f"supported: send the body as {names}")


async def read_body(headers: Headers, receive: Receive, limit_bytes: int) -> bytes:
    """The whole body (ASGI messages), or ``BodyTooLarge`` once it passes the limit."""
    declared = headers.get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise BodyTooLarge(f"body of {int(declared)} bytes is over the {limit_bytes}-byte "
                           "limit")
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        chunk: bytes = message.get("body", b"")  # the whole body in one message (most)
        if len(chunk) > limit_bytes:
            raise BodyTooLarge(f"body is over the {limit_bytes}-byte limit")
        return chunk
    return await _read_rest(message, receive, limit_bytes)


async def _read_rest(message: Message, receive: Receive, limit_bytes: int) -> bytes:
    """The body from its first ``message`` on, the next ones read with ``receive``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if message["type"] == "http.disconnect":
            raise BadRequest("client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            raise BodyTooLarge(f"body is over the {limit_bytes}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
        message = await receive()


def parse_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("empty body: send a JSON object")
    try:
        codec.check_containers(body)
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    except InvalidPayload as exc:
        raise BadRequest(str(exc)) from exc
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a JSON object, got {type(data).__name__}")
    return data


def refuse_duplicate_keys(body: bytes) -> None:
    """400 naming a key that one JSON object of ``body`` (parsed already) holds twice:
    for an admin body, where a later key would hide an earlier value that is refused
    (``{"max_batch_size": 0, "max_batch_size": 16}``)."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _value in items:  # (linear: a body of 100,000 keys is read at once)
            if key in seen:
                raise BadRequest(f"key {key!r} appears twice in one JSON object")
            seen.add(key)
        return dict(items)

    try:
        json.loads(body, object_pairs_hook=pairs)
    except RecursionError:
        raise BadRequest("JSON nested too deep") from None


def model_input(data: dict[str, Any], info: ModelInfo) -> Any:
    """The model's input field, checked against its tensor spec when it has one (a
    map of every named input, for a model with named inputs); with the spec's mask
    field beside it, cut to the positions the mask marks."""
    if info.input_name not in data:
        raise InvalidPayload(f"body has no {info.input_name!r} field (model {info.name!r} "
                             f"reads its input from {info.input_name!r})")
    value = data[info.input_name]
    if info.spec:
        if info.spec.mask is not None and info.spec.mask in data:  # padded by the caller
            return info.spec.check_masked(value, data[info.spec.mask], info.input_name)
        return info.spec.check(value, info.input_name)
    if info.signature:  # named inputs: {"inputs": {"a": ..., "b": ...}}
        checked = info.signature.check(value)
        for name in info.signature.loose:  # any value: as a spec-less model's input
            _refuse_tensor_tags(checked[name])
        return checked
    _refuse_tensor_tags(value)
    return value


_CONTAINERS = (dict, list)
_CONTAINERS_SET = frozenset(_CONTAINERS)


def _refuse_tensor_tags(value: Any) -> None:
    """A spec-less model takes any JSON, except a map whose one key is the tensor tag:
    that is how the queue spells an array, and a JSON one (base64 text) would not
    decode in the worker, so its caller would hear nothing until its deadline; and
    nothing nested deeper than an entry may be (``codec.MAX_DEPTH``: a reply nested so
    deep could not be written back as JSON, after the model ran)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > codec.MAX_DEPTH:
            raise InvalidPayload(f"the input nests deeper than {codec.MAX_DEPTH} lists "
                                 "and maps")
        if isinstance(item, dict):
            if len(item) == 1 and protocol.TENSOR_TAG in item:
                raise InvalidPayload(
                    f"a map whose only key is {protocol.TENSOR_TAG!r} is how the queue "
                    "spells a tensor, and this model has no tensor spec: send the array "
                    "as a nested list, or give the map another key")
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, _CONTAINERS))
        elif isinstance(item, list) and not _CONTAINERS_SET.isdisjoint(map(type, item)):
            stack.extend((v, depth + 1) for v in item if isinstance(v, _CONTAINERS))


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


def timeout_s(headers: Headers, data: dict[str, Any], default_s: float, max_s: float) -> float:
    """The client may shorten its deadline (header or field), never lengthen it."""
    chosen = default_s
    if TIMEOUT_HEADER in headers:
        raw = headers[TIMEOUT_HEADER].decode("latin-1")
        chosen = min(chosen, _positive_ms(raw, TIMEOUT_HEADER.decode()) / 1000)
    if TIMEOUT_FIELD in data:
        chosen = min(chosen, _positive_ms(data[TIMEOUT_FIELD], TIMEOUT_FIELD) / 1000)
    return min(chosen, max_s)


def trace_id(headers: Headers) -> str:
    """The caller's ``X-Request-ID``, checked; "" when it sent none (the request's own
    id then stands for it, and nothing extra travels)."""
    raw = headers.get(REQUEST_ID_HEADER)
    if raw is None:
        return ""
    value = raw.decode("latin-1")
    if not protocol.TRACE_ID_RE.fullmatch(value):
        raise BadRequest("X-Request-ID must be 1-128 characters of [A-Za-z0-9._:/-]")
    return value


def priority_header(headers: Headers, info: ModelInfo) -> int | None:
    """``X-Redbatch-Priority``: the request's priority level (1 most urgent; 0: the
    model's default), None without the header; 400 naming it when it is not an integer
    or out of the model's levels."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return None
    text = raw.decode("latin-1").strip()
    if not PRIORITY_RE.fullmatch(text):
        raise BadRequest(f"X-Redbatch-Priority must be an integer level, got {text[:40]!r}")
    return checked_priority(int(text), "X-Redbatch-Priority", info)


def checked_priority(value: Any, where: str, info: ModelInfo) -> int | None:
    """``value`` as a priority level of the model (None: none given); 400 naming
    ``where`` when it is not an integer of the model's levels."""
    if value is None:
        return None
    try:
        return levels.from_section(info.meta.get("priority")).resolve(info.name, value)
    except InvalidPayload as exc:
        raise BadRequest(f"{where}: {exc}") from exc


def jsonable(obj: Any) -> Any:
    """``orjson``'s ``default``: a tensor (anything with ``tolist``) as nested lists."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot serialize {type(obj).__name__}")
