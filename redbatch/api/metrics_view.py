"""``GET /metrics``: the gateway's Prometheus metrics, with each model's queue depth
and live workers read from Redis at scrape time."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from redbatch import metrics, protocol
from redbatch.errors import RedbatchError
from redbatch.levels import by_level, of_meta
from redbatch.redis_conn import translated

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

log = logging.getLogger("redbatch.api")


async def refresh_gauges(gateway: Gateway) -> None:
    """Queue depth and live workers of every registered model."""
    redis = gateway.redis
    now = protocol.now_ms()
    for name in await gateway.directory.model_names():
        async with translated(gateway.redis_settings):
            keys = of_meta(await redis.get(protocol.meta_key(name))).queues(name)
            depths = [int(await redis.llen(key)) for key in keys]
            live = await redis.zcount(protocol.workers_key(name), now, "+inf")
        metrics.QUEUE_DEPTH.labels(name).set(sum(depths))  # every level
        for level, depth in by_level(depths).items() if len(depths) > 1 else ():
            metrics.QUEUE_DEPTH_LEVEL.labels(name, level).set(depth)
        metrics.LIVE_WORKERS.labels(name).set(int(live))


async def exposition(gateway: Gateway) -> bytes:
    """The scrape body; without Redis the gauges keep their last values."""
    try:
        await refresh_gauges(gateway)
    except RedbatchError as exc:
        log.warning("metrics: could not read queue depths: %s", exc)
    return metrics.exposition()
