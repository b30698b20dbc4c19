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

from redbatch.levels import level_keys, of_meta, read_meta

FIRST_DELAY_S = 0.005
MAX_DELAY_S = 0.05


async def queue_of(redis: aioredis.Redis, model: str, priority: int | None) -> str:
    """The queue that ``model``'s requests of ``priority`` go to (a model of several
    priority levels has one per level; ``InvalidPayload`` for a level it lacks)."""
    return (await queues_of(redis, model, priority))[0]


async def queues_of(redis: aioredis.Redis, model: str, priority: int | None) -> list[str]:
    """``queue_of`` in every sub-queue of a model split into several (one for most)."""
    raw, draining = await read_meta(redis, model)
    return level_keys(model, raw, draining)[of_meta(raw).resolve(model, priority) - 1]


async def _depth(redis: aioredis.Redis, keys: list[str]) -> int:
    """The summed length of ``keys`` (one LLEN for one key)."""
    if len(keys) == 1:
        return int(await redis.llen(keys[0]))
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.llen(key)
        return sum(int(n) for n in await pipe.execute())


async def wait_for_room(redis: aioredis.Redis, keys: list[str], low_water: int,
                        max_wait_s: float) -> float:
    """Wait while the queues ``keys`` (a model's sub-queues) hold more than ``low_water``
    entries together (at most ``max_wait_s``); return the seconds waited."""
    started = time.monotonic()
    delay = FIRST_DELAY_S
    while await _depth(redis, keys) > low_water:
        waited = time.monotonic() - started
        if waited >= max_wait_s:
            break
        await asyncio.sleep(min(delay, max_wait_s - waited))
        delay = min(2 * delay, MAX_DELAY_S)
    return time.monotonic() - started
