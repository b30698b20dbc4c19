"""The RQ job of bulk / offline inference: ``redbatch.jobs.tasks.run_bulk``.

A bulk job feeds a large input set (an inline list or array, or a ``.npy`` / ``.jsonl``
file by path or http(s) URL) through the *same* batching workers as the real-time
traffic, with redbatch's async ``Client`` (``submit_many``, one pipelined round trip
per chunk), and returns the outputs (stored by RQ as the job's result) or writes them
to a ``.npy`` / ``.jsonl`` file.  Start it with ``redbatch.jobs.submit_bulk`` or
``redbatch jobs submit``; any ``rq worker redbatch-bulk`` runs it.

**Priority is admission-based.**  A model has one FIFO queue, shared by interactive
callers and bulk jobs, so a request cannot jump ahead of others.  Instead the bulk job
is polite at the door: before each chunk it reads the queue's depth (``LLEN``) and
waits, with a capped exponential backoff, while the queue holds more than
``low_water`` requests (default: twice the chunk size).  Bulk items therefore only
fill capacity that interactive traffic leaves idle, and an interactive request finds
at most about ``low_water + chunk_size`` bulk items ahead of it, however large the job.
The wait is bounded (``max_wait_s``): under sustained interactive load the job still
advances one chunk per ``max_wait_s``.  At most ``max_inflight_chunks`` chunks await
their replies at a time, so the job keeps the workers busy without holding many
waiters.

**Failures.**  An item that fails alone (a malformed ``.jsonl`` line, an input the
model's spec rejects, a model error, a missed deadline) is recorded (``job.meta``
``failed`` and the first few ``errors``; an ``ItemError`` in its output's place) and the
job goes on.  The job raises, so that RQ marks it failed, retries it (``Retry``) and
finally keeps it in the failed-job registry, when redbatch cannot serve it at all:
Redis unavailable, no live worker for the model within ``wait_workers_s``, an
unreadable source or output, or every item failed.  A retried job starts over.

**Redis.**  The producer connects to ``redis_url`` when given; otherwise to the Redis
of the RQ job itself (the usual set-up: one Redis for RQ and redbatch); outside RQ to
``$REDIS_URL``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any
from urllib.parse import quote

import redis
from rq import get_current_job

from redbatch import defaults, protocol
from redbatch.errors import (
    ConfigError,
    InvalidPayload,
    NoLiveWorkers,
    QueueFull,
    RedbatchError,
    RedisUnavailable,
)
from redbatch.jobs.errors import BadSource, BulkJobFailed, ItemError
from redbatch.jobs.progress import Progress
from redbatch.jobs.sinks import write_output
from redbatch.jobs.sources import BadRow, check_output, open_source
from redbatch.jobs.throttle import queues_of, wait_for_room
from redbatch.jobs.urls import with_password
from redbatch.producer.client import Client
from redbatch.redis_conn import translated

QUEUE_FULL_RETRIES = 3
WORKER_POLL_S = 0.1
Slot = asyncio.Future[Any] | ItemError


@dataclass(frozen=True)
class BulkOptions:
    """How a bulk job paces itself (see the module docstring)."""

    chunk_size: int = defaults.JOB_CHUNK_SIZE  # items per submit_many round trip
    low_water: int | None = None  # push only while the queue holds <= this; None: 2 x chunk
    max_wait_s: float = defaults.JOB_MAX_WAIT_S  # longest wait for the queue to drain
    timeout_s: float = defaults.JOB_ITEM_TIMEOUT_S  # deadline of each item, from its push
    max_inflight_chunks: int = defaults.JOB_MAX_INFLIGHT_CHUNKS  # awaiting replies at a time
    wait_workers_s: float = defaults.JOB_WAIT_WORKERS_S  # wait for a live worker this long
    max_errors: int = defaults.JOB_MAX_ERRORS  # item error messages kept in job.meta
    priority: int | None = None  # the items' priority level; None: the model's default

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_inflight_chunks < 1:
            raise ConfigError("chunk_size and max_inflight_chunks must be >= 1")
        if self.chunk_size * self.max_inflight_chunks > defaults.MAX_WAITERS:
            raise ConfigError(f"chunk_size x max_inflight_chunks must be at most "
                              f"{defaults.MAX_WAITERS} (the requests one process may "
                              f"have waiting), got {self.chunk_size} x "
                              f"{self.max_inflight_chunks}")
        if self.low_water is not None and self.low_water < 0:
            raise ConfigError("low_water must be >= 0")
        if not all(0 <= value < math.inf for value in (self.max_wait_s,
                                                         self.wait_workers_s)):
            raise ConfigError("max_wait_s and wait_workers_s must be finite numbers >= 0")
        if self.max_errors < 0:
            raise ConfigError("max_errors must be >= 0")
        if not 0 < self.timeout_s <= protocol.MAX_TIMEOUT_S:
            raise ConfigError(f"timeout_s must be in (0, {protocol.MAX_TIMEOUT_S}]")
        if self.priority is not None and not 0 <= self.priority <= protocol.MAX_PRIORITY_LEVELS:
            raise ConfigError(f"priority must be 1..{protocol.MAX_PRIORITY_LEVELS} (0: the "
                              "model's default level)")

    @property
    def low_water_mark(self) -> int:
        return 2 * self.chunk_size if self.low_water is None else self.low_water


def run_bulk(model: str, source: Any, output: str | None = None, *,
             options: BulkOptions | None = None, redis_url: str | None = None
             ) -> dict[str, Any]:
    """Run ``model`` on every item of ``source``; return a summary with the outputs (or,
    with ``output``, write them there).  Meant to run as an RQ job."""
    protocol.check_model_name(model)
    opts = options or BulkOptions()
    out_path = check_output(output)
    if out_path is not None and not os.path.isdir(os.path.dirname(out_path)):
        raise BadSource(f"cannot write the outputs to {out_path}: its directory does not "
                        "exist here (checked before any inference)")
    job = get_current_job()
    url = with_password(redis_url) or (url_of(job.connection) if job is not None else None)
    with open_source(source) as inputs:
        progress = Progress(job, model, inputs.total, opts.max_errors)
        progress.publish()
        outputs = asyncio.run(_run(url, model, inputs.items, opts, progress))
    if progress.total and progress.failed == progress.total:
        raise BulkJobFailed(f"all {progress.total} items for model {model!r} failed; first "
                            f"errors: {progress.errors}")
    if out_path is not None:
        write_output(out_path, outputs)
    return _summary(progress, out_path, outputs)


def _summary(progress: Progress, output: str | None, outputs: list[Any]) -> dict[str, Any]:
    summary = {**progress.as_meta(), "output": output,
               "failed_items": [i for i, o in enumerate(outputs) if isinstance(o, ItemError)]}
    if output is None:
        summary["outputs"] = [None if isinstance(o, ItemError) else o for o in outputs]
    return summary


def url_of(conn: redis.Redis) -> str:
    """A URL for the Redis that ``conn`` (an RQ job's connection) talks to.  TLS
    certificate options are not carried over: pass ``redis_url`` when they matter."""
    pool = conn.connection_pool
    kwargs = pool.connection_kwargs
    user, password = kwargs.get("username") or "", kwargs.get("password")
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        query = "".join(f"&{name}={quote(value, safe='')}"
                        for name, value in (("username", user), ("password", password))
                        if value)
        return f"unix://{kwargs['path']}?db={db}{query}"
    auth = (f"{quote(user, safe='')}:{quote(password or '', safe='')}@"
            if user or password else "")
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    host = str(kwargs.get("host", "localhost"))
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"{scheme}://{auth}{host}:{kwargs.get('port', 6379)}/{db}"


async def _run(url: str | None, model: str, items: Iterator[Any], opts: BulkOptions,
               progress: Progress) -> list[Any]:
    async with Client(url, max_timeout_s=protocol.MAX_TIMEOUT_S,
                      default_timeout_s=opts.timeout_s) as client:
        return await _Runner(client, model, opts, progress).run(items)


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


class _Runner:
    """Chunks out, outputs back in input order; progress after each chunk."""

    def __init__(self, client: Client, model: str, opts: BulkOptions,
                 progress: Progress) -> None:
        self.client = client
        self.model = model
        self.opts = opts
        self.progress = progress
        self.outputs: list[Any] = []
        self.pending: deque[tuple[int, list[Any], list[Slot]]] = deque()
        self.sent = 0
        # the queues its items go to (paced on): one, or one per sub-queue
        self.queues = [protocol.queue_key(model)]

    async def run(self, items: Iterator[Any]) -> list[Any]:
        await self._live_worker()
        async with translated(self.client.settings):
            self.queues = await queues_of(self.client.redis, self.model, self.opts.priority)
        try:
            for chunk in _chunks(items, self.opts.chunk_size):
                await self._admit()
                self.pending.append((self.sent, chunk, await self._submit(chunk)))
                self.sent += len(chunk)
                while len(self.pending) >= self.opts.max_inflight_chunks:
                    await self._settle_oldest()
            while self.pending:
                await self._settle_oldest()
        finally:
            _discard(slot for _, _, slots in self.pending for slot in slots)
        return self.outputs

    async def _live_worker(self) -> None:
        """Return once the model has a live worker; ``NoLiveWorkers`` after a while."""
        deadline = time.monotonic() + self.opts.wait_workers_s
        while await self.client.live_workers(self.model) < 1:
            if time.monotonic() >= deadline:
                raise NoLiveWorkers(f"no live worker for model {self.model!r} within "
                                    f"{self.opts.wait_workers_s} s")
            await asyncio.sleep(WORKER_POLL_S)

    async def _admit(self) -> None:
        """Wait for a live worker and for the queue to drain to the low-water mark."""
        await self._live_worker()
        async with translated(self.client.settings):
            self.progress.throttled_s += await wait_for_room(
                self.client.redis, self.queues, self.opts.low_water_mark, self.opts.max_wait_s)

    async def _submit(self, chunk: list[Any]) -> list[Slot]:
        """Push a chunk's readable items; a slot per item (its future, or its error)."""
        bad = [ItemError(InvalidPayload.code, x.message) if isinstance(x, BadRow) else None
               for x in chunk]
        pushed = iter(await self._push([x for x, b in zip(chunk, bad, strict=True)
                                        if b is None]))
        return [next(pushed) if b is None else b for b in bad]

    async def _push(self, items: list[Any]) -> list[Slot]:
        """A future per item (an item that cannot be encoded fails its own)."""
        return list(await self.client.submit_many(self.model, items, self.opts.timeout_s,
                                                  priority=self.opts.priority))

    async def _settle_oldest(self) -> None:
        first, chunk, slots = self.pending.popleft()
        results = await self._results(chunk, slots)
        self.outputs.extend(results)
        self.progress.record(first, results)
        self.progress.publish()

    async def _results(self, chunk: list[Any], slots: list[Slot]) -> list[Any]:
        """Await a chunk's replies; items refused with ``QueueFull`` are pushed again."""
        for attempt in range(QUEUE_FULL_RETRIES + 1):
            results = await _gather(slots)
            refused = [i for i, r in enumerate(results) if isinstance(r, QueueFull)]
            if not refused or attempt == QUEUE_FULL_RETRIES:
                break
            await asyncio.sleep(min(1.0, max(r.retry_after_s for r in results
                                             if isinstance(r, QueueFull))))
            await self._admit()
            for index, slot in zip(refused, await self._push([chunk[i] for i in refused]),
                                   strict=True):
                slots[index] = slot
        return [ItemError(r.code, str(r)) if isinstance(r, QueueFull) else r for r in results]


async def _gather(slots: list[Slot]) -> list[Any]:
    futures = [slot for slot in slots if isinstance(slot, asyncio.Future)]
    got = iter(await asyncio.gather(*futures, return_exceptions=True))
    return [_outcome(next(got)) if isinstance(slot, asyncio.Future) else slot
            for slot in slots]


def _outcome(result: Any) -> Any:
    """An output, an ``ItemError``, a ``QueueFull`` (pushed again), or raise when redbatch
    itself is unavailable."""
    if isinstance(result, QueueFull):
        return result
    if isinstance(result, RedisUnavailable | NoLiveWorkers):
        raise result
    if isinstance(result, RedbatchError):
        return ItemError(result.code, str(result))
    if isinstance(result, BaseException):
        raise result
    return result


def _discard(slots: Iterable[Slot]) -> None:
    """Cancel the waiters of an aborted job (and read errors nobody will await)."""
    for slot in slots:
        if isinstance(slot, asyncio.Future):
            if slot.done() and not slot.cancelled():
                slot.exception()
            slot.cancel()
