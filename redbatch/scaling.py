"""Autoscaling signals: how many workers a model needs, from fleet-wide figures.

Per model, at scrape time (``api.metrics_view``) or over ``redbatch status``'s sampling
interval, never on the request path:

- **capacity**: the ``items_per_s`` each live worker publishes with its heartbeat
  (queue entries served per busy second); per worker, the mean over the workers that
  measured one (above 0);
- **arrival rate** = served rate + queue growth, where the served rate is the sum of
  the ``served_per_s`` the live workers publish (entries taken off the queue per second
  of wall time, over ``defaults.SERVED_WINDOW_S``) and the growth is the change of the
  queue's length (every priority level) per second between two readings: what came in
  is what was served plus what stayed, whichever gateway or client sent it;
- **workers needed** = ceil((arrival + backlog / ``defaults.SCALE_DRAIN_S``) /
  per-worker capacity): enough workers for the traffic, plus what drains the queue
  standing now within ``SCALE_DRAIN_S``.  0 when there is neither traffic nor a
  backlog; while no live worker has measured its capacity (none is live, or none has
  served yet) but there is demand: the live workers, at least 1.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis

from redbatch import defaults, lua, protocol

GROWTH_MIN_INTERVAL_S: Final = 1.0  # readings closer than this share the last growth
ROUNDING: Final = 1e-9  # ceil(2.0000000001) is 2 workers, not 3


@dataclass(frozen=True)
class FleetRates:
    """A model's live workers as ``lua.SCALING_SUMMARY`` reads them."""

    live: int  # workers holding a live lease
    measured: int  # those that published a capacity above 0
    capacity_per_s: float  # their summed items_per_s
    served_per_s: float  # their summed served_per_s

    @property
    def per_worker_per_s(self) -> float | None:
        """The mean measured capacity of one worker (None: none measured)."""
        return self.capacity_per_s / self.measured if self.measured else None


def mean_capacity(capacities: list[float]) -> float | None:
    """The mean of the capacities above 0 (None: none)."""
    measured = [c for c in capacities if c > 0]
    return sum(measured) / len(measured) if measured else None


def arrival_rate(served_per_s: float, growth_per_s: float) -> float:
    """Entries arriving per second: those served plus the queue's growth (never < 0)."""
    return max(0.0, served_per_s + growth_per_s)


def workers_needed(arrival_per_s: float, backlog: int, per_worker_per_s: float | None,
                   live: int, drain_s: float = defaults.SCALE_DRAIN_S) -> int:
    """Workers that serve ``arrival_per_s`` and drain ``backlog`` within ``drain_s``."""
    demand = arrival_per_s + max(0, backlog) / drain_s
    if demand <= 0:
        return 0
    if not per_worker_per_s:
        return max(live, 1)
    return max(1, math.ceil(demand / per_worker_per_s - ROUNDING))


class QueueGrowth:
    """Per model, the queue's growth per second between this process's readings; a
    reading less than ``GROWTH_MIN_INTERVAL_S`` after the base one answers the last
    growth and keeps the base (two quick scrapes measure nothing but noise)."""

    def __init__(self) -> None:
        self._base: dict[str, tuple[float, int]] = {}  # model -> (monotonic s, length)
        self._last: dict[str, float] = {}

    def rate(self, model: str, length: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        base = self._base.get(model)
        if base is not None and now - base[0] < GROWTH_MIN_INTERVAL_S:
            return self._last.get(model, 0.0)
        self._base[model] = (now, length)
        growth = 0.0 if base is None else (length - base[1]) / (now - base[0])
        self._last[model] = growth
        return growth


class FleetReader:
    """Reads ``FleetRates`` (one read-only script call per model) and keeps the queue
    growth between readings: one per gateway."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._script = redis.register_script(lua.SCALING_SUMMARY)
        self.growth = QueueGrowth()

    async def rates(self, model: str) -> FleetRates:
        keys = [protocol.workers_key(model), protocol.worker_capacity_key(model)]
        reply: Any = await self._script(keys=keys, args=[protocol.now_ms()])
        live, measured, capacity, served = reply
        return FleetRates(int(live), int(measured), _finite(capacity), _finite(served))


def _finite(value: Any) -> float:
    """A rate the workers published, summed by the script; 0 for one that is not a
    finite number (``1e400`` in a field reads as infinity)."""
    rate = float(value)
    return rate if math.isfinite(rate) else 0.0
