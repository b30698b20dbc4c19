"""redbatch on a real Sentinel set-up (a primary, a replica, three sentinels): a worker
and a client through ``redis+sentinel://``, and after the primary dies they carry on
with the promoted replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from redbatch.config import RedisSettings, WorkerConfig
from redbatch.errors import DeadlineExceeded, NoLiveWorkers, RedisUnavailable
from redbatch.producer.client import Client
from redbatch.worker.process import Worker
from tests.conftest import wait_live
from tests.engines import SentinelEngine
from tests.models_for_tests import adder

pytestmark = [pytest.mark.engines, pytest.mark.serial, pytest.mark.timeout(90)]
RECOVER_S = 20.0  # a failover (down after 1 s) must be over well within this
# what a caller may meet while the sentinels fail over: typed, retryable errors (the
# worker's lease may lapse on the promoted replica until its next heartbeat there)
TRANSIENT = (RedisUnavailable, DeadlineExceeded, NoLiveWorkers)
WORKER = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=2.0)


@pytest.fixture
def settings(redis_sentinel: SentinelEngine) -> RedisSettings:
    return RedisSettings(redis_sentinel.url, socket_timeout_s=3.0, connect_timeout_s=0.5)


@pytest.fixture
async def producer(settings: RedisSettings, start_worker: Callable[..., Worker]
                   ) -> AsyncIterator[Client]:
    """A client, once an in-process worker of ``adder`` is live (both through the
    sentinels)."""
    start_worker([adder], url=settings.url, config=WORKER)
    async with Client(settings=settings) as client:
        await wait_live(settings.url, "adder")
        yield client


async def test_worker_and_client_through_the_sentinels(
        redis_sentinel: SentinelEngine, producer: Client) -> None:
    assert await producer.predict_many("adder", list(range(20)), timeout_s=5) == \
        list(range(1, 21))
    assert redis_sentinel.primary.ask("EXISTS", "rb:{adder}:workers") == 1


async def test_after_the_primary_dies_both_carry_on_with_the_replica(
        redis_sentinel: SentinelEngine, producer: Client) -> None:
    assert await producer.predict("adder", 1, timeout_s=5) == 2
    promoted = await asyncio.to_thread(redis_sentinel.fail_over)
    started = time.monotonic()
    errors = await _until_served(producer)
    assert time.monotonic() - started < RECOVER_S
    assert all(isinstance(e, TRANSIENT) for e in errors)
    assert promoted.ask("EXISTS", "rb:{adder}:workers") == 1  # the worker beats there


async def _until_served(producer: Client) -> list[Exception]:
    """Predict until one is answered; the typed errors met meanwhile (each try bounded:
    none may hang)."""
    errors: list[Exception] = []
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        try:
            async with asyncio.timeout(5):
                if await producer.predict("adder", 41, timeout_s=2) == 42:
                    return errors
        except TRANSIENT as exc:
            errors.append(exc)
            await asyncio.sleep(0.1)
    raise AssertionError(f"not served again within {RECOVER_S} s: {errors[-3:]}")


async def test_a_dead_sentinel_listed_first_costs_no_retries(redis_sentinel: SentinelEngine
                                                            ) -> None:
    """One sentinel of three down, listed first: a new client asks it once and moves on
    to the next (redis-py's default retry spent about 3.5 s on it, past deadlines)."""
    redis_sentinel.sentinels[0].kill()
    settings = RedisSettings(redis_sentinel.url, socket_timeout_s=3.0, connect_timeout_s=0.5)
    started = time.monotonic()
    async with Client(settings=settings, require_workers=False) as client:
        assert await client.redis.ping()
    assert time.monotonic() - started < 1.5
