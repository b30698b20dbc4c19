"""redbatch on a real Sentinel set-up (a primary, a replica, three sentinels): a worker
and a client through ``redis+sentinel://``, and after the primary dies they carry on
with the promoted replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from redbatch import batch
from redbatch.config import RedisSettings, WorkerConfig
from redbatch.errors import DeadlineExceeded, NoLiveWorkers, RedisUnavailable
from redbatch.producer.client import Client
from redbatch.worker.process import Worker
from tests.engines import SentinelEngine

pytestmark = [pytest.mark.engines, pytest.mark.timeout(90)]
RECOVER_S = 20.0  # a failover (down after 1 s) must be over well within this
# what a caller may meet while the sentinels fail over: typed, retryable errors (the
# worker's lease may lapse on the promoted replica until its next heartbeat there)
TRANSIENT = (RedisUnavailable, DeadlineExceeded, NoLiveWorkers)
WORKER = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=2.0)


@batch(name="adder", max_batch_size=8, batch_wait_timeout_s=0.002)
def adder(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


@pytest.fixture
def settings(redis_sentinel: SentinelEngine) -> RedisSettings:
    return RedisSettings(redis_sentinel.url, socket_timeout_s=3.0, connect_timeout_s=0.5)


async def _wait_live(producer: Client, model: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await producer.live_workers(model):
        assert time.monotonic() < deadline, f"no live worker of {model!r}"
        await asyncio.sleep(0.05)


async def test_worker_and_client_through_the_sentinels(
        settings: RedisSettings, redis_sentinel: SentinelEngine,
        start_worker: Callable[..., Worker]) -> None:
    start_worker([adder], url=settings.url, config=WORKER)
    async with Client(settings=settings) as producer:
        await _wait_live(producer, "adder")
        assert await producer.predict_many("adder", list(range(20)), timeout_s=5) == \
            list(range(1, 21))
    assert redis_sentinel.primary.ask("EXISTS", "rb:{adder}:workers") == 1


async def test_after_the_primary_dies_both_carry_on_with_the_replica(
        settings: RedisSettings, redis_sentinel: SentinelEngine,
        start_worker: Callable[..., Worker]) -> None:
    start_worker([adder], url=settings.url, config=WORKER)
    async with Client(settings=settings) as producer:
        await _wait_live(producer, "adder")
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
