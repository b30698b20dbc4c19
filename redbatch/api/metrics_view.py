"""``GET /metrics``: the gateway's Prometheus metrics, with each model's queue depth,
live workers and autoscaling signals (``redbatch.scaling``) read from Redis at scrape
time: per model, its meta and sub-queues draining count (``levels.read_meta``, one
round trip), an LLEN per priority level and sub-queue, and one read-only script call."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import redis

from redbatch import metrics, protocol, scaling
from redbatch.errors import RedbatchError, RedisUnavailable
from redbatch.levels import by_level, queue_depths, read_meta
from redbatch.redis_conn import deadline_bound, translated

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

log = logging.getLogger("redbatch.api")


READ_TIMEOUT_S = 2.0  # a scrape's reads of Redis end by then (the gauges keep their values)
LEVELS_SHOWN: dict[str, set[str]] = {}  # model -> the levels whose depth series exist


async def refresh_gauges(gateway: Gateway) -> None:
    """Queue depth, live workers and the scaling signals of every registered model;
    a model whose keys cannot be read (a key of another type, a number that is no
    number) is logged and skipped: the others' gauges still move."""
    for name in await gateway.directory.model_names():
        try:
            async with translated(gateway.redis_settings):
                await _refresh_one(gateway, name)
        except RedisUnavailable as exc:
            if not isinstance(exc.__cause__, redis.ResponseError):
                raise  # Redis away: every model's gauges keep their last values
            _skipped(name, exc.__cause__)
        except (ValueError, TypeError, ArithmeticError) as exc:
            _skipped(name, exc)


def _skipped(name: str, exc: Exception) -> None:
    log.warning("metrics: model %r skipped: its keys cannot be read (%s: %s)", name,
                type(exc).__name__, exc)


async def _refresh_one(gateway: Gateway, name: str) -> None:
    redis_ = gateway.redis
    depths = await queue_depths(redis_, name, *await read_meta(redis_, name))
    rates = await gateway.fleet.rates(name)
    metrics.QUEUE_DEPTH.labels(name).set(sum(depths))  # every level
    levels = by_level(depths) if len(depths) > 1 else {}
    for level, depth in levels.items():
        metrics.QUEUE_DEPTH_LEVEL.labels(name, level).set(depth)
    for gone in LEVELS_SHOWN.get(name, set()) - set(levels):  # (levels changed)
        metrics.QUEUE_DEPTH_LEVEL.labels(name, gone).set(0)  # (what several processes
        metrics.QUEUE_DEPTH_LEVEL.remove(name, gone)  # read: their files keep a value)
    LEVELS_SHOWN[name] = set(levels)
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
    """The scrape body; without Redis (or past ``READ_TIMEOUT_S`` reading it: a stalled
    Redis must not fail the scrape, 10 s by default in Prometheus) the gauges keep
    their last values."""
    try:
        async with deadline_bound(protocol.now_ms() + round(1000 * READ_TIMEOUT_S),
                                  "reading the queue depths"):
            await refresh_gauges(gateway)
    except RedbatchError as exc:
        log.warning("metrics: could not read queue depths: %s", exc)
    return metrics.exposition()
