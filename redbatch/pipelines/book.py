"""A producer's view of the pipeline registry: read at most once per ``refresh_s`` (one
``HGETALL`` for every name, by one read however many requests find it stale).  A name
the book has answered for (a pipeline, or a name a read found no pipeline of: a model)
is answered at once, a stale book read again in the background; only a name it never
answered for waits for a read."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from redbatch import defaults, protocol
from redbatch.pipelines.definition import Pipeline, parse_registry
from redbatch.redis_conn import idempotent
from redbatch.registry import shared

log = logging.getLogger("redbatch.pipelines")
MAX_MODEL_NAMES = 10_000  # names known to be no pipeline kept at most (then forgotten)


class PipelineBook:
    def __init__(self, redis: aioredis.Redis,
                 refresh_s: float = defaults.LIVE_REFRESH_S) -> None:
        self._redis = redis
        self._refresh_s = refresh_s
        self._known: dict[str, Pipeline] = {}
        self._models: set[str] = set()  # names a read found no pipeline of
        self._read_at = -float("inf")  # the last read that succeeded
        self._tried_at = -float("inf")  # the last read started
        self._flight: asyncio.Future[None] | None = None
        self.changes = 0  # counts the changes of its answers (a read landed, names dropped)

    def settled(self, name: str) -> bool:
        """True if the book answers for ``name`` without a read (``known``); a stale
        book starts a read in the background meanwhile, never waited for."""
        if name not in self._known and name not in self._models:
            return False
        if self._due():
            self._start_read()
        return True

    def known(self, name: str) -> Pipeline | None:
        """The pipeline called ``name`` as last read (None: a model, or nothing)."""
        return self._known.get(name)

    async def learn(self, name: str) -> None:
        """Read the registry for a name the book has not answered for (one read for all
        the callers that wait meanwhile).  A failed read raises only if the book was
        never read; else the earlier read answers (``name``: no pipeline, for now)."""
        never = self._read_at == -float("inf")
        if never or self._due():
            try:
                await shared(self._start_read())
            except Exception:
                if never and self._read_at == -float("inf"):
                    raise
                return
        if name not in self._known:
            if len(self._models) >= MAX_MODEL_NAMES:
                self._models.clear()
                self.changes += 1
            self._models.add(name)

    async def aclose(self) -> None:
        """Cancel a read in flight and wait for it, before the client's connection pool
        closes: a read left running saw the pool's close break its connection, read
        again (``idempotent``) on a fresh one of the closed pool, and left it open."""
        flight = self._flight
        if flight is not None:
            flight.cancel()
            await asyncio.gather(flight, return_exceptions=True)

    def quiet_until(self) -> float:
        """The ``time.monotonic()`` until which ``settled`` starts no read."""
        return self._tried_at + self._refresh_s

    def _due(self) -> bool:
        return time.monotonic() - self._tried_at > self._refresh_s

    def _start_read(self) -> asyncio.Future[None]:
        if self._flight is None:
            self._tried_at = time.monotonic()
            self._flight = asyncio.ensure_future(self._read())
            self._flight.add_done_callback(self._landed)
        return self._flight

    def _landed(self, flight: asyncio.Future[None]) -> None:
        if self._flight is flight:
            self._flight = None
        if not flight.cancelled() and (exc := flight.exception()) is not None:
            log.warning("pipeline registry not read: %s: %s", type(exc).__name__, exc)

    async def _read(self) -> None:
        raw = await idempotent(self._redis,
                               lambda: self._redis.hgetall(protocol.PIPELINES_KEY))
        self._known = parse_registry(raw)
        self._read_at = time.monotonic()
        self.changes += 1
