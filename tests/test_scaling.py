"""Autoscaling signals (redbatch.scaling): the formulas, the served rate workers publish,
the SCALING_SUMMARY read, and the gateway's gauges and `redbatch status` under load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from redbatch import Client, metrics, protocol, scaling
from redbatch.status import sample
from redbatch.status_view import table
from redbatch.worker.model import batch
from redbatch.worker.process import Worker
from redbatch.worker.stats import ServedRate
from tests.conftest import wait_live
from tests.test_gateway import _wait_registered, gateway

SERVE_S = 0.1  # per entry: one worker serves about 10 entries/s
TICK_S = 0.1  # the open-loop load sends a burst this often


@batch(name="slowpoke", max_batch_size=1, batch_wait_timeout_s=0)
def slowpoke(xs: list[int]) -> list[int]:
    time.sleep(SERVE_S)
    return xs


# --- the formulas ---------------------------------------------------------------------


@pytest.mark.parametrize(("arrival", "backlog", "per_worker", "live", "needed"), [
    (0.0, 0, None, 0, 0),  # nothing to do: no worker
    (0.0, 0, 10.0, 3, 0),
    (20.0, 0, 10.0, 1, 2),
    (20.0, 0, 10.0, 5, 2),  # more are live than needed
    (21.0, 0, 10.0, 1, 3),
    (0.1, 0, 10.0, 4, 1),
    (20.000000000001, 0, 10.0, 1, 2),  # float noise is no extra worker
    (0.0, 600, 1.0, 1, 10),  # a backlog drained within SCALE_DRAIN_S (60 s)
    (0.0, 60, 10.0, 0, 1),  # scale from zero
    (5.0, 0, None, 3, 3),  # demand, capacity not measured yet: the live ones
    (5.0, 0, None, 0, 1),  # ...at least one
])
def test_workers_needed(arrival: float, backlog: int, per_worker: float | None, live: int,
                        needed: int) -> None:
    assert scaling.workers_needed(arrival, backlog, per_worker, live) == needed


def test_arrival_and_mean_capacity() -> None:
    assert scaling.arrival_rate(10.0, 5.0) == 15.0
    assert scaling.arrival_rate(10.0, -4.0) == 6.0  # draining
    assert scaling.arrival_rate(1.0, -4.0) == 0.0
    assert scaling.mean_capacity([0.0, 10.0, 30.0]) == 20.0  # not measured: left out
    assert scaling.mean_capacity([0.0]) is None and scaling.mean_capacity([]) is None
    assert scaling.FleetRates(3, 2, 50.0, 1.0).per_worker_per_s == 25.0
    assert scaling.FleetRates(3, 0, 0.0, 1.0).per_worker_per_s is None


def test_queue_growth_between_readings() -> None:
    growth = scaling.QueueGrowth()
    assert growth.rate("m", 10, now=100.0) == 0.0  # the first reading: no rate
    assert growth.rate("m", 30, now=100.5) == 0.0  # too soon: the last growth, same base
    assert growth.rate("m", 30, now=102.0) == 10.0
    assert growth.rate("m", 0, now=102.5) == 10.0
    assert growth.rate("m", 0, now=104.0) == -15.0
    assert growth.rate("other", 5, now=104.0) == 0.0  # per model


def test_served_rate_over_a_window_and_zero_when_idle() -> None:
    rate = ServedRate(window_s=10.0)
    assert rate.sample(0, now=0.0) == 0.0
    assert rate.sample(10, now=1.0) == 10.0
    assert rate.sample(30, now=2.0) == 15.0
    assert rate.sample(30, now=12.5) == 0.0  # a quiet window: exactly 0
    assert rate.sample(40, now=13.5) == pytest.approx(10 / 11.5)


# --- the SCALING_SUMMARY read ---------------------------------------------------------


async def test_fleet_rates_read_live_workers_only(redis_url: str,
                                                  raw_redis: redis.Redis) -> None:
    now = protocol.now_ms()
    raw_redis.zadd(protocol.workers_key("m"), {"a": now + 60_000, "b": now + 60_000,
                                               "c": now + 60_000, "dead": now - 1})
    cap = protocol.worker_capacity_key("m")
    raw_redis.hset(cap, "a", orjson.dumps({protocol.F_ITEMS_PER_S: 30.0,
                                           protocol.F_SERVED_PER_S: 12.5}))
    raw_redis.hset(cap, "b", orjson.dumps({protocol.F_ITEMS_PER_S: 10.0}))  # older worker
    raw_redis.hset(cap, "c", b"not json")  # counts as nothing measured
    raw_redis.hset(cap, "dead", orjson.dumps({protocol.F_ITEMS_PER_S: 1000.0,
                                              protocol.F_SERVED_PER_S: 1000.0}))
    client = aioredis.Redis.from_url(redis_url)
    try:
        reader = scaling.FleetReader(client)
        assert await reader.rates("m") == scaling.FleetRates(3, 2, 40.0, 12.5)
        assert await reader.rates("nobody") == scaling.FleetRates(0, 0, 0.0, 0.0)
    finally:
        await client.aclose()


# --- the gateway's gauges and `redbatch status` under load ----------------------------


def scaling_gauges(text: str, model: str) -> dict[str, float]:
    names = set(metrics.SCALING_METRICS) | {"redbatch_queue_depth", "redbatch_live_workers"}
    return {s.name: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in names and s.labels.get("model") == model}


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    resp = await http.get("/metrics")
    assert resp.status_code == 200
    return scaling_gauges(resp.text, "slowpoke")


async def measured(http: httpx.AsyncClient) -> dict[str, float]:
    """Serve a few requests, then scrape until the worker's capacity shows."""
    for i in range(3):
        assert (await http.post("/v1/models/slowpoke/predict", json={"inputs": i})).is_success
    for _ in range(100):
        gauges = await scrape(http)
        if gauges["redbatch_worker_capacity_items_per_second"] > 0:
            return gauges
        await asyncio.sleep(0.05)
    pytest.fail("the worker never published its capacity")


async def overload(client: Client, rate_per_s: float, duration_s: float
                   ) -> list[asyncio.Task[Any]]:
    """Open-loop load: ``rate_per_s`` requests a second, whatever the answers, sent in
    a burst every 0.1 s (a late wake-up of the loop slows the rate down less)."""
    tasks: list[asyncio.Task[Any]] = []
    per_tick = round(rate_per_s * TICK_S)
    for _ in range(round(duration_s / TICK_S)):
        tasks += [asyncio.create_task(client.predict("slowpoke", len(tasks) + i, timeout_s=60))
                  for i in range(per_tick)]
        await asyncio.sleep(TICK_S)
    return tasks


async def test_gauges_measure_the_fleet_and_workers_needed_follows_a_backlog(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([slowpoke])
    await wait_live(redis_url, "slowpoke")
    async with gateway(redis_url, default_timeout_s=30.0) as http, \
            Client(redis_url) as client:
        await _wait_registered(http)
        calm = await measured(http)
        assert calm["redbatch_live_workers"] == 1
        per_worker = calm["redbatch_worker_capacity_items_per_second"]
        assert 2 < per_worker < 1.5 / SERVE_S  # ~10/s, measured per busy second
        assert calm["redbatch_capacity_items_per_second"] == per_worker  # one worker
        assert calm["redbatch_workers_needed"] <= 1
        tasks = await overload(client, 3 / SERVE_S, 1.5)  # three workers' worth
        busy = await scrape(http)
        assert busy["redbatch_queue_depth"] >= 10  # the backlog the test built
        assert 1.5 * per_worker < busy["redbatch_arrival_items_per_second"] < 6 / SERVE_S
        assert 2 <= busy["redbatch_workers_needed"] <= 6  # ~3
        assert await asyncio.gather(*tasks) == list(range(len(tasks)))


async def test_status_shows_workers_needed(start_worker: Callable[..., Worker],
                                           redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([slowpoke])
    await wait_live(redis_url, "slowpoke")
    async with Client(redis_url) as client:
        assert await client.predict_many("slowpoke", [1, 2, 3]) == [1, 2, 3]
        await asyncio.sleep(0.5)  # a heartbeat publishes the capacity
        load = asyncio.create_task(overload(client, 3 / SERVE_S, 2.0))
        snap = await asyncio.to_thread(sample, raw_redis, 1.5)
        tasks = await load
        assert await asyncio.gather(*tasks) == list(range(len(tasks)))
    status = snap["slowpoke"]
    assert status.workers_needed is not None and status.workers_needed >= 2
    assert status.workers_needed > len(status.workers) == 1
    cells = table(snap).columns[-1].cells
    assert list(cells) == [f"{status.workers_needed} (+{status.workers_needed - 1})"]
