"""Hot models across sub-queues (``Model.sub_queues``): producers spread requests by
the power of two choices, each sub-queue keeps its keys in a slot of its own and its
FIFO order, workers steal from sub-queues other than their home, the count changes
live with nothing stranded, admission counts every sub-queue, and the reaper returns
a dead worker's entries to the sub-queue they came from."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from redbatch import Client, batch, codec, lua, protocol
from redbatch.config import RedisSettings
from redbatch.errors import ConfigError, InvalidKnob, QueueFull
from redbatch.jobs.throttle import queues_of, wait_for_room
from redbatch.lean import LeanLink
from redbatch.levels import queue_depths, read_meta, sub_queues_of
from redbatch.producer.routing import STICK, Router, room_cap
from redbatch.status import read_model
from redbatch.worker import heartbeat
from redbatch.worker.claim import Claimer
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.reaper import Reaper
from redbatch.worker.shards import ShardClaimer
from tests import stream_models
from tests.conftest import FAST_WORKER, wait_live
from tests.test_backpressure import _until, blocking_model
from tests.test_gateway import _wait_registered, gateway
from tests.test_reliability import TAKEOVER, raw_request, read_reply

pytestmark = pytest.mark.e2e
HOT = "hot"
FOUR = protocol.sub_queue_tags(HOT, 4)


@batch(name=HOT, max_batch_size=16, batch_wait_timeout_s=0, sub_queues=4)
def hot(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


@batch(name="warm", max_batch_size=16, batch_wait_timeout_s=0)
def warm(xs: list[int]) -> list[int]:
    return [x * 2 for x in xs]


def queued(raw: redis.Redis, tag: str) -> list[int]:
    """The payloads queued in sub-queue ``tag``, head first."""
    return [codec.decode(e)[protocol.F_PAYLOAD] for e in raw.lrange(protocol.queue_key(tag),
                                                                       0, -1)]


def markers(raw: redis.Redis, tag: str) -> int:
    """How many request markers sub-queue ``tag`` holds (one per request it took)."""
    return sum(1 for _ in raw.scan_iter(match=f"rb:{{{tag}}}:req:*", count=1000))


def registered(raw: redis.Redis, model: str, count: int, meta: bytes | None = None) -> None:
    """A model known with ``count`` sub-queues (its stored knob), with no worker; its
    meta as a worker that knows the knob publishes it."""
    raw.set(protocol.meta_key(model), meta or b'{"name":"%s","defaults":{"sub_queues":1}}'
            % model.encode())
    raw.hset(protocol.config_key(model), "sub_queues", str(count))


async def test_the_count_comes_from_the_knob_once_workers_know_it(raw_redis: redis.Redis,
                                                                  redis_url: str) -> None:
    registered(raw_redis, HOT, 3)
    registered(raw_redis, "old", 3, meta=b'{"name":"old","defaults":{}}')  # older workers
    async with Client(redis_url, require_workers=False) as client:
        assert await client._admission.sub_queues(HOT) == 3
        assert await client._admission.sub_queues("old") == 1  # none would serve 1..2
        assert await client._admission.sub_queues("nobody") == 1


def test_tags_keep_one_sub_queue_on_the_models_keys() -> None:
    assert protocol.sub_queue_tags("m", 1) == ["m"]
    assert protocol.sub_queue_tags("m", 3) == ["m", "m:1", "m:2"]
    assert protocol.queue_key(protocol.sub_queue_tag("m", 2)) == "rb:{m:2}:queue"
    assert protocol.model_of_tag("m:2") == protocol.model_of_tag("m") == "m"
    assert protocol.reply_in_model_slot("m:2", protocol.reply_key("m:2", "c"))
    assert Router().pick("m", 1) == "m"
    router = Router()  # a caller's own id: always the same sub-queue (its marker's)
    assert len({router.pick("m", 4, "my-id") for _ in range(20)}) == 1
    picks = [router.pick("m", 4) for _ in range(STICK + 1)]  # one tick
    assert len(set(picks[:STICK])) == 1 and picks[STICK] != picks[0]  # then the other
    router.tick()  # a new tick chooses anew (the other of the two was shorter)
    assert room_cap(40, 30) == 10 and room_cap(40, 45) == -5  # the model's room


async def test_power_of_two_choices_balances_and_keeps_fifo(raw_redis: redis.Redis,
                                                            redis_url: str) -> None:
    registered(raw_redis, HOT, 4)
    futures: list[asyncio.Future[object]] = []
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        for start in range(0, 400, 4):  # 100 ticks of 4 requests: one choice per tick
            futures += await asyncio.gather(*(client.submit(HOT, v, timeout_s=30)
                                              for v in range(start, start + 4)))
            await asyncio.sleep(0.003)  # pushed, and their lengths learned
        depths = [raw_redis.llen(protocol.queue_key(tag)) for tag in FOUR]
        assert sum(depths) == 400
        assert max(depths) - min(depths) <= 12, depths  # random choice: ~40 apart
        for tag in FOUR:  # FIFO per sub-queue: each holds its requests in order
            values = queued(raw_redis, tag)
            assert values == sorted(values)
            assert markers(raw_redis, tag) == len(values)  # markers in the same slot
    await asyncio.gather(*futures, return_exceptions=True)  # failed by the close


async def test_admission_counts_every_sub_queue(raw_redis: redis.Redis,
                                                redis_url: str) -> None:
    registered(raw_redis, HOT, 4)
    async with Client(redis_url, require_workers=False, pack_rows=1,
                      max_queue_len=400) as client:
        first: list[asyncio.Future[object]] = []
        for start in range(0, 1000, 50):  # 20 ticks of 50
            first += await asyncio.gather(*(client.submit(HOT, v, timeout_s=30)
                                            for v in range(start, start + 50)))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # every push answered
        depths = [raw_redis.llen(protocol.queue_key(tag)) for tag in FOUR]
        refused = [f.exception() for f in first if f.done()]
        assert all(isinstance(e, QueueFull) for e in refused)
        # together they hold the model's cap at most
        assert 380 <= sum(depths) <= 400 and all(d > 0 for d in depths), depths
        assert len(refused) == 1000 - sum(depths)
        again = await client.submit(HOT, 100, timeout_s=30)
        with pytest.raises(QueueFull) as full:
            await again
    await asyncio.gather(*first, return_exceptions=True)  # failed by the close
    assert full.value.retry_after_s >= 1.0  # the gateway's 503 Retry-After
    assert f"({sum(depths)} queued, cap 400" in str(full.value)  # the model's, summed


async def test_a_burst_below_the_models_cap_goes_in_whole(raw_redis: redis.Redis,
                                                          redis_url: str) -> None:
    registered(raw_redis, HOT, 4)
    async with Client(redis_url, require_workers=False, pack_rows=1,
                      max_queue_len=40) as client:
        many = await client.submit_many(HOT, list(range(20)), timeout_s=30)  # one push
        tick = await asyncio.gather(*(client.submit(HOT, v, timeout_s=30)  # one tick
                                      for v in range(20, 40)))
        await asyncio.sleep(0.2)  # every push answered
        refused = [f for f in many + tick if f.done()]
        assert not refused, f"{len(refused)} refused with 40 queued, model cap 40"
        assert sum(raw_redis.llen(protocol.queue_key(tag)) for tag in FOUR) == 40
        with pytest.raises(QueueFull) as full:  # the model is full now: its cap holds
            await client.predict(HOT, 99, timeout_s=30)
        assert "(40 queued, cap 40" in str(full.value)
    await asyncio.gather(*many, *tick, return_exceptions=True)  # failed by the close


def claimer(client: aioredis.Redis, worker_id: str, count: int) -> ShardClaimer:
    policy = BatchPolicy(max_batch_size=4, batch_wait_timeout_s=0)
    return ShardClaimer(lambda tag, wait_s: Claimer(client, HOT, worker_id, policy, wait_s,
                                                    tag=tag), HOT, worker_id, count, 0.05)


async def test_a_worker_steals_from_other_sub_queues_in_order(raw_redis: redis.Redis,
                                                              redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    taker = claimer(client, "w1", 4)
    away = FOUR[(taker.home + 2) % 4]  # not its home
    entries = [raw_request(HOT, v, protocol.reply_key(away, "c"))[1] for v in range(10)]
    raw_redis.rpush(protocol.queue_key(away), *entries)
    got: list[int] = []
    for _ in range(10):
        items = await taker.claim(4)
        if items:
            assert taker.source.tag == away
            assert taker.source.inflight == protocol.inflight_key(away, "w1")
            got += [codec.decode(i)[protocol.F_PAYLOAD] for i in items]
    await client.aclose()
    assert got == list(range(10))  # every entry, in its sub-queue's order
    assert raw_redis.llen(protocol.inflight_key(away, "w1")) == 10


async def test_shrinking_drains_the_sub_queues_above(raw_redis: redis.Redis,
                                                     redis_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("redbatch.worker.shards.DRAIN_GRACE_S", 0.2)
    client = aioredis.Redis.from_url(redis_url)
    taker = claimer(client, "w2", 4)
    taker.resize(1)  # shrunk: sub-queues 1..3 are still drained
    late = [raw_request(HOT, v, protocol.reply_key(FOUR[3], "c"))[1] for v in range(3)]
    raw_redis.rpush(protocol.queue_key(FOUR[3]), *late)
    assert len(await taker.claim(4)) == 3 and taker.source.tag == FOUR[3]
    await asyncio.sleep(0.3)
    assert await taker.claim(4) == []
    assert taker.high == 1, "a steal that found 1..3 empty past the grace ends the drain"
    assert taker.seen == 4  # the reaper still looks at every list it may have used
    await client.aclose()


async def test_end_to_end_over_four_sub_queues(start_worker: Callable[..., Worker],
                                               raw_redis: redis.Redis,
                                               redis_url: str) -> None:
    start_worker([hot])  # one worker: it serves the three sub-queues that are not home
    start_worker([hot])
    await wait_live(redis_url, HOT)
    async with Client(redis_url, pack_rows=1) as client:
        answers = await asyncio.gather(*(client.predict(HOT, v, timeout_s=20)
                                         for v in range(300)))
        assert answers == [v + 1 for v in range(300)]  # none lost, none mixed up
        assert client.stats()["listeners"] == 4  # one reply list per sub-queue in use
    assert all(markers(raw_redis, tag) > 0 for tag in FOUR)
    assert sum(markers(raw_redis, tag) for tag in FOUR) == 300
    assert all(raw_redis.llen(protocol.queue_key(tag)) == 0 for tag in FOUR)


async def test_sub_queues_change_live(start_worker: Callable[..., Worker],
                                      raw_redis: redis.Redis, redis_url: str) -> None:
    start_worker([warm], config=TAKEOVER)
    await wait_live(redis_url, "warm")
    tags = protocol.sub_queue_tags("warm", 3)
    async with Client(redis_url, pack_rows=1) as client:
        await client.configure("warm", sub_queues=3)
        await asyncio.sleep(1.2)  # the cached count is a second old at most
        for start in range(0, 60, 3):  # 20 ticks, a choice each
            assert await asyncio.gather(*(client.predict("warm", v)
                                          for v in range(start, start + 3))) == \
                [2 * v for v in range(start, start + 3)]
        assert all(markers(raw_redis, tag) > 0 for tag in tags)  # grown: all three used
        await client.configure("warm", sub_queues=1)
        # a producer that has not seen the shrink yet: entries on sub-queue 2
        reply_to = protocol.reply_key(tags[2], "late")
        raw_redis.rpush(protocol.queue_key(tags[2]),
                        *[raw_request("warm", v, reply_to)[1] for v in range(5)])
        late = [await asyncio.to_thread(read_reply, raw_redis, reply_to) for _ in range(5)]
        assert sorted(r.payload for r in late) == [0, 2, 4, 6, 8]  # drained, not stranded
        await asyncio.sleep(1.2)
        before = markers(raw_redis, tags[1]) + markers(raw_redis, tags[2])
        assert await asyncio.gather(*(client.predict("warm", v) for v in range(20))) == \
            [2 * v for v in range(20)]
        assert markers(raw_redis, tags[1]) + markers(raw_redis, tags[2]) == before  # shrunk


async def test_reaper_returns_entries_to_their_sub_queue(raw_redis: redis.Redis,
                                                         redis_url: str) -> None:
    lists = {tag: [raw_request(HOT, v, protocol.reply_key(tag, "c"))[1] for v in range(3)]
             for tag in (FOUR[0], FOUR[2])}
    for tag, entries in lists.items():
        raw_redis.rpush(protocol.inflight_key(tag, "ghost"), *entries)
    raw_redis.zadd(protocol.workers_key(HOT), {"ghost": protocol.now_ms() - 1})
    client = aioredis.Redis.from_url(redis_url)
    reaper = Reaper(client, HOT, 3)
    reaper.tags = lambda: FOUR
    assert await reaper.reap("ghost") == 6
    await client.aclose()
    for tag in (FOUR[0], FOUR[2]):
        assert queued(raw_redis, tag) == [0, 1, 2]  # its own sub-queue, in order
        assert not raw_redis.exists(protocol.inflight_key(tag, "ghost"))
    assert raw_redis.zscore(protocol.workers_key(HOT), "ghost") is None  # forgotten


async def test_a_dead_workers_entries_are_answered_once(start_worker: Callable[..., Worker],
                                                        raw_redis: redis.Redis,
                                                        redis_url: str) -> None:
    start_worker([hot], config=TAKEOVER)
    await wait_live(redis_url, HOT)
    reply_to = protocol.reply_key(FOUR[3], "once")
    entries = [raw_request(HOT, v, reply_to)[1] for v in range(4)]
    raw_redis.rpush(protocol.inflight_key(FOUR[3], "ghost"), *entries)
    raw_redis.zadd(protocol.workers_key(HOT), {"ghost": protocol.now_ms() - 1})
    replies = [await asyncio.to_thread(read_reply, raw_redis, reply_to) for _ in range(4)]
    assert sorted(r.payload for r in replies) == [1, 2, 3, 4]
    await asyncio.sleep(0.3)
    assert raw_redis.llen(reply_to) == 0


async def test_depths_and_dead_letters_add_up_over_sub_queues(raw_redis: redis.Redis,
                                                              redis_url: str) -> None:
    raw_redis.set(protocol.meta_key(HOT), b'{"name":"hot","sub_queues":4}')
    for index, tag in enumerate(FOUR):
        raw_redis.rpush(protocol.queue_key(tag), *[b"x"] * (index + 1))
        raw_redis.rpush(protocol.dead_letter_key(tag), b"dead")
    client = aioredis.Redis.from_url(redis_url)
    assert await queue_depths(client, HOT, raw_redis.get(protocol.meta_key(HOT))) == [10]
    keys = await queues_of(client, HOT, None)  # what a bulk job paces on: every sub-queue
    assert keys == [protocol.queue_key(tag) for tag in FOUR]
    assert await wait_for_room(client, keys, 9, 0.2) >= 0.2  # 10 queued in all: it waits
    await client.aclose()
    status = read_model(raw_redis, HOT)  # redbatch status
    assert (status.queue_depth, status.dead_letters) == (10, 4)


async def test_the_gateway_refuses_by_the_sum_with_retry_after(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, redis_url: str) -> None:
    model, release = blocking_model("held2")
    model.sub_queues = 2
    start_worker([model])
    tags = protocol.sub_queue_tags("held2", 2)

    def queued_now() -> int:
        return sum(raw_redis.llen(protocol.queue_key(tag)) for tag in tags)

    async with gateway(redis_url, max_queue_len=4, default_timeout_s=10) as http:
        await _wait_registered(http)
        path = "/v1/models/held2/predict"
        pending = [asyncio.create_task(http.post(path, json={"inputs": 0}))]  # held
        await _until(lambda: any(raw_redis.keys(protocol.inflight_key(t, "*")) for t in tags))
        for n in range(1, 5):  # one a tick: each sub-queue takes its share, 2
            pending.append(asyncio.create_task(http.post(path, json={"inputs": n})))
            await _until(lambda n=n: queued_now() == n)  # type: ignore[misc]
        assert sorted(raw_redis.llen(protocol.queue_key(tag)) for tag in tags) == [2, 2]
        resp = await http.post(path, json={"inputs": 99})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_full"
        assert "(4 queued, cap 4" in resp.json()["error"]["message"]  # the sum, not 2
        assert int(resp.headers["retry-after"]) >= 1
        release.set()
        assert [(await t).status_code for t in pending] == [200] * 5


@batch(name="ranked", max_batch_size=8, batch_wait_timeout_s=0, priority_levels=2,
       default_priority=2, sub_queues=2)
def ranked(xs: list[int]) -> list[int]:
    return [x - 1 for x in xs]


async def test_priority_levels_within_each_sub_queue(start_worker: Callable[..., Worker],
                                                     raw_redis: redis.Redis,
                                                     redis_url: str) -> None:
    start_worker([ranked])
    await wait_live(redis_url, "ranked")
    tags = protocol.sub_queue_tags("ranked", 2)
    async with Client(redis_url, pack_rows=1) as client:
        for start in range(0, 40, 2):  # 20 ticks: both sub-queues, both levels
            assert await asyncio.gather(
                client.predict("ranked", start, priority=1),
                client.predict("ranked", start + 1)) == [start - 1, start]
    assert all(markers(raw_redis, tag) > 0 for tag in tags)
    for tag in tags:  # each sub-queue has its own level queues and bell, all drained
        assert not raw_redis.exists(protocol.queue_key(tag, 1), protocol.queue_key(tag),
                                    protocol.bell_key(tag))


async def test_entries_reaped_above_a_shrunk_count_are_drained_again(
        raw_redis: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("redbatch.worker.shards.DRAIN_GRACE_S", 0.0)
    client = aioredis.Redis.from_url(redis_url)
    taker = claimer(client, "w3", 4)
    taker.resize(2)
    assert await taker.claim(4) == [] and taker.high == 2  # 2..3 found empty: drained
    # a dead worker held a batch of sub-queue 3: the reaper puts it back there
    raw_redis.rpush(protocol.inflight_key(FOUR[3], "ghost"),
                    *[raw_request(HOT, v, protocol.reply_key(FOUR[3], "c"))[1] for v in range(3)])
    raw_redis.zadd(protocol.workers_key(HOT), {"ghost": protocol.now_ms() - 1})
    reaper = Reaper(client, HOT, 3)
    reaper.tags, reaper.requeued = (lambda: FOUR), taker.reopen  # as the runner wires it
    assert await reaper.reap("ghost") == 3
    got: list[int] = []
    for _ in range(4):
        got += [codec.decode(i)[protocol.F_PAYLOAD] for i in await taker.claim(4)]
    await client.aclose()
    assert got == [0, 1, 2], "the requeued batch is claimed again, not stranded"
    assert taker.source.tag == FOUR[3]


@batch(name="halved", max_batch_size=8, batch_wait_timeout_s=0, sub_queues=2)
def halved(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


async def test_a_dead_worker_is_reaped_over_every_sub_queue_it_saw(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, redis_url: str) -> None:
    worker = start_worker([halved], config=TAKEOVER)  # started after a shrink from 4
    await wait_live(redis_url, "halved")
    info = raw_redis.hget(protocol.worker_info_key("halved"), worker.worker_id)
    assert orjson.loads(info)[protocol.F_SUB_QUEUES_SEEN] == 2  # what it publishes
    tag = protocol.sub_queue_tag("halved", 3)  # a sub-queue this worker never knew
    reply_to = protocol.reply_key(tag, "ghosted")
    raw_redis.rpush(protocol.inflight_key(tag, "ghost"),
                    *[raw_request("halved", v, reply_to)[1] for v in range(3)])
    raw_redis.hset(protocol.worker_info_key("halved"), "ghost",
                   orjson.dumps({"worker_id": "ghost", protocol.F_SUB_QUEUES_SEEN: 4}))
    raw_redis.zadd(protocol.workers_key("halved"), {"ghost": protocol.now_ms() - 1})
    replies = [await asyncio.to_thread(read_reply, raw_redis, reply_to, 10) for _ in range(3)]
    assert sorted(r.payload for r in replies) == [1, 2, 3]  # reaped, drained, answered
    assert not raw_redis.exists(protocol.inflight_key(tag, "ghost"))


def commands(raw: redis.Redis) -> int:
    """Commands Redis ran since its last ``CONFIG RESETSTAT``, a test's own excluded."""
    stats = raw.info("commandstats")
    return sum(v["calls"] for k, v in stats.items()
               if not k.startswith(("cmdstat_info", "cmdstat_config", "cmdstat_rpush")))


def one_queue(worker_id: str, count: int) -> Callable[[aioredis.Redis], ShardClaimer]:
    """A sharded claimer whose plain wait (one sub-queue) is a second."""
    policy = BatchPolicy(max_batch_size=4, batch_wait_timeout_s=0)
    return lambda client: ShardClaimer(
        lambda tag, wait_s: Claimer(client, HOT, worker_id, policy, wait_s, tag=tag),
        HOT, worker_id, count, 1.0)


async def test_after_a_shrink_to_one_the_claim_blocks_its_whole_wait(
        raw_redis: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("redbatch.worker.shards.DRAIN_GRACE_S", 0.1)
    client = aioredis.Redis.from_url(redis_url)
    taker = one_queue("w4", 3)(client)
    taker.resize(1)
    for _ in range(10):  # traffic on sub-queue 0 while the others drain: busy claims
        raw_redis.rpush(protocol.queue_key(HOT), b"x")
        await taker.claim(4)
    while taker.high > 1:
        await taker.claim(4)
    raw_redis.config_resetstat()
    until = time.monotonic() + 1.0
    while time.monotonic() < until:  # idle, one sub-queue: blocking pops of 1 s
        assert await taker.claim(4) == []
    pops = raw_redis.info("commandstats")["cmdstat_blmove"]["calls"]
    await client.aclose()
    assert pops <= 2, f"{pops} blocking pops in a second: a short wait was left behind"
    assert taker.sub(0).block_timeout_s == 1.0


async def test_light_traffic_does_not_keep_workers_polling(raw_redis: redis.Redis,
                                                           redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    taker = one_queue("w5", 3)(client)
    tags = protocol.sub_queue_tags(HOT, 3)
    raw_redis.config_resetstat()
    got = 0
    for i in range(5):  # a request every 0.3 s, a different sub-queue each time
        raw_redis.rpush(protocol.queue_key(tags[i % 3]), b"x")
        until = time.monotonic() + 0.3
        while time.monotonic() < until:
            got += len(await taker.claim(4))
    calls = commands(raw_redis)
    await client.aclose()
    assert got == 5
    # polls back off after a request (idle claims block): about 300; polling every
    # 2 ms for half a second after each request took 3,000 and more
    assert calls < 1200, calls


async def test_a_streaming_model_keeps_one_sub_queue(raw_redis: redis.Redis,
                                                     redis_url: str) -> None:
    with pytest.raises(ConfigError, match="sub_queues must be 1 for a streaming model"):
        Model("streamy", fn=stream_models.counting, sub_queues=2)
    model = stream_models.counter(name="streamy")
    with pytest.raises(ConfigError, match="sub_queues must be 1"):  # the live knob
        model.apply_knobs({**model.knob_defaults, "sub_queues": 3})
    assert model.sub_queues == 1
    raw_redis.set(protocol.meta_key("streamy"), orjson.dumps(model.meta()))
    async with Client(redis_url, require_workers=False) as client:
        with pytest.raises(InvalidKnob, match="sub_queues must be 1"):  # configure refuses
            await client.configure("streamy", sub_queues=2)
        assert not raw_redis.exists(protocol.config_key("streamy"))
        # an override stored by hand: producers still push to the one queue it serves
        raw_redis.hset(protocol.config_key("streamy"), "sub_queues", "3")
        assert await client._admission.sub_queues("streamy") == 1


async def test_caller_ids_join_their_own_sub_queue_in_submit_many(raw_redis: redis.Redis,
                                                                   redis_url: str) -> None:
    registered(raw_redis, HOT, 4)
    ids = [f"mine-{n}" for n in range(12)]
    owner = {rid: Router().pick(HOT, 4, rid) for rid in ids}  # where ``submit`` sends each
    assert len(set(owner.values())) > 1
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        futures = await client.submit_many(HOT, list(range(12)), timeout_s=30,
                                           request_ids=ids)
        assert [f.request_id for f in futures] == ids  # in input order
        for rid in ids:
            assert raw_redis.exists(protocol.request_key(owner[rid], rid)), rid
        async with Client(redis_url, require_workers=False) as retrying:  # a retry
            again = await retrying.submit(HOT, 3, timeout_s=30, request_id="mine-3")
            await asyncio.sleep(0.1)
        assert sum(raw_redis.llen(protocol.queue_key(tag)) for tag in FOUR) == 12  # deduped
        for tag in FOUR:
            assert sorted(queued(raw_redis, tag)) == \
                [n for n, rid in enumerate(ids) if owner[rid] == tag]
    await asyncio.gather(*futures, again, return_exceptions=True)  # failed by the close


@batch(name="capped", max_batch_size=8, priority_levels=2, default_priority=2,
       priority_caps=[8, 4], sub_queues=2)
def capped(xs: list[int]) -> list[int]:
    return xs


async def test_a_level_cap_holds_for_the_model_not_each_sub_queue(raw_redis: redis.Redis,
                                                                   redis_url: str) -> None:
    raw_redis.set(protocol.meta_key("capped"), orjson.dumps(capped.meta()))
    tags = protocol.sub_queue_tags("capped", 2)
    futures = []
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        for value in range(8):  # one a tick: both sub-queues
            futures.append(await client.submit("capped", value, timeout_s=30, priority=2))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        queued_at_2 = [raw_redis.llen(protocol.queue_key(tag)) for tag in tags]  # default
        refused = [f.exception() for f in futures if f.done()]
    await asyncio.gather(*futures, return_exceptions=True)  # failed by the close
    assert sum(queued_at_2) == 4, queued_at_2  # level 2's cap, over both sub-queues
    assert all(q > 0 for q in queued_at_2)
    assert len(refused) == 4 and all(isinstance(e, QueueFull) for e in refused)
    assert "(4 queued at that level, its cap 4)" in str(refused[0])


async def test_a_reap_skips_empty_lists_and_leaves_a_live_worker_be(
        raw_redis: redis.Redis, redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    reaper = Reaper(client, HOT, 3)
    reaper.tags = lambda: FOUR
    raw_redis.rpush(protocol.inflight_key(FOUR[2], "woke"),  # a worker that woke up
                    *[raw_request(HOT, v, protocol.reply_key(FOUR[2], "c"))[1] for v in range(2)])
    raw_redis.zadd(protocol.workers_key(HOT), {"woke": protocol.now_ms() + 10_000})
    assert await reaper.reap("woke") < 0  # its lease is live: nothing requeued
    assert raw_redis.llen(protocol.inflight_key(FOUR[2], "woke")) == 2
    assert raw_redis.llen(protocol.queue_key(FOUR[2])) == 0
    raw_redis.rpush(protocol.inflight_key(HOT, "ghost"),
                    *[raw_request(HOT, v, protocol.reply_key(HOT, "c"))[1] for v in range(2)])
    raw_redis.zadd(protocol.workers_key(HOT), {"ghost": protocol.now_ms() - 1})
    raw_redis.script_load(lua.REAP)
    raw_redis.config_resetstat()
    assert await reaper.reap("ghost") == 2
    await client.aclose()
    scripts = raw_redis.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert scripts == 1, "one REAP: sub-queues 1..3 held nothing of it"


async def test_a_failed_claim_makes_every_sub_queue_ask_its_connection_again(
        raw_redis: redis.Redis, redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    link = LeanLink(client)  # one connection for every sub-queue's claims, as a worker's
    policy = BatchPolicy(max_batch_size=4, batch_wait_timeout_s=0)
    taker = ShardClaimer(lambda tag, wait_s: Claimer(client, HOT, "w6", policy, wait_s, client,
                                                     tag=tag, link=link), HOT, "w6", 3, 0.05)
    for tag in protocol.sub_queue_tags(HOT, 3):
        raw_redis.rpush(protocol.queue_key(tag), raw_request(HOT, 0, "r")[1])
    got = 0
    while got < 3:  # each sub-queue's claimer learns the connection's id
        got += len(await taker.claim(4))
    ids = {taker.sub(index)._client_id for index in range(3)}
    assert len(ids) == 1 and None not in ids
    raw_redis.client_kill_filter(_id=str(ids.pop()))  # the connection goes
    with pytest.raises(redis.ConnectionError):
        await taker.claim(4)
    assert all(taker.sub(index)._client_id is None for index in range(3))
    await client.aclose()


SAME_HASH = ["w0", "w1", "w2"]  # crc32(id) % 3 == 1 for all three: one hashed home


def test_homes_go_by_rank_among_the_live_workers() -> None:
    client = aioredis.Redis.from_url("redis://127.0.0.1:1")  # never reached
    takers = [claimer(client, worker_id, 3) for worker_id in SAME_HASH]
    assert [t.home for t in takers] == [1, 1, 1]  # hashed, before a heartbeat read ranks
    for taker in takers:
        taker.rank([b"w2", b"w0", b"w1"])  # as ZRANGEBYSCORE answers: by lease, not by id
    assert [t.home for t in takers] == [0, 1, 2]
    takers[0].rank(None)  # not read (one sub-queue then): the last ranks stand
    takers[1].rank([b"w1", b"w2"])  # w0 left: w1 ranks first
    assert takers[1].home == 0
    takers[1].rank([b"w0", b"w2"])  # gone from the live set: hashed again
    assert [t.home for t in takers] == [0, 1, 2]
    takers[2].resize(2)  # rank 2 over two sub-queues
    assert takers[2].home == 0


async def test_a_foreign_worker_id_of_any_bytes_takes_its_rank(raw_redis: redis.Redis,
                                                                redis_url: str) -> None:
    model = batch(name="raw", max_batch_size=4, sub_queues=2)(lambda xs: xs)
    until = protocol.now_ms() + 60_000
    raw_redis.zadd(protocol.workers_key("raw"), {b"\xff\xfeforeign": until, b"a": until})
    client = aioredis.Redis.from_url(redis_url)
    beat = await heartbeat.beat(client, [model], "w1", {"raw": (b"{}", b"{}")}, 10)
    await client.aclose()
    assert sorted(beat.live["raw"]) == [b"a", b"w1", b"\xff\xfeforeign"]  # bytewise
    taker = claimer(client, "w1", 2)
    taker.rank(beat.live["raw"])
    assert taker.home == 1


async def test_three_workers_of_three_sub_queues_have_three_homes(
        redis_url: str, raw_redis: redis.Redis) -> None:
    model = batch(name="trio", max_batch_size=4, batch_wait_timeout_s=0,
                  sub_queues=3)(lambda xs: xs)
    workers = [Worker([model], RedisSettings(redis_url), FAST_WORKER, worker_id=worker_id)
               for worker_id in SAME_HASH]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        await _until(lambda: all(w.runners for w in workers) and sorted(
            w.runners[0].claimer.home for w in workers) == [0, 1, 2], timeout_s=10)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert raw_redis.zcard(protocol.workers_key("trio")) == 0  # every one left cleanly


async def test_depths_count_the_sub_queues_above_a_shrink_until_drained(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("redbatch.worker.shards.DRAIN_GRACE_S", 0.2)
    model, release = blocking_model("shrunk")
    tags = protocol.sub_queue_tags("shrunk", 3)
    start_worker([dataclasses.replace(model, sub_queues=3)])
    await wait_live(redis_url, "shrunk")
    reply_to = protocol.reply_key(tags[2], "c")
    raw_redis.rpush(protocol.queue_key(tags[2]),
                    *[raw_request("shrunk", v, reply_to)[1] for v in range(8)])

    def meta() -> bytes:
        return raw_redis.get(protocol.meta_key("shrunk")) or b""

    raw_redis.hset(protocol.config_key("shrunk"), "sub_queues", 1)  # shrunk live
    await _until(lambda: sub_queues_of(meta()) == 1)  # the worker publishes S = 1
    await asyncio.sleep(0.5)  # the worker holds what it claimed, in its forward pass
    queued = raw_redis.llen(protocol.queue_key(tags[2]))
    assert queued > 0
    client = aioredis.Redis.from_url(redis_url)
    assert await queue_depths(client, "shrunk", *await read_meta(client, "shrunk")) == [
        queued]  # /metrics
    assert len(await queues_of(client, "shrunk", None)) == 3  # a bulk job's pacing
    await client.aclose()
    assert read_model(raw_redis, "shrunk").queue_depth == queued  # redbatch status
    assert raw_redis.llen(protocol.queue_key(tags[2])) == queued
    release.set()
    draining = protocol.sub_queues_draining_key("shrunk")
    await _until(lambda: not raw_redis.exists(draining))  # drained: the count expires
    assert raw_redis.llen(protocol.queue_key(tags[2])) == 0


async def test_a_workers_beat_leaves_another_ones_draining_count(
        raw_redis: redis.Redis, redis_url: str) -> None:
    model = batch(name="lww", max_batch_size=4, sub_queues=1)(lambda xs: xs)
    fields = {"lww": (b"{}", b"{}")}
    client = aioredis.Redis.from_url(redis_url)
    await heartbeat.beat(client, [model], "A", fields, 10,
                         heartbeat.Draining({"lww": 3}, 60_000))  # drains 1 and 2
    await heartbeat.beat(client, [model], "B", fields, 10)  # started after the shrink
    await heartbeat.beat(client, [model], "C", fields, 10,
                         heartbeat.Draining({"lww": 2}, 60_000))  # drains fewer
    raw_redis.rpush(protocol.queue_key("lww:2"), b"x", b"y")
    raw_redis.rpush(protocol.dead_letter_key("lww:1"), b"z")
    assert await queue_depths(client, "lww", *await read_meta(client, "lww")) == [2]
    assert len(await queues_of(client, "lww", None)) == 3
    await client.aclose()
    assert read_model(raw_redis, "lww").queue_depth == 2
    assert read_model(raw_redis, "lww").dead_letters == 1  # above S too
    assert sub_queues_of(raw_redis.get(protocol.meta_key("lww"))) == 1  # the meta: S
    assert 0 < raw_redis.pttl(protocol.sub_queues_draining_key("lww")) <= 60_000


async def test_past_the_ranked_most_a_beat_reads_no_ids_and_homes_are_hashed(
        raw_redis: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More live workers than ``RANKED_WORKERS_MAX`` (2 here, 4 live): the beat that
    counted them says so, and the next one sends no ZRANGEBYSCORE for the live ids (the
    homes fall back to crc32); once the count falls back, ids are read again."""
    monkeypatch.setattr(protocol, "RANKED_WORKERS_MAX", 2)
    model = batch(name="many", max_batch_size=4, sub_queues=2)(lambda xs: xs)
    until = protocol.now_ms() + 60_000
    raw_redis.zadd(protocol.workers_key("many"), {b"a": until, b"b": until, b"c": until})
    client = aioredis.Redis.from_url(redis_url)
    fields = {"many": (b"{}", b"{}")}
    try:
        first = await heartbeat.beat(client, [model], "w1", fields, 10)
        assert first.live_counts == {"many": 4} and first.unranked() == {"many"}
        assert sorted(first.live["many"]) == [b"a", b"b", b"c", b"w1"]  # read: 4 was news
        raw_redis.config_resetstat()
        second = await heartbeat.beat(client, [model], "w1", fields, 10, None,
                                      first.unranked())
        reads = raw_redis.info("commandstats")["cmdstat_zrangebyscore"]["calls"]
        assert second.live == {"many": []} and reads == 1  # the expired-lease scan alone
        raw_redis.zrem(protocol.workers_key("many"), "a", "b")
        third = await heartbeat.beat(client, [model], "w1", fields, 10, None,
                                     second.unranked())
        assert third.unranked() == frozenset()
        fourth = await heartbeat.beat(client, [model], "w1", fields, 10, None,
                                      third.unranked())
        assert sorted(fourth.live["many"]) == [b"c", b"w1"]
    finally:
        await client.aclose()
    taker = claimer(client, "w1", 2)
    taker.rank(fourth.live["many"])
    assert taker.home == 1
    taker.rank(second.live["many"])  # none read: hashed again
    assert taker.home == claimer(client, "w1", 2).home
