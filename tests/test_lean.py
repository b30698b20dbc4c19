"""LeanLink: the hot loops' command path on one held connection, against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from redbatch import lua
from redbatch.config import RedisSettings
from redbatch.lean import LeanLink
from redbatch.redis_conn import async_client
from tests.conftest import RedisServer


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = async_client(RedisSettings(redis_url, socket_timeout_s=5.0))
    yield client
    await client.aclose()


async def test_commands_and_a_pipeline_in_order(client: aioredis.Redis) -> None:
    link = LeanLink(client)
    assert await link.execute("RPUSH", "q", "a", "b") == 2
    item, left = await link.pipeline(("BLMOVE", "q", "p", "LEFT", "RIGHT", 1), ("LLEN", "q"))
    assert (item, left) == (b"a", 1)
    assert await link.execute("LRANGE", "p", 0, -1) == [b"a"]


async def test_an_error_reply_keeps_the_connection_in_step(client: aioredis.Redis) -> None:
    link = LeanLink(client)
    before = await link.execute("CLIENT", "ID")
    await link.execute("SET", "s", "x")
    with pytest.raises(redis.ResponseError):
        await link.pipeline(("LLEN", "s"), ("GET", "s"))  # LLEN on a string: WRONGTYPE
    assert await link.execute("GET", "s") == b"x"  # not the GET's stale reply
    assert await link.execute("CLIENT", "ID") == before  # the same connection


async def test_a_script_redis_lost_is_loaded_again(client: aioredis.Redis) -> None:
    link = LeanLink(client)
    await link.execute("RPUSH", "q", "a")
    await link.execute("SCRIPT", "FLUSH")
    assert await link.script(lua.CLAIM, ["q", "inflight"], [5, 60_000]) == [b"a"]


async def test_a_busy_link_sends_through_the_client(client: aioredis.Redis) -> None:
    link = LeanLink(client)
    blocked = asyncio.create_task(link.execute("BLPOP", "nothing", 1))
    await asyncio.sleep(0.05)
    assert await link.execute("LLEN", "nothing") == 0  # not queued behind the BLPOP
    assert await blocked is None


async def test_a_busy_link_sends_a_pipeline_through_the_client(client: aioredis.Redis
                                                              ) -> None:
    link = LeanLink(client)
    blocked = asyncio.create_task(link.execute("BLPOP", "nothing", 1))
    await asyncio.sleep(0.05)
    await client.rpush("q", "a")
    assert await link.pipeline(("LLEN", "q"), ("LPOP", "q")) == [1, b"a"]
    assert await blocked is None


async def test_a_cancel_drops_the_connection(client: aioredis.Redis) -> None:
    link = LeanLink(client)
    await link.execute("PING")
    pop = asyncio.create_task(link.execute("BLMOVE", "q", "p", "LEFT", "RIGHT", 5))
    await asyncio.sleep(0.05)
    pop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pop
    assert await link.execute("RPUSH", "q", "a") == 1  # a fresh connection: no stale reply
    assert await link.execute("LLEN", "p") == 0  # the abandoned pop took nothing


async def test_it_reconnects_after_redis_restarts(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory()
    client = async_client(RedisSettings(server.url, socket_timeout_s=2.0,
                                        connect_timeout_s=0.5))
    link = LeanLink(client)
    try:
        assert await link.execute("PING") == b"PONG"
        server.kill()
        with pytest.raises((redis.ConnectionError, OSError)):
            await link.execute("PING")
        server.start()
        assert await link.execute("PING") == b"PONG"
    finally:
        await client.aclose()
        server.kill()


async def test_closing_the_client_closes_the_held_connection(redis_url: str,
                                                             raw_redis: redis.Redis) -> None:
    client = async_client(RedisSettings(redis_url, socket_timeout_s=5.0))
    link = LeanLink(client)
    await link.execute("CLIENT", "SETNAME", "lean-test")
    assert "lean-test" in repr(raw_redis.client_list())
    await client.aclose()
    await asyncio.sleep(0.05)
    assert "lean-test" not in repr(raw_redis.client_list())


async def test_a_stream_gone_before_the_write_is_a_connection_error(
        client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py writes in a task of its own, a loop iteration later: a connection
    disconnected meanwhile (a cluster client resetting its nodes does that to the
    connections it lent out) has no stream left, and the AttributeError it raises is
    a ConnectionError here (a typed 503 at the gateway, not a 500)."""
    link = LeanLink(client)
    await link.execute("PING")
    conn = link._conn
    assert conn is not None

    real = conn._writer
    assert real is not None

    class Closing:  # the stream being torn down
        def is_closing(self) -> bool:
            return True

        def close(self) -> None:
            real.close()

    async def gone(command: object, check_health: bool = True) -> None:
        raise AttributeError("'NoneType' object has no attribute 'writelines'")  # (redis-py)

    monkeypatch.setattr(conn, "_writer", Closing())  # being torn down as the write starts
    monkeypatch.setattr(conn, "send_packed_command", gone)
    with pytest.raises(redis.ConnectionError, match="closed while writing"):
        await link.execute("PING")
    monkeypatch.undo()
    assert await link.execute("RPUSH", "q", "a") == 1


async def test_translated_types_an_attribute_error_of_redis_py_alone() -> None:
    """Raised inside redis-py (a stream torn down mid-command): ``RedisUnavailable``, a
    503 at the gateway; raised anywhere else (a bug of ours): left as it is."""
    from redis.asyncio.connection import Connection

    from redbatch.errors import RedisUnavailable
    from redbatch.redis_conn import translated

    conn = Connection(host="127.0.0.1", port=1)
    settings = RedisSettings("redis://127.0.0.1:1")
    # a stream torn down under the write (redis-py 8.2 checks for None itself): its
    # writer lacks what the write needs, and the AttributeError comes from redis-py
    conn._writer = SimpleNamespace(transport=SimpleNamespace(is_closing=lambda: False))
    with pytest.raises(RedisUnavailable, match="closed during a command"):
        async with translated(settings):
            await conn._send_packed_command([b"PING"])
    conn._writer = None  # (never connected: nothing to close)
    with pytest.raises(AttributeError):
        async with translated(settings):
            None.no_such_attribute  # type: ignore[attr-defined]  # noqa: B018


async def test_concurrent_readies_take_one_connection(client: aioredis.Redis) -> None:
    """``ready`` connects the held connection before a caller lets another write; many
    at once (first flushes of several queues) take one, and give back none twice."""
    link = LeanLink(client)
    pool: Any = client.connection_pool
    await asyncio.gather(*(link.ready() for _ in range(5)))
    assert len(pool._in_use_connections) == 1
    assert await link.execute("PING") == b"PONG"  # on the held connection
    await link.ready()  # connected: nothing to do
    await link.release()
    assert len(pool._in_use_connections) == 0
