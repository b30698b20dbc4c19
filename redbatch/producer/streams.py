"""Streams on the producer's side: a request's chunks, in order, as an iterator.

A model's reply listener routes each stream message (it has a ``seq``) to its
request's ``ChunkQueue``; ``Stream`` reads it: ``async for chunk in
client.stream(model, x)``.  A chunk whose number was seen already is dropped (and
counted); a gap in the numbers, which Redis's lists never make, fails the stream
rather than skip a chunk.  Every wait ends by the request's deadline plus
``STREAM_GRACE_MS`` (the worker itself ends the stream at the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from redbatch import protocol
from redbatch.errors import BadRequest, DeadlineExceeded, QueueFull, RedbatchError
from redbatch.stream_wire import StreamChunk

if TYPE_CHECKING:
    from redbatch.producer.client import Client

T = TypeVar("T")
log = logging.getLogger("redbatch.producer")

CANCEL_TIMEOUT_S = 2.0  # marking a closed stream cancelled in Redis takes at most this


class ChunkQueue:
    """The messages of one stream, as they came, numbered 0, 1, ... without gaps."""

    def __init__(self, request_id: str, deadline_ms: int) -> None:
        self.request_id = request_id
        self.deadline_ms = deadline_ms
        self._queue: asyncio.Queue[StreamChunk | BaseException] = asyncio.Queue()
        self._expect = 0
        self._bytes = 0  # of the chunks unread
        self.duplicates = 0
        self.closed = False  # its final message (or error) is in

    def put(self, chunk: StreamChunk) -> None:
        if self.closed or chunk.seq < self._expect:
            self.duplicates += 1
            return
        if chunk.seq > self._expect:
            self.fail(RedbatchError(f"stream {self.request_id}: chunk {chunk.seq} came "
                                    f"where {self._expect} was due"))
            return
        if self._queue.qsize() >= protocol.STREAM_MAX_BUFFERED or \
                self._bytes + chunk.size > protocol.STREAM_MAX_BUFFERED_BYTES:
            self.fail(QueueFull(f"stream {self.request_id}: over "
                                f"{protocol.STREAM_MAX_BUFFERED} chunks or "
                                f"{protocol.STREAM_MAX_BUFFERED_BYTES} bytes left unread"))
            return
        self._expect += 1
        self._bytes += chunk.size
        self.closed = chunk.last
        self._queue.put_nowait(chunk)

    def fail(self, exc: BaseException) -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(exc)

    async def get(self) -> StreamChunk:
        """The next message (one already in, whatever the time); ``DeadlineExceeded``
        when none comes in time."""
        wait_s = (self.deadline_ms + protocol.STREAM_GRACE_MS - protocol.now_ms()) / 1000
        try:
            if not self._queue.empty():
                item = self._queue.get_nowait()
            else:  # (not ``wait_for``: on Python 3.11 it may swallow the caller's cancel
                async with asyncio.timeout(max(0.0, wait_s)):  # when a chunk comes then)
                    item = await self._queue.get()
        except TimeoutError:
            raise DeadlineExceeded(f"stream {self.request_id}: no message before its "
                                   "deadline") from None
        if isinstance(item, BaseException):
            raise item
        self._bytes -= item.size
        return item


class Stream:
    """An async iterator over one request's chunks (``chunks=True``: the
    ``StreamChunk`` messages, with their numbers), started by the first ``__anext__``.
    It ends after the last chunk, raising the stream's typed error if it failed;
    ``timings`` then holds the final message's timings.  ``aclose`` (or leaving
    ``async with``) before its final message came (an early exit, or a failure on
    this side: a gap, too many chunks unread, its deadline) cancels the request: its
    worker drops it at the next step."""

    def __init__(self, client: Client, model: str, inputs: Any, deadline_ms: int,
                 trace_id: str = "", max_queue_len: int | None = None,
                 chunks: bool = False, version: str | None = None) -> None:
        self._client = client
        self.model = model  # once open: the served name it went to (a version's)
        self._version = version
        self._inputs = inputs
        self.deadline_ms = deadline_ms
        self._trace_id = trace_id
        self._max_queue_len = max_queue_len
        self._chunks = chunks
        self._queue: ChunkQueue | None = None
        self.request_id = ""
        self.timings: dict[str, Any] = {}
        self.done = False  # iteration is over
        self.ended = False  # its final message came (or it was cancelled): none to cancel

    async def open(self) -> None:
        """Enqueue the request (once); its listener routes its messages here."""
        if self._queue is None:
            self.model = await self._client._routed(self.model, self._version,
                                                    self.deadline_ms)
            self.request_id, self._queue = await self._client._open_stream(
                self.model, self._inputs, self.deadline_ms, self._trace_id,
                self._max_queue_len)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        await self.open()
        assert self._queue is not None
        try:
            chunk = await self._queue.get()
        except RedbatchError:  # cancelled already (by the listener, a stop, or aclose),
            self.done = self.ended = True  # or past its deadline: none to cancel
            raise
        except asyncio.CancelledError:  # its reader gave up (a timeout, a task's cancel)
            self.close_soon()
            raise
        if not chunk.last:
            return chunk if self._chunks else chunk.payload
        self.done = self.ended = True
        self.timings = chunk.timings
        if not chunk.ok:
            raise chunk.error()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel the request unless its final message came (``close_soon``, waited
        for: at most ``CANCEL_TIMEOUT_S``, and never raising)."""
        task = self.close_soon()
        if task is not None:
            await asyncio.shield(task)

    def close_soon(self) -> asyncio.Task[None] | None:
        """Cancel the request unless its final message came: its waiter fails now, and
        a task marks it cancelled in Redis (bounded by ``CANCEL_TIMEOUT_S``; an error is
        logged), off the caller's path.  The task, if any."""
        self.done = True
        if self.ended or self._queue is None:
            return None
        self.ended = True
        self._client.abandon(self.request_id, BadRequest("the stream was closed"), self.model)
        return self._client._cancel_soon(self.model, self.request_id, self.deadline_ms)

    def __del__(self) -> None:
        """A stream dropped unfinished (``break`` out of ``async for`` calls no
        ``aclose``) is cancelled, while its loop runs."""
        if self.ended or self._queue is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # none here (at exit, another thread): its deadline ends it
            return
        if loop is self._client._loop:  # later, not within a collection
            loop.call_soon(self.close_soon)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()


def sync_stream(call: Callable[[Coroutine[Any, Any, Any], float], Any], stream: Stream,
                budget_s: float) -> Iterator[Any]:
    """``stream`` as a blocking iterator, each step run by ``call`` (``SyncClient``'s
    loop); closing it early cancels the request."""
    try:
        while (item := call(_step(stream), budget_s)) is not _END:
            yield item
    finally:
        with contextlib.suppress(RedbatchError):  # (the client closed: it failed the
            call(stream.aclose(), budget_s)         # stream's waiter already)


_END = object()


async def _step(stream: Stream) -> Any:
    try:
        result: Any = await stream.__anext__()
    except StopAsyncIteration:
        return _END
    return result
