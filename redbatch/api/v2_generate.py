"""Triton's generate extension for streaming models: ``POST
/v2/models/{name}/generate_stream`` (Server-Sent Events, one event per chunk:
``{"model_name", "model_version", "text_output"}``; a chunk that is not text comes as
``output``) and ``POST /v2/models/{name}/generate`` (the chunks joined, in one JSON
answer).  The body's fields are the model's input, those under ``parameters``
flattened in (``{"text_input": "hello", "max_tokens": 16}``)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from redbatch import defaults, protocol
from redbatch.api import body, streaming
from redbatch.api.errors import public_message
from redbatch.errors import BadRequest, InvalidPayload, ModelError, RedbatchError, UnknownModel
from redbatch.producer.streams import Stream
from redbatch.stream_wire import StreamChunk

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

VERSION = "1"


def served_version(served: str) -> str:
    """The version a served name answers as (``VERSION`` for a model served without
    versions)."""
    return protocol.split_name(served)[1] or VERSION


def v2_shapes(name: str, version: str = VERSION) -> tuple[streaming.Shape, streaming.Final]:
    def shape(chunk: StreamChunk) -> dict[str, Any]:
        key = "text_output" if isinstance(chunk.payload, str) else "output"
        return {"model_name": name, "model_version": version, key: chunk.payload,
                "seq": chunk.seq}

    def final(stream: Stream, error: RedbatchError | None) -> dict[str, Any]:
        if error is not None:
            return {"error": public_message(error), "code": error.code}
        return {"model_name": name, "model_version": version, "text_output": "",
                "last": True, "timings": stream.timings}

    return shape, final


def path_name(request: Request) -> tuple[str, str | None]:
    """A v2 path's model name, once it is a name, and its version (None: none): a
    served name (``vm@1``) or an illegal one is a 404, a version pinned on a served
    name a 400."""
    name: str = request.path_params["name"]
    version: str | None = request.path_params.get("version")
    if not protocol.MODEL_NAME_RE.fullmatch(name):
        with contextlib.suppress(InvalidPayload):  # not a name at all: the 404
            protocol.check_pin(name, version, served_route=False)
        raise UnknownModel(f"unknown model {name!r}: not a model name")
    if version is not None and not protocol.VERSION_RE.fullmatch(version):
        raise UnknownModel(f"model {name!r} has no version {version!r}")
    return name, version


class GenerateApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def generate_stream(self, request: Request) -> Response:
        return await self._answer(request, sse=True)

    async def generate(self, request: Request) -> Response:
        answer = await self._answer(request, sse=False)
        first = [] if answer.first is None else [answer.first]
        try:
            chunks = [c.payload for c in first] + await streaming.unless_gone(
                _rest(answer.stream, sum(c.size for c in first)), request.receive)
        finally:
            answer.stream.close_soon()  # (a stream cut short: its request is cancelled)
        name = request.path_params["name"]
        named = {"model_name": name, "model_version": served_version(answer.stream.model)}
        if all(isinstance(c, str) for c in chunks):
            return JSONResponse({**named, "text_output": "".join(chunks)})
        try:
            content = orjson.dumps({**named, "output": chunks}, default=body.jsonable,
                                   option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as exc:  # (orjson's error)
            raise ModelError(f"model {name!r} yielded a chunk that cannot be written as "
                             f"JSON: {exc}") from exc
        return Response(content, media_type="application/json")

    async def _answer(self, request: Request, sse: bool) -> streaming.StreamAnswer:
        core, arrived_ms = self.gateway.core, protocol.now_ms()
        name, version = path_name(request)  # /v2/models/{name}[/versions/{v}]/...
        headers: body.Headers = dict(request.scope["headers"])
        trace = body.trace_id(headers)
        body.check_content_type(headers)
        data = body.parse_json(await core.read(headers, request.receive))  # (first: its
        params = data.pop("parameters", None)  # timeout bounds the look-ups too)
        data = {**params, **data} if isinstance(params, dict) else data
        info = await core.served(name, headers, arrived_ms, version,
                                 asked_s=lambda: core.asked_s(headers, data))
        if not info.meta.get(protocol.F_STREAMING):
            raise BadRequest(f"model {name!r} does not stream: use its infer endpoint")
        return await core.stream(info, data, headers, arrived_ms, trace,
                                 v2_shapes(name, served_version(info.name)), sse,
                                 request.receive)


async def _rest(stream: Stream, size: int) -> list[Any]:
    """The payloads of the stream's chunks still to come, those before them of
    ``size`` bytes; ``BadRequest`` once they come to over ``GENERATE_MAX_BYTES`` (one
    JSON answer: the caller is told to stream it instead; the model did no wrong)."""
    payloads = []
    async for chunk in stream:
        size += chunk.size
        if size > defaults.GENERATE_MAX_BYTES:
            raise BadRequest(f"the chunks come to over {defaults.GENERATE_MAX_BYTES} "
                             "bytes, more than one generate answer holds: use "
                             "generate_stream")
        payloads.append(chunk.payload)
    return payloads
