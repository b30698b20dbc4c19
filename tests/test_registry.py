"""The live-worker cache: one registry read per model per refresh, however many
requests find it stale at once (single flight)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from redbatch import protocol
from redbatch.producer.admission import Admission

CONCURRENT = 64


def register(raw: redis.Redis, model: str, worker_id: str, items_per_s: float) -> None:
    """A live worker, as ``worker.heartbeat`` publishes it."""
    info = {"worker_id": worker_id, "device": "cpu", "pid": 1, "host": "h",
            "started_ms": protocol.now_ms(), protocol.F_ROWS: True,
            "items_per_s": items_per_s}
    raw.zadd(protocol.workers_key(model), {worker_id: protocol.now_ms() + 60_000})
    raw.hset(protocol.worker_info_key(model), worker_id, orjson.dumps(info))


def zrange_calls(raw: redis.Redis) -> int:
    stats: Any = raw.info("commandstats")
    return int(stats.get("cmdstat_zrangebyscore", {}).get("calls", 0))


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_url, max_connections=CONCURRENT * 2)
    yield conn
    await conn.aclose()


async def test_stale_cache_is_read_once_for_all_callers(raw_redis: redis.Redis,
                                                        client: aioredis.Redis) -> None:
    register(raw_redis, "m", "w1", 100.0)
    register(raw_redis, "m", "w2", 50.0)
    admission = Admission(client, max_queue_len=100)
    assert admission.live_cached("m") is None
    before = zrange_calls(raw_redis)
    lives = await asyncio.gather(*(admission.live("m") for _ in range(CONCURRENT)))
    assert zrange_calls(raw_redis) - before == 1
    assert lives == [2] * CONCURRENT
    assert admission.live_cached("m") == 2  # now fresh, no I/O
    assert await admission.capacity("m") == 150.0 and await admission.takes_rows("m")
    assert zrange_calls(raw_redis) - before == 1


async def test_failed_refresh_raises_to_all_waiters_then_reads_again(
        raw_redis: redis.Redis, client: aioredis.Redis) -> None:
    raw_redis.set(protocol.workers_key("m"), b"not a sorted set")  # every read fails
    admission = Admission(client, max_queue_len=100)
    before = zrange_calls(raw_redis)
    results = await asyncio.gather(*(admission.live("m") for _ in range(CONCURRENT)),
                                   return_exceptions=True)
    assert all(isinstance(r, redis.ResponseError) for r in results)
    assert zrange_calls(raw_redis) - before == 1  # one failed read, shared
    raw_redis.delete(protocol.workers_key("m"))
    register(raw_redis, "m", "w1", 10.0)
    assert await admission.live("m") == 1  # the failure was not cached
    assert zrange_calls(raw_redis) - before == 2
