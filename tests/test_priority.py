"""Priority levels: urgent requests overtake a backlog, the lower levels still get
their share, each level has its own queue cap (a live knob), bad priorities are 400,
nothing is lost when a worker dies, foreign producers ring the bell, and a model of one
level keeps its one queue and no bell."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import redis

from redbatch import (
    Client,
    InvalidPayload,
    Model,
    QueueFull,
    batch,
    codec,
    lua,
    protocol,
    status,
    status_view,
)
from redbatch.config import WorkerConfig
from redbatch.errors import ConfigError, InvalidKnob
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import Proc, redbatch_cmd, test_env, wait_live
from tests.test_gateway import _wait_registered, gateway

SLOW_BLOCK = WorkerConfig(block_timeout_s=5.0, heartbeat_interval_s=0.2, lease_ttl_s=2.0)


def held_model(name: str, *, levels: int = 3, default: int = 2, size: int = 4,
               share: float = 0.0, caps: list[int] | None = None
               ) -> tuple[Model, threading.Event, list[list[int]]]:
    """A model whose first batch waits for ``release``; every batch's items recorded."""
    release = threading.Event()
    batches: list[list[int]] = []

    def forward(xs: list[Any]) -> list[Any]:
        release.wait(20)
        batches.append([int(x) for x in xs])
        return xs

    model = Model(name, fn=forward, policy=BatchPolicy(max_batch_size=size,
                                                       batch_wait_timeout_s=0),
                  priority_levels=levels, default_priority=default, priority_share=share,
                  priority_caps=caps)
    return model, release, batches


def queued(raw: redis.Redis, model: str, levels: int) -> int:
    return sum(int(raw.llen(protocol.queue_key(model, level))) for level in
               range(levels + 1))


async def until(done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def inflight(raw: redis.Redis, model: str) -> int:
    return sum(int(raw.llen(k)) for k in raw.keys(protocol.inflight_key(model, "*")))


async def hold(client: Client, raw: redis.Redis, model: str) -> asyncio.Future[Any]:
    """One request the worker holds in its forward pass (the queues empty behind it)."""
    first = await client.submit(model, 0, timeout_s=30)
    await until(lambda: inflight(raw, model) == 1 and queued(raw, model, 3) == 0)
    return first


# --- the claim script -------------------------------------------------------------
def test_claim_levels_reserves_slots_for_the_lower_levels_in_turn(raw_redis: redis.Redis
                                                                  ) -> None:
    queues = protocol.level_queues("m", 3, 1)
    bell, inflight_key = protocol.bell_key("m"), protocol.inflight_key("m", "w")
    raw_redis.rpush(queues[0], *[f"a{i}" for i in range(10)])
    raw_redis.rpush(queues[1], "b0", "b1")
    raw_redis.rpush(queues[2], "c0", "c1")
    raw_redis.rpush(bell, 1)
    claim = raw_redis.register_script(lua.CLAIM_LEVELS)
    keys = [bell, inflight_key, *queues]
    low, left, items, turn = claim(keys=keys, args=[4, 60_000, 2, 0])
    assert (low, left, turn) == (2, 10, 2)  # two reserved slots given: the turn moves 2
    assert items == [b"b0", b"c0", b"a0", b"a1"]  # one of each lower level, then urgent
    assert raw_redis.lrange(inflight_key, 0, -1) == items
    low, left, items, turn = claim(keys=keys, args=[4, 60_000, 1, 1])  # the turn moved on
    assert (low, items, turn) == (1, [b"c1", b"a2", b"a3", b"a4"], 2)  # one slot given
    low, left, items, turn = claim(keys=keys, args=[20, 60_000, 0, 0])
    assert (low, left, len(items), turn) == (1, 0, 6, 0)  # a5..a9, then b1 (in order)


def test_the_turn_moves_on_when_a_reserved_slot_empties_its_level(raw_redis: redis.Redis
                                                                  ) -> None:
    """Level 2 gets one entry per claim and each reserved slot empties it: the turn
    must move on all the same, or level 3 would never get a slot."""
    queues = protocol.level_queues("m", 3, 1)
    bell, inflight_key = protocol.bell_key("m"), protocol.inflight_key("m", "w")
    claim = raw_redis.register_script(lua.CLAIM_LEVELS)
    raw_redis.rpush(queues[2], *[f"c{i}" for i in range(20)])
    turn, taken = 0, []
    for i in range(20):
        raw_redis.rpush(queues[0], f"a{i}")
        raw_redis.rpush(queues[1], f"b{i}")
        _low, _left, items, turn = claim(keys=[bell, inflight_key, *queues],
                                         args=[2, 60_000, 1, turn])
        taken += [item[:1] for item in items if not item.startswith(b"a")]
    assert (taken.count(b"b"), taken.count(b"c")) == (10, 10), taken
    assert raw_redis.exists(bell) == 0  # every level empty: the bell is silenced


def test_enqueue_level_counts_the_more_urgent_levels_and_its_own_cap(raw_redis: redis.Redis
                                                                     ) -> None:
    queues = protocol.level_queues("m", 2, 1)
    raw_redis.rpush(queues[0], "u0", "u1")
    enqueue = raw_redis.register_script(lua.ENQUEUE_LEVEL)
    marks = [protocol.request_key("m", f"r{i}") for i in range(3)]
    keys = [queues[1], protocol.bell_key("m"), queues[0], *marks]
    accepted, ahead, own = enqueue(keys=keys, args=[100, 2, 60_000, 1, 9000, 9000, 9000,
                                                     "x", "y", "z"])
    assert (accepted, ahead, own) == (2, 4, 2)  # the level's own cap of 2
    assert raw_redis.lrange(protocol.bell_key("m"), 0, -1) == [b"1"]
    assert raw_redis.exists(marks[2]) == 0  # the refused one's marker is gone


# --- ordering and the starvation guard -------------------------------------------
async def test_urgent_requests_overtake_a_backlog(start_worker: Callable[..., Worker],
                                                  redis_url: str, raw_redis: redis.Redis,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "redbatch.worker")
    model, release, batches = held_model("urgent")
    start_worker([model])
    await wait_live(redis_url, "urgent")
    async with Client(redis_url) as client:
        first = await hold(client, raw_redis, "urgent")
        backlog = await client.submit_many("urgent", list(range(100, 110)), 30, priority=3)
        await until(lambda: raw_redis.llen(protocol.queue_key("urgent", 3)) == 10)
        urgent = await client.submit_many("urgent", [1, 2, 3], 30, priority=1)
        plain = await client.submit("urgent", 50, 30)  # the default level, 2
        await until(lambda: queued(raw_redis, "urgent", 3) == 14)
        release.set()
        results = await asyncio.gather(first, *urgent, plain, *backlog)
    assert results == [0, 1, 2, 3, 50, *range(100, 110)]
    assert sorted(batches[1]) == [1, 2, 3, 50]  # levels 1 and 2 before the backlog
    assert "levels=1:3,2:1" in caplog.text  # the batch log line names its levels
    assert raw_redis.exists(protocol.bell_key("urgent")) == 0


async def test_lower_levels_get_their_share_under_saturation(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    model, release, batches = held_model("starve", levels=2, default=1, size=4, share=0.25)
    start_worker([model])
    await wait_live(redis_url, "starve")
    async with Client(redis_url) as client:
        first = await hold(client, raw_redis, "starve")
        top = await client.submit_many("starve", list(range(1, 201)), 60, priority=1)
        low = await client.submit_many("starve", list(range(1000, 1020)), 60, priority=2)
        await until(lambda: queued(raw_redis, "starve", 2) == 220)
        release.set()
        await asyncio.gather(first, *top, *low)
    served = [x for batch in batches[1:] for x in batch]
    last_low = max(i for i, x in enumerate(served) if x >= 1000)
    # 25 % of the claims: every low request is served while the urgent backlog lasts
    assert last_low < 120, served
    assert sum(1 for x in served[:40] if x >= 1000) >= 8


async def test_every_lower_level_gets_its_turn_whatever_the_claims_rhythm(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    """Three levels, one reserved slot every second claim: the slots go to levels 2 and
    3 in turn (before, the turn moved once per claim, so every reserved slot went to
    level 2 and level 3 waited for levels 1 and 2 to empty)."""
    model, release, batches = held_model("rhythm", levels=3, default=1, size=2, share=0.25)
    start_worker([model])
    await wait_live(redis_url, "rhythm")
    async with Client(redis_url) as client:
        first = await hold(client, raw_redis, "rhythm")
        top = await client.submit_many("rhythm", list(range(1, 201)), 60, priority=1)
        mid = await client.submit_many("rhythm", list(range(1000, 1100)), 60, priority=2)
        low = await client.submit_many("rhythm", list(range(5000, 5010)), 60, priority=3)
        await until(lambda: queued(raw_redis, "rhythm", 3) == 310)
        release.set()
        await asyncio.gather(first, *top, *mid, *low)
    served = [x for batch in batches[1:] for x in batch]
    last_top = max(i for i, x in enumerate(served) if x < 1000)
    assert max(i for i, x in enumerate(served) if x >= 5000) < last_top, served


# --- per-level caps, over HTTP ------------------------------------------------------
V2 = {"inputs": [{"name": "inputs", "shape": [1], "datatype": "INT64", "data": [7]}]}


@pytest.fixture
async def capped(start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis
                 ) -> AsyncIterator[tuple[httpx.AsyncClient, threading.Event]]:
    model, release, _batches = held_model("capped", levels=2, default=1, size=1,
                                          caps=[100, 2])
    start_worker([model])
    async with gateway(redis_url, default_timeout_s=20, max_timeout_s=30) as http:
        await _wait_registered(http)
        yield http, release
        release.set()


async def test_a_full_low_level_is_503_while_the_urgent_one_flows(
        capped: tuple[httpx.AsyncClient, threading.Event], raw_redis: redis.Redis) -> None:
    http, release = capped
    path = "/v1/models/capped/predict"
    held = asyncio.create_task(http.post(path, json={"inputs": 0}))
    await until(lambda: inflight(raw_redis, "capped") == 1)
    low = [asyncio.create_task(http.post(path, json={"inputs": i},
                                         headers={"X-Redbatch-Priority": "2"}))
           for i in (1, 2)]
    await until(lambda: raw_redis.llen(protocol.queue_key("capped", 2)) == 2)
    started = time.monotonic()
    refused = await http.post(path, json={"inputs": 3}, headers={"X-Redbatch-Priority": "2"})
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "queue_full"
    assert "priority 2" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert time.monotonic() - started < 1.0
    scraped = (await http.get("/metrics")).text
    assert 'redbatch_queue_depth_level{level="2",model="capped"} 2.0' in scraped
    assert 'redbatch_queue_depth{model="capped"} 2.0' in scraped
    v2_refused = await http.post("/v2/models/capped/infer",
                                 json={**V2, "parameters": {"priority": 2}})
    assert v2_refused.status_code == 503, v2_refused.text
    urgent = asyncio.create_task(http.post(path, json={"inputs": 4},
                                           headers={"X-Redbatch-Priority": "1"}))
    v2_urgent = asyncio.create_task(http.post("/v2/models/capped/infer",
                                              json={**V2, "parameters": {"priority": 1}}))
    await until(lambda: raw_redis.llen(protocol.queue_key("capped")) == 2)  # both accepted
    release.set()
    answers = await asyncio.gather(held, *low, urgent, v2_urgent)
    assert [a.status_code for a in answers] == [200] * 5
    assert answers[3].json() == {"outputs": 4}
    assert answers[4].json()["outputs"][0]["data"] == [7]


@pytest.mark.parametrize(("headers", "body_params", "named"), [
    ({"X-Redbatch-Priority": "high"}, None, "X-Redbatch-Priority"),
    ({"X-Redbatch-Priority": "1.5"}, None, "X-Redbatch-Priority"),
    ({"X-Redbatch-Priority": b"\xb2"}, None, "X-Redbatch-Priority"),  # a latin-1 digit
    ({"X-Redbatch-Priority": "99999"}, None, "X-Redbatch-Priority"),
    ({"X-Redbatch-Priority": "3"}, None, "priority 3"),
    ({"X-Redbatch-Priority": "-1"}, None, "priority -1"),
    ({}, {"priority": 9}, "parameters.priority"),
    ({}, {"priority": "1"}, "parameters.priority: priority must be an integer"),
    ({}, {"priority": True}, "parameters.priority: priority must be an integer"),
])
async def test_a_bad_priority_is_400_naming_it(
        capped: tuple[httpx.AsyncClient, threading.Event], headers: dict[str, Any],
        body_params: dict[str, Any] | None, named: str) -> None:
    http, release = capped
    release.set()
    if body_params is None:
        resp = await http.post("/v1/models/capped/predict", json={"inputs": 1},
                               headers=headers)
    else:
        resp = await http.post("/v2/models/capped/infer", json={**V2,
                                                                "parameters": body_params})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]  # v2 answers Triton's {"error": message}
    assert named in (error if isinstance(error, str) else error["message"])


async def test_the_client_checks_the_priority(start_worker: Callable[..., Worker],
                                              redis_url: str) -> None:
    model, release, _ = held_model("checked", levels=2, default=2)
    release.set()
    start_worker([model])
    await wait_live(redis_url, "checked")
    async with Client(redis_url) as client:
        with pytest.raises(InvalidPayload, match="priority 5 is out of range"):
            await client.predict("checked", 1, priority=5)
        assert await client.predict("checked", 1, priority=0) == 1  # the default
        assert await client.predict_many("checked", [1, 2], priority=1) == [1, 2]


# --- the live knob ------------------------------------------------------------------
async def test_priority_caps_change_live(start_worker: Callable[..., Worker], redis_url: str,
                                         raw_redis: redis.Redis) -> None:
    model, release, _ = held_model("live", levels=2, default=1, size=1)
    start_worker([model])
    await wait_live(redis_url, "live")
    async with Client(redis_url) as client:
        with pytest.raises(InvalidKnob, match="list of 2 integers"):
            await client.configure("live", priority_caps=[5])
        with pytest.raises(InvalidKnob):
            await client.configure("live", priority_caps=[5, 0])
        answer = await client.configure("live", priority_caps=[50, 1])
        assert answer["effective"]["priority_caps"] == [50, 1]

        def published() -> Any:
            raw = raw_redis.get(protocol.meta_key("live"))
            return raw and orjson.loads(raw)["priority"]["caps"]

        await until(lambda: published() == [50, 1])
        await asyncio.sleep(1.1)  # the client's cached summary expires
        first = await hold(client, raw_redis, "live")
        accepted = await client.submit("live", 1, 30, priority=2)
        await until(lambda: raw_redis.llen(protocol.queue_key("live", 2)) == 1)
        with pytest.raises(QueueFull, match="priority 2"):
            await client.predict("live", 2, 30, priority=2)
        urgent = await client.submit("live", 3, 30, priority=1)
        release.set()
        assert await asyncio.gather(first, accepted, urgent) == [0, 1, 3]
    async with gateway(redis_url) as http:
        listed = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
        assert listed["live"]["priority"] == {"levels": 2, "default": 1, "caps": [50, 1]}
        assert listed["live"]["queue_depths"] == {"1": 0, "2": 0}
    seen = status.read_model(raw_redis, "live")
    assert seen.queue_depths == {"1": 0, "2": 0} and seen.knobs["priority_caps"] == [50, 1]
    assert "(p1:0 p2:0) caps 50/1*" in status_view._queue(seen)


# --- reliability and foreign producers -------------------------------------------------
async def test_a_killed_worker_of_a_multi_level_model_loses_nothing(
        spawn: Callable[..., Proc], redis_url: str, raw_redis: redis.Redis,
        start_worker: Callable[..., Worker]) -> None:
    from tests.models_for_tests import slow_levels

    proc = spawn(redbatch_cmd("worker", "tests.models_for_tests:slow_levels", "--redis-url",
                              redis_url),
                 env=test_env(REDBATCH_HEARTBEAT_INTERVAL_S="0.2", REDBATCH_LEASE_TTL_S="1.0",
                              SLOW_FORWARD_S="30"), name="levels-worker")
    await wait_live(redis_url, "slow_levels")
    await until(lambda: raw_redis.get(protocol.meta_key("slow_levels")) is not None)
    async with Client(redis_url) as client:
        futures = [*await client.submit_many("slow_levels", [1, 2, 3], 30, priority=3),
                   *await client.submit_many("slow_levels", [4, 5], 30, priority=1),
                   *await client.submit_many("slow_levels", [6], 30)]
        await until(lambda: inflight(raw_redis, "slow_levels") > 0)
        os.killpg(proc.popen.pid, signal.SIGKILL)
        start_worker([slow_levels], config=WorkerConfig(
            block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=1.0))
        assert sorted(await asyncio.wait_for(asyncio.gather(*futures), 30)) == [1, 2, 3, 4,
                                                                               5, 6]
    assert inflight(raw_redis, "slow_levels") == 0
    assert raw_redis.llen(protocol.dead_letter_key("slow_levels")) == 0


async def test_the_reaper_requeues_to_the_most_urgent_level_and_rings(
        redis_url: str, raw_redis: redis.Redis) -> None:
    import redis.asyncio as aioredis

    from redbatch.levels import Levels
    from redbatch.worker.reaper import Reaper

    reply_to = protocol.reply_key("reaped", "reap-test")
    entries = [foreign_entry("reaped", v, reply_to) for v in (1, 2)]
    raw_redis.rpush(protocol.inflight_key("reaped", "dead"), *entries)
    raw_redis.zadd(protocol.workers_key("reaped"), {"dead": protocol.now_ms() - 1})
    raw_redis.rpush(protocol.queue_key("reaped", 1), b"queued-before")
    client = aioredis.Redis.from_url(redis_url)
    try:
        reaper = Reaper(client, "reaped", 3, levels=Levels(3, 2))
        assert await reaper.reap("dead") == 2
    finally:
        await client.aclose()
    level1 = raw_redis.lrange(protocol.queue_key("reaped", 1), 0, -1)
    assert [codec.decode(e)["payload"] for e in level1[:2]] == [1, 2]  # at the front
    assert level1[2] == b"queued-before"
    assert all(codec.decode(e)["suspect"] for e in level1[:2])
    assert raw_redis.lrange(protocol.bell_key("reaped"), 0, -1) == [b"1"]
    assert raw_redis.llen(protocol.queue_key("reaped")) == 0  # not the default level's


def foreign_entry(model: str, value: int, reply_to: str) -> bytes:
    now = protocol.now_ms()
    request = protocol.Request(protocol.new_id(), model, now, now + 20_000, reply_to, value)
    return codec.encode(request.to_wire())


async def test_a_foreign_producer_rings_the_bell(start_worker: Callable[..., Worker],
                                                 redis_url: str, raw_redis: redis.Redis
                                                 ) -> None:
    model, release, _ = held_model("foreign", levels=3, default=2)
    release.set()
    start_worker([model], config=SLOW_BLOCK)  # a 5 s block: only the bell wakes it sooner
    await wait_live(redis_url, "foreign")
    await asyncio.sleep(0.5)  # the worker is blocked on the bell by now
    reply_to = protocol.reply_key("foreign", "foreign-test")
    listen = redis.Redis.from_url(redis_url, socket_timeout=20)
    started = time.monotonic()
    raw_redis.rpush(protocol.queue_key("foreign", 3), foreign_entry("foreign", 9, reply_to))
    raw_redis.rpush(protocol.bell_key("foreign"), 1)
    got = await asyncio.to_thread(listen.blpop, [reply_to], 10)
    assert got is not None and time.monotonic() - started < 1.5
    assert protocol.reply_from_wire(codec.decode(got[1])).payload == 9
    # no bell (a producer that knows only the plain queue): served within a block timeout
    raw_redis.rpush(protocol.queue_key("foreign"), foreign_entry("foreign", 8, reply_to))
    got = await asyncio.to_thread(listen.blpop, [reply_to], 10)
    listen.close()
    assert got is not None and protocol.reply_from_wire(codec.decode(got[1])).payload == 8


async def test_a_single_level_model_has_no_bell_and_one_queue(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    model = Model("plain", fn=lambda xs: xs, policy=BatchPolicy(max_batch_size=4))
    start_worker([model])
    await wait_live(redis_url, "plain")
    async with Client(redis_url) as client:
        assert await client.predict_many("plain", list(range(20))) == list(range(20))
        assert await client.predict("plain", 1, priority=1) == 1  # its one level
        with pytest.raises(InvalidPayload):
            await client.predict("plain", 1, priority=2)
        with pytest.raises(InvalidKnob, match="several priority levels"):
            await client.configure("plain", priority_caps=[5])
    names = {k.decode() for k in raw_redis.keys("rb:{plain}:*")}
    assert not any(k.endswith(":bell") or ":queue:p" in k for k in names), names
    assert "priority" not in orjson.loads(raw_redis.get(protocol.meta_key("plain")) or b"{}")
    assert np.all([b"bell" not in k for k in raw_redis.keys("*")])


def test_batch_takes_the_per_level_caps() -> None:
    model = batch(name="capped", priority_levels=2, priority_caps=[10, 2])(lambda xs: xs)
    assert model.priority_caps == [10, 2]
    assert model.meta()["limits"]["priority_caps"] == [10, 2]
    with pytest.raises(ConfigError):  # one cap per level
        batch(name="capped", priority_levels=2, priority_caps=[10])(lambda xs: xs)


async def test_one_level_failing_fails_only_its_own_requests(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """A flush spans levels: Redis refusing level 2's push (its queue key is a string)
    fails level 2's requests, not those it queued at level 1 in the same flush."""
    raw_redis.set(protocol.meta_key("split"), orjson.dumps(
        {"name": "split", "priority": {"levels": 2, "default": 2, "caps": None}}))
    raw_redis.set(protocol.queue_key("split"), b"not a list")  # level 2, the default
    async with Client(redis_url, require_workers=False) as client:
        await client.submit("split", 0, timeout_s=5, priority=1)  # levels now cached
        urgent, backfill = await asyncio.gather(
            client.submit("split", 1, timeout_s=5, priority=1),
            client.submit("split", 2, timeout_s=5, priority=2))
        await asyncio.wait([backfill], timeout=5)
        assert backfill.done() and "WRONGTYPE" in str(backfill.exception())
        await until(lambda: raw_redis.llen(protocol.queue_key("split", 1)) == 2)
        assert not urgent.done()  # queued, waiting for a worker
        urgent.cancel()
