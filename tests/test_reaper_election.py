"""One reaper per dead worker: the live workers elect one (``SET NX PX``) and only it
reads the dead worker's in-flight list; an elected reaper that died is replaced once its
election expires.  Nothing is lost or answered twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from redbatch import protocol
from redbatch.worker.process import Worker
from redbatch.worker.reaper import NOT_ELECTED, Reaper
from tests.test_reliability import TAKEOVER, fast_slow, raw_request, read_reply

pytestmark = pytest.mark.e2e
GHOST = "ghost"


def ghost_entries(raw: redis.Redis, reply_to: str, count: int) -> list[bytes]:
    """A dead worker's in-flight list of ``count`` entries, its lease expired."""
    entries = [raw_request("slow", v, reply_to)[1] for v in range(count)]
    raw.rpush(protocol.inflight_key("slow", GHOST), *entries)
    raw.zadd(protocol.workers_key("slow"), {GHOST: protocol.now_ms() - 1})
    return entries


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def replies_exactly_once(raw: redis.Redis, reply_to: str, count: int) -> None:
    replies = [await asyncio.to_thread(read_reply, raw, reply_to) for _ in range(count)]
    assert all(r.ok for r in replies)
    assert sorted(r.payload for r in replies) == list(range(count))  # none lost
    await asyncio.sleep(0.5)
    assert raw.llen(reply_to) == 0, "a reply was delivered twice"


def count_reads(monkeypatch: pytest.MonkeyPatch, slow_s: float) -> list[tuple[str, str]]:
    """Record every (reaper, dead worker) read of an in-flight list; each read then
    takes ``slow_s``, so that every live worker beats while the first one reaps."""
    reads: list[tuple[str, str]] = []
    read = Reaper._read_all

    async def recorded(self: Reaper, worker_id: str, force: bool, tags: list[str]) -> Any:
        got = await read(self, worker_id, force, tags)
        if not force:
            reads.append((self.reaper_id, worker_id))
            await asyncio.sleep(slow_s)
        return got

    monkeypatch.setattr(Reaper, "_read_all", recorded)
    return reads


async def test_one_live_worker_reads_a_dead_workers_list(
        raw_redis: redis.Redis, start_worker: Callable[..., Worker],
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads = count_reads(monkeypatch, slow_s=0.6)
    workers = [start_worker([fast_slow], config=TAKEOVER) for _ in range(3)]
    await wait_until(lambda: raw_redis.zcard(protocol.workers_key("slow")) == 3, 10,
                     "three live workers")
    reply_to = protocol.reply_key("slow", "election")
    ghost_entries(raw_redis, reply_to, 5)
    await replies_exactly_once(raw_redis, reply_to, 5)
    assert [w for _r, w in reads] == [GHOST], reads
    assert reads[0][0] in {w.worker_id for w in workers}
    assert raw_redis.zscore(protocol.workers_key("slow"), GHOST) is None
    assert not raw_redis.exists(protocol.reaping_key("slow", GHOST))


async def test_a_dead_reapers_election_is_taken_over_after_its_ttl(
        raw_redis: redis.Redis, start_worker: Callable[..., Worker],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "REAPING_TTL_MS", 1500)
    reads = count_reads(monkeypatch, slow_s=0.0)
    # the elected reaper died right after it won: its election stands until the TTL
    raw_redis.set(protocol.reaping_key("slow", GHOST), "gone", px=protocol.REAPING_TTL_MS)
    reply_to = protocol.reply_key("slow", "takeover")
    entries = ghost_entries(raw_redis, reply_to, 3)
    start_worker([fast_slow], config=TAKEOVER)
    await asyncio.sleep(0.8)  # four beats: the live worker lost every election
    assert reads == []
    assert raw_redis.lrange(protocol.inflight_key("slow", GHOST), 0, -1) == entries
    await replies_exactly_once(raw_redis, reply_to, 3)
    assert len(reads) == 1


async def test_the_holder_may_retry_others_may_not(redis_url: str,
                                                   raw_redis: redis.Redis) -> None:
    """Direct: the loser returns NOT_ELECTED without reading; the holder re-enters (its
    REAP said no, say); the election carries a bounded TTL."""
    client = aioredis.Redis.from_url(redis_url)
    entries = ghost_entries(raw_redis, protocol.reply_key("slow", "direct"), 2)
    key = protocol.reaping_key("slow", GHOST)
    raw_redis.set(key, "a", px=protocol.REAPING_TTL_MS)
    assert await Reaper(client, "slow", 3, reaper_id="b").reap(GHOST) == NOT_ELECTED
    assert raw_redis.lrange(protocol.inflight_key("slow", GHOST), 0, -1) == entries
    assert 0 < raw_redis.pttl(key) <= protocol.REAPING_TTL_MS
    assert await Reaper(client, "slow", 3, reaper_id="a").reap(GHOST) == 2
    await client.aclose()
    assert raw_redis.llen(protocol.queue_key("slow")) == 2
    assert not raw_redis.exists(key)
