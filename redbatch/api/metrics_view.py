"""``GET /metrics``: the gateway's Prometheus metrics, with each model's queue depth,
live workers and autoscaling signals (``redbatch.scaling``) read from Redis at scrape
time: per model, its meta and sub-queues draining count (``levels.read_meta``, one
round trip), an LLEN per priority level and sub-queue, and one read-only script call."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from redbatch import metrics, scaling
from redbatch.errors import RedbatchError
from redbatch.levels import by_level, queue_depths, read_meta
from redbatch.redis_conn import translated

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

log = logging.getLogger("redbatch.api")


async def refresh_gauges(gateway: Gateway) -> None:
    """Queue depth, live workers and the scaling signals of every registered model."""
    redis = gateway.redis
    for name in await gateway.directory.model_names():
        async with translated(gateway.redis_settings):
            depths = await queue_depths(redis, name, *await read_meta(redis, name))
            rates = await gateway.fleet.rates(name)
        metrics.QUEUE_DEPTH.labels(name).set(sum(depths))  # every level
        for level, depth in by_level(depths).items() if len(depths) > 1 else ():
            metrics.QUEUE_DEPTH_LEVEL.labels(name, level).set(depth)
        metrics.LIVE_WORKERS.labels(name).set(rates.live)
        set_scaling(name, sum(depths), rates, gateway.fleet.growth)


def set_scaling(name: str, backlog: int, rates: scaling.FleetRates,
                growth: scaling.QueueGrowth) -> None:
    """The four autoscaling gauges of one model."""
    arrival = scaling.arrival_rate(rates.served_per_s, growth.rate(name, backlog))
    per_worker = rates.per_worker_per_s
    metrics.CAPACITY.labels(name).set(rates.capacity_per_s)
    metrics.WORKER_CAPACITY.labels(name).set(per_worker or 0.0)
    metrics.ARRIVAL_RATE.labels(name).set(arrival)
    metrics.WORKERS_NEEDED.labels(name).set(
        scaling.workers_needed(arrival, backlog, per_worker, rates.live))


async def exposition(gateway: Gateway) -> bytes:
    """The scrape body; without Redis the gauges keep their last values."""
    try:
        await refresh_gauges(gateway)
    except RedbatchError as exc:
        log.warning("metrics: could not read queue depths: %s", exc)
    return metrics.exposition()
