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

FIRST_DELAY_S = 0.005
MAX_DELAY_S = 0.05


async def wait_for_room(redis: aioredis.Redis, model: str, low_water: int,
                        max_wait_s: float) -> float:
    """Wait while ``model``'s queue is longer than ``low_water`` (at most ``max_wait_s``);
    return the seconds waited."""
    key = protocol.queue_key(model)
    started = time.monotonic()
    delay = FIRST_DELAY_S
    while await redis.llen(key) > low_water:
        waited = time.monotonic() - started
        if waited >= max_wait_s:
            break
        await asyncio.sleep(min(delay, max_wait_s - waited))
        delay = min(2 * delay, MAX_DELAY_S)
    return time.monotonic() - started
