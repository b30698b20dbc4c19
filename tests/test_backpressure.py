"""Bounded queues and waiters, Retry-After from the drain rate, and overload."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

import httpx
import numpy as np
import pytest
import redis

from redbatch import Client, DeadlineExceeded, Model, QueueFull, batch, protocol
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.test_gateway import _wait_registered, gateway


def blocking_model(name: str) -> tuple[Model, threading.Event]:
    release = threading.Event()

    def forward(xs: list[int]) -> list[int]:
        release.wait(20)
        return xs

    return Model(name, fn=forward, policy=BatchPolicy(max_batch_size=1,
                                                      batch_wait_timeout_s=0)), release


async def held_then_queued(http: httpx.AsyncClient, redis_url: str, model: str, queued: int
                           ) -> list[asyncio.Task[httpx.Response]]:
    """One request the worker holds in its forward pass, then ``queued`` behind it
    (sent after it: requests that arrive together may be refused together); returns
    once they are all in Redis where they belong."""
    path = f"/v1/models/{model}/predict"
    raw = redis.Redis.from_url(redis_url)
    try:
        pending = [asyncio.create_task(http.post(path, json={"inputs": 0}))]
        await _until(lambda: bool(raw.keys(protocol.inflight_key(model, "*")))
                     and raw.llen(protocol.queue_key(model)) == 0)
        pending += [asyncio.create_task(http.post(path, json={"inputs": i}))
                    for i in range(1, queued + 1)]
        await _until(lambda: raw.llen(protocol.queue_key(model)) == queued)
    finally:
        raw.close()
    return pending


async def _until(done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def blocked(start_worker: Callable[..., Worker]) -> AsyncIterator[threading.Event]:
    model, release = blocking_model("held")
    start_worker([model])
    yield release
    release.set()


async def test_full_queue_is_503_with_retry_after(blocked: threading.Event, redis_url: str
                                                  ) -> None:
    async with gateway(redis_url, max_queue_len=3, default_timeout_s=10) as http:
        await _wait_registered(http)
        pending = await held_then_queued(http, redis_url, "held", 3)  # one held, 3 queued
        started = time.monotonic()
        resp = await http.post("/v1/models/held/predict", json={"inputs": 99})
        assert time.monotonic() - started < 1.0  # refused at once, not queued
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_full"
        assert int(resp.headers["retry-after"]) >= 1
        blocked.set()
        assert [(await t).status_code for t in pending] == [200] * 4


async def test_waiter_cap_is_503(blocked: threading.Event, redis_url: str) -> None:
    async with gateway(redis_url, max_waiters=2, default_timeout_s=10) as http:
        await _wait_registered(http)
        pending = [asyncio.create_task(http.post("/v1/models/held/predict",
                                                 json={"inputs": i})) for i in range(2)]
        await asyncio.sleep(0.3)
        resp = await http.post("/v1/models/held/predict", json={"inputs": 3})
        assert resp.status_code == 503 and "max_waiters" in resp.json()["error"]["message"]
        blocked.set()
        await asyncio.gather(*pending)


async def test_model_without_live_workers_is_503_fast(redis_url: str) -> None:
    import orjson

    raw = redis.Redis.from_url(redis_url)
    gone = Model("gone", fn=lambda xs: xs)  # registered once, its workers since gone
    raw.set(protocol.meta_key("gone"), orjson.dumps(gone.meta()))
    raw.zadd(protocol.workers_key("gone"), {"dead-worker": protocol.now_ms() - 1})
    async with gateway(redis_url) as http:
        started = time.monotonic()
        resp = await http.post("/v1/models/gone/predict", json={"inputs": 1})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_workers"
        assert resp.headers["retry-after"] == "1"
        assert time.monotonic() - started < 2.0
    raw.close()


async def test_overload_refuses_the_excess_fast(start_worker: Callable[..., Worker],
                                                redis_url: str) -> None:
    """About 2x the sustainable rate: the excess is refused at once and what is
    accepted is served within its deadline."""

    @batch(name="tight", max_batch_size=1, batch_wait_timeout_s=0)
    def tight(xs: list[int]) -> list[int]:
        time.sleep(0.01)  # ~100 items/s
        return xs

    start_worker([tight])
    async with Client(redis_url, require_workers=False) as client:
        await client.predict_many("tight", list(range(30)))  # lets the worker measure itself
        await asyncio.sleep(0.5)

        async def one(i: int) -> tuple[str, float]:
            started = time.monotonic()
            try:
                await client.predict("tight", i, timeout_s=1.0)
                return "ok", time.monotonic() - started
            except QueueFull:
                return "refused", time.monotonic() - started
            except DeadlineExceeded:
                return "late", time.monotonic() - started

        tasks = []
        for i in range(600):  # 200/s for 3 s
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.005)
        results = await asyncio.gather(*tasks)
    by = {k: [t for o, t in results if o == k] for k in ("ok", "refused", "late")}
    assert len(by["refused"]) > 100, {k: len(v) for k, v in by.items()}
    assert np.percentile(by["refused"], 99) < 0.2
    assert len(by["late"]) <= 0.1 * (len(by["ok"]) + len(by["late"]))
    assert np.percentile(by["ok"], 99) < 1.0


async def test_a_model_brings_its_own_queue_cap_and_default_deadline(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    release = threading.Event()

    def held(xs: list[int]) -> list[int]:
        release.wait(20)
        return xs

    model = Model("capped", fn=held, policy=BatchPolicy(max_batch_size=1,
                                                        batch_wait_timeout_s=0),
                  max_queue_len=2, default_timeout_s=0.5, inline=False)
    start_worker([model])
    try:
        async with gateway(redis_url, max_queue_len=100, default_timeout_s=10) as http:
            await _wait_registered(http)
            started = time.monotonic()
            pending = await held_then_queued(http, redis_url, "capped", 2)  # the model's cap
            full = await http.post("/v1/models/capped/predict", json={"inputs": 9})
            assert full.status_code == 503 and "cap 2" in full.json()["error"]["message"]
            statuses = [(await t).status_code for t in pending]
            assert statuses == [504] * 3  # the model's 0.5 s default, not the gateway's 10 s
            assert time.monotonic() - started < 3
    finally:
        release.set()
