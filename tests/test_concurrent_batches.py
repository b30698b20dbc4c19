"""``max_concurrent_batches``: several batches in flight per worker, each acked by its
own publish; a killed worker's batches are all reaped and answered once; a suspect
batch still runs alone."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest
import redis

from redbatch import Client, batch, codec, protocol
from redbatch.config import RedisSettings
from redbatch.errors import ConfigError
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import FAST_WORKER, Proc, redbatch_cmd, test_env, wait_live
from tests.test_reliability import (
    FAST_LEASE,
    TAKEOVER,
    inflight_total,
    raw_request,
    read_reply,
    wait_for,
)

SLEEP_S = 0.3


class Gauge:
    """Batch calls running at once inside a model: now, and the most seen."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        # each call's inputs and the most calls running at once while it ran
        self.calls: list[tuple[list[int], list[int]]] = []
        self._running: list[list[int]] = []

    async def run(self, xs: list[int], sleep_s: float = SLEEP_S) -> list[int]:
        self.now += 1
        self.peak = max(self.peak, self.now)
        mine = [self.now]
        self.calls.append((list(xs), mine))
        self._running.append(mine)
        for seen in self._running:
            seen[0] = max(seen[0], self.now)
        try:
            await asyncio.sleep(sleep_s)
        finally:
            self.now -= 1
            self._running.remove(mine)
        return [x * 2 for x in xs]

    def overlaps(self, value: int) -> list[int]:
        """For each call that got ``value``: the most calls running while it ran."""
        return [seen[0] for xs, seen in self.calls if value in xs]


def gauged(name: str, gauge: Gauge, **knobs: int) -> Model:
    @batch(name=name, max_batch_size=4, batch_wait_timeout_s=0.0, **knobs)
    async def fn(xs: list[int]) -> list[int]:
        return await gauge.run(xs)

    return fn


def test_policy_checks_the_range() -> None:
    assert BatchPolicy().max_concurrent_batches == 1
    assert BatchPolicy.from_mapping({"max_concurrent_batches": 64}).max_concurrent_batches == 64
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ConfigError, match="max_concurrent_batches"):
            BatchPolicy(max_concurrent_batches=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("limit", [1, 3])
async def test_batches_overlap_up_to_the_limit(redis_url: str, limit: int,
                                               start_worker: Callable[..., Worker]) -> None:
    gauge = Gauge()
    name = f"gauged{limit}"
    start_worker([gauged(name, gauge, max_concurrent_batches=limit)])
    await wait_live(redis_url, name)
    async with Client(redis_url) as client:
        futures = await client.submit_many(name, list(range(12)), timeout_s=30)
        assert await asyncio.wait_for(asyncio.gather(*futures), 20) == [
            x * 2 for x in range(12)]
    assert gauge.peak == limit
    assert sorted(x for xs, _ in gauge.calls for x in xs) == list(range(12))


async def test_a_suspect_batch_runs_alone(redis_url: str, raw_redis: redis.Redis,
                                          start_worker: Callable[..., Worker]) -> None:
    """A suspect (requeued by a reaper after a crash) is never computed beside another
    batch, even with three allowed: a crash then blames it alone."""
    gauge = Gauge()
    start_worker([gauged("suspects", gauge, max_concurrent_batches=3)])
    await wait_live(redis_url, "suspects")
    replies, entries = [], []
    for value in range(16):
        reply_to = protocol.reply_key("suspects", f"suspect-test-{value}")
        req, _ = raw_request("suspects", value, reply_to)
        req.suspect = value == 12  # the fourth batch: three are in flight when it comes
        entries.append(codec.encode(req.to_wire()))
        replies.append(reply_to)
    suspect = codec.decode(entries[12])
    raw_redis.zadd(protocol.suspects_key("suspects"),  # as the reaper that requeued it
                   {suspect["id"]: suspect[protocol.F_DEADLINE_MS]})
    raw_redis.rpush(protocol.queue_key("suspects"), *entries)
    for value, reply_to in enumerate(replies):
        reply = await asyncio.to_thread(read_reply, raw_redis, reply_to)
        assert reply.ok and reply.payload == value * 2
    assert gauge.overlaps(12) == [1]  # it ran alone...
    assert [xs for xs, _ in gauge.calls if 12 in xs] == [[12]]  # ...in a pass of its own
    assert gauge.overlaps(13) == [1]  # its batch's others too, after it
    assert gauge.peak == 3  # the batches before it did overlap


async def test_a_suspect_flag_no_reaper_set_is_ignored(
        redis_url: str, raw_redis: redis.Redis, start_worker: Callable[..., Worker]) -> None:
    """Entries pushed with ``suspect`` set, that no reaper requeued, run batched as any
    other: a forged flag costs the batch no extra passes."""
    gauge = Gauge()
    start_worker([gauged("forged", gauge)])
    await wait_live(redis_url, "forged")
    replies, entries = [], []
    for value in range(4):
        reply_to = protocol.reply_key("forged", f"forged-test-{value}")
        req, _ = raw_request("forged", value, reply_to)
        req.suspect = True
        entries.append(codec.encode(req.to_wire()))
        replies.append(reply_to)
    raw_redis.rpush(protocol.queue_key("forged"), *entries)
    for value, reply_to in enumerate(replies):
        reply = await asyncio.to_thread(read_reply, raw_redis, reply_to)
        assert reply.ok and reply.payload == value * 2
    assert [sorted(xs) for xs, _ in gauge.calls] == [[0, 1, 2, 3]]  # one pass, batched


async def test_kill_9_with_three_batches_in_flight_loses_nothing(
        spawn: Callable[..., Proc], redis_url: str, raw_redis: redis.Redis,
        start_worker: Callable[..., Worker]) -> None:
    proc = spawn(redbatch_cmd("worker", "tests.concurrent_models:sleepy", "--redis-url",
                              redis_url), env=test_env(**FAST_LEASE), name="sleepy-worker")
    replies = []
    for value in range(12):
        reply_to = protocol.reply_key("sleepy", f"sleepy-test-{value}")
        _req, entry = raw_request("sleepy", value, reply_to)
        raw_redis.rpush(protocol.queue_key("sleepy"), entry)
        replies.append(reply_to)
    await asyncio.to_thread(wait_for, lambda: inflight_total(raw_redis, "sleepy") == 12, 30,
                            "the worker to claim three batches of four")
    assert raw_redis.llen(protocol.queue_key("sleepy")) == 0
    os.killpg(proc.popen.pid, signal.SIGKILL)
    gauge = Gauge()
    taker = gauged("sleepy", gauge, max_concurrent_batches=3)
    start_worker([taker], config=TAKEOVER)
    for value, reply_to in enumerate(replies):
        reply = await asyncio.to_thread(read_reply, raw_redis, reply_to, 20)
        assert reply.ok and reply.payload == value * 2
    await asyncio.sleep(0.5)
    assert all(raw_redis.llen(reply_to) == 0 for reply_to in replies)  # exactly once
    assert sorted(x for xs, _ in gauge.calls for x in xs) == list(range(12))
    assert all(seen == [1] for _, seen in gauge.calls)  # suspects: each alone
    assert raw_redis.zcard(protocol.suspects_key("sleepy")) == 12  # the reaper's record
    assert inflight_total(raw_redis, "sleepy") == 0
    assert raw_redis.llen(protocol.dead_letter_key("sleepy")) == 0


async def test_a_sync_model_computes_one_batch_at_a_time(redis_url: str,
                                                         start_worker: Callable[..., Worker]
                                                         ) -> None:
    """A sync model shares the one forward thread: its passes never overlap, but the
    next batch is claimed (moved to the in-flight list) while one computes."""
    seen: list[int] = []  # in-flight entries at each call's start
    running = [0, 0]  # now, peak
    raw = redis.Redis.from_url(redis_url)
    inflight = protocol.inflight_key("syncgauge", "*")

    @batch(name="syncgauge", max_batch_size=4, batch_wait_timeout_s=0.0,
           max_concurrent_batches=3)
    def syncgauge(xs: list[int]) -> list[int]:
        running[0] += 1
        running[1] = max(running)
        seen.append(sum(int(raw.llen(key)) for key in raw.keys(inflight)))
        time.sleep(SLEEP_S)
        running[0] -= 1
        return [x * 2 for x in xs]

    start_worker([syncgauge])
    await wait_live(redis_url, "syncgauge")
    async with Client(redis_url) as client:
        futures = await client.submit_many("syncgauge", list(range(12)), timeout_s=30)
        assert await asyncio.wait_for(asyncio.gather(*futures), 20) == [
            x * 2 for x in range(12)]
    raw.close()
    assert running[1] == 1
    assert max(seen) > 4  # more than the computing batch was claimed


async def test_a_graceful_stop_finishes_every_batch_in_flight(
        redis_url: str, raw_redis: redis.Redis) -> None:
    gauge = Gauge()
    worker = Worker([gauged("stopping", gauge, max_concurrent_batches=3)],
                    RedisSettings(redis_url), FAST_WORKER)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_live(redis_url, "stopping")
        replies, entries = [], []
        for value in range(12):
            reply_to = protocol.reply_key("stopping", f"stopping-test-{value}")
            entries.append(raw_request("stopping", value, reply_to)[1])
            replies.append(reply_to)
        raw_redis.rpush(protocol.queue_key("stopping"), *entries)
        while gauge.now < 3:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 20)
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
    for value, reply_to in enumerate(replies):
        reply = await asyncio.to_thread(read_reply, raw_redis, reply_to, 5)
        assert reply.ok and reply.payload == value * 2
    assert inflight_total(raw_redis, "stopping") == 0


def test_busy_time_of_overlapping_batches_is_their_union(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Busy time feeds the worker's published items/s: overlapping batches count the
    time at least one computed, not the sum of their times."""
    from redbatch.worker import runner

    now = [0.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: now[0])
    clock = runner.BusyClock()
    shares = []
    for at, event in [(0, "start"), (1, "start"), (2, "end"), (3, "end"),  # [0,2] [1,3]
                      (5, "start"), (6, "end"),  # alone: [5,6]
                      (7, "start"), (8, "start"), (9, "start"), (10, "end"), (11, "end"),
                      (12, "end")]:  # three at once: [7,12]
        now[0] = float(at)
        if event == "start":
            clock.start()
        else:
            shares.append(clock.end())
    assert shares == [2.0, 1.0, 1.0, 3.0, 1.0, 1.0]
    assert sum(shares) == 3 + 1 + 5
