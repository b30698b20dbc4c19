"""One stats object per runner: the Prometheus metrics, the heartbeat's published
counters and histograms, and the capacity admission reads all come from it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import orjson
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from redbatch import protocol
from redbatch.errors import DeadlineExceeded
from redbatch.protocol import Request
from redbatch.registry import LiveCache
from redbatch.worker import heartbeat
from redbatch.worker.decode import Decoded
from redbatch.worker.model import Model, batch
from redbatch.worker.reaper import Reaper
from redbatch.worker.stats import Capacity, WorkerStats


def model(name: str) -> Model:
    @batch(name=name, max_batch_size=4)
    def echo(xs: list[int]) -> list[int]:
        return xs

    return echo


def sample(name: str, metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, {"model": name, **labels}) or 0.0


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_url)
    yield conn
    await conn.aclose()


def test_capacity_is_entries_per_busy_second_smoothed_and_idle_keeps_it() -> None:
    capacity = Capacity()
    assert capacity.sample(0, 0.0) == 0.0
    assert capacity.sample(10, 2.0) == 5.0  # the first interval is taken as it is
    assert capacity.sample(10, 2.0) == 5.0  # idle: the last estimate stays
    assert capacity.sample(40, 4.0) == 10.0  # 15/s this interval, smoothed with 5/s


def test_one_batch_feeds_prometheus_and_the_published_counters() -> None:
    name = "stats-feed"
    stats = WorkerStats(name, max_batch_size=4)
    now = protocol.now_ms()
    expired = Request("r1", name, now - 10, now - 1, protocol.reply_key(name, "c"), None)
    decoded = Decoded(early=[(expired, "json", DeadlineExceeded("late"))], dead=[b"junk"])
    before = {o: sample(name, "redbatch_worker_items_total", outcome=o)
              for o in ("computed", "expired", "error")}
    stats.batch(decoded, entries=3, size=6, passes=[4, 2], waits_ms=[5, 20, 1500],
                fwd_ms=8.0, busy_s=0.5, failed=0)
    published = stats.counters()
    assert {k: published[k] for k in ("batches", "items", "entries", "passes", "pass_items",
                                      "forward_ms", "queue_wait_ms")} == {
        "batches": 1, "items": 6, "entries": 3, "passes": 2, "pass_items": 6,
        "forward_ms": 8.0, "queue_wait_ms": 1525.0}
    hist = published["hist"]
    assert [sum(hist[h]) for h in ("batch_size", "batch_entries", "queue_wait_s")] == [2, 1, 3]
    assert sum(hist["forward_s"]) == 0  # no item reached the model
    assert sample(name, "redbatch_batch_size_count") == 2
    assert sample(name, "redbatch_queue_wait_seconds_sum") == pytest.approx(1.525)
    assert sample(name, "redbatch_dead_letters_total") == 1
    assert sample(name, "redbatch_worker_items_total", outcome="expired") - before[
        "expired"] == 1
    assert published[protocol.F_ITEMS_PER_S] == 0.0  # not sampled yet
    assert stats.sample_capacity() == 6.0  # 3 entries in 0.5 busy seconds
    assert stats.counters()[protocol.F_ITEMS_PER_S] == 6.0


async def test_heartbeat_publishes_full_info_and_compact_capacity_and_leave_drops_both(
        client: aioredis.Redis, raw_redis: redis.Redis) -> None:
    served = model("stats-beat")
    stats = WorkerStats(served.name, 4)
    stats.batch(Decoded(), entries=4, size=4, passes=[4], waits_ms=[1, 1, 1, 1], fwd_ms=2.0,
                busy_s=0.25, failed=0)
    fields = {served.name: heartbeat.published(heartbeat.static_info("w1", "cpu"), stats)}
    await heartbeat.beat(client, [served], "w1", fields, lease_ttl_s=10)
    info_key, cap_key = (protocol.worker_info_key(served.name),
                         protocol.worker_capacity_key(served.name))
    capacity = orjson.loads(raw_redis.hget(cap_key, "w1") or b"")
    info = orjson.loads(raw_redis.hget(info_key, "w1") or b"")
    assert capacity == {protocol.F_ITEMS_PER_S: 16.0, protocol.F_ROWS: True,
                        protocol.F_SERVED_PER_S: 0.0}  # the first sample measures no rate
    assert info[protocol.F_ITEMS_PER_S] == 16.0 and info[protocol.F_ROWS] is True
    assert (info["entries"], info["items"], info["worker_id"]) == (4, 4, "w1")
    assert 0 < raw_redis.ttl(cap_key) <= protocol.WORKERS_TTL_S
    summary = await LiveCache(client).get(served.name)
    assert (summary.live, summary.items_per_s, summary.rows) == (1, 16.0, True)
    await heartbeat.leave(client, [served], "w1")
    assert raw_redis.hget(cap_key, "w1") is None and raw_redis.hget(info_key, "w1") is None


async def test_reaping_an_expired_worker_drops_its_capacity_field(
        client: aioredis.Redis, raw_redis: redis.Redis) -> None:
    name = "stats-reap"
    cap_key = protocol.worker_capacity_key(name)
    raw_redis.zadd(protocol.workers_key(name), {"dead": protocol.now_ms() - 1})
    raw_redis.hset(cap_key, mapping={"dead": b"{}", "alive": b"{}"})
    stats = WorkerStats(name, 4)
    assert await Reaper(client, name, 3, stats).reap("dead") == 0
    assert raw_redis.hkeys(cap_key) == [b"alive"]
    assert raw_redis.zscore(protocol.workers_key(name), "dead") is None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("inline", [False, True])
async def test_a_pass_counts_the_cpu_time_of_its_thread_not_its_sleep(inline: bool) -> None:
    """Forward CPU time is the CPU of the thread that ran the pass: a pass that sleeps
    costs wall time and next to no CPU time, one that computes costs both."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from redbatch.worker.forward import Forwarder

    def work_fn(xs: list[int]) -> list[int]:
        if xs[0] == 0:
            time.sleep(0.2)
        else:
            spin_until = time.thread_time() + 0.2
            while time.thread_time() < spin_until:
                pass
        return xs

    work = replace(batch(name="cpu-timed", max_batch_size=4)(work_fn), inline=inline)
    with ThreadPoolExecutor(1) as executor:
        fwd = Forwarder(work, work.bind("cpu"), executor)
        await fwd.run_batches([0])
        slept_ms = fwd.take_cpu_ms()
        await fwd.run_batches([1])
        spun_ms = fwd.take_cpu_ms()
    assert slept_ms < 50 and spun_ms >= 190
    assert fwd.take_cpu_ms() == 0.0  # taken


def test_the_published_counters_carry_the_forward_cpu_time() -> None:
    stats = WorkerStats("stats-cpu", max_batch_size=4)
    stats.batch(Decoded(), entries=1, size=1, passes=[1], waits_ms=[1], fwd_ms=9.0,
                busy_s=0.01, failed=0, fwd_cpu_ms=6.5)
    stats.batch(Decoded(), entries=1, size=1, passes=[1], waits_ms=[1], fwd_ms=9.0,
                busy_s=0.01, failed=0, fwd_cpu_ms=1.0)
    assert stats.counters()["forward_cpu_ms"] == 7.5
