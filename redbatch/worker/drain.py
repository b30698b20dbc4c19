"""Draining a version (``redbatch versions MODEL --drain V``): a worker whose every
model is a draining version keeps serving until every producer has seen the drain
(``defaults.DRAIN_SETTLE_S`` after the worker saw it), then stops once the versions'
queues and its own in-flight lists are empty: nothing queued is left behind."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis

from redbatch import defaults, protocol, versions
from redbatch.worker.model import Model

log = logging.getLogger("redbatch.worker")


class Drain:
    """Decides, with each heartbeat, whether this worker has drained its versions."""

    def __init__(self, models: list[Model], worker_id: str) -> None:
        self._models = models
        self._worker_id = worker_id
        self._seen_at: float | None = None  # monotonic, when every model was draining

    def draining(self, rows: dict[str, Any]) -> bool:
        """Whether every model is a version marked draining (``rows``: each versioned
        model's raw row of its table, as the heartbeat read it)."""
        every = all(_draining(m, rows.get(m.name)) for m in self._models)
        if every and self._seen_at is None:
            log.info("worker %s: draining %s; stopping once their queues are empty",
                     self._worker_id, ",".join(m.name for m in self._models))
        self._seen_at = (self._seen_at or time.monotonic()) if every else None
        return every

    async def done(self, redis: aioredis.Redis, rows: dict[str, Any]) -> bool:
        """Whether to stop now: draining for ``DRAIN_SETTLE_S`` already, and nothing
        queued or in flight (one round trip, only while draining)."""
        if not self.draining(rows) or self._seen_at is None or \
                time.monotonic() - self._seen_at < defaults.DRAIN_SETTLE_S:
            return False
        async with redis.pipeline(transaction=False) as pipe:
            for model in self._models:
                for key in model.priorities.queues(model.name):
                    pipe.llen(key)
                pipe.llen(protocol.inflight_key(model.name, self._worker_id))
            left = sum(int(n) for n in await pipe.execute())
        return left == 0


def _draining(model: Model, raw: Any) -> bool:
    if model.version is None or raw is None:
        return False
    row = versions.decode({model.version: raw}).versions.get(model.version)
    return row is not None and row.draining
