"""The producer: async and sync clients, futures, deadlines, caps, unreachable Redis."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from redbatch import (
    Client,
    DeadlineExceeded,
    NoLiveWorkers,
    QueueFull,
    RedisUnavailable,
    SyncClient,
    UnknownModel,
    batch,
    defaults,
    protocol,
)
from redbatch.protocol import Reply
from redbatch.worker.process import Worker
from tests.conftest import free_port, until


@batch(name="inc", max_batch_size=16, batch_wait_timeout_s=0.01)
def inc(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


async def queued(raw_redis: redis.Redis, model: str, count: int) -> None:
    """Wait (bounded) until ``count`` entries wait in ``model``'s queue."""
    for _ in range(200):
        if raw_redis.llen(protocol.queue_key(model)) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} entries never reached the queue of {model!r}")


async def test_submit_returns_a_future(start_worker: Callable[..., Worker], redis_url: str
                                       ) -> None:
    start_worker([inc])
    async with Client(redis_url, require_workers=False) as client:
        futures = [await client.submit("inc", i) for i in range(8)]
        assert await asyncio.gather(*futures) == list(range(1, 9))


async def test_one_listener_serves_many_waiters(start_worker: Callable[..., Worker],
                                                redis_url: str, raw_redis: redis.Redis) -> None:
    release = threading.Event()

    @batch(name="held", max_batch_size=64, batch_wait_timeout_s=0)
    def held(xs: list[int]) -> list[int]:
        release.wait(10)
        return [x + 1 for x in xs]

    start_worker([held])
    async with Client(redis_url, require_workers=False) as client:
        pending = [asyncio.create_task(client.predict("held", i)) for i in range(64)]
        await until(lambda: client.waiting == 64, "all 64 waiting for their replies")

        def popping() -> list[Any]:
            return [c for c in raw_redis.client_list() if c["cmd"] == "blmpop"]

        await until(popping, "the reply listener's blocking pop")
        listeners = popping()
        release.set()
        results = await asyncio.gather(*pending)
    assert results == list(range(1, 65))
    assert len(listeners) == 1  # one blocking pop for all 64 waiters, no polling


async def test_more_models_in_use_than_pool_connections_starve_nothing(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Each model's reply listener holds a connection while it runs: more models in use
    than the client's pool has connections still enqueue, and every reply arrives."""
    from redbatch import codec, defaults

    models = [f"many-{i}" for i in range(defaults.REDIS_MAX_CONNECTIONS + 8)]
    async with Client(redis_url, require_workers=False) as client:
        futures = [(await client.submit_many(m, [1], timeout_s=8))[0] for m in models]
        assert [raw_redis.llen(protocol.queue_key(m)) for m in models] == [1] * len(models)
        for model, future in zip(models, futures, strict=True):  # a worker's replies
            reply = Reply(future.request_id, True, model)  # type: ignore[attr-defined]
            raw_redis.rpush(client.reply_to(model), codec.encode(reply.to_wire()))
        assert await asyncio.wait_for(asyncio.gather(*futures), 8) == models
        assert client.stats()["listeners"] == len(models)


async def test_predict_many_is_one_enqueue_call(redis_url: str, raw_redis: redis.Redis
                                                ) -> None:
    async with Client(redis_url, require_workers=False) as client:
        await client._admission.live("inc")  # loads the registry summary's own script
        raw_redis.config_resetstat()
        futures = await client.submit_many("inc", list(range(50)), timeout_s=5)
        stats = raw_redis.info("commandstats")
        assert raw_redis.llen(protocol.queue_key("inc")) == 50  # enqueued once it returns
        for future in futures:
            future.cancel()
    summaries = stats.get("cmdstat_zrangebyscore", {}).get("calls", 0)  # LIVE_SUMMARY reads
    assert stats["cmdstat_evalsha"]["calls"] - summaries == 1  # 50 requests, one ENQUEUE
    assert "cmdstat_rpush" not in stats or stats["cmdstat_rpush"]["calls"] == 50


async def test_a_push_over_one_chunk_is_one_multi_of_evalsha_even_after_a_script_flush(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Over ``ENQUEUE_CHUNK`` entries the chunks go in one MULTI as EVALSHA (no
    ``+eval`` in the ACL); a Redis that lost its scripts gets them loaded, once."""
    from redbatch.producer.enqueuer import ENQUEUE_CHUNK

    async with Client(redis_url, require_workers=False) as client:
        await client._admission.live("inc")
        raw_redis.script_flush()
        raw_redis.config_resetstat()
        futures = await client.submit_many("inc", list(range(ENQUEUE_CHUNK + 500)),
                                           timeout_s=5)
        stats = raw_redis.info("commandstats")
        assert raw_redis.llen(protocol.queue_key("inc")) == ENQUEUE_CHUNK + 500
        for future in futures:
            future.cancel()
    assert "cmdstat_eval" not in stats
    assert stats["cmdstat_exec"]["calls"] == 2  # refused for NOSCRIPT, then again
    # the enqueue script, loaded once (and the live summary's, if its 1 s cache ran out
    # on a slow machine meanwhile)
    assert stats["cmdstat_script|load"]["calls"] in (1, 2)


async def test_no_worker_means_deadline_exceeded(redis_url: str) -> None:
    async with Client(redis_url, require_workers=False) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await client.predict("nobody-serves-this", 1, timeout_s=0.3)
        assert time.monotonic() - started < 5
        assert client.waiting == 0


async def test_unreachable_redis_fails_fast_and_typed() -> None:
    client = Client(f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(RedisUnavailable):
        await asyncio.wait_for(client.predict("inc", 1), 10)
    assert time.monotonic() - started < 3.0
    await client.close()


async def test_queue_cap_refuses_with_queue_full(redis_url: str) -> None:
    async with Client(redis_url, require_workers=False, max_queue_len=3) as client:
        results = await client.predict_many("inc", list(range(5)), timeout_s=0.5,
                                            return_exceptions=True)
    assert [type(r) for r in results[3:]] == [QueueFull, QueueFull]
    assert all(isinstance(r, DeadlineExceeded) for r in results[:3])


async def test_waiter_cap_refuses_with_queue_full(redis_url: str) -> None:
    async with Client(redis_url, require_workers=False, max_waiters=2) as client:
        held = await client.submit_many("inc", [1, 2], timeout_s=5)
        with pytest.raises(QueueFull, match="max_waiters"):
            await client.submit("inc", 3)
        for future in held:
            future.cancel()


async def test_timeout_is_capped_by_max_timeout(redis_url: str) -> None:
    client = Client(redis_url, require_workers=False, default_timeout_s=1, max_timeout_s=2)
    assert 1900 <= client.deadline_ms(1000) - protocol.now_ms() <= 2000
    assert 900 <= client.deadline_ms(None) - protocol.now_ms() <= 1000
    assert 400 <= client.deadline_ms(0.5) - protocol.now_ms() <= 500


async def test_sync_client(start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([inc])

    def use_sync() -> tuple[int, list[int], int]:
        with SyncClient(redis_url, require_workers=False) as client:
            one = client.predict("inc", 1)
            many = client.predict_many("inc", [1, 2, 3])
            future = client.submit("inc", 41)
            return one, many, future.result(10)

    assert await asyncio.to_thread(use_sync) == (2, [2, 3, 4], 42)


def test_sync_client_unreachable_redis() -> None:
    with pytest.raises(RedisUnavailable):
        SyncClient(f"redis://127.0.0.1:{free_port()}/0")


async def test_a_caller_that_gives_up_frees_its_waiter_slot(redis_url: str) -> None:
    async with Client(redis_url, require_workers=False, max_waiters=2) as client:
        for i in range(2):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.predict("nobody", i, timeout_s=60), 0.2)
        assert client.waiting == 0
        future = await client.submit("nobody", 3, timeout_s=60)  # not refused: slots free
        future.cancel()


async def test_a_cancelled_request_frees_its_waiter_in_the_same_step(redis_url: str
                                                                    ) -> None:
    """A future cancelled (by its caller, or by the cancel of a task awaiting it) frees
    its waiter's slot at once, within the cancel itself."""
    async with Client(redis_url, require_workers=False) as client:
        future = await client.submit("nobody", 1, timeout_s=60)
        assert client.waiting == 1
        assert future.cancel()
        assert client.waiting == 0
        assert not future.cancel()  # cancelled already: nothing more to free
        task = asyncio.create_task(client.predict("nobody", 2, timeout_s=60))
        while client.waiting == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.waiting == 0


async def test_predict_many_of_nothing(redis_url: str) -> None:
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many("inc", []) == []


async def test_redis_refusing_writes_is_a_typed_error(redis_url: str,
                                                      raw_redis: redis.Redis) -> None:
    raw_redis.config_set("maxmemory", "1")
    raw_redis.config_set("maxmemory-policy", "noeviction")
    try:
        async with Client(redis_url, require_workers=False) as client:
            with pytest.raises(RedisUnavailable, match="OutOfMemoryError"):
                await client.predict("inc", 1, timeout_s=10)
            assert client.waiting == 0
    finally:
        raw_redis.config_set("maxmemory", "0")


async def test_a_call_s_own_queue_cap_holds_from_the_first_request(
        redis_url: str, raw_redis: redis.Redis) -> None:
    client = Client(redis_url, require_workers=False)  # not started: the call starts it
    try:
        futures = await client.submit_many("capped", [1, 2, 3], timeout_s=0.5,
                                           max_queue_len=2)
        out = await asyncio.gather(*futures, return_exceptions=True)
        later = await client.submit("capped", 4, timeout_s=0.5)  # no cap of its own now
        await queued(raw_redis, "capped", 3)
        assert not later.done()
        later.cancel()
    finally:
        await client.close()
    assert isinstance(out[2], QueueFull) and "cap 2" in str(out[2])
    assert all(isinstance(o, DeadlineExceeded) for o in out[:2])  # queued; no worker


async def test_a_refused_push_fails_exactly_the_refused_futures(
        redis_url: str, raw_redis: redis.Redis) -> None:
    async with Client(redis_url, require_workers=False) as client:
        futures = await client.submit_many("refuser", list(range(5)), timeout_s=10,
                                           max_queue_len=3)
        one = await client.submit("refuser", 5, timeout_s=10, max_queue_len=3)
        await asyncio.wait([*futures[3:], one], timeout=5)
        assert [f.done() for f in futures] == [False, False, False, True, True]
        assert all(isinstance(f.exception(), QueueFull) for f in [*futures[3:], one])
        assert raw_redis.llen(protocol.queue_key("refuser")) == 3
        assert client.waiting == 3  # the refused ones freed their slots
        for future in futures[:3]:
            future.cancel()


def test_the_public_surface_is_four_request_methods() -> None:
    """predict, predict_many, submit, submit_many: the reply metadata is a keyword."""
    coroutines = {name for name, member in inspect.getmembers(Client)
                  if not name.startswith("_") and inspect.iscoroutinefunction(member)}
    # configure and versions are admin calls (a model's live knobs, its versions), route
    # and table look-ups (where a request goes), not request methods
    life_cycle = {"start", "close", "live_workers", "check_served", "mark_cancelled",
                  "configure", "versions", "route", "table"}
    assert coroutines - life_cycle == {"predict", "predict_many", "submit", "submit_many"}
    for name in ("predict", "predict_many", "submit", "submit_many"):
        assert "reply" in inspect.signature(getattr(Client, name)).parameters
    sync = {name for name, member in inspect.getmembers(SyncClient)
            if not name.startswith("_") and inspect.isfunction(member)}
    # stream: a streaming model's iterator (``Client.stream`` is no coroutine either);
    # versions: the routing table's look-up and admin call
    assert sync - {"close", "configure", "stream", "versions"} == {
        "predict", "predict_many", "submit", "submit_many"}


async def test_reply_true_gives_the_whole_reply_with_timings(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([inc])
    async with Client(redis_url, require_workers=False) as client:
        one = await client.predict("inc", 1, timeout_s=10, reply=True)
        future = await client.submit("inc", 2, timeout_s=10, reply=True)
        many = await client.predict_many("inc", [3, 4], timeout_s=10, reply=True)
        submitted = await future
        plain = await client.predict("inc", 5, timeout_s=10)
    for reply, output in zip([one, submitted, *many], [2, 3, 4, 5], strict=True):
        assert isinstance(reply, Reply) and reply.ok and reply.payload == output
        assert reply.timings.batch_size >= 1 and reply.timings.forward_ms >= 0
    assert submitted.id == future.request_id
    assert plain == 6


async def test_a_caller_s_request_id_names_the_request(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([inc])
    async with Client(redis_url, require_workers=False) as client:
        future = await client.submit("inc", 1, timeout_s=10, request_id="mine-1", reply=True)
        assert future.request_id == "mine-1"
        assert (await future).id == "mine-1"
        many = await client.submit_many("inc", [1, 2], timeout_s=10, request_ids=["a", "b"])
        assert [f.request_id for f in many] == ["a", "b"]
        assert await asyncio.gather(*many) == [2, 3]


async def test_sync_client_submit_many_and_replies(start_worker: Callable[..., Worker],
                                                   redis_url: str) -> None:
    start_worker([inc])

    def use_sync() -> tuple[list[int], Reply, list[Reply]]:
        with SyncClient(redis_url, require_workers=False) as client:
            futures = client.submit_many("inc", [1, 2, 3], timeout_s=10)
            outputs = [f.result(10) for f in futures]
            return (outputs, client.predict("inc", 4, reply=True),
                    client.predict_many("inc", [5], reply=True))

    outputs, one, many = await asyncio.to_thread(use_sync)
    assert outputs == [2, 3, 4]
    assert one.ok and one.payload == 5 and many[0].payload == 6


async def test_an_unknown_model_fails_fast_and_queues_nothing(redis_url: str,
                                                              raw_redis: redis.Redis) -> None:
    async with Client(redis_url) as client:
        started = time.monotonic()
        with pytest.raises(UnknownModel, match="unknown model 'ghost'"):
            await client.predict("ghost", 1, timeout_s=30)
        with pytest.raises(UnknownModel):
            await client.predict_many("ghost", [1, 2], timeout_s=30)
        assert time.monotonic() - started < 2.0
        assert client.waiting == 0
    assert raw_redis.llen(protocol.queue_key("ghost")) == 0
    with SyncClient(redis_url) as sync, pytest.raises(UnknownModel):
        sync.predict("ghost", 1, timeout_s=30)


async def test_a_model_without_live_workers_fails_fast(redis_url: str,
                                                       raw_redis: redis.Redis) -> None:
    raw_redis.set(protocol.meta_key("gone"), b'{"name": "gone"}')  # its workers since gone
    async with Client(redis_url) as client:
        with pytest.raises(NoLiveWorkers, match="no live worker"):
            await client.predict("gone", 1, timeout_s=30)
    assert raw_redis.llen(protocol.queue_key("gone")) == 0


async def test_a_model_known_lately_that_redis_forgot_is_no_workers_not_unknown(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """A Redis that lost a model's registration (a replica promoted before it got it)
    answers as if the model never existed until the next heartbeat: a process that
    knew the model a moment ago says 503 no_workers (retry), not 404 unknown_model.
    A process that never knew it still says unknown."""
    from redbatch import defaults

    raw_redis.set(protocol.meta_key("forgotten"), b"{}")  # registered, no live worker
    async with Client(redis_url) as client:
        with pytest.raises(NoLiveWorkers):
            await client.predict("forgotten", 1, timeout_s=1)
        raw_redis.delete(protocol.meta_key("forgotten"))
        await asyncio.sleep(defaults.MISS_REFRESH_S * 1.5)  # past the cached summary
        with pytest.raises(NoLiveWorkers):
            await client.predict("forgotten", 1, timeout_s=1)
    async with Client(redis_url) as fresh:
        with pytest.raises(UnknownModel):
            await fresh.predict("forgotten", 1, timeout_s=1)


async def test_a_model_known_from_any_read_is_a_503_once_redis_forgets_it(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """A model this client saw registered, by whichever read (here its routing table,
    as a request's version pick reads it), is ``no_workers`` rather than an unknown
    model when Redis loses its registration (a promoted replica that never got it)."""
    raw_redis.set(protocol.meta_key("forgotten"), b'{"name": "forgotten"}')
    async with Client(redis_url) as client:
        await client.table("forgotten")
        raw_redis.delete(protocol.meta_key("forgotten"))
        await asyncio.sleep(defaults.LIVE_REFRESH_S + 0.1)  # the cached read goes stale
        with pytest.raises(NoLiveWorkers):
            await client.check_served("forgotten")
        with pytest.raises(UnknownModel):
            await client.check_served("never-registered")
