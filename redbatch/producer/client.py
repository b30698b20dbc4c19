"""The async producer: enqueue requests and await their replies."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis

from redbatch import codec, lua, protocol
from redbatch.checks import check_eviction
from redbatch.codec import Format
from redbatch.config import RedisSettings, check_socket_timeout
from redbatch.errors import ConfigError, DeadlineExceeded, QueueFull, RedbatchError
from redbatch.producer import rows
from redbatch.producer.admission import Admission
from redbatch.producer.enqueuer import Enqueuer
from redbatch.producer.listener import ReplyListener
from redbatch.protocol import Reply, Request
from redbatch.redis_conn import async_client, deadline_bound, translated

T = TypeVar("T")
log = logging.getLogger("redbatch.producer")
QUEUE_FULL_RETRY_AFTER_S = 1.0  # for the per-process waiter cap


class Client:
    """Async client: ``predict``, ``submit`` (a future, like Ray's ``.remote()``) and
    ``predict_many`` (one pipelined round trip for many requests).

    Use ``async with Client(url) as client`` or call ``start``/``close``; the first
    request starts a client that was not started.  Numpy inputs of one shape and dtype
    travel as multi-row requests of up to ``pack_rows`` rows: those of one
    ``predict_many``, and lone requests that reach one tick's enqueue together
    (``docs/protocol.md`` §3.1); ``pack_rows=1`` sends every input as its own entry.

    A request for a model that no worker registered fails at once with
    ``UnknownModel``, and one for a model without a live worker with
    ``NoLiveWorkers`` (both looked up once a second at most), as over HTTP: nothing
    is queued.  ``require_workers=False`` queues them anyway, for a worker that starts
    later (a batch job filled ahead of its workers).
    """

    def __init__(self, url: str | None = None, *, settings: RedisSettings | None = None,
                 default_timeout_s: float = 30.0, max_timeout_s: float = protocol.MAX_TIMEOUT_S,
                 max_queue_len: int = 10_000, max_waiters: int = 10_000,
                 block_timeout_s: float = 1.0, fmt: Format = "msgpack",
                 pack_rows: int = 32, require_workers: bool = True) -> None:
        self.settings = settings or RedisSettings.from_env(url)
        check_socket_timeout(self.settings, block_timeout_s)
        if not 0 < default_timeout_s <= max_timeout_s <= protocol.MAX_TIMEOUT_S:
            raise ConfigError("need 0 < default_timeout_s <= max_timeout_s <= "
                              f"{protocol.MAX_TIMEOUT_S}")
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.max_queue_len = max_queue_len
        self.max_waiters = max_waiters
        self.fmt: Format = fmt
        if not 1 <= pack_rows <= protocol.MAX_ROWS:
            raise ConfigError(f"pack_rows must be 1..{protocol.MAX_ROWS}, got {pack_rows}")
        self.pack_rows = pack_rows
        self.require_workers = require_workers
        self.client_id = protocol.new_id()
        self.reply_to = protocol.reply_key(self.client_id)
        self._block_timeout_s = block_timeout_s
        self._redis: aioredis.Redis | None = None
        self._listener: ReplyListener | None = None
        self._enqueuer: Enqueuer | None = None
        self._start_lock = asyncio.Lock()
        self._model_caps: dict[str, int] = {}  # set_queue_cap's, shared with admission

    # --- life cycle ---------------------------------------------------------
    async def start(self) -> None:
        """Connect (failing fast with ``RedisUnavailable``) and start the listener."""
        async with self._start_lock:
            if self._listener is not None:
                return
            redis = async_client(self.settings)
            try:
                async with translated(self.settings):
                    await redis.ping()
                    await check_eviction(redis)
                    await redis.script_load(lua.ENQUEUE)
            except BaseException:  # an error, or a deadline that passed meanwhile
                await redis.aclose()
                raise
            self._redis = redis
            self._admission = Admission(redis, self.max_queue_len, self._model_caps)
            listener = ReplyListener(redis, self.reply_to, self._block_timeout_s)
            self._enqueuer = Enqueuer(redis, self.settings, self._admission, self.fmt,
                                      self.pack_rows, listener.route_pack)
            self._listener = listener
            listener.start()

    async def close(self) -> None:
        if self._enqueuer is not None:
            await self._enqueuer.drain()
            self._enqueuer = None
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            raise RedbatchError("client is not started")
        return self._redis

    def set_queue_cap(self, model: str, cap: int | None) -> None:
        """A lower queue cap for ``model`` than ``max_queue_len`` (None: back to it)."""
        if cap is None:
            self._model_caps.pop(model, None)
        else:
            self._model_caps[model] = cap  # kept here: it holds before (and across) a start

    def _own_cap(self, model: str, cap: int | None) -> None:
        """A submit's cap for ``model`` (None: leave it as it is); one dict look-up."""
        if cap is not None and self._model_caps.get(model) != cap:
            self._model_caps[model] = cap

    async def live_workers(self, model: str, deadline_ms: int | None = None) -> int:
        """Live workers of ``model`` (cached for a second); a look-up in Redis (and a
        start) ends by ``deadline_ms`` (``DeadlineExceeded``)."""
        if self._listener is not None and (live := self._admission.live_cached(model)) \
                is not None:
            return live
        return await self._look_up(model, deadline_ms, self._admission.live)

    async def check_served(self, model: str, deadline_ms: int | None = None) -> None:
        """``UnknownModel`` or ``NoLiveWorkers`` (the gateway's errors) unless a live
        worker serves ``model``; cached for a second."""
        if self._listener is not None and self._admission.served_cached(model):
            return
        await self._look_up(model, deadline_ms, self._admission.check_served)

    async def _look_up(self, model: str, deadline_ms: int | None,
                       read: Callable[[str], Awaitable[T]]) -> T:
        """``read(model)`` from the registry (starting the client if needed), ending by
        ``deadline_ms``, with Redis errors translated."""
        async with deadline_bound(deadline_ms, f"looking up the workers of {model!r}"):
            await self.start()
            async with translated(self.settings):
                return await read(model)

    def abandon(self, request_id: str, why: RedbatchError) -> None:
        """Give up waiting for a request: its waiter fails with ``why`` now, freeing
        its slot under ``max_waiters``.  (``mark_cancelled`` spares the worker too.)"""
        if self._listener is not None:
            self._listener.fail(request_id, why)

    async def mark_cancelled(self, model: str, request_id: str, deadline_ms: int) -> None:
        """Mark a queued request cancelled in Redis (one MULTI), so that a worker that
        claims it skips it without computing."""
        now = protocol.now_ms()
        if deadline_ms <= now:
            return  # a worker answers an expired request without computing anyway
        key, ttl_ms = protocol.cancelled_key(model), protocol.marker_ttl_ms(deadline_ms, now)
        async with translated(self.settings), self.redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.zadd(key, {request_id: deadline_ms})
            pipe.zremrangebyrank(key, 0, -protocol.CANCELLED_MAX - 1)
            pipe.pexpire(key, ttl_ms, nx=True)  # a new set: expires with this deadline
            pipe.pexpire(key, ttl_ms, gt=True)  # else only ever later
            await pipe.execute()

    def stats(self) -> dict[str, int]:
        """Replies received by this process, and the duplicates and late ones among them."""
        base = self._listener.stats.as_dict() if self._listener else {}
        return {"waiting": self.waiting, **base}

    @property
    def waiting(self) -> int:
        return self._listener.waiting if self._listener else 0

    # --- requests -----------------------------------------------------------
    def deadline_ms(self, timeout_s: float | None) -> int:
        """Absolute deadline: ``timeout_s`` (default if None), capped at the maximum."""
        chosen = self.default_timeout_s if timeout_s is None else timeout_s
        chosen = min(max(chosen, 0.0), self.max_timeout_s)
        return protocol.now_ms() + round(chosen * 1000)

    def _request(self, model: str, inputs: Any, deadline_ms: int, request_id: str | None,
                 trace_id: str = "", rows: int = 0) -> Request:
        return Request(id=request_id or protocol.new_request_id(), model=model,
                       enqueue_ms=protocol.now_ms(), deadline_ms=deadline_ms,
                       reply_to=self.reply_to, payload=inputs, trace_id=trace_id, rows=rows)

    async def _ready(self, model: str, count: int, deadline_ms: int) -> ReplyListener:
        """The listener (starting the client if needed), once ``model`` is a valid name
        and ``count`` more waiters fit under ``max_waiters``: checked before any work.
        The start and the worker check end by ``deadline_ms``."""
        if self._listener is None:
            async with deadline_bound(deadline_ms, "connecting to Redis"):
                await self.start()
        assert self._listener is not None
        protocol.check_model_name(model)
        if self._listener.waiting + count > self.max_waiters:
            raise QueueFull(f"{count} more requests would pass this process's "
                            f"max_waiters={self.max_waiters} ({self._listener.waiting} "
                            "already wait)", QUEUE_FULL_RETRY_AFTER_S)
        if self.require_workers:
            await self.check_served(model, deadline_ms)
        return self._listener

    async def submit_many(self, model: str, inputs: Sequence[Any], timeout_s: float | None = None,
                          *, want_reply: bool = False, request_ids: Sequence[str] | None = None,
                          max_queue_len: int | None = None) -> list[asyncio.Future[Any]]:
        """Enqueue every input in one round trip; return one future per input.

        A future resolves to the model's output (or, with ``want_reply``, the whole
        ``Reply``) and raises a typed ``RedbatchError`` otherwise.  ``max_queue_len``:
        the model's own queue cap, as ``set_queue_cap`` sets it."""
        if not inputs:
            return []
        self._own_cap(model, max_queue_len)
        per_request = 1 if request_ids else rows.rows_per_request(inputs, self.pack_rows)
        if per_request > 1:
            return await self._submit_rows(model, inputs, per_request, timeout_s, want_reply)
        deadline = self.deadline_ms(timeout_s)
        listener = await self._ready(model, len(inputs), deadline)
        ids = list(request_ids) if request_ids else [None] * len(inputs)
        requests = [self._request(model, x, deadline, rid) for x, rid in zip(inputs, ids,
                                                                              strict=True)]
        entries = [codec.encode(r.to_wire(), self.fmt) for r in requests]
        listener.check_new([r.id for r in requests])
        futures = [listener.expect(r.id, deadline, want_reply) for r in requests]
        await self._push(model, requests, entries)
        return futures

    async def _submit_rows(self, model: str, inputs: Sequence[Any], per_request: int,
                           timeout_s: float | None, want_reply: bool
                           ) -> list[asyncio.Future[Any]]:
        """Same-shape arrays go as multi-row requests of ``per_request`` rows: one
        queue entry and one reply per chunk, one future per input all the same."""
        chunks = rows.chunks(inputs, per_request)
        deadline = self.deadline_ms(timeout_s)
        listener = await self._ready(model, len(chunks), deadline)
        requests = [self._request(model, np.stack(chunk), deadline, None, rows=len(chunk))
                    for chunk in chunks]
        entries = [codec.encode(r.to_wire(), self.fmt) for r in requests]
        waiters = [listener.expect(r.id, deadline, True) for r in requests]
        await self._push(model, requests, entries)
        return [f for waiter, chunk in zip(waiters, chunks, strict=True)
                for f in rows.split(waiter, len(chunk), want_reply)]

    async def submit_tensor(self, model: str, tensor: np.ndarray[Any, Any], deadline_ms: int,
                            *, max_queue_len: int | None = None
                            ) -> list[tuple[int, asyncio.Future[Reply]]]:
        """The rows of ``tensor`` (its first dimension) as multi-row requests, sliced,
        never split into rows: one entry per up to ``pack_rows`` rows (and
        ``rows.PACK_BYTES``), in one enqueue.  Returns each request's first row and
        the future of its whole ``Reply`` (``rows.split_reply`` reads its rows)."""
        self._own_cap(model, max_queue_len)
        per = rows.pack_size(tensor.nbytes // max(1, len(tensor)), self.pack_rows)
        starts = range(0, len(tensor), per)
        listener = await self._ready(model, len(starts), deadline_ms)
        requests = [self._request(model, part, deadline_ms, None, rows=len(part))
                    for part in (tensor[start:start + per] for start in starts)]
        entries = [codec.encode(r.to_wire(), self.fmt) for r in requests]
        waiters = [listener.expect(r.id, deadline_ms, True) for r in requests]
        await self._push(model, requests, entries)
        return list(zip(starts, waiters, strict=True))

    async def _push(self, model: str, requests: list[Request], entries: list[bytes]) -> None:
        assert self._listener is not None
        try:
            accepted, full = await self._admit(model, requests, entries)
        except BaseException:  # cancelled, or any error: no waiter may linger, and the
            for request in requests:  # caller gets the error, not these futures
                self._listener.fail(request.id, asyncio.CancelledError())
            raise
        for request in requests[accepted:]:
            self._listener.fail(request.id, full or QueueFull("queue full"))

    async def _admit(self, model: str, requests: list[Request], entries: list[bytes]
                     ) -> tuple[int, QueueFull | None]:
        """Enqueue (coalesced with this tick's other pushes) within the deadline."""
        assert self._enqueuer is not None
        budget_s = max(0.001, (requests[0].deadline_ms - protocol.now_ms()) / 1000)
        try:
            return await asyncio.wait_for(self._enqueuer.push(model, requests, entries),
                                          budget_s)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"deadline passed while enqueueing to {model!r}") from exc

    async def submit(self, model: str, inputs: Any, timeout_s: float | None = None
                     ) -> asyncio.Future[Any]:
        """Enqueue one request; the returned future resolves to its output."""
        (future,) = await self.submit_many(model, [inputs], timeout_s)
        return future

    async def predict(self, model: str, inputs: Any, timeout_s: float | None = None) -> Any:
        """Run ``model`` on one input and return its output (or raise a typed error)."""
        _id, future = await self._send_one(model, inputs, timeout_s, None, want_reply=False)
        return await future

    async def predict_reply(self, model: str, inputs: Any, timeout_s: float | None = None,
                            request_id: str | None = None, *, trace_id: str = "") -> Reply:
        """Like ``predict`` but return the whole ``Reply`` (timings, error code);
        ``trace_id`` travels with the request (``X-Request-ID``) for the logs."""
        _id, future = await self._send_one(model, inputs, timeout_s, request_id,
                                           want_reply=True, trace_id=trace_id)
        reply: Reply = await future
        return reply

    async def submit_reply(self, model: str, inputs: Any, timeout_s: float | None = None,
                           *, trace_id: str = "", deadline_ms: int | None = None,
                           max_queue_len: int | None = None
                           ) -> tuple[str, asyncio.Future[Reply]]:
        """Enqueue one request as ``predict_reply`` does; return its id at once, with a
        future for its ``Reply`` (the gateway names the request in its errors too).
        ``deadline_ms`` (absolute) takes the place of ``timeout_s``; ``max_queue_len``
        is the model's own queue cap, as ``set_queue_cap`` sets it."""
        self._own_cap(model, max_queue_len)
        return await self._send_one(model, inputs, timeout_s, None, want_reply=True,
                                    trace_id=trace_id, deadline_ms=deadline_ms)

    async def _send_one(self, model: str, inputs: Any, timeout_s: float | None,
                        request_id: str | None, *, want_reply: bool, trace_id: str = "",
                        deadline_ms: int | None = None) -> tuple[str, asyncio.Future[Any]]:
        """The lean path of ``predict``: one waiter, whose deadline timer also bounds
        the enqueue; the push's outcome settles it through a callback (no task, no
        second timer).  Returns the request's id and its waiter."""
        deadline = self.deadline_ms(timeout_s) if deadline_ms is None else deadline_ms
        listener = await self._ready(model, 1, deadline)
        assert self._enqueuer is not None
        request = self._request(model, inputs, deadline, request_id, trace_id)
        # an id of our own: encoded (or packed) at the flush; a caller's: now, alone, so
        # that its marker dedupes the caller's retries
        entries = [codec.encode(request.to_wire(), self.fmt)] if request_id else None
        future = listener.expect(request.id, request.deadline_ms, want_reply)
        pushed = self._enqueuer.push(model, [request], entries)
        pushed.add_done_callback(functools.partial(self._pushed, request.id))
        return request.id, future

    def _pushed(self, request_id: str,
                pushed: asyncio.Future[tuple[int, QueueFull | None]]) -> None:
        """Fail the waiter of a push that was refused or failed (the outcome is read
        first, so that it is consumed even after ``close``)."""
        exc = asyncio.CancelledError() if pushed.cancelled() else pushed.exception()
        listener = self._listener
        if listener is None:  # closed meanwhile: close() already failed every waiter
            return
        if exc is not None:
            listener.fail(request_id, exc)
        elif (result := pushed.result())[0] < 1:
            listener.fail(request_id, result[1] or QueueFull("queue full"))

    async def predict_many(self, model: str, inputs: Sequence[Any],
                           timeout_s: float | None = None, *, return_exceptions: bool = False
                           ) -> list[Any]:
        """Send many requests in one pipelined round trip; outputs in input order."""
        futures = await self.submit_many(model, inputs, timeout_s)
        return list(await asyncio.gather(*futures, return_exceptions=return_exceptions))
