"""Admission: how much of a model's queue a new request may join, and Retry-After.

Workers publish their measured capacity (items per busy second) with each
heartbeat.  A queue longer than capacity x time-to-deadline x ``ADMIT_FRACTION``
would likely not drain before the deadline, so a request that finds one is refused
at once (``QueueFull``, HTTP 503) rather than queued to time out: under overload
the excess is refused quickly and the accepted requests keep a bounded latency.
"""

from __future__ import annotations

import math
import time

import redis.asyncio as aioredis

from redbatch import defaults, protocol
from redbatch.errors import NoLiveWorkers, QueueFull, UnknownModel
from redbatch.levels import Levels
from redbatch.registry import LiveCache, LiveSummary
from redbatch.versions import Table

REFRESH_S = defaults.LIVE_REFRESH_S
MIN_CAP = 8
# Admit a queue that drains in this fraction of the time to the deadline: the rest is
# margin for the measured rate being optimistic and for the forward pass itself.
ADMIT_FRACTION = 0.5
RETRY_AFTER_RANGE_S = (1.0, 60.0)


def unknown_model(model: str) -> UnknownModel:
    """The error for a model no worker registered (the gateway's 404, the client's)."""
    return UnknownModel(f"unknown model {model!r}: no worker serves it")


def no_live_workers(model: str) -> NoLiveWorkers:
    """The error for a model whose workers are all gone (503, in the client too)."""
    return NoLiveWorkers(f"model {model!r} has no live worker; retry shortly")


class Admission:
    def __init__(self, redis: aioredis.Redis, max_queue_len: int) -> None:
        self._redis = redis
        self.max_queue_len = max_queue_len
        self._live = LiveCache(redis, REFRESH_S)  # one read per model per REFRESH_S

    async def aclose(self) -> None:
        """Stop the live-worker reads in flight (``LiveCache.aclose``)."""
        await self._live.aclose()

    def limit(self, own: int | None = None) -> int:
        """The cap of a queue: the model's ``own`` (a caller's) if lower than this
        process's ``max_queue_len``."""
        return self.max_queue_len if own is None else min(self.max_queue_len, own)

    def summary_cached(self, model: str) -> LiveSummary | None:
        """The model's live summary from the cache, or None when it is stale (no I/O)."""
        return self._live.cached(model)

    def fresh_until(self, summary: LiveSummary) -> float:
        """The ``time.monotonic()`` after which ``summary_cached`` no longer returns
        ``summary`` (no read replaces a summary before then)."""
        return summary.fresh_until(self._live.refresh_s)

    def live_cached(self, model: str) -> int | None:
        """Live workers from the cache, or None when it is stale (no I/O)."""
        summary = self.summary_cached(model)
        return None if summary is None else summary.live

    def served_cached(self, model: str) -> bool:
        """True when the cache (fresh) knows ``model`` has a live worker (no I/O)."""
        summary = self.summary_cached(model)
        return summary is not None and summary.live > 0

    def table_cached(self, model: str) -> Table | None:
        """The model's version routing table from the cache, or None when stale."""
        summary = self.summary_cached(model)
        return None if summary is None else summary.versions

    async def table(self, model: str) -> Table:
        """The model's version routing table (read with its live summary, cached)."""
        return (await self._live.get(model)).versions

    async def check_served(self, model: str) -> None:
        """``UnknownModel`` or ``NoLiveWorkers`` unless a live worker serves ``model``
        (cached for a second, like the live count)."""
        summary = await self._live.get(model)
        if not summary.known and not self._known_lately(model):
            raise unknown_model(model)
        if not summary.live:
            raise no_live_workers(model)

    def _known_lately(self, model: str) -> bool:
        """Whether ``model`` was known within ``KNOWN_GRACE_S``: a Redis that lost its
        registration (a replica promoted before it got it) is a gap until the workers'
        next heartbeat there, a 503 to retry, not an unknown model's 404."""
        seen = self._live.known_at.get(model)
        return seen is not None and time.monotonic() - seen < defaults.KNOWN_GRACE_S

    async def levels(self, model: str) -> Levels:
        """The model's priority levels, as its workers publish them (cached)."""
        return (await self._live.get(model)).levels

    def sub_queues_cached(self, model: str) -> int | None:
        """The model's sub-queues from the cache, or None when it is stale (no I/O)."""
        summary = self.summary_cached(model)
        return None if summary is None else summary.sub_queues

    async def sub_queues(self, model: str) -> int:
        """The model's sub-queues, as its knob or its workers publish them (cached)."""
        return (await self._live.get(model)).sub_queues

    async def takes_rows(self, model: str) -> bool:
        """Whether every live worker of ``model`` takes multi-row requests (cached)."""
        return (await self._live.get(model)).rows

    async def capacity(self, model: str) -> float:
        """Items per second the model's live workers can serve (0 when unknown)."""
        return (await self._live.get(model)).items_per_s

    async def live(self, model: str) -> int:
        """How many workers of the model hold a live lease (cached for a second)."""
        return (await self._live.get(model)).live

    async def cap(self, model: str, deadline_ms: int, own: int | None = None) -> int:
        """The queue length at which this request is refused (``own``: the model's
        own cap, as the caller gives it)."""
        return self.cap_at(await self.capacity(model), deadline_ms, own)

    def cap_at(self, rate: float, deadline_ms: int, own: int | None = None) -> int:
        """``cap`` for a model that drains ``rate`` items per second (0: unknown)."""
        limit = self.limit(own)
        if rate <= 0:
            return limit
        budget_s = max(0.0, (deadline_ms - protocol.now_ms()) / 1000)
        admitted = math.floor(rate * budget_s * ADMIT_FRACTION)
        return min(limit, max(MIN_CAP, admitted))

    async def queue_full(self, model: str, depth: int, cap: int, own: int | None = None
                         ) -> QueueFull:
        """The error for a refused request, with Retry-After from the drain rate."""
        rate = await self.capacity(model)
        low, high = RETRY_AFTER_RANGE_S
        retry_s = min(high, max(low, depth / rate)) if rate > 0 else low
        why = "is full" if cap >= self.limit(own) else "could not drain before the deadline"
        return QueueFull(f"queue of model {model!r} {why} ({depth} queued, cap {cap}, "
                         f"drain rate {rate:.0f}/s)", retry_s)

    async def level_full(self, model: str, level: int, depths: tuple[int, int], cap: int,
                         level_cap: int | None, own: int | None = None) -> QueueFull:
        """The error for a request refused at priority ``level``: ``depths`` are the
        entries queued at that level and above, and at that level alone; Retry-After
        from the drain rate of the former (all that is served before it).  ``own``: the
        caller's queue cap, as for ``queue_full``."""
        ahead, at_level = depths
        full = await self.queue_full(model, ahead, cap, own)
        if level_cap is not None and at_level >= level_cap:
            return QueueFull(f"queue of model {model!r} at priority {level} is full ({at_level} "
                             f"queued at that level, its cap {level_cap})", full.retry_after_s)
        return QueueFull(f"{full} at priority {level}", full.retry_after_s)
