"""Streaming answers over HTTP: Server-Sent Events or newline-delimited JSON.

A streaming model's predict (v1) answers Server-Sent Events (``text/event-stream``,
one ``data:`` line per event) when the client's ``Accept`` asks for them, else
newline-delimited JSON (``application/x-ndjson``, one object per line).  Each chunk is
one event, ``{"seq": n, <output name>: chunk}``; the last event has ``"last": true``
and the timings, or the stream's error.  The first chunk is awaited before the
response starts, so that a request refused or failed before any chunk gets its usual
status and JSON error.  A client that disconnects, before its first chunk or after,
cancels its request: the worker drops it at its next step.  A chunk that cannot be
written as JSON ends the stream with a ``model_error`` last event.  Sending is bounded
by the deadline (plus ``STREAM_GRACE_MS`` and ``SEND_GRACE_S``): a client that stops
reading is cut off.  Triton's generate extension (``generate_stream``,
``generate``) is served the same way (``v2_generate``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from redbatch import protocol
from redbatch.api import body
from redbatch.api.errors import public_message
from redbatch.errors import BadRequest, ModelError, RedbatchError
from redbatch.producer.streams import Stream
from redbatch.stream_wire import StreamChunk

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
Shape = Callable[[StreamChunk], dict[str, Any]]  # a chunk's event
Final = Callable[[Stream, RedbatchError | None], dict[str, Any]]  # the last event
T = TypeVar("T")
SEND_GRACE_S = 1.0  # the response may take this long past the stream's own end


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
            event["error"] = {"code": error.code, "message": public_message(error)}
        else:
            event["timings"] = stream.timings
        return event

    return shape, final


async def first_chunk(stream: Stream, receive: Receive) -> StreamChunk | None:
    """The stream's first chunk (None: it ended without one); its error is raised,
    and the request cancelled, before any byte of the response (a client that hangs
    up meanwhile cancels it too)."""
    try:
        chunk: StreamChunk = await unless_gone(anext(stream), receive)
    except StopAsyncIteration:
        return None
    except BaseException:
        stream.close_soon()
        raise
    return chunk


async def unless_gone(work: Awaitable[T], receive: Receive) -> T:
    """``work``'s outcome; ``BadRequest`` (and ``work`` cancelled) if the client hangs
    up first (its body was read: only the disconnect comes next)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            # a call may swallow its cancel (``wait_for`` on Python 3.11) and fail later,
            # once the stream is closed: nobody waits for it, so its outcome is read
            # here, not logged as "Task exception was never retrieved"
            task.add_done_callback(_outcome_read)
    if not task.done():
        raise BadRequest("the client disconnected before the answer")
    return task.result()


def _outcome_read(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class StreamAnswer(Response):
    """The streamed response: events as the chunks come, then the last event."""

    def __init__(self, stream: Stream, first: StreamChunk | None, shapes: tuple[Shape, Final],
                 sse: bool, request_id: str) -> None:
        super().__init__(status_code=200, media_type=SSE if sse else NDJSON,
                         headers={"x-request-id": request_id, "cache-control": "no-cache"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.stream, self.first, self.sse = stream, first, sse
        self.shape, self.final = shapes
        self.on_end: Callable[[], None] | None = None  # called once the answer is over

    def event(self, data: dict[str, Any]) -> bytes:
        line = orjson.dumps(data, default=body.jsonable, option=orjson.OPT_SERIALIZE_NUMPY)
        return b"data: " + line + b"\n\n" if self.sse else line + b"\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._answer(receive, send)
        finally:
            if self.on_end is not None:
                self.on_end()

    async def _answer(self, receive: Receive, send: Send) -> None:
        """The events, the last one included, unless the client leaves or stalls."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        gone = asyncio.create_task(_disconnect(receive))
        budget_s = (self.stream.deadline_ms + protocol.STREAM_GRACE_MS
                    - protocol.now_ms()) / 1000 + SEND_GRACE_S
        try:
            async with asyncio.timeout(max(0.0, budget_s)):  # a reader that stalls
                last = await self._pump(send, gone)
                if last is not None:
                    await send({"type": "http.response.body", "body": last})
        except TimeoutError:
            pass  # the response is left incomplete: the server drops the connection
        finally:
            gone.cancel()
            self.stream.close_soon()  # a stream cut short: its request is cancelled

    def _chunk_event(self, chunk: StreamChunk) -> bytes | ModelError:
        try:
            return self.event(self.shape(chunk))
        except TypeError as exc:  # (orjson's error) not JSON: the stream ends there
            return ModelError(f"chunk {chunk.seq} of stream {self.stream.request_id} "
                              f"cannot be written as JSON: {exc}")

    async def _pump(self, send: Send, gone: asyncio.Task[None]) -> bytes | None:
        """Send every chunk; the last event's bytes, or None once the client left."""
        chunk = self.first
        error: RedbatchError | None = None
        while chunk is not None:
            event = self._chunk_event(chunk)
            if isinstance(event, ModelError):
                error = event
                break
            await send({"type": "http.response.body", "body": event, "more_body": True})
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

