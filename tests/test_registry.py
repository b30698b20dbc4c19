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

from redbatch import defaults, protocol
from redbatch.api.directory import ModelDirectory
from redbatch.config import RedisSettings
from redbatch.errors import UnknownModel
from redbatch.producer.admission import Admission
from redbatch.registry import LiveCache, live_workers

CONCURRENT = 64


def register(raw: redis.Redis, model: str, worker_id: str, items_per_s: float, *,
             lease_ms: int = 60_000) -> None:
    """A worker, as ``worker.heartbeat`` publishes it: its lease, full info and compact
    capacity."""
    capacity = {protocol.F_ITEMS_PER_S: items_per_s, protocol.F_ROWS: True}
    info = {"worker_id": worker_id, "device": "cpu", "pid": 1, "host": "h",
            "started_ms": protocol.now_ms(), **capacity}
    raw.zadd(protocol.workers_key(model), {worker_id: protocol.now_ms() + lease_ms})
    raw.hset(protocol.worker_info_key(model), worker_id, orjson.dumps(info))
    raw.hset(protocol.worker_capacity_key(model), worker_id, orjson.dumps(capacity))


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


async def test_summary_counts_live_workers_and_sums_their_capacity(
        raw_redis: redis.Redis, client: aioredis.Redis) -> None:
    for worker_id, rate in (("w1", 100.0), ("w2", 50.5), ("w3", 0.0)):
        register(raw_redis, "m", worker_id, rate)
    register(raw_redis, "m", "gone", 1000.0, lease_ms=-1000)  # expired, not yet reaped
    summary = await LiveCache(client).get("m")
    assert (summary.live, summary.items_per_s, summary.rows, summary.known) == (
        3, 150.5, True, True)


async def test_summary_never_reads_the_workers_info(raw_redis: redis.Redis,
                                                    client: aioredis.Redis) -> None:
    register(raw_redis, "m", "w1", 100.0)
    register(raw_redis, "m", "w2", 25.0)
    info_key = protocol.worker_info_key("m")
    raw_redis.delete(info_key)
    raw_redis.set(info_key, b"x" * 1_000_000)  # any read of it as a hash fails: WRONGTYPE
    with pytest.raises(redis.ResponseError):
        await live_workers(client, "m")  # the full read does touch it
    summary = await LiveCache(client).get("m")
    assert (summary.live, summary.items_per_s, summary.rows) == (2, 125.0, True)


async def test_summary_of_workers_that_publish_no_or_bad_capacity(
        raw_redis: redis.Redis, client: aioredis.Redis) -> None:
    cache = LiveCache(client, refresh_s=0.0)
    assert not (await cache.get("m")).known  # no worker, no meta
    raw_redis.set(protocol.meta_key("m"), b"{}")
    summary = await cache.get("m")
    assert (summary.live, summary.known, summary.rows) == (0, True, False)
    register(raw_redis, "m", "w1", 40.0)
    raw_redis.zadd(protocol.workers_key("m"), {"old": protocol.now_ms() + 60_000})
    summary = await cache.get("m")  # "old" has a lease but no capacity field
    assert (summary.live, summary.items_per_s, summary.rows) == (2, 40.0, False)
    raw_redis.hset(protocol.worker_capacity_key("m"), "old", b"not json")
    assert (await cache.get("m")).items_per_s == 40.0
    raw_redis.hset(protocol.worker_capacity_key("m"), "old", orjson.dumps(
        {protocol.F_ITEMS_PER_S: 2.5, protocol.F_ROWS: True}))
    summary = await cache.get("m")
    assert (summary.live, summary.items_per_s, summary.rows) == (2, 42.5, True)


async def test_a_summary_with_no_live_worker_is_trusted_briefly(
        raw_redis: redis.Redis, client: aioredis.Redis) -> None:
    """A model nobody serves is re-read after MISS_REFRESH_S (a worker that just started
    is seen at once), one that is served only after the whole refresh_s."""
    cache = LiveCache(client, refresh_s=30.0)
    assert (await cache.get("m")).live == 0
    register(raw_redis, "m", "w1", 10.0)
    assert cache.cached("m") is not None  # within MISS_REFRESH_S: still the miss
    await asyncio.sleep(defaults.MISS_REFRESH_S + 0.05)
    assert cache.cached("m") is None
    assert (await cache.get("m")).live == 1
    raw_redis.delete(protocol.workers_key("m"))
    await asyncio.sleep(defaults.MISS_REFRESH_S + 0.05)
    assert cache.cached("m") is not None and (await cache.get("m")).live == 1


async def test_the_gateway_forgets_an_unknown_model_quickly(
        raw_redis: redis.Redis, client: aioredis.Redis) -> None:
    directory = ModelDirectory(client, RedisSettings(), refresh_s=30.0)
    with pytest.raises(UnknownModel):
        await directory.get("m")
    raw_redis.set(protocol.meta_key("m"), orjson.dumps({"name": "m"}))
    with pytest.raises(UnknownModel):  # the miss is remembered for a moment...
        await directory.get("m")
    await asyncio.sleep(defaults.MISS_REFRESH_S + 0.05)
    assert (await directory.get("m")).name == "m"  # ...not for the whole refresh_s
    raw_redis.delete(protocol.meta_key("m"))
    await asyncio.sleep(defaults.MISS_REFRESH_S + 0.05)
    assert (await directory.get("m")).name == "m"  # a hit is kept for refresh_s


async def test_live_caps_take_effect_from_the_stored_change(raw_redis: redis.Redis,
                                                           client: aioredis.Redis) -> None:
    """A stored change of ``priority_caps`` or ``max_queue_len`` is in the summary at
    once, before any worker republishes its meta (a second sooner than before); a
    stored value that does not fit the levels leaves the meta's caps."""
    register(raw_redis, "m", "w1", 100.0)
    meta = {"name": "m", "priority": {"levels": 2, "default": 1, "caps": [40, 40]},
            "limits": {"max_queue_len": 500}}
    raw_redis.set(protocol.meta_key("m"), orjson.dumps(meta))
    summary = await LiveCache(client).get("m")
    assert summary.levels.caps == (40, 40) and summary.max_queue_len == 500
    raw_redis.hset(protocol.config_key("m"), mapping={"priority_caps": "[5, 40]",
                                                      "max_queue_len": "64"})
    summary = await LiveCache(client).get("m")
    assert summary.levels.caps == (5, 40) and summary.levels.count == 2
    assert summary.max_queue_len == 64
    for caps in ("[5]", '["a", 40]', "[0, 40]", "{}", "not json"):  # edited by hand
        raw_redis.hset(protocol.config_key("m"), mapping={"priority_caps": caps,
                                                          "max_queue_len": "lots"})
        summary = await LiveCache(client).get("m")
        assert summary.levels.caps == (40, 40) and summary.levels.count == 2, caps
        assert summary.max_queue_len == 500
