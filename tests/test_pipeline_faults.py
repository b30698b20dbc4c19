"""Pipelines under faults: a bad record, a refused key, a failing duty or a stale
registry cost the request at fault alone, never a stage's hand-off, another request,
an ordinary model's submit or the worker's clean exit."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from redbatch import Client, RedisSettings, codec, defaults, lua, protocol
from redbatch.errors import ConfigError, DeadlineExceeded, QueueFull
from redbatch.lean import LeanLink
from redbatch.pipelines import Pipeline
from redbatch.pipelines.context import Context
from redbatch.pipelines.duty import PipelineDuty
from redbatch.pipelines.mover import Mover
from redbatch.protocol import Reply
from redbatch.registry import LiveCache
from redbatch.worker.model import Model
from redbatch.worker.process import Worker
from tests.conftest import FAST_WORKER, connected, ping_once_ended, wait_live
from tests.test_pipelines import CALC, POLICY, inc

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_url)
    yield conn
    await conn.aclose()


def ctx_json(reply_to: str, route: Any = (), **extra: Any) -> bytes:
    ctx = Context("calc", list(route), reply_to, protocol.now_ms() + 10_000,
                  protocol.now_ms())
    return orjson.dumps({**orjson.loads(ctx.to_json()), **extra})


async def put(conn: aioredis.Redis, stage: str, request_id: str, ctx: bytes,
              payload: Any = 1) -> None:
    """A reply of ``stage`` to a pipeline request, in its outbox, with its context."""
    await conn.set(protocol.context_key(stage, request_id), ctx)
    await conn.rpush(protocol.outbox_key(stage),
                     codec.encode(Reply(request_id, True, payload=payload).to_wire()))


def got(raw: redis.Redis, reply_to: str) -> Reply:
    entry = raw.lpop(reply_to)
    assert entry is not None, f"no reply in {reply_to}"
    return protocol.reply_from_wire(codec.decode(entry))


async def hand_on(conn: aioredis.Redis, stage: str) -> Mover:
    """One mover step of ``stage``, and a second one (it marks the first done)."""
    mover = Mover(conn, stage, LiveCache(conn), None, 0.1)
    await mover.step()
    await mover.step()
    return mover


async def test_a_bad_context_costs_its_own_record_alone(
        client: aioredis.Redis, raw_redis: redis.Redis) -> None:
    """A context that cannot be read (no caller named), one that cannot be planned (a
    caller named: told why) and one from a newer version (a field unknown here:
    handed on) beside a good one: each handled on its own, all marked done."""
    lists = {name: protocol.reply_key("calc", name) for name in ("broken", "newer", "good")}
    await put(client, "inc", "poison", b'{"pipeline":"calc","newfield":1}')
    await put(client, "inc", "broken", ctx_json(lists["broken"], route=[], stages=7))
    await put(client, "inc", "newer", ctx_json(lists["newer"], newfield=1))
    await put(client, "inc", "good", ctx_json(lists["good"]))
    await hand_on(client, "inc")
    assert got(raw_redis, lists["good"]).payload == 1
    assert got(raw_redis, lists["newer"]).payload == 1
    broken = got(raw_redis, lists["broken"])
    assert not broken.ok and "stage 'inc' failed" in (broken.error_message or "")
    assert raw_redis.zcard(protocol.handoff_key("inc")) == 0
    assert raw_redis.llen(protocol.outbox_key("inc")) == 0


async def test_an_input_too_large_for_the_next_stage_is_refused_alone(
        client: aioredis.Redis, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_ENTRY_BYTES", 1000)
    big, small = protocol.reply_key("calc", "big"), protocol.reply_key("calc", "small")
    await put(client, "inc", "big", ctx_json(big, route=["dbl"]), payload="x" * 2000)
    await put(client, "inc", "small", ctx_json(small, route=["dbl"]), payload=2)
    await hand_on(client, "inc")
    refused = got(raw_redis, big)
    assert refused.error_code == "invalid_payload" and "limit" in (refused.error_message or "")
    assert raw_redis.llen(protocol.queue_key("dbl")) == 1  # the small one went on
    assert raw_redis.llen(small) == 0


async def test_a_final_reply_over_an_entrys_limit_is_a_model_error(
        client: aioredis.Redis, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last stage's reply fitted; with the stages' timings added the final one did
    not: the caller's client dropped it and waited out its deadline."""
    monkeypatch.setattr(protocol, "MAX_ENTRY_BYTES", 1000)
    big, small = protocol.reply_key("calc", "big"), protocol.reply_key("calc", "small")
    await put(client, "dbl", "big", ctx_json(big), payload="x" * 990)
    await put(client, "dbl", "small", ctx_json(small), payload=8)
    await hand_on(client, "dbl")
    refused = got(raw_redis, big)
    assert refused.error_code == "model_error"
    assert "over the 1000-byte limit" in refused.error_message
    assert got(raw_redis, small).payload == 8


@pytest.mark.parametrize("key", ["outbox", "handoff"])
async def test_a_stage_key_of_another_type_is_deleted_not_fatal_for_good(
        client: aioredis.Redis, raw_redis: redis.Redis, key: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """``SET rb:{inc}:handoff x`` (or the outbox) failed every take (WRONGTYPE, retried
    forever): every request of the pipeline waited out its deadline, for good."""
    bad = protocol.outbox_key("inc") if key == "outbox" else protocol.handoff_key("inc")
    raw_redis.set(bad, b"x")
    mover = Mover(client, "inc", LiveCache(client), None, 0.1)
    with caplog.at_level(logging.ERROR, "redbatch.pipelines"):
        assert await mover.step() == 0
    assert raw_redis.exists(bad) == 0
    assert "held another type of value" in caplog.text
    reply_to = protocol.reply_key("calc", "after")
    await put(client, "inc", "after", ctx_json(reply_to))
    await hand_on(client, "inc")
    assert got(raw_redis, reply_to).payload == 1


def test_a_pipeline_naming_a_pipeline_as_a_stage_is_refused() -> None:
    """Its hand-offs went to the other pipeline's name, a queue nothing serves: every
    request waited out its deadline."""
    nested = Pipeline("nested", ["inc", "calc"])
    with pytest.raises(ConfigError, match="stage 'calc' is a pipeline"):
        Worker([inc()], RedisSettings(), FAST_WORKER, pipelines=[CALC, nested])


async def test_a_stored_pipeline_naming_a_pipeline_is_not_served(
        redis_url: str, raw_redis: redis.Redis) -> None:
    from redbatch.errors import NoLiveWorkers, UnknownModel
    from redbatch.pipelines.definition import registry_mapping

    nested = Pipeline("nested", ["inc", "calc"])
    raw_redis.hset(protocol.PIPELINES_KEY, mapping=registry_mapping([CALC, nested]))
    stop = asyncio.Event()
    task = asyncio.create_task(Worker([inc()], RedisSettings(redis_url), FAST_WORKER).run(stop))
    try:
        await wait_live(redis_url, "calc", timeout_s=5)  # (both in the same tick)
        assert raw_redis.zcard(protocol.workers_key("nested")) == 0
        async with Client(redis_url) as client:
            with pytest.raises((NoLiveWorkers, UnknownModel)):
                await client.predict("nested", 1, timeout_s=5)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_refusal_raised_for_a_whole_group_is_retried_command_by_command(
        client: aioredis.Redis, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster link raises one command's error for its whole group: each command is
    then sent alone, the refused one logged, the others delivered."""
    real = LeanLink.pipeline_replies

    async def as_a_cluster(self: LeanLink, *commands: Any) -> list[Any]:
        replies = await real(self, *commands)
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
        return replies

    monkeypatch.setattr(LeanLink, "pipeline_replies", as_a_cluster)
    bad, good = protocol.reply_key("calc", "bad"), protocol.reply_key("calc", "good")
    raw_redis.set(bad, "not a list")
    await put(client, "dbl", "r-bad", ctx_json(bad))
    await put(client, "dbl", "r-good", ctx_json(good))
    await hand_on(client, "dbl")
    assert got(raw_redis, good).payload == 1
    assert raw_redis.zcard(protocol.handoff_key("dbl")) == 0


async def test_a_merge_drops_its_parts_once_sent(client: aioredis.Redis,
                                                  raw_redis: redis.Redis) -> None:
    parts = protocol.parts_key("mrg", "r1")
    raw_redis.eval(lua.HANDOFF_PART, 1, parts, "fa",
                   codec.encode({protocol.F_PART: 10}), 2, 10_000)
    ctx = ctx_json(protocol.reply_key("calc", "c"), route=["mrg"], branch="fb",
                   branches=["fa", "fb"])
    await put(client, "fb", "r1", ctx, payload=20)
    await hand_on(client, "fb")
    entry = codec.decode(raw_redis.lpop(protocol.queue_key("mrg")))
    assert entry["payload"] == {"fa": 10, "fb": 20}
    assert not raw_redis.exists(parts)


async def test_a_mover_survives_a_bug_and_a_dead_one_is_started_again(
        client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    real_step, steps = Mover.step, []

    async def buggy_step(self: Mover) -> int:
        steps.append(1)
        if len(steps) == 1:
            raise RuntimeError("a bug")
        return await real_step(self)

    monkeypatch.setattr(Mover, "step", buggy_step)
    duty = PipelineDuty(client, [inc()], "w1", [CALC], 0.1, 2.0, wait_s=0.1)
    stop = asyncio.Event()
    await duty.tick(stop)
    for _ in range(100):
        if len(steps) > 1:
            break
        await asyncio.sleep(0.02)
    assert len(steps) > 1 and "a bug" in caplog.text  # logged, and on it went
    task = duty._tasks["inc"]
    task.cancel()  # a mover task that ended anyhow: started again by the next tick
    await asyncio.gather(task, return_exceptions=True)
    with caplog.at_level(logging.ERROR):
        await duty.tick(stop)
    assert not duty._tasks["inc"].done() and "started again" in caplog.text
    stop.set()
    await asyncio.gather(*duty._tasks.values())


async def test_a_mover_whose_step_swallowed_its_cancel_still_ends(
        client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that swallows the cancel (as Python 3.11's ``asyncio.wait_for`` can,
    inside redis-py) returns normally: the hand-off sees the pending cancel at its next
    turn and ends, instead of going on for ever (a stopped duty would wait on it)."""
    steps = 0

    async def swallowing_step(self: Mover) -> int:
        nonlocal steps
        steps += 1
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        return 1

    monkeypatch.setattr(Mover, "step", swallowing_step)
    live = LiveCache(client)
    task = asyncio.create_task(Mover(client, "inc", live, None, 0.1).run(asyncio.Event()))
    await asyncio.sleep(0.05)
    task.cancel()
    done, _pending = await asyncio.wait([task], timeout=5)
    await live.aclose()
    assert done and task.cancelled() and steps == 1


async def test_a_failing_duty_never_skips_the_workers_clean_exit(
        redis_url: str, raw_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick that fails (a bug) is logged and the next one runs; a duty that dies
    still lets the worker leave its leases."""
    real_tick, ticks = PipelineDuty.tick, []

    async def failing_tick(self: PipelineDuty, stop: asyncio.Event) -> None:
        ticks.append(1)
        if len(ticks) == 1:
            raise RuntimeError("a bad tick")
        await real_tick(self, stop)

    monkeypatch.setattr(PipelineDuty, "tick", failing_tick)
    raw_redis.set(protocol.meta_key("dbl"), b"not json")  # the last stage's: corrupt
    stop = asyncio.Event()
    worker = Worker([inc()], RedisSettings(redis_url), FAST_WORKER, pipelines=[CALC])
    task = asyncio.create_task(worker.run(stop))
    await wait_live(redis_url, "calc", timeout_s=5)

    async def dead_duty(self: PipelineDuty, stop: asyncio.Event) -> None:
        raise RuntimeError("a dead duty")

    monkeypatch.setattr(PipelineDuty, "run", dead_duty)
    worker2 = Worker([inc()], RedisSettings(redis_url), FAST_WORKER, worker_id="w2")
    stop2 = asyncio.Event()
    task2 = asyncio.create_task(worker2.run(stop2))
    await wait_live(redis_url, "inc", timeout_s=5)
    stop.set()
    stop2.set()
    await asyncio.wait_for(asyncio.gather(task, task2), 10)
    assert raw_redis.zscore(protocol.workers_key("inc"), "w2") is None  # it left


async def test_an_ordinary_submit_never_waits_on_the_pipeline_registry(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Once the book answered for a model, a stale book is read in the background: a
    registry that does not answer, or fails, never holds up or fails that model's
    submits; a name the book never answered for waits, bounded by its deadline."""
    stop = asyncio.Event()
    worker = Worker([inc()], RedisSettings(redis_url), FAST_WORKER)
    task = asyncio.create_task(worker.run(stop))
    await wait_live(redis_url, "inc", timeout_s=5)
    async with Client(redis_url) as client:
        assert await client.predict("inc", 1, timeout_s=5) == 2
        book = client._pipelines
        stalled = asyncio.Event()

        async def stalled_read() -> None:
            await stalled.wait()

        book._refresh_s = 0.0
        book._read = stalled_read  # type: ignore[method-assign]
        assert await asyncio.wait_for(client.predict("inc", 2, timeout_s=5), 5) == 3
        await book.aclose()
        del book._read
        raw_redis.delete(protocol.PIPELINES_KEY)
        raw_redis.set(protocol.PIPELINES_KEY, "not a hash")  # every read fails
        for x in range(3, 6):
            assert await client.predict("inc", x, timeout_s=5) == x + 1
    async with Client(redis_url, require_workers=False) as fresh:
        never = asyncio.Event()

        async def never_read() -> None:
            await never.wait()

        fresh._pipelines._read = never_read  # type: ignore[method-assign]
        with pytest.raises(DeadlineExceeded, match="looking up pipeline"):
            await asyncio.wait_for(fresh.submit("other", 1, timeout_s=0.2), 5)
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_registry_read_in_flight_ends_before_the_client_closes(
        redis_url: str) -> None:
    """A read of the pipeline registry still running when the client closes ends
    before its connection pool does: one that went on after (a cancel that redis-py
    turned into a broken connection, and the read's retry on a fresh one) would leave
    a live connection in the closed pool, warned of when it is collected."""
    client = Client(redis_url, require_workers=False)
    await client.start()
    pool = client.redis.connection_pool
    reading = asyncio.Event()
    client._pipelines._read = functools.partial(  # type: ignore[method-assign]
        ping_once_ended, client.redis, reading)
    assert not client._pipelines.settled("calc")
    flight = client._pipelines._start_read()
    await reading.wait()
    await client.close()
    assert flight.cancelled() and connected(pool) == 0


def test_a_stage_a_pipeline_cannot_route_to_is_refused() -> None:
    versioned = Model("inc", fn=lambda xs: xs, policy=POLICY, version="2")
    split = Model("inc", fn=lambda xs: xs, policy=POLICY, sub_queues=2)
    with pytest.raises(ConfigError, match="served here as version 'inc@2'"):
        Worker([versioned], RedisSettings(), FAST_WORKER, pipelines=[CALC])
    with pytest.raises(ConfigError, match="sub_queues=2"):
        Worker([split], RedisSettings(), FAST_WORKER, pipelines=[CALC])
    Worker([versioned], RedisSettings(), FAST_WORKER,
           pipelines=[Pipeline("calc", ["inc@2", "dbl"])])  # the served name: routed


async def test_a_full_first_stage_refuses_the_pipelines_requests(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """A pipeline request enters its first stage under that stage's queue cap (the
    client's, or the caller's own): refused with ``QueueFull``, never queued."""
    raw_redis.hset(protocol.PIPELINES_KEY, "calc", CALC.to_json())
    async with Client(redis_url, require_workers=False, max_queue_len=3) as client:
        futures = await client.submit_many("calc", [1, 2, 3, 4], timeout_s=5)
        refused = [f for f in futures if f.done()]  # (entered side by side: any one)
        assert len(refused) == 1
        with pytest.raises(QueueFull, match="stage 'inc' is full"):
            await refused[0]
        own = await client.submit("calc", 5, timeout_s=5, max_queue_len=1)
        assert own.done()
        with pytest.raises(QueueFull):
            await own
    assert raw_redis.llen(protocol.queue_key("inc")) == 3


async def test_a_full_next_stage_answers_the_request_with_an_error(
        client: aioredis.Redis, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hop into a stage whose queue holds the cap is refused there: its caller gets a
    ``queue_full`` error naming that stage, and the record is done."""
    monkeypatch.setattr(defaults, "MAX_QUEUE_LEN", 1)
    first, second = protocol.reply_key("calc", "a"), protocol.reply_key("calc", "b")
    await put(client, "inc", "a", ctx_json(first, route=["dbl"]))
    await put(client, "inc", "b", ctx_json(second, route=["dbl"]))
    await hand_on(client, "inc")
    assert raw_redis.llen(protocol.queue_key("dbl")) == 1
    refused = got(raw_redis, second)
    assert refused.error_code == "queue_full" and "'dbl'" in (refused.error_message or "")
    assert raw_redis.zcard(protocol.handoff_key("inc")) == 0


async def test_a_hop_takes_the_next_stages_own_queue_cap(
        client: aioredis.Redis, raw_redis: redis.Redis) -> None:
    """A stage whose own ``max_queue_len`` is below the gateway's default caps its
    hops: the ones past it are answered ``queue_full`` (cap 2) at once, well before
    their deadline, and the stage's queue never holds more."""
    dbl = Model("dbl", fn=lambda xs: xs, policy=POLICY, max_queue_len=2)
    await client.set(protocol.meta_key("dbl"), orjson.dumps(dbl.meta()))
    callers = [protocol.reply_key("calc", f"c{i}") for i in range(4)]
    for i, reply_to in enumerate(callers):
        await put(client, "inc", f"r{i}", ctx_json(reply_to, route=["dbl"]))
    await hand_on(client, "inc")
    assert raw_redis.llen(protocol.queue_key("dbl")) == 2
    refused = [got(raw_redis, c) for c in callers if raw_redis.llen(c)]
    assert len(refused) == 2
    for reply in refused:
        assert reply.error_code == "queue_full"
        assert "stage 'dbl' is full (cap 2)" in (reply.error_message or "")


async def test_a_hop_takes_the_next_stages_cap_of_the_requests_level(
        client: aioredis.Redis, raw_redis: redis.Redis) -> None:
    """A stage's ``priority_caps`` cap its hops as they cap a direct enqueue: a level's
    own queue never holds more than its cap, and the stage's cap counts the entries of
    that level and the more urgent ones."""
    dbl = Model("dbl", fn=lambda xs: xs, policy=POLICY, max_queue_len=3,
                priority_levels=2, default_priority=2, priority_caps=[3, 1])
    await client.set(protocol.meta_key("dbl"), orjson.dumps(dbl.meta()))
    urgent, low = dbl.priorities.queues("dbl")

    async def hop(name: str, level: int) -> Reply | None:
        reply_to = protocol.reply_key("calc", name)
        await put(client, "inc", name, ctx_json(reply_to, route=["dbl"], priority=level))
        await hand_on(client, "inc")
        return got(raw_redis, reply_to) if raw_redis.llen(reply_to) else None

    assert [await hop(f"u{i}", 1) for i in range(2)] == [None, None]
    assert await hop("low", 2) is None
    refused = await hop("low2", 2)  # level 2 holds its cap, 1
    assert refused is not None and refused.error_code == "queue_full"
    assert "stage 'dbl' at priority 2 is full (cap 1)" in (refused.error_message or "")
    assert await hop("u2", 1) is None  # the less urgent entries never count against it
    raw_redis.delete(low)
    refused = await hop("low3", 2)  # level 1 holds the stage's cap, 3
    assert refused is not None and "stage 'dbl' is full (cap 3)" in (refused.error_message
                                                                      or "")
    assert (raw_redis.llen(urgent), raw_redis.llen(low)) == (3, 0)


async def test_a_stage_cap_is_the_one_in_effect(client: aioredis.Redis) -> None:
    """The cap read is ``limits.max_queue_len`` (live overrides included), never the
    model's own default of the knob: an override to none means none."""
    dbl = Model("dbl", fn=lambda xs: xs, policy=POLICY, max_queue_len=2)
    dbl.apply_knobs({"max_queue_len": None})
    meta = dbl.meta()
    assert meta["limits"]["max_queue_len"] is None and meta["defaults"]["max_queue_len"] == 2
    await client.set(protocol.meta_key("dbl"), orjson.dumps(meta))
    assert (await LiveCache(client).get("dbl")).max_queue_len is None
    dbl.apply_knobs({"max_queue_len": 7})
    await client.set(protocol.meta_key("dbl"), orjson.dumps(dbl.meta()))
    assert (await LiveCache(client, 0).get("dbl")).max_queue_len == 7


@pytest.mark.parametrize(("limits", "cap"), [
    ('{"default_timeout_s":1.0,"max_queue_len":5}', 5),  # not the first field
    ('{"max_queue_len": 5 , "default_timeout_s":1.0}', 5),
    ('{"default_timeout_s":1.0}', None),
    ('{"max_queue_len":1e4}', None),  # not an integer: no cap read, never 1
])
async def test_a_stage_cap_is_read_in_any_field_order(
        client: aioredis.Redis, limits: str, cap: int | None) -> None:
    """A foreign worker's meta may list ``limits``' fields in any order; a cap that is
    not an integer is none (never its leading digits)."""
    meta = f'{{"name":"dbl","policy":{{"x":{{"y":1}}}},"limits":{limits}}}'
    await client.set(protocol.meta_key("dbl"), meta)
    assert (await LiveCache(client, 0).get("dbl")).max_queue_len == cap


async def test_a_pipeline_never_takes_a_served_models_name(
        client: aioredis.Redis, raw_redis: redis.Redis) -> None:
    with pytest.raises(ConfigError, match="the pipeline's name"):
        Worker([inc(), Model("calc", fn=lambda xs: xs, policy=POLICY)], RedisSettings(),
               FAST_WORKER, pipelines=[CALC])
    model_meta = orjson.dumps({"name": "calc", "inputs": []})  # a model's, elsewhere
    raw_redis.set(protocol.meta_key("calc"), model_meta)
    duty = PipelineDuty(client, [inc()], "w1", [CALC], 0.1, 2.0, wait_s=0.1)
    stop = asyncio.Event()
    await duty.tick(stop)
    stop.set()
    await asyncio.gather(*duty._tasks.values())
    assert raw_redis.get(protocol.meta_key("calc")) == model_meta
    assert raw_redis.zscore(protocol.workers_key("calc"), "w1") is None


async def test_a_worker_with_long_blocking_waits_leaves_its_pipelines_at_a_stop(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """Its movers' idle waits (``block_timeout_s``, 3.5 s here) held their last steps
    past the stop's 3 s for the duty: the duty was cancelled before it left, and the
    pipeline's lease stayed listed for ``lease_ttl_s``."""
    import dataclasses
    import time

    config = dataclasses.replace(FAST_WORKER, block_timeout_s=3.5)
    stop = asyncio.Event()
    worker = Worker([inc()], RedisSettings(redis_url), config, pipelines=[CALC])
    task = asyncio.create_task(worker.run(stop))
    await wait_live(redis_url, "calc", timeout_s=5)
    await asyncio.sleep(0.5)  # (the movers in their idle waits)
    stop.set()
    started = time.monotonic()
    await asyncio.wait_for(task, 15)
    assert time.monotonic() - started < 3.5 + 1.5  # (the batch loop's own claim: 3.5 s)
    assert raw_redis.zscore(protocol.workers_key("calc"), worker.worker_id) is None
