"""Reliable claim: move requests from a model's queue into this worker's in-flight list.

Items never live only in a worker's memory: ``BLMOVE`` and the ``CLAIM`` script
move them atomically into ``inflight_key(model, worker_id)``, where they stay
until the batch's replies are published together with the ack.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import orjson
import redis.asyncio as aioredis

from redbatch import lua, protocol
from redbatch.worker.policy import BatchPolicy

MIN_BLOCK_S = 0.001
GAIN_MIN = 0.5  # waiting is worth it while a window adds this many requests on average
GAIN_SMOOTHING = 0.2
PROBE_EVERY = 16  # lone batches: one in this many waits anyway, to re-measure the gain
SERVER_TIMER_SLACK_S = 0.11  # a blocked client's timeout may fire up to 1/hz s late


def peek_enqueue_ms(raw: bytes, fallback_ms: int) -> int:
    """Read an entry's enqueue time without validating the rest of it, never later than
    ``fallback_ms`` (the claim time)."""
    try:
        wire: Any = orjson.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw)
        value = wire.get(protocol.F_ENQUEUE_MS) if isinstance(wire, dict) else None
    except Exception:  # a bad entry is rejected later, by the decode step
        return fallback_ms
    if isinstance(value, int) and not isinstance(value, bool):
        return min(value, fallback_ms)  # a producer clock ahead of ours must not hold a batch
    return fallback_ms


class Claimer:
    """Forms one batch at a time for one model under a ``BatchPolicy``."""

    def __init__(self, redis: aioredis.Redis, model: str, worker_id: str, policy: BatchPolicy,
                 block_timeout_s: float) -> None:
        self._redis = redis
        self._policy = policy
        self._block_timeout_s = block_timeout_s
        self.queue = protocol.queue_key(model)
        self.inflight = protocol.inflight_key(model, worker_id)
        self._claim = redis.register_script(lua.CLAIM)
        self._last_claim = 0.0
        self._loaded = False
        self._gain = 1.0  # requests a window wait added, smoothed; starts hopeful
        self._lone = 0

    async def _take(self, count: int) -> list[bytes]:
        ttl_ms = protocol.INFLIGHT_TTL_S * 1000
        items = await self._claim(keys=[self.queue, self.inflight], args=[count, ttl_ms])
        return list(items)

    async def _block_one(self, timeout_s: float) -> bytes | None:
        timeout: Any = timeout_s  # redis accepts fractional seconds; its stubs say int
        item: Any = await self._redis.blmove(self.queue, self.inflight, timeout, "LEFT", "RIGHT")
        return item if isinstance(item, bytes) else None

    async def _pace(self) -> None:
        wait_s = self._last_claim + self._policy.stride_s - time.monotonic()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._last_claim = time.monotonic()

    async def claim(self) -> list[bytes]:
        """Return up to ``max_batch_size`` raw entries, or [] after the block timeout."""
        await self._pace()
        if not self._loaded:  # EVALSHA then never misses (fakeredis drops the link on a miss)
            await self._redis.script_load(lua.CLAIM)
            self._loaded = True
        size = self._policy.max_batch_size
        items = await self._take(size)
        if not items:
            first = await self._block_one(self._block_timeout_s)
            if first is None:
                return []
            items = [first, *await self._take(size - 1)]
        if len(items) < size and self._policy.batch_wait_timeout_s > 0 and \
                self._worth_waiting(len(items)):
            claimed_ms = protocol.now_ms()
            oldest_ms = peek_enqueue_ms(items[0], claimed_ms)
            found = len(items)
            await self._fill(items, self._policy.window_end_ms(oldest_ms, claimed_ms))
            self._gain += GAIN_SMOOTHING * (len(items) - found - self._gain)
        return items

    def _worth_waiting(self, found: int) -> bool:
        """Skip the window for a lone request while windows have been bringing nothing."""
        policy = self._policy
        if found > 1 or not (policy.adaptive and policy.allow_small_batch):
            return True
        self._lone += 1
        return self._gain >= GAIN_MIN or self._lone % PROBE_EVERY == 0

    async def _fill(self, items: list[bytes], window_end_ms: int) -> None:
        """Top the batch up until it is full or its window closes.

        Redis wakes blocked clients on its own timer (``hz``, 100 ms by default), so a
        server-side block timeout is only used while it cannot overshoot the window;
        the last stretch is a client-side sleep followed by one non-blocking claim."""
        size = self._policy.max_batch_size
        while len(items) < size:
            remaining_s = (window_end_ms - protocol.now_ms()) / 1000
            if remaining_s < MIN_BLOCK_S:
                return
            if remaining_s <= SERVER_TIMER_SLACK_S + MIN_BLOCK_S:
                await asyncio.sleep(remaining_s)
                items.extend(await self._take(size - len(items)))
                return
            # Never block past the socket's patience: long windows are waited in steps.
            item = await self._block_one(min(remaining_s - SERVER_TIMER_SLACK_S,
                                             self._block_timeout_s))
            if item is not None:
                items.append(item)
                items.extend(await self._take(size - len(items)))
