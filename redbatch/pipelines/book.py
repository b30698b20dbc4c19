"""A producer's view of the pipeline registry: read at most once per ``refresh_s`` (one
``HGETALL`` for every name, by one read however many requests find it stale)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from redbatch import defaults, protocol
from redbatch.pipelines.definition import Pipeline, parse_registry
from redbatch.redis_conn import idempotent


class PipelineBook:
    def __init__(self, redis: aioredis.Redis,
                 refresh_s: float = defaults.LIVE_REFRESH_S) -> None:
        self._redis = redis
        self._refresh_s = refresh_s
        self._known: dict[str, Pipeline] = {}
        self._at = -float("inf")
        self._flight: asyncio.Future[None] | None = None

    def fresh(self) -> bool:
        return time.monotonic() - self._at <= self._refresh_s

    def known(self, name: str) -> Pipeline | None:
        """The pipeline called ``name`` as last read (None: a model, or nothing)."""
        return self._known.get(name)

    async def refresh(self) -> None:
        """Read the registry (one read for all the callers that wait meanwhile)."""
        if self._flight is None:
            self._flight = asyncio.ensure_future(self._read())
        flight = self._flight
        try:
            await asyncio.shield(flight)
        finally:
            if self._flight is flight and flight.done():
                self._flight = None

    async def _read(self) -> None:
        raw = await idempotent(self._redis,
                               lambda: self._redis.hgetall(protocol.PIPELINES_KEY))
        self._known = parse_registry(raw)
        self._at = time.monotonic()
