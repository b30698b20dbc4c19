"""Streaming answers over HTTP: Server-Sent Events or newline-delimited JSON.

A streaming model's predict (v1) answers Server-Sent Events (``text/event-stream``,
one ``data:`` line per event) when the client's ``Accept`` asks for them, else
newline-delimited JSON (``application/x-ndjson``, one object per line).  Each chunk is
one event, ``{"seq": n, <output name>: chunk}``; the last event has ``"last": true``
and the timings, or the stream's error.  The first chunk is awaited before the
response starts, so that a request refused or failed before any chunk gets its usual
status and JSON error.  A client that disconnects cancels its request: the worker
drops it at its next step.  Triton's generate extension (``generate_stream``,
``generate``) is served the same way (``v2_generate``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from redbatch.api import body
from redbatch.errors import RedbatchError
from redbatch.producer.streams import Stream
from redbatch.stream_wire import StreamChunk

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
Shape = Callable[[StreamChunk], dict[str, Any]]  # a chunk's event
Final = Callable[[Stream, RedbatchError | None], dict[str, Any]]  # the last event


def wants_sse(headers: body.Headers) -> bool:
    return SSE.encode() in headers.get(b"accept", b"")


def stream_input(data: dict[str, Any]) -> dict[str, Any]:
    """A streaming model's input: the body's fields, but the request's timeout."""
    return {key: value for key, value in data.items() if key != body.TIMEOUT_FIELD}


def v1_shapes(output_name: str) -> tuple[Shape, Final]:
    def shape(chunk: StreamChunk) -> dict[str, Any]:
        return {"seq": chunk.seq, output_name: chunk.payload}

    def final(stream: Stream, error: RedbatchError | None) -> dict[str, Any]:
        event: dict[str, Any] = {"id": stream.request_id, "last": True}
        if error is not None:
            event["error"] = {"code": error.code, "message": str(error)}
        else:
            event["timings"] = stream.timings
        return event

    return shape, final


async def first_chunk(stream: Stream) -> StreamChunk | None:
    """The stream's first chunk (None: it ended without one); its error is raised,
    and the request cancelled, before any byte of the response."""
    try:
        chunk: StreamChunk = await anext(stream)
    except StopAsyncIteration:
        return None
    except BaseException:
        await stream.aclose()
        raise
    return chunk


class StreamAnswer(Response):
    """The streamed response: events as the chunks come, then the last event."""

    def __init__(self, stream: Stream, first: StreamChunk | None, shapes: tuple[Shape, Final],
                 sse: bool, request_id: str) -> None:
        super().__init__(status_code=200, media_type=SSE if sse else NDJSON,
                         headers={"x-request-id": request_id, "cache-control": "no-cache"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.stream, self.first, self.sse = stream, first, sse
        self.shape, self.final = shapes

    def event(self, data: dict[str, Any]) -> bytes:
        line = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)
        return b"data: " + line + b"\n\n" if self.sse else line + b"\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        gone = asyncio.create_task(_disconnect(receive))
        try:
            last = await self._pump(send, gone)
            if last is not None:
                await send({"type": "http.response.body", "body": last})
        finally:
            gone.cancel()
            await self.stream.aclose()  # a stream cut short: its request is cancelled

    async def _pump(self, send: Send, gone: asyncio.Task[None]) -> bytes | None:
        """Send every chunk; the last event's bytes, or None once the client left."""
        chunk = self.first
        error: RedbatchError | None = None
        while chunk is not None:
            await send({"type": "http.response.body", "body": self.event(self.shape(chunk)),
                        "more_body": True})
            step = asyncio.ensure_future(anext(self.stream))
            await asyncio.wait([step, gone], return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                return None
            chunk, error = _outcome(step)
        return self.event(self.final(self.stream, error))


def _outcome(step: asyncio.Future[Any]) -> tuple[StreamChunk | None, RedbatchError | None]:
    try:
        return step.result(), None
    except StopAsyncIteration:
        return None, None
    except RedbatchError as exc:
        return None, exc


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has gone (the body was read: only that comes next)."""
    with contextlib.suppress(Exception):
        while (await receive())["type"] != "http.disconnect":
            pass

