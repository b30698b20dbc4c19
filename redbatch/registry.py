"""Who is live: the workers whose lease on a model has not expired, with the info each
published (``worker.heartbeat`` writes the leases; ``redbatch status`` and the
benchmark read the full info here).  ``LiveCache`` keeps a per-model summary for the
hot path (gateways and clients): read at most once per ``defaults.LIVE_REFRESH_S``
per process, by one read however many requests find it stale at once, and that read
is one call of the ``LIVE_SUMMARY`` script over the workers' compact capacity fields,
never their full info."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis

from redbatch import defaults, lua, protocol, versions
from redbatch.errors import RedbatchError
from redbatch.levels import ONE, Levels, from_summary
from redbatch.redis_conn import idempotent

T = TypeVar("T")


async def live_workers(redis: aioredis.Redis, model: str) -> list[dict[str, Any]]:
    """Workers whose lease has not expired, with their info."""
    ids: Any = await redis.zrangebyscore(protocol.workers_key(model), protocol.now_ms(), "+inf")
    if not ids:
        return []
    return _with_info(ids, await redis.hmget(protocol.worker_info_key(model), ids))


def live_workers_sync(redis: Any, model: str) -> list[dict[str, Any]]:
    """``live_workers`` for a synchronous client (``redbatch status``)."""
    ids: Any = redis.zrangebyscore(protocol.workers_key(model), protocol.now_ms(), "+inf")
    return _with_info(ids, redis.hmget(protocol.worker_info_key(model), ids)) if ids else []


def _with_info(ids: Any, infos: Any) -> list[dict[str, Any]]:
    return [_info(wid, raw) for wid, raw in zip(ids, infos, strict=True)]


def _info(worker_id: bytes, raw: bytes | None) -> dict[str, Any]:
    """A live worker's published info; its id alone when there is none, or when it is
    not a JSON object (written by something else)."""
    own = {"worker_id": worker_id.decode(errors="replace")}
    if not raw:
        return own
    try:
        info = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return own
    return info if isinstance(info, dict) else own


@dataclass(frozen=True)
class LiveSummary:
    """What admission needs to know of a model's live workers."""

    at: float  # time.monotonic() of the read
    live: int  # workers holding a live lease
    items_per_s: float  # their summed measured capacity
    rows: bool  # every live worker takes multi-row requests (and one is live)
    known: bool  # a worker is live or the model is registered
    levels: Levels = ONE  # its priority levels, as its workers publish them
    sub_queues: int = 1  # its sub-queues (the stored knob, else its meta's)
    versions: versions.Table = versions.EMPTY  # its routing table, if served in versions
    max_queue_len: int | None = None  # its own queue cap, as its meta says (None: none)

    def fresh(self, refresh_s: float) -> bool:
        """Whether to trust it still: for ``refresh_s``, or for ``MISS_REFRESH_S`` at
        most while it says nobody serves the model (a worker that just started is seen
        within that, not after a whole ``refresh_s``)."""
        return time.monotonic() <= self.fresh_until(refresh_s)

    def fresh_until(self, refresh_s: float) -> float:
        """The ``time.monotonic()`` after which it is stale (``fresh``)."""
        if not self.live and not self.versions:
            refresh_s = min(refresh_s, defaults.MISS_REFRESH_S)
        return self.at + refresh_s


async def shared(flight: asyncio.Future[T]) -> T:
    """The result of a read that several callers await, shielded: a caller's
    cancellation spares the others'.  The read cancelled under a caller that nobody
    cancelled (its client closing: ``aclose``) is ``RedbatchError`` for that caller,
    not a cancellation it never asked for."""
    try:
        return await asyncio.shield(flight)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if flight.cancelled() and (task is None or not task.cancelling()):
            raise RedbatchError("the client closed while this call read Redis") from None
        raise


MAX_SUMMARIES = 4096  # models whose live summary a process keeps (unknown names first out)


class LiveCache:
    """Per-model ``LiveSummary``, refreshed at most every ``refresh_s`` with single
    flight: callers that find a model stale await one read; a failed read raises to
    all of them, and the next call reads again."""

    def __init__(self, redis: aioredis.Redis,
                 refresh_s: float = defaults.LIVE_REFRESH_S) -> None:
        self._redis = redis
        self._script = redis.register_script(lua.LIVE_SUMMARY)
        self.refresh_s = refresh_s
        self._summaries: dict[str, LiveSummary] = {}
        self._flights: dict[str, asyncio.Task[LiveSummary]] = {}
        self.known_at: dict[str, float] = {}  # model -> when (monotonic) a read knew it

    def cached(self, model: str) -> LiveSummary | None:
        """The fresh summary of ``model``, or None when it is stale (no I/O)."""
        summary = self._summaries.get(model)
        return summary if summary is not None and summary.fresh(self.refresh_s) else None

    async def get(self, model: str) -> LiveSummary:
        """The summary of ``model``; read (once for all callers) when stale."""
        summary = self.cached(model)
        if summary is not None:
            return summary
        flight = self._flights.get(model)
        if flight is None:
            flight = asyncio.ensure_future(self._read(model))
            self._flights[model] = flight
            flight.add_done_callback(lambda done: self._landed(model, done))
        return await shared(flight)

    async def aclose(self) -> None:
        """Cancel the reads in flight (their callers may have gone: a shielded read
        outlives them) and wait for them, before the connection pool closes."""
        flights = list(self._flights.values())
        for flight in flights:
            flight.cancel()
        await asyncio.gather(*flights, return_exceptions=True)

    def _landed(self, model: str, flight: asyncio.Task[LiveSummary]) -> None:
        if self._flights.get(model) is flight:
            del self._flights[model]
        if not flight.cancelled() and flight.exception() is None:  # retrieved: no warning
            summary = self._summaries[model] = flight.result()
            if summary.known:  # whoever read it (a route, a cap, a served check)
                self.known_at[model] = summary.at
            if len(self._summaries) > MAX_SUMMARIES:
                self._evict()

    def _evict(self) -> None:
        """Down to three quarters of ``MAX_SUMMARIES``: names nothing serves first (a
        client asking for ever new names must not grow a gateway's memory), then the
        least recently read."""
        keep = MAX_SUMMARIES * 3 // 4
        order = sorted(self._summaries.items(), key=lambda kv: (kv[1].known, kv[1].at))
        for model, _summary in order[:len(order) - keep]:
            del self._summaries[model]

    async def _read(self, model: str) -> LiveSummary:
        """One round trip (a read), repeated once on a broken connection."""
        reply: Any = await idempotent(self._redis, lambda: self._script(
            keys=summary_keys(model), args=[protocol.now_ms()]))
        return summary_of(reply)


def summary_of(reply: Any) -> LiveSummary:
    """``LIVE_SUMMARY``'s reply, read now."""
    live, items_per_s, rows, known, levels, subs, table, cap = reply
    return LiveSummary(time.monotonic(), int(live), float(items_per_s), bool(int(rows)),
                       bool(int(known)), from_summary(levels), sub_queue_count(subs),
                       versions.decode(table, int(live) > 0), int(cap) or None)


def summary_keys(model: str) -> list[str]:
    """``LIVE_SUMMARY``'s keys for ``model`` (all in the slot of its tag ``{model}``)."""
    return [protocol.workers_key(model), protocol.worker_capacity_key(model),
            protocol.meta_key(model), protocol.config_key(model),
            protocol.versions_key(model)]


def sub_queue_count(value: Any) -> int:
    """A model's sub-queues as published (``LIVE_SUMMARY``), 1..MAX_SUB_QUEUES; 1 when
    it cannot be read."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        return 1
    return count if 1 <= count <= protocol.MAX_SUB_QUEUES else 1
