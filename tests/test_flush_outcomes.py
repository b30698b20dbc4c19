"""Every push of a flush gets its outcome, whatever ends the flush: a cancel fails
its requests with a typed error at once (no waiter left to its deadline, no
``submit_many`` blocked), an ``on_failed`` that raises leaves the rest of the flush
settled; a request racing ``close`` fails typed, before its waiter is made; and the
flushes of one sub-queue write in submit order across ticks, whatever their awaits
before the write take."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from redbatch import Client
from redbatch.errors import DeadlineExceeded, RedbatchError, RedisUnavailable
from redbatch.producer.enqueuer import Outcome
from tests.test_shards import queued, registered

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
MODEL = "lone"


async def _settled(*waits: asyncio.Future[Any]) -> None:
    """Every one of ``waits`` done well within the requests' 30 s deadline."""
    await asyncio.wait(waits, timeout=10)
    assert all(f.done() for f in waits), "left to its deadline"


async def test_a_cancelled_flush_fails_its_requests_at_once(raw_redis: redis.Redis,
                                                           redis_url: str) -> None:
    registered(raw_redis, MODEL, 1)
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        await client.live_workers(MODEL)
        flight = asyncio.ensure_future(asyncio.sleep(60))

        async def levels(model: str) -> None:
            await asyncio.shield(flight)  # as a LiveCache read in flight is awaited

        client._admission.levels = levels  # type: ignore[assignment,method-assign]
        one = await client.submit(MODEL, 1, timeout_s=30)
        many = asyncio.ensure_future(client.submit_many(MODEL, [2, 3], timeout_s=30))
        await asyncio.sleep(0.05)  # both flushes wait on the read
        flight.cancel()  # as ``LiveCache.aclose`` cancels a read in flight
        await _settled(one, many)
        assert client.waiting == 0
        for future in [one, *many.result()]:
            error = future.exception()
            assert isinstance(error, RedbatchError), error
            assert not isinstance(error, DeadlineExceeded)
            assert "cancelled" in str(error)


async def test_a_flush_cancelled_before_its_start_fails_its_requests(
        raw_redis: redis.Redis, redis_url: str) -> None:
    registered(raw_redis, MODEL, 1)
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        await client.live_workers(MODEL)
        enqueuer = client._enqueuer
        assert enqueuer is not None
        one = await client.submit(MODEL, 1, timeout_s=30)
        # after the flush made its task, before the task's first step (a loop's shutdown)
        asyncio.get_running_loop().call_soon(lambda: [t.cancel() for t in enqueuer._tasks])
        await _settled(one)
        assert isinstance(one.exception(), RedbatchError)
        assert "cancelled" in str(one.exception())
        assert client.waiting == 0


async def test_an_on_failed_that_raises_leaves_the_rest_of_the_flush_settled(
        raw_redis: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    registered(raw_redis, MODEL, 1)
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        await client.live_workers(MODEL)
        assert client._enqueuer is not None
        failed, calls = client._failed, []

        def breaks_first(tag: str, outcome: Outcome) -> None:
            calls.append(outcome)
            if len(calls) == 1:
                raise RuntimeError("on_failed broke")
            failed(tag, outcome)

        async def down(model: str) -> None:
            raise RedisUnavailable("down")

        client._enqueuer._on_failed = breaks_first
        client._admission.levels = down  # type: ignore[assignment,method-assign]
        first, second, many = await asyncio.gather(  # one tick: one flush, three pushes
            client.submit(MODEL, 1, timeout_s=30), client.submit(MODEL, 2, timeout_s=30),
            client.submit_many(MODEL, [3, 4], timeout_s=30))
        await _settled(second, *many)
        assert len(calls) == 3
        for future in [second, *many]:
            assert isinstance(future.exception(), RedisUnavailable)
        assert "on_failed raised" in caplog.text
        first.cancel()  # its waiter: on_failed broke for it


async def test_a_submit_racing_close_fails_typed(raw_redis: redis.Redis,
                                                 redis_url: str) -> None:
    registered(raw_redis, MODEL, 1)
    client = Client(redis_url, require_workers=False, pack_rows=1)
    await client.start()
    await client.live_workers(MODEL)
    gate = asyncio.Event()
    level = client._level

    async def held(model: str, priority: int, deadline_ms: int) -> int:
        await gate.wait()  # the request resumes once the close has begun
        return await level(model, priority, deadline_ms)

    client._level = held  # type: ignore[method-assign]
    racing = asyncio.ensure_future(client.submit(MODEL, 1, timeout_s=30, priority=1))
    await asyncio.sleep(0.05)
    closing = asyncio.ensure_future(client.close())
    await asyncio.sleep(0)  # the enqueuer is gone: the close awaits its listeners
    gate.set()
    with pytest.raises(RedbatchError, match="closing"):
        await racing
    await closing


async def test_flushes_of_one_queue_write_in_submit_order_across_ticks(
        raw_redis: redis.Redis, redis_url: str) -> None:
    """The first tick's flush waits long on a read before its write (a stale summary
    read anew), the second's does not: the second still writes after it."""
    registered(raw_redis, MODEL, 1)
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        await client.live_workers(MODEL)
        gate, seen, read = asyncio.Event(), [], []
        cap = client._admission.cap

        async def slow_first(model: str, deadline_ms: int, own: int | None) -> int:
            seen.append(model)
            if len(seen) == 1:
                await gate.wait()
            answer = await cap(model, deadline_ms, own)
            read.append(model)
            return answer

        client._admission.cap = slow_first  # type: ignore[method-assign]
        first = await client.submit(MODEL, 1, timeout_s=30)
        await asyncio.sleep(0.05)  # its flush waits on the read
        second = await client.submit(MODEL, 2, timeout_s=30)
        for _ in range(300):  # the second flush past its read (its reply in: the held
            if len(read) == 1:  # connection free again for the first flush's write)
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # (time enough for its write, were it not held back)
        gate.set()
        for _ in range(100):
            if len(queued(raw_redis, MODEL)) == 2:
                break
            await asyncio.sleep(0.01)
        assert queued(raw_redis, MODEL) == [1, 2]
    await asyncio.gather(first, second, return_exceptions=True)  # failed by the close


async def test_a_first_flush_that_must_connect_still_writes_first(
        raw_redis: redis.Redis, redis_url: str) -> None:
    """The held connection is taken (and connected) at the first enqueue: a flush that
    waits for that must not let the next flush's write, through the pool, pass it."""
    registered(raw_redis, MODEL, 1)
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        await client.live_workers(MODEL)
        link: Any = client._enqueuer._link
        connection, calls = link._connection, []

        async def slow_once() -> Any:
            calls.append(1)
            if len(calls) == 1:  # the held connection's checkout: as a slow connect
                await asyncio.sleep(0.2)
            return await connection()

        link._connection = slow_once
        first = asyncio.ensure_future(client.predict(MODEL, 1, timeout_s=30))
        await asyncio.sleep(0.02)  # the first tick's flush is waiting on its connect
        second = asyncio.ensure_future(client.predict(MODEL, 2, timeout_s=30))
        for _ in range(100):
            if len(queued(raw_redis, MODEL)) == 2:
                break
            await asyncio.sleep(0.01)
        assert calls and queued(raw_redis, MODEL) == [1, 2]
    await asyncio.gather(first, second, return_exceptions=True)  # failed by the close
