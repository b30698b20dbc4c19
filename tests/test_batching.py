"""Batch formation against a real Redis: size cap, FIFO, windows, opportunistic mode."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis
import redis.asyncio as aioredis

from redbatch import codec, protocol
from redbatch.worker.claim import (
    MOVE_AHEAD,
    MOVE_MAX,
    WINDOW_MARGIN_MS,
    Claimer,
    peek_deadline_ms,
    peek_enqueue_ms,
)
from redbatch.worker.policy import BatchPolicy
from tests.conftest import RedisServer

MODEL = "m"


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=10)
    yield client
    await client.aclose()


def entry(n: int, enqueue_ms: int | None = None, timeout_ms: int = 60_000) -> bytes:
    enq = protocol.now_ms() if enqueue_ms is None else enqueue_ms
    req = protocol.Request(f"id{n}", MODEL, enq, enq + timeout_ms, protocol.reply_key(MODEL, "c"),
                           n)
    return codec.encode(req.to_wire())


def ids(items: list[bytes]) -> list[str]:
    return [codec.decode(raw)["id"] for raw in items]


async def push(redis: aioredis.Redis, *entries: bytes) -> None:
    await redis.rpush(protocol.queue_key(MODEL), *entries)


def claimer(redis: aioredis.Redis, **policy: object) -> Claimer:
    return Claimer(redis, MODEL, "w1", BatchPolicy(**policy), block_timeout_s=0.3)  # type: ignore[arg-type]


async def test_size_cap_and_fifo(aredis: aioredis.Redis) -> None:
    await push(aredis, *(entry(i) for i in range(10)))
    c = claimer(aredis, max_batch_size=4, batch_wait_timeout_s=0)
    assert ids(await c.claim()) == ["id0", "id1", "id2", "id3"]
    assert ids(await c.claim()) == ["id4", "id5", "id6", "id7"]
    assert await aredis.llen(protocol.queue_key(MODEL)) == 2


async def test_claim_moves_items_into_the_inflight_list(aredis: aioredis.Redis) -> None:
    await push(aredis, entry(0), entry(1))
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0)
    items = await c.claim()
    assert await aredis.lrange(protocol.inflight_key(MODEL, "w1"), 0, -1) == items
    assert await aredis.ttl(protocol.inflight_key(MODEL, "w1")) > 0


async def test_opportunistic_takes_what_is_queued(aredis: aioredis.Redis) -> None:
    await push(aredis, entry(0), entry(1))
    later = asyncio.create_task(_push_after(aredis, 0.1, entry(2)))
    c = claimer(aredis, max_batch_size=32, batch_wait_timeout_s=0)
    assert ids(await c.claim()) == ["id0", "id1"]
    await later


async def _push_after(redis: aioredis.Redis, delay_s: float, *entries: bytes) -> None:
    await asyncio.sleep(delay_s)
    await push(redis, *entries)


async def test_idle_claim_returns_empty_after_block_timeout(aredis: aioredis.Redis) -> None:
    assert await claimer(aredis).claim() == []


async def test_blocking_claim_wakes_on_push(aredis: aioredis.Redis) -> None:
    c = Claimer(aredis, MODEL, "w1", BatchPolicy(batch_wait_timeout_s=0), block_timeout_s=5)
    later = asyncio.create_task(_push_after(aredis, 0.1, entry(7)))
    assert ids(await c.claim()) == ["id7"]
    await later


async def test_window_waits_for_more_items(aredis: aioredis.Redis) -> None:
    await push(aredis, entry(0))
    later = asyncio.create_task(_push_after(aredis, 0.1, entry(1), entry(2)))
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0.4)
    assert ids(await c.claim()) == ["id0", "id1", "id2"]
    await later


async def test_full_batch_runs_before_the_window_ends(aredis: aioredis.Redis) -> None:
    await push(aredis, entry(0))
    later = asyncio.create_task(_push_after(aredis, 0.05, entry(1), entry(2), entry(3)))
    c = claimer(aredis, max_batch_size=4, batch_wait_timeout_s=5.0)
    started = time.monotonic()
    assert len(await c.claim()) == 4
    assert time.monotonic() - started < 4.0  # did not sit out the 5 s window
    await later


def packed(n: int, rows: int) -> bytes:
    """A multi-row request of ``rows`` rows (the claim reads its ``rows`` alone)."""
    now = protocol.now_ms()
    wire = {"v": 1, "id": f"id{n}", "model": MODEL, "enqueue_ms": now,
            "deadline_ms": now + 60_000, "reply_to": protocol.reply_key(MODEL, "c"),
            "attempt": 0, "payload": [[n]] * rows, "rows": rows}
    return codec.encode(wire)


def rows_of(items: list[bytes]) -> int:
    return sum(codec.decode(raw).get("rows", 1) for raw in items)


async def test_a_window_counting_rows_stays_near_max_batch_size(aredis: aioredis.Redis
                                                                ) -> None:
    """A window that counts items begins with one single request, then packs of 8 rows
    come: it takes about ``max_batch_size`` items (the claim's count of entries first),
    not every pack there is."""
    await push(aredis, entry(0))
    later = asyncio.create_task(_push_after(aredis, 0.02, *(packed(i, 8) for i in
                                                            range(1, 16))))
    c = claimer(aredis, max_batch_size=32, batch_wait_timeout_s=0.08)
    items = await c.claim(4)  # the runner's count of entries after packs of 8
    await later
    assert 25 <= rows_of(items) <= 32 + 8, rows_of(items)


async def test_a_window_counting_rows_fills_up_after_a_pack(aredis: aioredis.Redis) -> None:
    """A pack of 16 rows, then single requests: the window fills to ``max_batch_size``
    items, not one entry more."""
    await push(aredis, packed(0, 16))
    later = asyncio.create_task(_push_after(aredis, 0.02, *(entry(i) for i in range(1, 16))))
    c = claimer(aredis, max_batch_size=32, batch_wait_timeout_s=0.08)
    items = await c.claim()
    await later
    assert rows_of(items) == 31 and await aredis.llen(protocol.queue_key(MODEL)) == 0


async def test_window_is_measured_from_the_oldest_item(aredis: aioredis.Redis) -> None:
    await push(aredis, entry(0, enqueue_ms=protocol.now_ms() - 1000))
    later = asyncio.create_task(_push_after(aredis, 0.15, entry(1)))
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0.4)
    assert ids(await c.claim()) == ["id0"]  # its window closed while it queued
    await later


async def test_no_small_batch_outwaits_the_window_until_full(aredis: aioredis.Redis) -> None:
    """allow_small_batch=False no longer sends a small batch when batch_wait_timeout_s
    has passed: it waits for a full batch while the deadlines (60 s) allow."""
    await push(aredis, entry(0, enqueue_ms=protocol.now_ms() - 1000))
    later = asyncio.create_task(_push_after(aredis, 0.6, *(entry(i) for i in range(1, 4))))
    c = claimer(aredis, max_batch_size=4, batch_wait_timeout_s=0.1, allow_small_batch=False)
    assert ids(await c.claim()) == ["id0", "id1", "id2", "id3"]  # not ["id0"] at 0.1 s
    await later


async def test_no_small_batch_runs_when_a_deadline_forces_it(aredis: aioredis.Redis) -> None:
    await push(aredis, entry(0, timeout_ms=30_000), entry(1, timeout_ms=700))
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0.05, allow_small_batch=False)
    started = time.monotonic()
    assert ids(await c.claim()) == ["id0", "id1"]
    assert 0.3 < time.monotonic() - started < 0.7 - WINDOW_MARGIN_MS / 1000 + 0.05


async def test_an_urgent_arrival_closes_the_window_early(aredis: aioredis.Redis) -> None:
    await push(aredis, entry(0))
    later = asyncio.create_task(_push_after(aredis, 0.1, entry(1, timeout_ms=400)))
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=3.0, adaptive=False)
    c.pass_ms = lambda n: 100.0  # measured: the window keeps 150 ms + the margin
    started = time.monotonic()
    assert ids(await c.claim()) == ["id0", "id1"]
    assert time.monotonic() - started < 1.0  # not the 3 s window
    await later


def test_peek_deadline_ms() -> None:
    raw = entry(0, enqueue_ms=1000, timeout_ms=500)
    assert peek_deadline_ms(raw) == 1500
    assert peek_deadline_ms(codec.encode(codec.decode(raw), "json")) == 1500
    assert peek_deadline_ms(b"\xc1garbage") is None
    assert peek_deadline_ms(b'{"deadline_ms": true}') is None


async def test_stride_spaces_batch_pops(aredis: aioredis.Redis) -> None:
    await push(aredis, *(entry(i) for i in range(4)))
    c = claimer(aredis, max_batch_size=2, batch_wait_timeout_s=0, stride_s=0.3)
    started = time.monotonic()
    await c.claim()
    await c.claim()
    assert time.monotonic() - started >= 0.29


def test_peek_enqueue_ms_falls_back_on_garbage() -> None:
    assert peek_enqueue_ms(entry(0, enqueue_ms=123), 10**13) == 123
    assert peek_enqueue_ms(entry(0, enqueue_ms=123), 100) == 100  # clock skew: clamped
    assert peek_enqueue_ms(b"\xc1garbage", 9) == 9
    assert peek_enqueue_ms(b'{"enqueue_ms": "x"}', 9) == 9


async def _lone_claims(c: Claimer, redis: aioredis.Redis, n: int) -> list[float]:
    """Claim ``n`` lone requests one after another; return each claim's duration."""
    durations = []
    for i in range(n):
        await push(redis, entry(i))
        started = time.monotonic()
        assert len(await c.claim()) == 1
        durations.append(time.monotonic() - started)
    return durations


async def test_a_quiet_queue_costs_one_command_per_lone_request(
        aredis: aioredis.Redis, raw_redis: redis.Redis) -> None:
    """Once a claim found the queue empty, the next one blocks at once (no CLAIM script
    first), and its pop's LLEN says that nothing waits behind (no top-up)."""
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0)

    async def arrives_while_blocked(n: int) -> list[str]:
        claim = asyncio.create_task(c.claim())
        await asyncio.sleep(0.05)
        await push(aredis, entry(n))
        return ids(await claim)

    assert await arrives_while_blocked(0) == ["id0"]
    raw_redis.config_resetstat()
    assert [await arrives_while_blocked(n) for n in range(1, 6)] == [[f"id{n}"]
                                                                     for n in range(1, 6)]
    stats = raw_redis.info("commandstats")
    assert stats["cmdstat_blmove"]["calls"] == 5
    assert "cmdstat_evalsha" not in stats


@pytest.mark.parametrize("queued", [MOVE_MAX, MOVE_MAX + 3])
async def test_a_small_claim_moves_entries_without_a_script(
        aredis: aioredis.Redis, raw_redis: redis.Redis, queued: int) -> None:
    """Up to ``MOVE_MAX`` entries go by plain LMOVEs (no copy through Lua), more by
    the CLAIM script: the same entries, in order, in the in-flight list, with its TTL."""
    c = claimer(aredis, max_batch_size=queued, batch_wait_timeout_s=0)
    await push(aredis, entry(-1))
    assert ids(await c.claim()) == ["id-1"]  # (the first claim checks that LMOVE is allowed)
    await push(aredis, *(entry(i) for i in range(queued)))
    raw_redis.config_resetstat()
    items = await c.claim()
    assert ids(items) == [f"id{i}" for i in range(queued)]
    inflight = protocol.inflight_key(MODEL, "w1")
    held = await aredis.lrange(inflight, 0, -1)  # (the first batch was never acked)
    assert ids(held[:1]) == ["id-1"] and held[1:] == items and await aredis.ttl(inflight) > 0
    stats = raw_redis.info("commandstats")
    scripted = queued > MOVE_MAX
    assert ("cmdstat_evalsha" in stats) is scripted
    assert ("cmdstat_lmove" in stats) is not scripted


async def test_a_blocking_pop_brings_the_entries_behind_it(
        aredis: aioredis.Redis, raw_redis: redis.Redis) -> None:
    """``MOVE_AHEAD`` LMOVEs ride behind the pop, and the entries its LLEN still saw
    follow by plain LMOVEs (even for a batch larger than ``MOVE_MAX``), no more."""
    c = claimer(aredis, max_batch_size=32, batch_wait_timeout_s=0)
    assert await c.claim() == []  # the queue is empty: the next claim blocks first
    queued = MOVE_AHEAD + 3
    await push(aredis, *(entry(i) for i in range(queued)))
    raw_redis.config_resetstat()
    items = await c.claim()
    assert ids(items) == [f"id{i}" for i in range(queued)]
    assert await aredis.lrange(protocol.inflight_key(MODEL, "w1"), 0, -1) == items
    stats = raw_redis.info("commandstats")
    assert stats["cmdstat_blmove"]["calls"] == 1
    assert stats["cmdstat_lmove"]["calls"] == queued - 1 and "cmdstat_evalsha" not in stats


async def test_a_pop_that_gives_up_keeps_what_its_moves_found(
        aredis: aioredis.Redis, own_connection: aioredis.Redis) -> None:
    """The window's end unblocks the pop: an entry pushed in that instant, moved by
    an LMOVE behind it, is part of the batch (it is in the in-flight list)."""
    c = Claimer(aredis, MODEL, "w1", BatchPolicy(max_batch_size=4), 1.0, own_connection)
    blocked_id = int(await own_connection.client_id())
    blocked, late = asyncio.create_task(c._block_some(5.0, 1)), entry(7)
    await asyncio.sleep(0.1)
    async with aredis.pipeline(transaction=True) as pipe:  # the unblock, then the push
        pipe.client_unblock(blocked_id)
        pipe.rpush(protocol.queue_key(MODEL), late)
        await pipe.execute()
    assert await blocked == [late]
    assert await aredis.lrange(protocol.inflight_key(MODEL, "w1"), 0, -1) == [late]


async def test_a_window_ending_while_writes_are_paused_leaves_redis_up(
        redis_server_factory: Callable[[], RedisServer]) -> None:
    """``CLIENT PAUSE WRITE`` (an operator's, ``FAILOVER``'s, a manual ``CLUSTER
    FAILOVER``'s) holds a window's ``BLMOVE`` unrun; the window's end unblocks it by
    error, never by timeout (which makes Redis before 8.2 abort): the pop gives up,
    its moves run once the pause is over, and Redis is still up (a private server:
    a crash would take no other test's with it)."""
    server = redis_server_factory()
    aredis = aioredis.Redis.from_url(server.url, socket_timeout=10)
    pool = aioredis.BlockingConnectionPool.from_url(server.url, max_connections=1,
                                                    socket_timeout=10)
    own = aioredis.Redis.from_pool(pool)
    try:
        c = Claimer(aredis, MODEL, "w1", BatchPolicy(max_batch_size=4), 1.0, own)
        await c._prepare()
        await aredis.execute_command("CLIENT", "PAUSE", 800, "WRITE")
        started = time.monotonic()
        assert await c._block_some(5.0, 1, protocol.now_ms() + 200) == []
        assert time.monotonic() - started < 3.0  # woken, then the pause's end: not 5 s
        assert await aredis.ping()
        assert server.proc is not None and server.proc.poll() is None
    finally:
        await own.aclose()
        await aredis.aclose()


async def test_adaptive_window_stops_holding_lone_requests(aredis: aioredis.Redis) -> None:
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0.3)
    durations = await _lone_claims(c, aredis, 8)
    assert durations[0] >= 0.25  # the first window is waited out, and brings nothing
    assert all(d < 0.2 for d in durations[-3:]), durations  # then lone requests go at once


async def test_non_adaptive_window_always_waits(aredis: aioredis.Redis) -> None:
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0.2, adaptive=False)
    assert all(d >= 0.15 for d in await _lone_claims(c, aredis, 5))


async def test_adaptive_window_waits_again_under_load(aredis: aioredis.Redis) -> None:
    c = claimer(aredis, max_batch_size=8, batch_wait_timeout_s=0.3)
    await _lone_claims(c, aredis, 8)  # learns that waiting brings nothing
    await push(aredis, entry(100), entry(101))  # two queued: there is load again
    later = asyncio.create_task(_push_after(aredis, 0.1, entry(102)))
    assert ids(await c.claim()) == ["id100", "id101", "id102"]
    await later


@pytest.fixture
async def own_connection(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=1,
                                                    socket_timeout=10)
    client = aioredis.Redis.from_pool(pool)
    yield client
    await client.aclose()


async def test_quiet_gap_closes_the_window_early(aredis: aioredis.Redis,
                                                 own_connection: aioredis.Redis) -> None:
    c = Claimer(aredis, MODEL, "w1", BatchPolicy(max_batch_size=8, batch_wait_timeout_s=2.0,
                                                 quiet_s=0.15), 1.0, own_connection)
    await push(aredis, entry(0))
    later = asyncio.create_task(_push_after(aredis, 0.05, entry(1)))
    started = time.monotonic()
    assert ids(await c.claim()) == ["id0", "id1"]
    assert time.monotonic() - started < 1.0  # quiet for 0.15 s: no need to sit out 2 s
    await later


async def test_precise_window_ends_on_time(aredis: aioredis.Redis,
                                           own_connection: aioredis.Redis) -> None:
    policy = BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0.05, adaptive=False)
    c = Claimer(aredis, MODEL, "w1", policy, 1.0, own_connection)
    durations = []
    for i in range(5):
        await push(aredis, entry(i))
        started = time.monotonic()
        assert len(await c.claim()) == 1
        durations.append(time.monotonic() - started)
    assert all(0.03 < d < 0.25 for d in durations), durations  # the 50 ms window, kept


async def test_claims_bigger_than_luas_unpack_limit(aredis: aioredis.Redis) -> None:
    await aredis.rpush(protocol.queue_key(MODEL), *[b"x%d" % i for i in range(9100)])
    c = claimer(aredis, max_batch_size=9000, batch_wait_timeout_s=0)
    assert len(await c.claim()) == 9000
    assert await aredis.llen(protocol.inflight_key(MODEL, "w1")) == 9000
    assert await aredis.llen(protocol.queue_key(MODEL)) == 100
