"""Admission-based priority for bulk work: push only into a short queue.

A model has one FIFO queue for everyone, so priority cannot be a field of the request.
Instead, a bulk job reads the queue's depth (``LLEN``) before each chunk and waits,
sleeping with a capped exponential backoff, while it is above a low-water mark.  Bulk
items then only ever fill idle capacity: an interactive request finds at most about
``low_water + chunk_size`` bulk items ahead of it, however large the job.

The wait is bounded by ``max_wait_s``: under sustained interactive load the job still
pushes one chunk per ``max_wait_s`` (slow progress, no starvation), which adds at most
one chunk to the queue.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from redbatch import protocol
from redbatch.levels import of_meta

FIRST_DELAY_S = 0.005
MAX_DELAY_S = 0.05


async def queue_of(redis: aioredis.Redis, model: str, priority: int | None) -> str:
    """The queue that ``model``'s requests of ``priority`` go to (a model of several
    priority levels has one per level; ``InvalidPayload`` for a level it lacks)."""
    levels = of_meta(await redis.get(protocol.meta_key(model)))
    return levels.queues(model)[levels.resolve(model, priority) - 1]


async def wait_for_room(redis: aioredis.Redis, key: str, low_water: int,
                        max_wait_s: float) -> float:
    """Wait while the queue ``key`` is longer than ``low_water`` (at most ``max_wait_s``);
    return the seconds waited."""
    started = time.monotonic()
    delay = FIRST_DELAY_S
    while await redis.llen(key) > low_water:
        waited = time.monotonic() - started
        if waited >= max_wait_s:
            break
        await asyncio.sleep(min(delay, max_wait_s - waited))
        delay = min(2 * delay, MAX_DELAY_S)
    return time.monotonic() - started
