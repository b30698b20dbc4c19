"""A command's connection goes back to its pool even when the command's task is
cancelled while the release waits for the pool's lock (``redis_conn.ShieldedRelease``),
against a real Redis: redis-py lost it (open until collected, a ``ResourceWarning``;
in a blocking pool, a slot of ``max_connections`` gone meanwhile)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from redbatch.config import RedisSettings
from redbatch.redis_conn import ShieldedPool, ShieldedSentinel, async_client


async def _cancelled_while_releasing(client: aioredis.Redis) -> None:
    """A command whose release meets a held lock, cancelled there."""
    pool: Any = client.connection_pool
    lock = getattr(pool, "_condition", None) or pool._lock
    command = asyncio.create_task(client.execute_command("BLPOP", "rb:test:none", 0.3))
    await asyncio.sleep(0.1)  # the command waits on its connection
    async with lock:  # another task holds the pool's lock as the reply comes
        await asyncio.sleep(0.4)  # the release now waits for the lock
        command.cancel()
    with pytest.raises(asyncio.CancelledError):
        await command
    await asyncio.sleep(0.05)  # (the shielded release ends)


@pytest.mark.parametrize("make", [
    lambda url: async_client(RedisSettings(url)),  # a plain Redis: a blocking pool
    lambda url: aioredis.Redis.from_pool(ShieldedPool.from_url(url)),  # a sentinel's link
], ids=["blocking", "plain"])
async def test_a_cancel_during_the_release_keeps_the_connection_in_the_pool(
        redis_url: str, make: Callable[[str], aioredis.Redis]) -> None:
    client = make(redis_url)
    try:
        await _cancelled_while_releasing(client)
        pool: Any = client.connection_pool
        assert len(pool._available_connections) == 1 and not pool._in_use_connections
        assert await client.ping()  # on the same connection
        assert len(pool._available_connections) == 1
    finally:
        await client.aclose()  # (a lost connection would fail the leak check)


def test_sentinel_links_use_shielded_pools() -> None:
    sentinel = ShieldedSentinel([("127.0.0.1", 1), ("127.0.0.1", 2)],
                                sentinel_kwargs={"socket_timeout": 1.0})
    assert [type(s.connection_pool) for s in sentinel.sentinels] == [ShieldedPool] * 2
    assert sentinel.sentinels[1].connection_pool.connection_kwargs["port"] == 2
    assert sentinel.sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 1.0
