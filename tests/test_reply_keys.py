"""Reply lists in the model's slot (``rb:reply:{<model>}:<client_id>``): the worker's
PUBLISH and REAP scripts touch one slot; a client keeps one reply listener per model
in use, which stops once idle and starts again with no reply lost; a legacy
``rb:reply:{<id>}`` is still answered on a plain Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.crc import key_slot

from redbatch import Client, batch, codec, lua, protocol
from redbatch.errors import DeadlineExceeded, RedbatchError, WorkerCrashed
from redbatch.lean import LeanLink
from redbatch.protocol import Reply
from redbatch.worker.process import Worker
from redbatch.worker.reaper import Reaper
from tests.conftest import wait_live


@batch(name="slot-a", max_batch_size=8, batch_wait_timeout_s=0)
def slot_a(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


@batch(name="slot-b", max_batch_size=8, batch_wait_timeout_s=0)
def slot_b(xs: list[int]) -> list[int]:
    return [x * 10 for x in xs]


Calls = list[tuple[str, list[str]]]  # (script source, its KEYS) of every script call


@pytest.fixture
def script_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """Record the KEYS of every script call, through the lean path and redis-py's."""
    calls: Calls = []
    lean_script, script_call = LeanLink.script, AsyncScript.__call__

    async def lean(self: LeanLink, source: str, keys: list[Any], args: list[Any]) -> Any:
        calls.append((source, [str(k) for k in keys]))
        return await lean_script(self, source, keys, args)

    def call(self: AsyncScript, keys: Any = None, args: Any = None, client: Any = None
             ) -> Awaitable[Any]:
        calls.append((self.script if isinstance(self.script, str) else self.script.decode(),
                      [str(k) for k in keys or []]))
        return script_call(self, keys, args, client)

    monkeypatch.setattr(LeanLink, "script", lean)
    monkeypatch.setattr(AsyncScript, "__call__", call)
    yield calls


def slots(keys: list[str]) -> set[int]:
    return {key_slot(key.encode()) for key in keys}


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``check()`` holds."""
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_publish_touches_one_slot(start_worker: Callable[..., Worker], redis_url: str,
                                        script_calls: Calls) -> None:
    start_worker([slot_a])
    await wait_live(redis_url, "slot-a")
    async with Client(redis_url) as client:
        assert await client.predict("slot-a", 1) == 2
        assert await client.predict_many("slot-a", [1, 2, 3]) == [2, 3, 4]
    published = [keys for source, keys in script_calls if source == lua.PUBLISH]
    assert published
    for keys in published:
        assert slots(keys) == slots([protocol.queue_key("slot-a")]), keys
    assert any(client.reply_to("slot-a") in keys for keys in published)


async def test_reap_touches_one_slot(redis_url: str, raw_redis: redis.Redis,
                                     script_calls: Calls) -> None:
    """A dead worker's request, sent by a Client, answered ``worker_crashed`` by REAP."""
    model, ghost = "slot-ghosted", "ghost"
    async with Client(redis_url, require_workers=False) as client:
        future = await client.submit(model, 7, timeout_s=10)
        await until(lambda: raw_redis.llen(protocol.queue_key(model)) == 1, "enqueued")
        raw_redis.lmove(protocol.queue_key(model), protocol.inflight_key(model, ghost))
        raw_redis.zadd(protocol.workers_key(model), {ghost: protocol.now_ms() - 1})
        conn = aioredis.Redis.from_url(redis_url)
        try:
            assert await Reaper(conn, model, max_attempts=1).reap(ghost) == 0
        finally:
            await conn.aclose()
        with pytest.raises(WorkerCrashed):
            await future
    reaped = [keys for source, keys in script_calls if source == lua.REAP]
    assert len(reaped) == 1
    assert slots(reaped[0]) == slots([protocol.queue_key(model)]), reaped[0]
    assert client.reply_to(model) in reaped[0]


async def test_two_models_two_listeners(start_worker: Callable[..., Worker], redis_url: str,
                                        raw_redis: redis.Redis) -> None:
    start_worker([slot_a, slot_b])
    await wait_live(redis_url, "slot-a")
    await wait_live(redis_url, "slot-b")
    async with Client(redis_url) as client:
        a, b = await asyncio.gather(client.predict("slot-a", 1, reply=True),
                                    client.predict("slot-b", 1, reply=True))
        assert (a.payload, b.payload) == (2, 10)
        stats = client.stats()
        assert (stats["listeners"], stats["listeners_started"], stats["replies"]) == (2, 2, 2)
        await until(lambda: blocked(raw_redis) == 2, "two blocking pops")
    assert client.stats() == {"waiting": 0}


def blocked(raw_redis: redis.Redis) -> int:
    """Clients blocked in a BLMPOP now (the reply listeners: workers use BLMOVE)."""
    return sum(1 for c in raw_redis.client_list() if c["cmd"] == "blmpop" and "b" in c["flags"])


async def test_an_idle_listener_stops_and_a_new_request_restarts_it(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([slot_a])
    await wait_live(redis_url, "slot-a")
    async with Client(redis_url, listener_idle_s=0.2, block_timeout_s=0.1) as client:
        assert await client.predict("slot-a", 1) == 2
        await until(lambda: client.stats()["listeners"] == 0, "the idle listener stopped")
        assert blocked(raw_redis) == 0
        assert await client.predict("slot-a", 2) == 3  # a new listener
        stats = client.stats()
        assert (stats["listeners_started"], stats["replies"], stats["late"]) == (2, 2, 0)


async def test_a_request_that_arrives_while_its_listener_stops_is_answered(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """The listener stops between a request's checks and its waiter: the waiter goes
    to a new listener, which gets the reply."""
    start_worker([slot_a])
    await wait_live(redis_url, "slot-a")
    async with Client(redis_url, listener_idle_s=0.2, block_timeout_s=0.1) as client:
        assert await client.predict("slot-a", 1) == 2
        served = client.check_served

        async def check_then_wait(model: str, deadline_ms: int | None = None) -> None:
            await served(model, deadline_ms)
            await until(lambda: client.stats()["listeners"] == 0, "the listener stopped")

        client.check_served = check_then_wait  # type: ignore[method-assign]
        # version "1" (of a model served without versions): the full path, whose served
        # check awaits (the plain path, without a priority, has no await between its
        # checks and the waiter)
        assert await client.predict("slot-a", 5, timeout_s=5, version="1") == 6
        assert client.stats()["listeners_started"] == 2


async def test_a_reply_pushed_while_no_listener_runs_is_not_lost(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """The reply list outlives its listener: a reply already there when a listener
    starts is popped by it."""
    async with Client(redis_url, require_workers=False, listener_idle_s=0.2,
                      block_timeout_s=0.1) as client:
        first = await client.submit("slot-none", 1, timeout_s=0.2)
        with pytest.raises(DeadlineExceeded):
            await first
        await until(lambda: client.stats()["listeners"] == 0, "the idle listener stopped")
        early = Reply("r-early", True, payload=42).to_wire()
        raw_redis.rpush(client.reply_to("slot-none"), codec.encode(early))
        assert await client.predict("slot-none", 1, request_id="r-early", timeout_s=5) == 42
        assert client.stats()["listeners_started"] == 2


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_a_legacy_reply_to_is_answered_on_a_plain_redis(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        fmt: str) -> None:
    start_worker([slot_a])
    reply_to = protocol.legacy_reply_key(f"old-producer-{fmt}")
    assert not protocol.reply_in_model_slot("slot-a", reply_to)
    now = protocol.now_ms()
    request = protocol.Request(protocol.new_request_id(), "slot-a", now, now + 10_000,
                               reply_to, 41)
    raw_redis.rpush(protocol.queue_key("slot-a"), codec.encode(request.to_wire(), fmt))
    got = await asyncio.to_thread(raw_redis.blpop, [reply_to], 10)
    assert got is not None
    reply = protocol.reply_from_wire(codec.decode(got[1]))
    assert (reply.id, reply.ok, reply.payload) == (request.id, True, 42)
    assert raw_redis.get(protocol.request_key("slot-a", request.id)) == b"d"


async def test_no_listener_starts_for_a_closed_client(redis_url: str) -> None:
    client = Client(redis_url, require_workers=False)
    await client.start()
    listeners = client._listeners
    assert listeners is not None
    listeners.of("slot-a")
    await client.close()
    assert listeners.running == 0
    with pytest.raises(RedbatchError, match="closed"):
        listeners.of("slot-a")
