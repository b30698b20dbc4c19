"""Nothing lost: leases, the reaper, exactly one reply, dead letters, graceful stop,
supervision, and isolation of a failing item.  Real worker processes are killed,
paused and stopped; a second worker (in-process) takes over."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest
import redis

from redbatch import Client, ModelError, WorkerCrashed, batch, codec, defaults, protocol
from redbatch.config import WorkerConfig
from redbatch.worker.claim import Claimer
from redbatch.worker.process import Worker
from tests.conftest import Proc, redbatch_cmd, test_env, until

pytestmark = pytest.mark.e2e
FAST_LEASE = {"REDBATCH_HEARTBEAT_INTERVAL_S": "0.2", "REDBATCH_LEASE_TTL_S": "1.0"}
TAKEOVER = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=1.0)


@batch(name="slow", max_batch_size=8, batch_wait_timeout_s=0.0)
def fast_slow(xs: list[int]) -> list[int]:
    """Stands in for tests.models_for_tests:slow, without the sleep."""
    return xs


def spawn_slow(spawn: Callable[..., Proc], redis_url: str, **env: str) -> Proc:
    return spawn(redbatch_cmd("worker", "tests.models_for_tests:slow", "--redis-url", redis_url),
                 env=test_env(**FAST_LEASE, **env), name="slow-worker")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def inflight_total(raw: redis.Redis, model: str) -> int:
    keys = raw.keys(protocol.inflight_key(model, "*"))
    return sum(int(raw.llen(k)) for k in keys)


def raw_request(model: str, value: int, reply_to: str, timeout_s: float = 30,
                attempt: int = 0) -> tuple[protocol.Request, bytes]:
    now = protocol.now_ms()
    req = protocol.Request(protocol.new_id(), model, now, now + int(timeout_s * 1000), reply_to,
                           value, attempt)
    return req, codec.encode(req.to_wire())


def read_reply(raw: redis.Redis, reply_to: str, timeout_s: float = 15) -> protocol.Reply:
    got = raw.blpop([reply_to], timeout=timeout_s)
    assert got is not None, "no reply"
    return protocol.reply_from_wire(codec.decode(got[1]))


async def test_kill_9_mid_batch_loses_nothing(spawn: Callable[..., Proc], redis_url: str,
                                              raw_redis: redis.Redis,
                                              start_worker: Callable[..., Worker]) -> None:
    proc = spawn_slow(spawn, redis_url, SLOW_FORWARD_S="30")
    async with Client(redis_url, require_workers=False) as client:
        futures = await client.submit_many("slow", list(range(6)), timeout_s=30)
        await asyncio.to_thread(wait_for, lambda: inflight_total(raw_redis, "slow") > 0, 30,
                                "the worker to claim a batch")
        os.killpg(proc.popen.pid, signal.SIGKILL)
        start_worker([fast_slow], config=TAKEOVER)
        assert await asyncio.wait_for(asyncio.gather(*futures), 20) == list(range(6))
    assert inflight_total(raw_redis, "slow") == 0
    assert raw_redis.llen(protocol.dead_letter_key("slow")) == 0


async def test_paused_worker_cannot_answer_twice(spawn: Callable[..., Proc], redis_url: str,
                                                 raw_redis: redis.Redis,
                                                 start_worker: Callable[..., Worker]) -> None:
    proc = spawn_slow(spawn, redis_url, SLOW_FORWARD_S="1.5")
    reply_to = protocol.reply_key("slow", "paused-test")
    req, entry = raw_request("slow", 7, reply_to)
    raw_redis.rpush(protocol.queue_key("slow"), entry)
    await asyncio.to_thread(wait_for, lambda: inflight_total(raw_redis, "slow") > 0, 30,
                            "the worker to claim")
    os.killpg(proc.popen.pid, signal.SIGSTOP)  # past its 1 s lease, mid-forward
    start_worker([fast_slow], config=TAKEOVER)
    first = await asyncio.to_thread(read_reply, raw_redis, reply_to)
    assert first.ok and first.payload == 7 and first.id == req.id
    os.killpg(proc.popen.pid, signal.SIGCONT)
    await asyncio.to_thread(wait_for, lambda: "in-flight list changed" in proc.log(), 30,
                            "the paused worker to notice that its batch was taken over")
    await asyncio.sleep(0.5)
    assert raw_redis.llen(reply_to) == 0, "a second reply was delivered"


async def test_reaper_requeues_at_the_front_in_order(raw_redis: redis.Redis,
                                                     start_worker: Callable[..., Worker]
                                                     ) -> None:
    order: list[int] = []

    @batch(name="ordered", max_batch_size=1, batch_wait_timeout_s=0)
    def ordered(xs: list[int]) -> list[int]:
        order.extend(xs)
        return xs

    reply_to = protocol.reply_key("ordered", "order-test")
    ghost = [raw_request("ordered", v, reply_to)[1] for v in (1, 2)]
    raw_redis.rpush(protocol.inflight_key("ordered", "ghost"), *ghost)
    raw_redis.zadd(protocol.workers_key("ordered"), {"ghost": protocol.now_ms() - 1})
    raw_redis.rpush(protocol.queue_key("ordered"), raw_request("ordered", 3, reply_to)[1])
    start_worker([ordered], config=TAKEOVER)
    replies = [await asyncio.to_thread(read_reply, raw_redis, reply_to) for _ in range(3)]
    assert all(r.ok for r in replies)
    assert order in ([1, 2, 3], [3, 1, 2])  # 3 may be served before the first reap
    assert raw_redis.zscore(protocol.workers_key("ordered"), "ghost") is None


async def test_too_many_crashes_dead_letter_with_worker_crashed(
        raw_redis: redis.Redis, start_worker: Callable[..., Worker]) -> None:
    reply_to = protocol.reply_key("slow", "crash-test")
    req, entry = raw_request("slow", 1, reply_to, attempt=defaults.MAX_ATTEMPTS - 1)
    raw_redis.rpush(protocol.inflight_key("slow", "ghost"), entry)
    raw_redis.zadd(protocol.workers_key("slow"), {"ghost": protocol.now_ms() - 1})
    start_worker([fast_slow], config=TAKEOVER)
    reply = await asyncio.to_thread(read_reply, raw_redis, reply_to)
    assert not reply.ok and reply.error_code == WorkerCrashed.code and reply.id == req.id
    assert raw_redis.lrange(protocol.dead_letter_key("slow"), 0, -1) == [entry]


async def test_live_lease_is_not_reaped(raw_redis: redis.Redis,
                                        start_worker: Callable[..., Worker]) -> None:
    _req, entry = raw_request("slow", 1, protocol.reply_key("slow", "x"))
    raw_redis.rpush(protocol.inflight_key("slow", "busy"), entry)
    raw_redis.zadd(protocol.workers_key("slow"), {"busy": protocol.now_ms() + 60_000})
    start_worker([fast_slow], config=TAKEOVER)
    await asyncio.sleep(1.0)
    assert raw_redis.llen(protocol.inflight_key("slow", "busy")) == 1


def test_sigterm_finishes_the_batch_then_exits(spawn: Callable[..., Proc], redis_url: str,
                                               raw_redis: redis.Redis) -> None:
    proc = spawn_slow(spawn, redis_url, SLOW_FORWARD_S="1")
    reply_to = protocol.reply_key("slow", "term-test")
    raw_redis.rpush(protocol.queue_key("slow"), raw_request("slow", 5, reply_to)[1])
    wait_for(lambda: inflight_total(raw_redis, "slow") > 0, 30, "the worker to claim")
    os.killpg(proc.popen.pid, signal.SIGTERM)
    assert read_reply(raw_redis, reply_to).payload == 5
    assert proc.popen.wait(30) == 0
    assert raw_redis.zcard(protocol.workers_key("slow")) == 0


async def test_sigterm_past_the_grace_returns_the_batch(
        spawn: Callable[..., Proc], redis_url: str, raw_redis: redis.Redis,
        start_worker: Callable[..., Worker]) -> None:
    """...and the replica exits then: it waited for the pass still running in its
    forward thread (the interpreter joins it), until the pool killed it 5 s later (now 8)."""
    proc = spawn_slow(spawn, redis_url, SLOW_FORWARD_S="20", REDBATCH_GRACE_S="0.3")
    reply_to = protocol.reply_key("slow", "grace-test")
    raw_redis.rpush(protocol.queue_key("slow"), raw_request("slow", 9, reply_to)[1])
    await asyncio.to_thread(wait_for, lambda: inflight_total(raw_redis, "slow") > 0, 30,
                            "the worker to claim")
    os.killpg(proc.popen.pid, signal.SIGTERM)
    await asyncio.to_thread(wait_for, lambda: "returned the batch" in proc.log(), 10,
                            "the batch to be returned")
    returned = time.monotonic()
    assert raw_redis.llen(protocol.queue_key("slow")) == 1
    start_worker([fast_slow], config=TAKEOVER)
    reply = await asyncio.to_thread(read_reply, raw_redis, reply_to)
    assert reply.ok and reply.payload == 9
    await asyncio.to_thread(proc.popen.wait, 30)
    assert time.monotonic() - returned < 4.0, proc.log()  # (the pool kills at 8.3 s)
    assert "killing it" not in proc.log()
    await asyncio.sleep(0.3)
    assert raw_redis.llen(reply_to) == 0


def test_supervisor_restarts_a_crashed_replica(spawn: Callable[..., Proc], redis_url: str,
                                               raw_redis: redis.Redis) -> None:
    spawn_slow(spawn, redis_url)
    info_key = protocol.worker_info_key("slow")

    def live_pids() -> set[int]:
        import orjson
        return {orjson.loads(v)["pid"] for v in raw_redis.hvals(info_key)}

    wait_for(lambda: len(live_pids()) == 1, 30, "the first replica")
    (first,) = live_pids()
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: bool(live_pids() - {first}), 30, "a restarted replica")


async def test_a_failing_item_fails_alone(start_worker: Callable[..., Worker], redis_url: str
                                          ) -> None:
    calls: list[int] = []

    @batch(name="picky", max_batch_size=32, batch_wait_timeout_s=0.05)
    def picky(xs: list[int]) -> list[int]:
        calls.append(len(xs))
        if 13 in xs:
            raise ValueError("13 is unlucky")
        return [x * 10 for x in xs]

    start_worker([picky])
    async with Client(redis_url, require_workers=False) as client:
        out = await client.predict_many("picky", list(range(20)), return_exceptions=True)
    assert isinstance(out[13], ModelError) and "13 is unlucky" in str(out[13])
    assert [o for i, o in enumerate(out) if i != 13] == [i * 10 for i in range(20) if i != 13]
    assert max(calls) == 20  # one batch, then bisected


async def test_a_claim_that_fails_midway_is_returned_not_lost(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    top_up, block_some = Claimer._top_up, Claimer._block_some
    state = {"moved": False, "failed": 0}

    async def blocking(self: Claimer, timeout_s: float, ahead: int,
                       wake_at_ms: int | None = None) -> list[bytes]:
        items = await block_some(self, timeout_s, ahead, wake_at_ms)
        state["moved"] = bool(items)
        return items

    async def flaky(self: Claimer, count: int) -> list[bytes]:
        if state["moved"] and not state["failed"]:  # BLMOVE just moved a request in flight
            state["failed"] += 1
            raise redis.ConnectionError("injected")
        return await top_up(self, count)

    monkeypatch.setattr(Claimer, "_top_up", flaky)
    monkeypatch.setattr(Claimer, "_block_some", blocking)
    worker = start_worker([fast_slow], config=TAKEOVER)
    async with Client(redis_url, require_workers=False) as client:
        await until(lambda: any(c["cmd"] == "blmove" for c in raw_redis.client_list()),
                    "the worker blocked in BLMOVE")
        assert await client.predict("slow", 41, timeout_s=10) == 41
        assert await client.predict("slow", 42, timeout_s=10) == 42
    assert state["failed"] == 1
    assert inflight_total(raw_redis, "slow") == 0
    assert raw_redis.zscore(protocol.workers_key("slow"), worker.worker_id) is not None


async def test_reaper_leaves_a_list_that_changed_under_it(redis_url: str,
                                                          raw_redis: redis.Redis) -> None:
    """The worker acked and claimed a new batch of the same size between the reaper's
    read and its script: nothing may be requeued or dropped."""
    import redis.asyncio as aioredis

    from redbatch.worker.reaper import Plan, Reaper

    inflight = protocol.inflight_key("slow", "zombie")
    old = raw_request("slow", 1, protocol.reply_key("slow", "z"))[1]
    new = raw_request("slow", 2, protocol.reply_key("slow", "z"))[1]
    raw_redis.rpush(inflight, old)
    raw_redis.zadd(protocol.workers_key("slow"), {"zombie": protocol.now_ms() - 1})

    class Racing(Reaper):
        def plan(self, raws: list[bytes], bump: bool, crashing: str | None = None,
                 tag: str | None = None, elsewhere: bool = False) -> Plan:
            raw_redis.delete(inflight)
            raw_redis.rpush(inflight, new)  # same length, other content
            return super().plan(raws, bump, crashing, tag, elsewhere)

    client = aioredis.Redis.from_url(redis_url)
    assert await Racing(client, "slow", 3).reap("zombie") == -2
    await client.aclose()
    assert raw_redis.lrange(inflight, 0, -1) == [new]
    assert raw_redis.llen(protocol.queue_key("slow")) == 0
