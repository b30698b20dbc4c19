"""A reply listener: blocks on one reply list (a client's, for one model), drains it
in bulk, and routes each reply to its waiting future by request id.  Given an idle
time, it stops once nothing has waited on it for that long (``listeners``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis

from redbatch import codec, protocol
from redbatch.errors import DeadlineExceeded, InvalidPayload, RedbatchError, error_from_code
from redbatch.lean import LeanLink
from redbatch.producer import packing
from redbatch.producer.streams import ChunkQueue
from redbatch.stream_wire import chunk_from_wire

T = TypeVar("T")
Abandoned = Callable[[str, str, int], object]  # (tag, request id, deadline ms)
log = logging.getLogger("redbatch.producer")
DRAIN_COUNT = 1024
RECENT_IDS = 100_000  # answered ids remembered to tell a duplicate reply from a late one
BACKOFF_CAP_S = 0.5  # a Redis that is back is found within this


@dataclass
class ListenerStats:
    """Replies seen, and those that found no waiter: a second reply to a request
    answered shortly before (``duplicates``, which must stay 0) or one that came
    after its caller's deadline (``late``)."""

    replies: int = 0
    duplicates: int = 0
    late: int = 0
    _recent: OrderedDict[str, None] = field(default_factory=OrderedDict, repr=False)

    def count(self, request_id: str, answered: bool) -> None:
        self.replies += 1
        if answered:
            self._recent[request_id] = None
            if len(self._recent) > RECENT_IDS:
                self._recent.popitem(last=False)
        elif request_id in self._recent:
            self.duplicates += 1
        else:
            self.late += 1

    def as_dict(self) -> dict[str, int]:
        return {"replies": self.replies, "duplicates": self.duplicates, "late": self.late}


class RequestFuture(asyncio.Future[T]):
    """The future of one request, naming it: ``request_id`` (for errors, ``abandon``
    and ``mark_cancelled``), and ``tag``, the sub-queue it went to (its model's name,
    or one of a sharded model's ``protocol.sub_queue_tag``s)."""

    __slots__ = ("_on_cancel", "request_id", "tag")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, tag: str = "",
                 on_cancel: Callable[[str, asyncio.Future[Any]], None] | None = None
                 ) -> None:
        super().__init__(loop=loop)
        self.request_id = request_id
        self.tag = tag
        self._on_cancel = on_cancel

    def cancel(self, msg: Any | None = None) -> bool:
        """Cancel it (a caller that gave up: ``on_cancel(request_id, self)`` frees its
        waiter at once).  Every cancel comes here, a task's or ``wait_for``'s too: no
        done callback per request is needed for the rare one."""
        if not super().cancel(msg):
            return False
        if self._on_cancel is not None:
            self._on_cancel(self.request_id, self)
        return True


@dataclass(slots=True)
class Waiter:
    future: asyncio.Future[Any]
    timer: asyncio.TimerHandle
    want_reply: bool
    deadline_ms: int


def resolve(future: asyncio.Future[Any], reply: protocol.Reply, want_reply: bool) -> None:
    """Settle ``future`` with the reply (or its payload / typed error: a batch's first
    failed row's)."""
    if future.done():
        return
    if want_reply:
        future.set_result(reply)
    elif reply.ok and not reply.row_errors:
        future.set_result(reply.payload)
    elif reply.ok:
        row = min(reply.row_errors)
        code, message = reply.row_errors[row]
        future.set_exception(error_from_code(code, f"row {row}: {message}"))
    else:
        future.set_exception(error_from_code(reply.error_code, reply.error_message))


class ReplyListener:
    def __init__(self, redis: aioredis.Redis, reply_to: str, block_timeout_s: float,
                 stats: ListenerStats | None = None, idle_s: float | None = None,
                 on_idle: Callable[[ReplyListener], None] | None = None,
                 on_abandoned: Abandoned | None = None) -> None:
        """``stats``: shared with other listeners, if given; ``idle_s``: stop once no
        request has waited for that long (checked between pops), after calling
        ``on_idle(self)`` in the same step (None: run until ``stop``);
        ``on_abandoned(tag, request_id, deadline_ms)``: a streaming request this side
        gave up on while its worker may still run it (a stream failed here, one that
        ``predict`` awaited, or the listener's stop), to be marked cancelled."""
        self._link = LeanLink(redis)  # the blocking pops: one held connection
        self.reply_to = reply_to
        self.tag = protocol.hash_tag(reply_to) or ""  # the sub-queue whose replies it takes
        self._block_timeout_s = block_timeout_s
        self._waiters: dict[str, Waiter] = {}
        self._streams: dict[str, ChunkQueue] = {}  # streaming requests, by id
        # coalesced request id -> its member ids, and the timer that forgets the route
        self._packs: dict[str, tuple[list[str], asyncio.TimerHandle]] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.stats = stats if stats is not None else ListenerStats()
        self._idle_s = idle_s
        self._on_idle = on_idle
        self._on_abandoned = on_abandoned
        self._busy = False  # a request waited since the last idle check
        self._busy_at_s = 0.0  # (monotonic) when the last idle check saw one

    @property
    def waiting(self) -> int:
        return len(self._waiters) + len(self._streams)

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._busy_at_s = time.monotonic()
            self._task = asyncio.create_task(self._run(), name="redbatch-reply-listener")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for stream in self._streams.values():
            self._abandoned(stream.request_id, stream.deadline_ms)
        for request_id in [*self._waiters, *self._streams]:
            self.fail(request_id, RedbatchError("client closed before the reply arrived"))
        self._forget_packs()

    def _abandoned(self, request_id: str, deadline_ms: int) -> None:
        if self._on_abandoned is not None:
            self._on_abandoned(self.tag, request_id, deadline_ms)

    def _forget_packs(self) -> None:
        for _members, timer in self._packs.values():
            timer.cancel()
        self._packs.clear()

    def idle_over(self) -> bool:
        """Whether no request has waited for ``idle_s`` (checked between pops: a
        request that came and went since the last check counts as waiting)."""
        if self._idle_s is None:
            return False
        now_s = time.monotonic()
        if self._waiters or self._streams or self._busy:
            self._busy = False
            self._busy_at_s = now_s
            return False
        return now_s - self._busy_at_s >= self._idle_s

    def _retire(self) -> None:
        """Stop for idleness, in one step with the idle check: ``on_idle`` forgets this
        listener before any new request can reach it (a new one starts for the next)."""
        self._stopping = True
        self._forget_packs()
        if self._on_idle is not None:
            self._on_idle(self)

    def route_pack(self, pack_id: str, member_ids: list[str], deadline_ms: int) -> None:
        """Split the reply to ``pack_id`` (a multi-row request of lone requests) into
        replies to ``member_ids``, row by row; forgotten once ``deadline_ms`` (the
        members' latest) and the marker's grace have passed."""
        delay_s = max(0.0, (deadline_ms - protocol.now_ms() + protocol.MARKER_GRACE_MS) / 1000)
        timer = asyncio.get_running_loop().call_later(delay_s, self._packs.pop, pack_id, None)
        self._packs[pack_id] = (member_ids, timer)

    def check_new(self, request_ids: list[str]) -> None:
        """Refuse ids that repeat, or that already wait: routing is by id."""
        if len(set(request_ids)) != len(request_ids) or any(
                rid in self._waiters for rid in request_ids):
            raise InvalidPayload("request ids must be unique among waiting requests")

    def expect(self, request_id: str, deadline_ms: int, want_reply: bool
               ) -> RequestFuture[Any]:
        """A future for ``request_id`` that fails with DeadlineExceeded at its deadline."""
        if request_id in self._waiters:
            raise InvalidPayload(f"request id {request_id!r} is already waiting for a reply")
        loop = asyncio.get_running_loop()
        future: RequestFuture[Any] = RequestFuture(request_id, loop, self.tag, self._forget)
        self._busy = True
        delay_s = max(0.0, (deadline_ms - protocol.now_ms()) / 1000)
        timer = loop.call_later(delay_s, self._expire, request_id)
        self._waiters[request_id] = Waiter(future, timer, want_reply, deadline_ms)
        return future

    def expect_stream(self, request_id: str, deadline_ms: int) -> ChunkQueue:
        """The queue of ``request_id``'s stream messages (``redbatch.producer.streams``)."""
        if request_id in self._waiters or request_id in self._streams:
            raise InvalidPayload(f"request id {request_id!r} is already waiting for a reply")
        self._busy = True
        queue = self._streams[request_id] = ChunkQueue(request_id, deadline_ms)
        delay_s = (deadline_ms - protocol.now_ms() + protocol.STREAM_GRACE_MS) / 1000
        asyncio.get_running_loop().call_later(max(0.0, delay_s), self._expire, request_id)
        return queue

    def _forget(self, request_id: str, future: asyncio.Future[Any]) -> None:
        """A caller that gave up (cancelled its future) frees its slot at once."""
        waiter = self._waiters.get(request_id)
        if waiter is not None and waiter.future is future:
            del self._waiters[request_id]
            waiter.timer.cancel()

    def fail(self, request_id: str, exc: BaseException) -> None:
        """Settle a waiter with ``exc`` (a cancellation cancels it; a foreign error is
        wrapped in ``RedbatchError``)."""
        waiter = self._waiters.pop(request_id, None)
        if waiter is None:
            if (stream := self._streams.pop(request_id, None)) is not None:
                stream.fail(exc)
            return
        waiter.timer.cancel()
        if waiter.future.done():
            return
        if isinstance(exc, asyncio.CancelledError):
            waiter.future.cancel()
        else:
            waiter.future.set_exception(exc if isinstance(exc, RedbatchError) else
                                        RedbatchError(f"request failed: {exc!r}"))

    def _expire(self, request_id: str) -> None:
        self.fail(request_id, DeadlineExceeded(f"no reply to request {request_id} before "
                                               "its deadline"))

    def dispatch(self, raw: bytes) -> None:
        try:
            wire = codec.decode(raw)
            if isinstance(wire, dict) and protocol.F_SEQ in wire:
                self._stream_message(wire, len(raw))
                return
            reply = protocol.reply_from_wire(wire)
        except Exception as exc:  # a foreign or corrupt reply must not stop the listener
            log.warning("dropped an undecodable reply on %s: %s: %s", self.reply_to,
                        type(exc).__name__, exc)
            return
        route = self._packs.pop(reply.id, None)
        if route is None:
            self._deliver(reply)
            return
        members, timer = route
        timer.cancel()
        for row, outcome in enumerate(packing.split_reply(reply, len(members))):
            self._deliver(packing.row_reply(reply, members[row], outcome))

    def _stream_message(self, wire: dict[str, Any], size: int) -> None:
        chunk = chunk_from_wire(wire)
        chunk.size = size
        stream = self._streams.get(chunk.id)
        if chunk.last:  # (a stream counts once, as a reply)
            self.stats.count(chunk.id, answered=stream is not None)
        if stream is None:  # its caller gave up, or awaits one reply (no stream)
            waiter = self._waiters.get(chunk.id)
            if waiter is not None and not chunk.last:  # the rest would go to nobody
                self._abandoned(chunk.id, waiter.deadline_ms)
            self.fail(chunk.id, InvalidPayload("the model streams its answers: call it "
                                               "with stream(), not predict()"))
            return
        before = stream.duplicates
        stream.put(chunk)
        self.stats.duplicates += stream.duplicates - before
        if stream.closed:
            del self._streams[chunk.id]
            if not chunk.last:  # failed here (a gap, too many chunks unread)
                self._abandoned(chunk.id, stream.deadline_ms)

    def _deliver(self, reply: protocol.Reply) -> None:
        waiter = self._waiters.pop(reply.id, None)
        late = waiter is not None and protocol.now_ms() > waiter.deadline_ms
        self.stats.count(reply.id, answered=waiter is not None and not late)
        if waiter is None:  # its caller already gave up (deadline) or never waited,
            if (stream := self._streams.pop(reply.id, None)) is not None:  # or streams
                stream.fail(error_from_code(reply.error_code, reply.error_message)
                            if not reply.ok else InvalidPayload(
                                "the model does not stream: call it with predict()"))
            return
        waiter.timer.cancel()
        if late:  # its timer is due but has not run: past the deadline, no answer counts
            reply = protocol.Reply(reply.id, False, error_code=DeadlineExceeded.code,
                                   error_message=f"the reply to request {reply.id} came "
                                   "after its deadline")
        resolve(waiter.future, reply, waiter.want_reply)

    async def _pop(self) -> list[bytes]:
        result: Any = await self._link.execute("BLMPOP", self._block_timeout_s, 1,
                                               self.reply_to, "LEFT", "COUNT", DRAIN_COUNT)
        return list(result[1]) if result else []

    async def _run(self) -> None:
        backoff_s = 0.05
        while not self._stopping:
            if self.idle_over():
                self._retire()
                await self._link.release()  # no pop in flight: the connection is free
                return
            try:
                for raw in await self._pop():
                    self.dispatch(raw)
                backoff_s = 0.05
            except Exception as exc:  # never die: every waiter of this process needs us
                if self._stopping:  # redis-py may turn our cancel into a connection error
                    return
                log.warning("reply listener: %s: %s; retrying in %.2f s", type(exc).__name__,
                            exc, backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_CAP_S)
