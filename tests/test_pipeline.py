"""The worker's pipeline: the next batch is claimed while a short pass computes (and
only then), batches are answered in claim order, and short CPU passes run inline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from redbatch import Client, protocol
from redbatch.worker.forward import AUTO_INLINE_MS, Forwarder
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.runner import PREFETCH_MAX_MS

ONE_AT_A_TIME = BatchPolicy(max_batch_size=1, batch_wait_timeout_s=0)


def gated_model(name: str, pass_s: float) -> tuple[Model, threading.Event, threading.Event]:
    """A model whose passes take ``pass_s``; the pass on input -1 waits for ``gate``."""
    gate, entered = threading.Event(), threading.Event()

    def forward(xs: list[int]) -> list[int]:
        if xs == [-1]:
            entered.set()
            gate.wait(20)
        time.sleep(pass_s)
        return xs

    return Model(name, fn=forward, policy=ONE_AT_A_TIME, inline=False), gate, entered


async def _held(raw: redis.Redis, model: str, expected: int) -> int:
    """How many entries the worker holds in flight, once it settles on ``expected``."""
    key = next(iter(raw.scan_iter(protocol.inflight_key(model, "*"))))
    for _ in range(100):
        if raw.llen(key) == expected:
            break
        await asyncio.sleep(0.02)
    return int(raw.llen(key))


@pytest.mark.parametrize(("pass_s", "held"), [(0.0, 2), (PREFETCH_MAX_MS / 1000 * 2, 1)])
async def test_next_batch_is_claimed_during_a_short_pass_only(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        pass_s: float, held: int) -> None:
    model, gate, entered = gated_model(f"gated{held}", pass_s)
    start_worker([model])
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many(model.name, [1, 2, 3]) == [1, 2, 3]  # learn pass time
        pending = [asyncio.create_task(client.predict(model.name, x)) for x in (-1, 7, 8)]
        await asyncio.to_thread(entered.wait, 10)
        # a short pass: the gated one plus the prefetched next; a slow one: its own only
        assert await _held(raw_redis, model.name, held) == held
        gate.set()
        assert [await t for t in pending] == [-1, 7, 8]


async def test_replies_follow_claim_order_under_load(start_worker: Callable[..., Worker],
                                                     redis_url: str) -> None:
    model = Model("fast", fn=lambda xs: [x * 3 for x in xs],
                  policy=BatchPolicy(max_batch_size=4, batch_wait_timeout_s=0.001))
    start_worker([model])
    async with Client(redis_url, require_workers=False) as client:
        results = await asyncio.gather(*(client.predict_many("fast", list(range(i, i + 50)))
                                         for i in range(0, 500, 50)))
    assert [x for chunk in results for x in chunk] == [3 * i for i in range(500)]


async def test_short_cpu_passes_run_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """(The threshold raised: a loaded machine's thread handoff alone passed 5 ms.)"""
    from redbatch.worker import forward

    monkeypatch.setattr(forward, "AUTO_INLINE_MS", 1000.0)
    caller: list[str] = []

    def fn(xs: list[int]) -> list[int]:
        caller.append(threading.current_thread().name)
        return xs

    with ThreadPoolExecutor(1, thread_name_prefix="fwd") as pool:
        auto = Forwarder(Model("a", fn=fn), fn, pool, device="cpu")
        gpu = Forwarder(Model("g", fn=fn), fn, pool, device="cuda:0")
        never = Forwarder(Model("n", fn=fn, inline=False), fn, pool, device="cpu")
        for forwarder in (auto, gpu, never):
            await forwarder.run([1])  # the first pass is timed in the thread
            await forwarder.run([2])
    main = threading.current_thread().name
    assert caller[0].startswith("fwd") and caller[1] == main  # auto: inline once known short
    assert all(name.startswith("fwd") for name in caller[2:])  # GPU and inline=False: never
    assert auto.pass_ms is not None and auto.pass_ms < forward.AUTO_INLINE_MS


async def test_slow_cpu_passes_stay_off_the_loop() -> None:
    def slow(xs: list[int]) -> list[int]:
        time.sleep(AUTO_INLINE_MS * 2 / 1000)
        return xs

    with ThreadPoolExecutor(1) as pool:
        forwarder = Forwarder(Model("s", fn=slow), slow, pool, device="cpu")
        await forwarder.run([1])
        assert not forwarder.inline


async def test_a_lost_lease_is_noticed_and_nothing_is_lost(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    """A reaper takes over the in-flight list mid-pass (as when the lease lapsed): the
    ack must not trim the wrong entries; the worker returns what it holds, goes on,
    and every request is answered."""
    model, gate, entered = gated_model("taken", 0.0)
    start_worker([model])
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many(model.name, [1, 2, 3]) == [1, 2, 3]
        pending = [asyncio.create_task(client.predict(model.name, x)) for x in (-1, 7, 8)]
        await asyncio.to_thread(entered.wait, 10)
        await _held(raw_redis, model.name, 2)
        key = next(iter(raw_redis.scan_iter(protocol.inflight_key(model.name, "*"))))
        held = raw_redis.lrange(key, 0, -1)
        raw_redis.delete(key)  # what a reaper does: requeue at the front, drop the list
        raw_redis.lpush(protocol.queue_key(model.name), *reversed(held))
        gate.set()
        assert [await t for t in pending] == [-1, 7, 8]
        assert await client.predict_many(model.name, [4, 5]) == [4, 5]
        assert client.stats()["duplicates"] == 0
    assert raw_redis.llen(key) == 0 and raw_redis.llen(protocol.queue_key(model.name)) == 0


async def test_one_slow_pass_sends_the_next_ones_to_the_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    slow = [False]
    from redbatch.worker import forward

    inline_ms = 100.0  # (above a trivial pass's hop to the thread under a loaded CI)
    monkeypatch.setattr(forward, "AUTO_INLINE_MS", inline_ms)

    def fn(xs: list[int]) -> list[int]:
        calls.append(threading.current_thread().name)
        if slow[0]:
            time.sleep(inline_ms * 2 / 1000)
        return xs

    with ThreadPoolExecutor(1, thread_name_prefix="fwd") as pool:
        forwarder = Forwarder(Model("f", fn=fn), fn, pool, device="cpu")
        await forwarder.run([1])
        await forwarder.run([2])
        assert forwarder.inline
        slow[0] = True
        await forwarder.run([3])  # inline, measured slow
        slow[0] = False
        await forwarder.run([4])
    assert calls[3].startswith("fwd") and not forwarder.inline


def test_the_ack_trims_only_its_own_batch(raw_redis: redis.Redis) -> None:
    """PUBLISH acks by trimming the in-flight head only if it holds exactly the batch."""
    import hashlib

    from redbatch import lua

    publish = raw_redis.register_script(lua.PUBLISH)
    inflight, dead = "rb:{t}:inflight:w", "rb:{t}:dead"

    def ack(batch: list[bytes]) -> list[int]:
        digest = hashlib.sha1(b"".join(batch), usedforsecurity=False).hexdigest()
        return list(publish(keys=[inflight, dead], args=[len(batch), 60, digest, 60, 0]))

    raw_redis.rpush(inflight, b"a1", b"a2", b"b1")
    assert ack([b"a1", b"a2"]) == [1, 0] and raw_redis.lrange(inflight, 0, -1) == [b"b1"]
    raw_redis.delete(inflight)  # a reaper took the list; then the next batch was claimed
    raw_redis.rpush(inflight, b"c1")
    assert ack([b"b1"]) == [0, 0]  # refused: c1 stays in flight
    assert raw_redis.lrange(inflight, 0, -1) == [b"c1"]
