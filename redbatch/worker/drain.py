"""Draining a version (``redbatch versions MODEL --drain V``): a worker whose every
model is a draining version keeps serving until every producer has seen the drain
(``defaults.DRAIN_SETTLE_S`` after the worker saw it), then stops once it closed every
sub-queue of its versions: in one step per sub-queue (``lua.DRAIN_CLOSE``), once nothing
is queued there nor in flight from it (a dead peer's included: its reaper requeues them
first), it sets the sub-queue's closed marker, and from then on an enqueue there is
refused (``lua.ENQUEUE_OPEN``: 503, ``no_workers``), so that nothing is ever queued where
no worker will come, however late a producer that routed before the drain pushes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from redbatch import defaults, lua, protocol, versions
from redbatch.redis_conn import ID_ERRORS
from redbatch.worker.model import Model

log = logging.getLogger("redbatch.worker")


class Drain:
    """Decides, with each heartbeat, whether this worker has drained its versions."""

    def __init__(self, models: Callable[[], list[Model]], worker_id: str) -> None:
        self._current = models  # the models as served now (live knobs: sub_queues)
        self._worker_id = worker_id
        self._seen_at: float | None = None  # monotonic, when every model was draining
        self._opened = False  # the sub-queues' closed markers deleted (not draining)

    @property
    def _models(self) -> list[Model]:
        return self._current()

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
        """Whether to stop now: draining for ``DRAIN_SETTLE_S`` already, and every
        sub-queue of every model closed (``close``).  A worker of a version not
        draining reopens its sub-queues once (a version undrained, or served again)."""
        if not self.draining(rows):
            if not self._opened:
                await self._reopen(redis)
            return False
        if self._seen_at is None or time.monotonic() - self._seen_at < defaults.DRAIN_SETTLE_S:
            return False
        self._opened = False
        for model in self._models:
            if not await close(redis, model, self._worker_id):
                return False
        return True

    async def _reopen(self, redis: aioredis.Redis) -> None:
        keys = [protocol.closed_key(tag) for model in self._models
                for tag in protocol.sub_queue_tags(model.name, model.sub_queues)]
        await redis.delete(*keys)
        self._opened = True


async def close(redis: aioredis.Redis, model: Model, worker_id: str) -> bool:
    """Close each sub-queue of a draining version (``lua.DRAIN_CLOSE``: atomically, once
    nothing is queued there and nothing is in flight or held over from it, a dead
    worker's that its reaper has yet to requeue included), so that nothing can be
    queued where no worker will come; whether every one is closed (a closed one stays
    closed: the version is draining, so no producer routes to it)."""
    ids: Any = await redis.zrange(protocol.workers_key(model.name), 0, -1)
    workers = {worker_id, *(i.decode(errors=ID_ERRORS) for i in ids)}
    script = redis.register_script(lua.DRAIN_CLOSE)
    ttl_ms = protocol.CLOSED_TTL_S * 1000
    for tag in protocol.sub_queue_tags(model.name, model.sub_queues):
        keys = [protocol.closed_key(tag), *model.priorities.queues(tag),
                *(protocol.inflight_key(tag, w) for w in sorted(workers)),
                *(protocol.held_key(tag, w) for w in sorted(workers))]
        if not int(await script(keys=keys, args=[ttl_ms])):
            return False
    return True


def _draining(model: Model, raw: Any) -> bool:
    if model.version is None or raw is None:
        return False
    row = versions.decode({model.version: raw}).versions.get(model.version)
    return row is not None and row.draining
