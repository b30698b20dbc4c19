"""The async producer: enqueue requests and await their replies."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis

from redbatch import codec, defaults, knobs, lua, protocol, versions
from redbatch.checks import check_eviction
from redbatch.codec import Format
from redbatch.config import RedisSettings, ReplicaWait, check_client, check_socket_timeout
from redbatch.errors import ConfigError, InvalidPayload, QueueFull, RedbatchError
from redbatch.lean import LeanLink
from redbatch.pipelines.book import PipelineBook
from redbatch.pipelines.definition import Pipeline
from redbatch.pipelines.enter import asked_priority, enter
from redbatch.producer.admission import Admission
from redbatch.producer.enqueuer import Enqueuer, Outcome
from redbatch.producer.listener import RequestFuture
from redbatch.producer.listeners import Listeners
from redbatch.producer.plain import PlainModels
from redbatch.producer.replication import check_replicas
from redbatch.producer.streams import CANCEL_TIMEOUT_S, ChunkQueue, Stream
from redbatch.protocol import Request
from redbatch.redis_conn import (
    add_by_deadline,
    async_client,
    deadline_bound,
    idempotent,
    translated,
)

T = TypeVar("T")
log = logging.getLogger("redbatch.producer")


class Client:
    """Async client: ``predict``, ``submit`` (a future, like Ray's ``.remote()``),
    ``predict_many`` and ``submit_many`` (one pipelined round trip for many requests);
    ``reply=True`` gives the whole ``Reply`` (timings, error code) for the output.  A
    model with named inputs and outputs takes a dict input name -> value per request
    (``predict("pair", {"x": x, "scale": 2.0})``; lists of dicts for the ``_many``
    calls) and answers a dict output name -> value.

    Use ``async with Client(url) as client`` or call ``start``/``close``; the first
    request starts a client that was not started.  Numpy inputs of one shape and dtype
    travel as multi-row requests of up to ``pack_rows`` rows: those of one
    ``submit_many``, and lone requests that reach one tick's enqueue together
    (``docs/protocol.md`` §3.1); ``pack_rows=1`` sends every input as its own entry.

    A request for a model that no worker registered fails at once with
    ``UnknownModel``, and one for a model without a live worker with
    ``NoLiveWorkers`` (both looked up once a second at most), as over HTTP: nothing
    is queued.  ``require_workers=False`` queues them anyway, for a worker that starts
    later (a batch job filled ahead of its workers).

    A pipeline's name (``redbatch.pipelines``, ``docs/models.md``) is served like a
    model's: its request enters the first stage and its reply comes from the last (the
    registry of pipelines is read once a second at most).

    ``replica_wait`` (default: ``REDBATCH_WAIT_REPLICAS`` and
    ``REDBATCH_WAIT_TIMEOUT_MS``, off) follows each enqueue with a Redis ``WAIT``
    for that many replicas, bounded by the request's deadline; a WAIT that ends short
    is counted in ``stats()`` and logged, and the requests keep waiting for their
    replies (``docs/reliability.md``).
    """

    def __init__(self, url: str | None = None, *, settings: RedisSettings | None = None,
                 default_timeout_s: float = defaults.DEFAULT_TIMEOUT_S,
                 max_timeout_s: float = defaults.CLIENT_MAX_TIMEOUT_S,
                 max_queue_len: int = defaults.MAX_QUEUE_LEN,
                 max_waiters: int = defaults.MAX_WAITERS,
                 block_timeout_s: float = defaults.BLOCK_TIMEOUT_S, fmt: Format = "msgpack",
                 pack_rows: int = defaults.PACK_ROWS, require_workers: bool = True,
                 listener_idle_s: float = defaults.LISTENER_IDLE_S,
                 replica_wait: ReplicaWait | None = None) -> None:
        self.settings = settings or RedisSettings.from_env(url)
        check_client(block_timeout_s, listener_idle_s, max_queue_len, max_waiters)
        check_socket_timeout(self.settings, block_timeout_s)
        if not 0 < default_timeout_s <= max_timeout_s <= protocol.MAX_TIMEOUT_S:
            raise ConfigError("need 0 < default_timeout_s <= max_timeout_s <= "
                              f"{protocol.MAX_TIMEOUT_S}")
        # WAIT for replicas after each enqueue (docs/reliability.md); None: from the env
        self.replica_wait = ReplicaWait.from_env() if replica_wait is None else replica_wait
        self.replica_wait.check_budget(default_timeout_s, self.settings.socket_timeout_s)
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.max_queue_len = max_queue_len
        self.max_waiters = max_waiters
        if fmt not in ("msgpack", "json"):
            raise ConfigError(f"fmt must be 'msgpack' or 'json', got {fmt!r}")
        self.fmt: Format = fmt
        if not 1 <= pack_rows <= protocol.MAX_ROWS:
            raise ConfigError(f"pack_rows must be 1..{protocol.MAX_ROWS}, got {pack_rows}")
        self.pack_rows = pack_rows
        self.require_workers = require_workers
        self.client_id = protocol.new_id()
        self._block_timeout_s = block_timeout_s
        self._listener_idle_s = listener_idle_s
        self._redis: aioredis.Redis | None = None
        self._listeners: Listeners | None = None
        self._enqueuer: Enqueuer | None = None
        self._start_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that started it
        self._closed = False  # ``close`` was called, and ``start`` not since
        self._cancels: set[asyncio.Task[None]] = set()  # streams' cancels under way

    # --- life cycle ---------------------------------------------------------
    async def start(self) -> None:
        """Connect (failing fast with ``RedisUnavailable``); each model's reply listener
        starts with its first request.  A closed client starts again (on any loop)."""
        self._closed = False
        await self._open()

    async def _open(self) -> None:
        """``start``, as a request (or an admin call) does it when the client is not
        started yet: ``RedbatchError`` once ``close`` was called (a request racing the
        close, or made after it, never opens a new connection pool that nobody closes)."""
        self._check_loop()
        async with self._start_lock:
            if self._closed:
                raise RedbatchError("the client is closed (start it again to use it)")
            if self._listeners is not None:
                return
            # each running reply listener (one per model in use) holds a connection: room
            # for them beside the commands', so that many models never starve the enqueues
            redis = async_client(self.settings,
                                 defaults.REDIS_MAX_CONNECTIONS + defaults.MAX_LISTENERS)
            try:
                async with translated(self.settings):
                    await redis.ping()
                    await check_eviction(redis)
                    await check_replicas(redis, self.replica_wait)
                    for script in lua.PRODUCER_SCRIPTS:  # EVALSHA finds them loaded
                        await redis.script_load(script)
            except BaseException:  # an error, or a deadline that passed meanwhile
                await redis.aclose()
                raise
            self._redis = redis
            self._admission = Admission(redis, self.max_queue_len)
            self._pipelines = PipelineBook(redis)
            self._plain = PlainModels(self._admission, self._pipelines)
            self._pipeline_link = LeanLink(redis)  # one held connection: pipeline entries
            listeners = Listeners(redis, self.client_id, self._block_timeout_s,
                                  self._listener_idle_s, self._cancel_soon)
            self._enqueuer = Enqueuer(redis, self.settings, self._admission, self._failed,
                                      self.fmt, self.pack_rows, listeners.route_pack,
                                      self.replica_wait)
            self._listeners = listeners
            self._loop = asyncio.get_running_loop()

    def _check_loop(self) -> None:
        """``RedbatchError`` when a started client is used from another event loop than
        the one that started it (its connections, listeners and tasks live there);
        a closed client may be started again on any loop (``start``)."""
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is loop:
            return
        if self._listeners is not None:
            raise RedbatchError("this Client was started on another event loop: use one "
                                "Client per loop, or close it and start it again there")
        self._loop, self._start_lock = None, asyncio.Lock()  # (closed: start afresh)

    async def close(self) -> None:
        # every task on the pool ends before it closes: one that went on would take a
        # connection of the closed pool and leave it open; the pool closes even if
        # ending one of them failed (behind Sentinel, its sentinels' links with it);
        # a start under way (a request's) ends first, so that close closes what it made;
        # requests refuse to start it again (``_open``) until ``start`` is called
        self._closed = True
        async with self._start_lock:
            try:
                await self._end_tasks()
            finally:
                redis, self._redis = self._redis, None
                if redis is not None:
                    await redis.aclose()

    async def _end_tasks(self) -> None:
        if self._enqueuer is not None:
            await self._enqueuer.drain()
            self._enqueuer = None
        if self._listeners is not None:
            await self._listeners.stop()  # (its open streams: cancels, ``_cancel_soon``)
            self._listeners = None
        await asyncio.gather(*self._cancels, return_exceptions=True)  # (bounded each)
        if self._redis is not None:  # started: the admission's reads end first
            await self._admission.aclose()
            await self._pipelines.aclose()

    def _cancel_soon(self, model: str, request_id: str, deadline_ms: int
                     ) -> asyncio.Task[None] | None:
        """Mark a request of ``model`` (its sub-queue) cancelled in Redis, off the
        caller's path: a task bounded by ``CANCEL_TIMEOUT_S`` (an error is logged),
        which ``close`` waits for before the connection pool closes; none once the
        client is closed (its close cancelled what was open)."""
        if self._redis is None:
            return None
        loop = asyncio.get_running_loop()  # (before the coroutine: none left unawaited)
        task = loop.create_task(self._mark_cancelled(model, request_id, deadline_ms))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)
        return task

    async def _mark_cancelled(self, model: str, request_id: str, deadline_ms: int) -> None:
        try:
            await asyncio.wait_for(self.mark_cancelled(model, request_id, deadline_ms),
                                   CANCEL_TIMEOUT_S)
        except (RedbatchError, TimeoutError) as exc:
            log.warning("could not mark request %s of model %s cancelled: %s",
                        request_id, model, exc or type(exc).__name__)

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

    async def live_workers(self, model: str, deadline_ms: int | None = None) -> int:
        """Live workers of ``model`` (cached for a second); a look-up in Redis (and a
        start) ends by ``deadline_ms`` (``DeadlineExceeded``)."""
        protocol.check_model_name(model)
        if self._listeners is not None and (live := self._admission.live_cached(model)) \
                is not None:
            return live
        return await self._look_up(model, deadline_ms, self._admission.live)

    async def check_served(self, model: str, deadline_ms: int | None = None) -> None:
        """``UnknownModel`` or ``NoLiveWorkers`` (the gateway's errors) unless a live
        worker serves ``model``; cached for a second."""
        if self._listeners is not None and self._admission.served_cached(model):
            return
        await self._look_up(model, deadline_ms, self._admission.check_served)

    async def _look_up(self, model: str, deadline_ms: int | None,
                       read: Callable[[str], Awaitable[T]]) -> T:
        """``read(model)`` from the registry (starting the client if needed), ending by
        ``deadline_ms``, with Redis errors translated."""
        async with deadline_bound(deadline_ms, f"looking up the workers of {model!r}"):
            await self._open()
            async with translated(self.settings):
                return await read(model)

    async def route(self, model: str, version: str | None = None,
                    deadline_ms: int | None = None) -> str:
        """Where a request for ``model`` goes: ``model`` itself, or the served name of
        the version it pins (``version``) or its routing table picks by weight
        (``redbatch.versions``); the table comes with the model's live summary (cached
        for a second: no read per request)."""
        protocol.check_pin(model, version)  # input only: refused before any read
        if version is not None:
            protocol.check_version(version)
        elif protocol.VERSION_SEP in model:  # a version's served name: as if pinned
            return await self._served_version(model, deadline_ms)
        table = self._admission.table_cached(model) if self._listeners is not None else None
        if table is None:  # stale or not started: read (once for every caller)
            table = await self.table(model, deadline_ms)
        if version is not None or not table:
            return table.route(model, version)
        return await self._pick_live(model, table, deadline_ms)

    async def _pick_live(self, model: str, table: versions.Table, deadline_ms: int | None
                         ) -> str:
        """The served name of a version picked by weight among those with a live worker
        (a version none serves, weighted or latest, would fail its share of the
        requests): the cached live counts first, then each pick's, read if stale."""
        dead = self._dead_versions(model, table)
        while True:
            version = table.pick(model, dead=dead)
            served = table.served(model, version)
            if await self.live_workers(served, deadline_ms):
                return served
            dead.add(version)

    def _dead_versions(self, model: str, table: versions.Table) -> set[str]:
        """The versions whose cached live count is 0 (no I/O; stale ones not known)."""
        return {v for v in table.versions
                if self._admission.live_cached(table.served(model, v)) == 0}

    async def _served_version(self, name: str, deadline_ms: int | None) -> str:
        """``name`` (``<model>@<version>``), checked against its model's table like a
        pinned version (a draining one refused), when the table lists it."""
        protocol.check_model_name(name)
        model, version = protocol.split_name(name)
        assert version is not None
        table = await self.table(model, deadline_ms)
        return table.route(model, version) if version in table.versions else name

    def direct(self, model: str) -> bool:
        """Whether a request for ``model`` that pins no version goes straight to the
        model's own queue (``redbatch.producer.plain``): served without versions, in
        one sub-queue, by a live worker, and no pipeline, as the cached live summary
        and the pipeline book know (no I/O; False while that summary is stale or the
        book has never answered for ``model``). The gateway skips its look-ups then."""
        return self._listeners is not None and self._plain.plain(model)

    def cached_pick(self, model: str) -> str | None:
        """The version a request for ``model`` that pins none goes to, picked by weight
        from the cached table (no I/O), leaving out the versions whose cached live count
        is 0: None when the cache is stale, or the model has no versions (the gateway
        labels its request metrics with it)."""
        table = self._admission.table_cached(model) if self._listeners is not None else None
        return table.choose(dead=self._dead_versions(model, table)) if table else None

    def has_versions(self, model: str) -> bool:
        """Whether ``model``'s cached table lists versions (no I/O; False when stale)."""
        table = self._admission.table_cached(model) if self._listeners is not None else None
        return bool(table)

    async def table(self, model: str, deadline_ms: int | None = None) -> versions.Table:
        """``model``'s version routing table (empty: served without versions), read
        with its live summary (cached for a second)."""
        if self._listeners is not None and (table := self._admission.table_cached(model)) \
                is not None:  # the name was checked before it was read
            return table
        protocol.check_model_name(model)
        return await self._look_up(model, deadline_ms, self._read_table)

    async def _read_table(self, model: str) -> versions.Table:
        return await self._admission.table(model)  # started by then (``_look_up``)

    async def configure(self, model: str, *, reset: bool = False, **values: Any
                        ) -> dict[str, Any]:
        """An admin call: change ``model``'s live batching knobs (``max_batch_size=16``,
        ``batch_wait_timeout_s=0.01``, ...; None drops an override), after dropping
        every override with ``reset``.  Every worker of the model applies them within
        two seconds, and they outlive worker restarts.  Returns ``{"overrides": ...,
        "effective": ...}``; with no knobs and no reset, changes nothing.  A bad knob
        or value raises ``InvalidKnob`` (a ``ConfigError``) and stores nothing."""
        await self._open()
        async with translated(self.settings):
            if not values and not reset:
                return await knobs.show(self.redis, model)
            return await knobs.configure(self.redis, model, values, reset=reset)

    async def versions(self, model: str, *, weights: dict[str, float] | None = None,
                       latest: str | None = None, drain: str | None = None,
                       undrain: str | None = None) -> dict[str, Any]:
        """An admin call: show ``model``'s versions, or change their traffic split
        (``weights={"1": 95, "2": 5}``), pin ``latest`` (``""`` unpins it), ``drain`` a
        version (no new traffic; its workers stop once its queue is empty) or
        ``undrain`` it.  Gateways and clients apply a change within about a second.
        Returns what ``GET /v1/models/{model}/versions`` shows."""
        await self._open()
        changes = {"latest": latest, "drain": drain, "undrain": undrain}
        async with translated(self.settings):
            table = None
            if weights or any(v is not None for v in changes.values()):
                table = await versions.change(self.redis, model, weights=weights, **changes)
            return await versions.describe(self.redis, model, table)

    def abandon(self, request_id: str, why: RedbatchError, model: str | None = None) -> None:
        """Give up waiting for a request (of ``model``, if given: for a sharded model,
        the sub-queue it went to, its future's ``tag``): its waiter fails with ``why``
        now, freeing its slot under ``max_waiters``.  (``mark_cancelled`` spares the
        worker too.)"""
        if self._listeners is not None:
            self._listeners.fail(request_id, why, model)

    async def mark_cancelled(self, model: str, request_id: str, deadline_ms: int) -> None:
        """Mark a queued request cancelled in Redis (one MULTI), so that a worker that
        claims it skips it without computing (``model``: for a sharded model, the
        sub-queue the request went to, its future's ``tag``).  A request this client
        packed with others into one multi-row entry is computed with its pack (the
        worker sees the pack's id alone); its reply is dropped."""
        if deadline_ms <= protocol.now_ms():
            return  # a worker answers an expired request without computing anyway
        async with translated(self.settings):
            await add_by_deadline(self.redis, protocol.cancelled_key(model),
                                  {request_id: deadline_ms}, protocol.CANCELLED_MAX)

    def stats(self) -> dict[str, int]:
        """Replies received by this process (over its listeners, stopped ones included),
        the duplicates and late ones among them, and the reply listeners running now
        (one per model with requests in flight lately) and started so far; with
        ``replica_wait`` on, the WAITs sent and the requests whose WAIT ended short
        (``enqueue_waits``, ``enqueue_unreplicated``)."""
        listeners = self._listeners
        if listeners is None:
            return {"waiting": 0}
        waiter = self._enqueuer.waiter if self._enqueuer else None
        return {"waiting": self.waiting, **listeners.stats.as_dict(),
                "listeners": listeners.running, "listeners_started": listeners.started,
                **(waiter.stats() if waiter else {})}

    @property
    def waiting(self) -> int:
        return self._listeners.waiting if self._listeners else 0

    def reply_to(self, model: str) -> str:
        """The reply list of this client's requests for ``model``."""
        return protocol.reply_key(model, self.client_id)

    # --- requests -----------------------------------------------------------
    def deadline_ms(self, timeout_s: float | None) -> int:
        """Absolute deadline: ``timeout_s`` (default if None), capped at the maximum."""
        chosen = self.default_timeout_s if timeout_s is None else timeout_s
        if isinstance(chosen, bool) or not isinstance(chosen, int | float) or \
                math.isnan(chosen):
            raise InvalidPayload(f"timeout_s must be a number of seconds, got {chosen!r}")
        chosen = min(max(chosen, 0.0), self.max_timeout_s)
        return protocol.now_ms() + round(chosen * 1000)

    def _request(self, model: str, inputs: Any, deadline_ms: int, request_id: str | None,
                 reply_to: str, trace_id: str = "", rows: int = 0, priority: int = 0
                 ) -> Request:
        return Request(id=request_id or protocol.new_request_id(), model=model,
                       enqueue_ms=protocol.now_ms(), deadline_ms=deadline_ms,
                       reply_to=reply_to, payload=inputs, trace_id=trace_id, rows=rows,
                       priority=priority)

    async def _level(self, model: str, priority: int, deadline_ms: int) -> int:
        """The level of a request that asks for ``priority``, checked against the
        model's levels as its workers publish them (a request that asks for none goes
        to the model's default level, decided at the enqueue: nothing per request); the
        look-up ends by ``deadline_ms``."""
        summary = self._admission.summary_cached(model)
        if summary is not None:  # (no I/O: no bound to set up)
            levels = summary.levels
        else:
            async with deadline_bound(deadline_ms, f"looking up the levels of {model!r}"), \
                    translated(self.settings):
                levels = await self._admission.levels(model)
        level = levels.resolve(model, priority)
        return level if levels.many else 0  # one level: the plain path, no field

    async def _route(self, model: str, request_id: str | None, deadline_ms: int) -> str:
        """The sub-queue a request of ``model`` joins (``routing.Router.pick``): the
        model's own queue while it has one sub-queue (its count is cached with the
        live workers: no round trip; a look-up ends by ``deadline_ms``)."""
        count = self._admission.sub_queues_cached(model)
        if count is None:
            async with deadline_bound(deadline_ms, f"looking up the sub-queues of "
                                                   f"{model!r}"), translated(self.settings):
                count = await self._admission.sub_queues(model)
        return model if count == 1 else self._pusher().router.pick(model, count, request_id)

    def _pusher(self) -> Enqueuer:
        """The enqueuer; ``RedbatchError`` once ``close`` has begun (a request racing
        the close fails typed, before its waiter is made)."""
        if self._enqueuer is None:
            raise RedbatchError("client is closing")
        return self._enqueuer

    async def _ready(self, model: str, count: int, deadline_ms: int) -> Listeners:
        """The listeners (starting the client if needed), once ``model`` is a valid
        name and ``count`` more waiters fit under ``max_waiters``: checked before any
        work.  The start and the worker check end by ``deadline_ms``.  (A waiter goes
        to its model's listener in the step that makes it: ``Listeners.expect``.)"""
        self._check_loop()
        if self._listeners is None:
            async with deadline_bound(deadline_ms, "connecting to Redis"):
                await self._open()
        listeners = self._listeners
        if listeners is None:  # (closed meanwhile)
            raise RedbatchError("client is closing")
        protocol.check_model_name(model)
        self._check_room(listeners, count)
        if self.require_workers:
            await self.check_served(model, deadline_ms)
        return listeners

    def _check_room(self, listeners: Listeners, count: int) -> None:
        """``QueueFull`` unless ``count`` more waiters fit under ``max_waiters``."""
        if (waiting := listeners.waiting) + count > self.max_waiters:
            raise QueueFull(f"{count} more requests would pass this process's "
                            f"max_waiters={self.max_waiters} ({waiting} already wait)",
                            defaults.RETRY_AFTER_S)

    def _deadline(self, timeout_s: float | None, deadline_ms: int | None) -> int:
        if deadline_ms is None:
            return self.deadline_ms(timeout_s)
        if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int):
            raise InvalidPayload(f"deadline_ms must be epoch milliseconds (an int), got "
                                 f"{deadline_ms!r}")
        return deadline_ms

    async def submit(self, model: str, inputs: Any, timeout_s: float | None = None, *,
                     reply: bool = False, request_id: str | None = None, trace_id: str = "",
                     deadline_ms: int | None = None, max_queue_len: int | None = None,
                     priority: int | None = None, version: str | None = None
                     ) -> RequestFuture[Any]:
        """Enqueue one request; return its future at once (``.request_id`` names it).

        It resolves to the model's output (``reply=True``: the whole ``Reply``, with
        its timings and error code) and raises a typed ``RedbatchError`` otherwise.
        ``request_id``: the caller's own (its marker dedupes the caller's retries);
        ``trace_id`` travels with the request for the logs (the gateway's
        ``X-Request-ID``); ``deadline_ms`` (absolute) takes the place of ``timeout_s``;
        ``max_queue_len``: the model's own queue cap, below the client's; ``priority``:
        the request's priority level, 1 the most urgent (None or 0: the model's default;
        out of its range: ``InvalidPayload``); ``version``: the model's version to run
        (None: by its routing table's weights, ``redbatch.versions``)."""
        deadline = self._deadline(timeout_s, deadline_ms)
        _check_call(model, [request_id] if request_id is not None else None, max_queue_len)
        if version is None and self.direct(model):  # the plain path: no look-up awaited
            return await self._submit_direct(model, inputs, reply=reply,
                                             request_id=request_id, trace_id=trace_id,
                                             deadline_ms=deadline,
                                             max_queue_len=max_queue_len, priority=priority)
        model, listeners, pipeline = await self._resolve(model, version, 1, deadline)
        if pipeline is not None:
            return await self._enter(pipeline, listeners, inputs, deadline, reply,
                                     request_id, trace_id, asked_priority(priority),
                                     cap=max_queue_len)
        level = 0 if priority is None else await self._level(model, priority, deadline)
        tag = await self._route(model, request_id, deadline)
        return self._expect(listeners, model, tag, inputs, deadline, reply, request_id,
                            trace_id, max_queue_len, level)

    async def _submit_direct(self, model: str, inputs: Any, *, deadline_ms: int,
                             reply: bool = False, request_id: str | None = None,
                             trace_id: str = "", max_queue_len: int | None = None,
                             priority: int | None = None) -> RequestFuture[Any]:
        """``submit`` of a request that pins no version, for a model its caller found
        ``direct`` just now (the gateway's infer core, once a request's body is read;
        not a public request method): straight to the model's own queue, the verdict
        not taken again.  ``RedbatchError`` unless the client is started (``direct`` is
        False before) or once ``close`` has begun."""
        listeners = self._listeners
        if listeners is None:
            raise RedbatchError("client is not started")
        self._check_loop()
        self._check_room(listeners, 1)
        level = 0 if priority is None else await self._level(model, priority, deadline_ms)
        return self._expect(listeners, model, model, inputs, deadline_ms, reply, request_id,
                            trace_id, max_queue_len, level)

    def _expect(self, listeners: Listeners, model: str, tag: str, inputs: Any,
                deadline_ms: int, reply: bool, request_id: str | None, trace_id: str,
                cap: int | None, level: int) -> RequestFuture[Any]:
        """One request of ``model`` into sub-queue ``tag``: its waiter, then its push
        (``RedbatchError`` once ``close`` has begun: no waiter then)."""
        enqueuer = self._enqueuer
        if enqueuer is None:
            raise RedbatchError("client is closing")
        request = self._request(model, inputs, deadline_ms, request_id,
                                listeners.reply_to(tag), trace_id, priority=level)
        # an id of our own: encoded (or packed) at the flush; a caller's: now, alone, so
        # that its marker dedupes the caller's retries
        entries = [codec.encode(request.to_wire(), self.fmt)] if request_id else None
        self._check_room(listeners, 1)  # again: other callers may have awaited past it
        future = listeners.expect(tag, request.id, deadline_ms, reply)
        # the enqueue goes out with this tick's flush, bounded by the waiters' own
        # deadline timers; the enqueuer settles refused or failed waiters (``_failed``)
        enqueuer.push(tag, [request], entries, cap, level)
        return future

    async def submit_many(self, model: str, inputs: Sequence[Any],
                          timeout_s: float | None = None, *, reply: bool = False,
                          request_ids: Sequence[str] | None = None, batched: bool = False,
                          deadline_ms: int | None = None, max_queue_len: int | None = None,
                          priority: int | None = None, version: str | None = None
                          ) -> list[RequestFuture[Any]]:
        """Enqueue every input in one round trip; return one future per input, as
        ``submit`` does, once they are enqueued or refused (refusals and other errors
        are in the futures), so that a caller pacing itself on the queue's depth sees
        them there.  Numpy inputs of one shape and dtype travel packed, as multi-row
        requests of up to ``pack_rows`` rows.  ``batched``: each input is
        itself a batch of rows along its first dimension (1 to ``MAX_ROWS``; for a
        model with named inputs, a map input name -> rows), sent whole as one
        multi-row request; its future resolves to the rows' outputs (or
        its ``Reply``, whose ``row_errors`` name the failed rows).  ``priority`` and
        ``version``: as for ``submit``, for every input."""
        if not _rows_of(inputs):
            return []
        deadline = self._deadline(timeout_s, deadline_ms)
        _check_call(model, request_ids, max_queue_len)
        direct = self._plain_ready(model, version, len(inputs))
        model, listeners, pipeline = (model, direct, None) if direct is not None \
            else await self._resolve(model, version, len(inputs), deadline)
        if request_ids is not None and len(request_ids) != len(inputs):
            raise InvalidPayload(f"{len(request_ids)} request ids for {len(inputs)} inputs: "
                                 "give one id per input")
        ids: list[str | None] = list(request_ids) if request_ids else [None] * len(inputs)
        if pipeline is not None:  # one entry per input
            return list(await asyncio.gather(*(
                self._enter(pipeline, listeners, x, deadline, reply, rid, "",
                            asked_priority(priority), _rows(x) if batched else 0,
                            max_queue_len)
                for x, rid in zip(inputs, ids, strict=True))))
        level = 0 if priority is None else await self._level(model, priority, deadline)
        first = model if direct is not None else await self._route(model, ids[0], deadline)
        groups = await self._route_many(model, ids, first, deadline) \
            if request_ids and first != model else {first: list(range(len(ids)))}
        built = {tag: [self._request(model, inputs[i], deadline, ids[i],
                                     listeners.reply_to(tag),
                                     rows=_rows(inputs[i]) if batched else 0, priority=level)
                       for i in indices] for tag, indices in groups.items()}
        if request_ids:  # the checks, then the waiters, in one step
            for tag, requests in built.items():
                listeners.of(tag).check_new([r.id for r in requests])
        # as in ``submit``: the caller's ids travel alone, encoded now, before any
        # waiter is made (an input that cannot be encoded leaves none behind)
        encoded = {tag: [codec.encode(r.to_wire(), self.fmt) for r in requests]
                   for tag, requests in built.items()} if request_ids else {}
        self._check_room(listeners, len(inputs))  # again: others may have awaited past it
        futures: list[RequestFuture[Any]] = []
        pushed, enqueuer = [], self._pusher()
        for tag, requests in built.items():
            futures += [listeners.of(tag).expect(r.id, deadline, reply) for r in requests]
            pushed.append(self._enqueued(enqueuer.push_watched(
                tag, requests, encoded.get(tag), max_queue_len, level), requests, deadline,
                tag))
        await (pushed[0] if len(pushed) == 1 else asyncio.gather(*pushed))
        return futures if len(groups) == 1 else _in_order(futures, groups)

    async def _route_many(self, model: str, ids: list[str | None], first: str,
                          deadline_ms: int) -> dict[str, list[int]]:
        """The sub-queues of a ``submit_many``'s requests that carry the caller's ids
        (of a model of several sub-queues; ``first``: the first id's), each with the
        indices of the requests it takes: each id's own, where a retry of it by
        ``submit`` goes too (its marker dedupes it there).  (Without ids, the lot joins
        one sub-queue: one push.)"""
        groups: dict[str, list[int]] = {first: [0]}
        for index in range(1, len(ids)):
            groups.setdefault(await self._route(model, ids[index], deadline_ms),
                              []).append(index)
        return groups

    def _plain_ready(self, model: str, version: str | None, count: int) -> Listeners | None:
        """The listeners, when a request for ``model`` that pins no ``version`` takes
        the plain path (``PlainModels``: to the model's own queue, no step awaited)
        and ``count`` more waiters fit; None: the full path (``_resolve``)."""
        listeners = self._listeners
        if version is not None or listeners is None or not self._plain.plain(model):
            return None
        self._check_room(listeners, count)
        return listeners

    async def _resolve(self, model: str, version: str | None, count: int, deadline_ms: int
                       ) -> tuple[str, Listeners, Pipeline | None]:
        """The full path: the served name a request for ``model`` goes to
        (``_routed``), the listeners once ``count`` more waiters fit (``_ready``), and
        the pipeline of that name (None: a model's)."""
        model = await self._routed(model, version, deadline_ms)
        listeners = await self._ready(model, count, deadline_ms)
        return model, listeners, await self._pipeline(model, deadline_ms)

    async def _routed(self, model: str, version: str | None, deadline_ms: int) -> str:
        """``route``, unless the client queues for workers to come
        (``require_workers=False``) and no version is asked for: the name given."""
        if version is None and not self.require_workers:
            return model
        return await self.route(model, version, deadline_ms)

    async def _pipeline(self, name: str, deadline_ms: int) -> Pipeline | None:
        """The pipeline called ``name`` (None: a model's): at once for a name the book
        has answered for (``PipelineBook.settled``), else one registry read shared with
        the others, ending by ``deadline_ms``."""
        if self._pipelines.settled(name):
            return self._pipelines.known(name)
        async with deadline_bound(deadline_ms, f"looking up pipeline {name!r}"), \
                translated(self.settings):
            await self._pipelines.learn(name)
        return self._pipelines.known(name)

    async def _enter(self, pipeline: Pipeline, listeners: Listeners, inputs: Any,
                     deadline_ms: int, reply: bool, request_id: str | None, trace_id: str,
                     level: int, rows: int = 0, cap: int | None = None
                     ) -> RequestFuture[Any]:
        """A pipeline request: it enters the first stage, under that stage's queue cap
        as a model's request would (``cap``: the caller's own), and its final reply comes
        to this client's reply list of the pipeline (``redbatch.pipelines``)."""
        rid = request_id or protocol.new_request_id()
        self._check_room(listeners, 1)  # again: other callers may have awaited past it
        future = listeners.expect(pipeline.name, rid, deadline_ms, reply)
        try:
            async with deadline_bound(deadline_ms, f"entering pipeline {pipeline.name!r}"), \
                    translated(self.settings):
                levels = await self._admission.levels(pipeline.first)
                send = functools.partial(
                    enter, self._pipeline_link, levels, pipeline, rid, inputs,
                    reply_to=listeners.reply_to(pipeline.name), deadline_ms=deadline_ms,
                    trace_id=trace_id, priority=level, fmt=self.fmt, rows=rows,
                    cap=await self._admission.cap(pipeline.first, deadline_ms, cap))
                await idempotent(self.redis, send)  # (its marker dedupes a second push)
        except Exception as exc:
            listeners.fail(rid, exc, pipeline.name)
        except BaseException:  # a caller cancelled: its waiter goes too
            listeners.fail(rid, asyncio.CancelledError(), pipeline.name)
            raise
        return future

    async def _enqueued(self, pushed: asyncio.Future[Outcome], requests: list[Request],
                        deadline_ms: int, tag: str) -> None:
        """Wait (until ``deadline_ms`` at most) for a push's outcome, whose refused or
        failed requests the enqueuer's ``on_failed`` (``_failed``) has settled in the
        waiters by then; a caller that gives up meanwhile leaves no waiter behind."""
        try:
            await asyncio.wait([pushed], timeout=max(0.0, (deadline_ms - protocol.now_ms())
                                                     / 1000))
        except BaseException:
            if self._listeners is not None:
                for request in requests:
                    self._listeners.fail(request.id, asyncio.CancelledError(), tag)
            raise

    def _failed(self, tag: str, outcome: Outcome) -> None:
        """Fail the waiters of a push's refused or failed requests (of sub-queue
        ``tag``; closed: ``close`` failed every waiter)."""
        listeners = self._listeners
        if listeners is None:
            return
        for request_id, exc in outcome:
            listeners.fail(request_id, exc, tag)

    async def predict(self, model: str, inputs: Any, timeout_s: float | None = None, *,
                      reply: bool = False, request_id: str | None = None,
                      trace_id: str = "", deadline_ms: int | None = None,
                      max_queue_len: int | None = None, priority: int | None = None,
                      version: str | None = None) -> Any:
        """Run ``model`` on one input and return its output (``reply=True``: the
        whole ``Reply``) or raise a typed error; keywords as for ``submit``."""
        return await (await self.submit(
            model, inputs, timeout_s, reply=reply, request_id=request_id, trace_id=trace_id,
            deadline_ms=deadline_ms, max_queue_len=max_queue_len, priority=priority,
            version=version))

    def stream(self, model: str, inputs: Any, timeout_s: float | None = None, *,
               trace_id: str = "", deadline_ms: int | None = None,
               max_queue_len: int | None = None, chunks: bool = False,
               version: str | None = None) -> Stream:
        """A streaming model's chunks for one input: ``async for chunk in
        client.stream(model, x)`` (``chunks=True``: numbered ``StreamChunk``s).  The
        deadline bounds the whole stream; ``Stream.aclose`` cancels it.  ``version``:
        as for ``submit`` (``Stream.model``: the served name it went to)."""
        deadline = self._deadline(timeout_s, deadline_ms)
        _check_call(model, None, max_queue_len)
        return Stream(self, model, inputs, deadline, trace_id, max_queue_len, chunks, version)

    async def _open_stream(self, model: str, inputs: Any, deadline_ms: int,
                          trace_id: str = "", max_queue_len: int | None = None
                          ) -> tuple[str, ChunkQueue]:
        """Enqueue one streaming request: its id and the queue of its messages.  A
        pipeline's name is refused (its stages give one reply each, not a stream)."""
        listeners = await self._ready(model, 1, deadline_ms)
        if await self._pipeline(model, deadline_ms) is not None:
            raise InvalidPayload(f"{model!r} is a pipeline, not a streaming model: call "
                                 "predict, not stream")
        request = self._request(model, inputs, deadline_ms, None, listeners.reply_to(model),
                                trace_id)
        # encoded before its queue is registered: an input that cannot be encoded
        # leaves no waiter behind (and a stream's entry travels alone, never packed)
        entry = codec.encode(request.to_wire(), self.fmt)
        queue = listeners.of(model).expect_stream(request.id, deadline_ms)
        self._pusher().push(model, [request], [entry], max_queue_len)
        return request.id, queue

    async def predict_many(self, model: str, inputs: Sequence[Any],
                           timeout_s: float | None = None, *, reply: bool = False,
                           return_exceptions: bool = False, priority: int | None = None,
                           version: str | None = None) -> list[Any]:
        """Send many requests in one pipelined round trip; outputs (``reply=True``:
        ``Reply``s) in input order."""
        futures = await self.submit_many(model, inputs, timeout_s, reply=reply,
                                         priority=priority, version=version)
        return list(await asyncio.gather(*futures, return_exceptions=return_exceptions))


def _in_order(futures: list[RequestFuture[Any]], groups: dict[str, list[int]]
              ) -> list[RequestFuture[Any]]:
    """``futures`` (in the order of ``groups``' indices) in input order."""
    ordered: list[RequestFuture[Any]] = [*futures]
    for future, index in zip(futures, (i for g in groups.values() for i in g), strict=True):
        ordered[index] = future
    return ordered


def _rows_of(inputs: Any) -> int:
    """How many inputs a ``submit_many`` got: a list, a tuple or an array of them (a
    mapping, a string or a generator is refused with ``InvalidPayload``)."""
    if isinstance(inputs, str | bytes | Mapping) or not isinstance(inputs, Sequence | np.ndarray):
        raise InvalidPayload(f"inputs must be a list (or a tuple, or an array) of inputs, "
                             f"got {type(inputs).__name__}")
    return len(inputs)


def _check_call(model: str, request_ids: Sequence[str] | None, cap: int | None) -> None:
    """A call's own arguments, before any look-up: ``InvalidPayload`` naming the bad one."""
    protocol.check_model_name(model)
    for request_id in request_ids or ():
        protocol.check_request_id(request_id)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise InvalidPayload(f"max_queue_len must be a whole number >= 1, got {cap!r}")


def _rows(batch: Any) -> int:
    """The rows of a batch sent whole: its first dimension, 1 to ``MAX_ROWS`` (of a
    map of named inputs, its first input's; the worker checks the others)."""
    if isinstance(batch, dict) and batch:
        batch = next(iter(batch.values()))
    sized = isinstance(batch, list) or (isinstance(batch, np.ndarray) and batch.ndim > 0)
    rows = len(batch) if sized else 0
    if not 1 <= rows <= protocol.MAX_ROWS:
        raise InvalidPayload(f"a batch must hold 1 to {protocol.MAX_ROWS} rows along its "
                             f"first dimension, got {type(batch).__name__} of {rows}")
    return rows

