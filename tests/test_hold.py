"""Holding an under-filled length bucket over to the next batch (``worker/hold.py``):
the held items join the next claim's pass of their bucket, their entries move to the
worker's held list in the PUBLISH step, and a reap or a stop never loses them.

The runner is driven step by step (claim, compute, publish) against a real Redis, so
that the claims, and so the passes, are exactly what each test pushes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from redbatch import codec, lua, protocol
from redbatch.demo import TOKENS
from redbatch.lean import script_sha
from redbatch.producer import Client
from redbatch.worker import drain, heartbeat
from redbatch.worker.live import LiveKnobs
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.reaper import Reaper
from redbatch.worker.runner import BatchRunner, Claimed, LeaseLost
from redbatch.worker.stats import PASS_WARMUP
from redbatch.worker.stream_reap import StreamReaper
from tests.conftest import wait_live

MODEL = "held"
REPLY_TO = protocol.reply_key(MODEL, "c1")
pytestmark = pytest.mark.timeout(30)


class Recorder:
    """A variable-length model that answers each input's length and records its passes
    (the lengths in each)."""

    def __init__(self) -> None:
        self.passes: list[list[int]] = []

    def __call__(self, batch: list[Any]) -> list[int]:
        self.passes.append([len(x) for x in batch])
        return [len(x) for x in batch]


def lens_model(recorder: Recorder, max_batch_size: int, auto_batch: bool = True) -> Model:
    policy = BatchPolicy(max_batch_size=max_batch_size, batch_wait_timeout_s=0.0,
                         auto_batch=auto_batch)
    return Model(MODEL, fn=recorder, spec=TOKENS, policy=policy, inline=True)


def entry(length: int, deadline_in_ms: int = 10_000, request_id: str | None = None
          ) -> bytes:
    now = protocol.now_ms()
    request = protocol.Request(request_id or protocol.new_request_id(), MODEL, now,
                               now + deadline_in_ms, REPLY_TO,
                               np.arange(1, length + 1, dtype=np.int64))
    return codec.encode(request.to_wire())


def push(raw: redis.Redis, *lengths: int) -> list[bytes]:
    entries = [entry(n) for n in lengths]
    raw.rpush(protocol.queue_key(MODEL), *entries)
    return entries


def answered(raw: redis.Redis) -> list[protocol.Reply]:
    return [protocol.reply_from_wire(codec.decode(r)) for r in raw.lrange(REPLY_TO, 0, -1)]


def held(raw: redis.Redis, worker_id: str = "w1") -> list[bytes]:
    return list(raw.lrange(protocol.held_key(MODEL, worker_id), 0, -1))


def inflight(raw: redis.Redis, worker_id: str = "w1") -> list[bytes]:
    return list(raw.lrange(protocol.inflight_key(MODEL, worker_id), 0, -1))


@pytest.fixture
async def make_runner(redis_url: str) -> AsyncIterator[Callable[..., BatchRunner]]:
    """A runner of ``lens_model`` whose pass time is measured (1 ms a pass)."""
    conns: list[aioredis.Redis] = []
    with ThreadPoolExecutor(1) as executor:
        def make(model: Model, worker_id: str = "w1", precise: bool = False) -> BatchRunner:
            """``precise``: with a connection of its own for the claims, as a worker
            on plain Redis (CLIENT UNBLOCK ends its waits); without, as on a cluster."""
            conns.append(conn := aioredis.Redis.from_url(redis_url))
            blocking = None
            if precise:
                conns.append(blocking := aioredis.Redis.from_url(redis_url,
                                                                 max_connections=1))
            runner = BatchRunner(conn, model, model.fn, worker_id, executor, 0.05,
                                 blocking=blocking)
            runner.peers_hold_aware = True  # as a heartbeat finding no older worker
            for _ in range(PASS_WARMUP):
                runner.stats.pass_times.add([1], 1.0)
            return runner

        yield make
        for conn in conns:
            await conn.aclose()


async def holding(make_runner: Callable[..., BatchRunner], raw: redis.Redis,
                  precise: bool = False) -> tuple[Recorder, BatchRunner]:
    """A runner (``max_batch_size`` 4) that has held four entries over: 10, 20, 10, 20."""
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4), precise=precise)
    push(raw, 10, 20, 10, 20)
    await step(runner)  # a full claim: the model is busy, both buckets under 4
    assert len(held(raw)) == 4
    return recorder, runner


async def step(runner: BatchRunner) -> Claimed | None:
    """One batch: claim (with what the batch before held), compute, publish."""
    batch = await runner._take()
    if batch is not None:
        await runner._publish_batch(batch, await runner._compute(batch))
    return batch


async def test_two_claims_under_filled_buckets_run_as_one_pass(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=6))
    first = push(raw_redis, 10, 20, 10, 20, 10, 20)  # buckets 16 and 32, 3 items each
    await step(runner)  # a full claim: the model is busy, both buckets under 6
    assert recorder.passes == [] and answered(raw_redis) == []
    assert held(raw_redis) == first and inflight(raw_redis) == []
    push(raw_redis, 11, 21, 12, 22, 13, 23)
    await step(runner)
    assert [sorted(p) for p in recorder.passes] == [[10, 10, 10, 11, 12, 13],
                                                    [20, 20, 20, 21, 22, 23]]
    replies = answered(raw_redis)
    assert len(replies) == 12 and len({r.id for r in replies}) == 12
    assert all(r.ok and r.timings.batch_size == 6 for r in replies)
    assert held(raw_redis) == [] and inflight(raw_redis) == []  # both acked


async def test_a_held_item_runs_in_the_next_batch_even_if_its_bucket_gets_none(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4))
    push(raw_redis, 10, 10, 100, 100)
    await step(runner)
    assert len(held(raw_redis)) == 4
    push(raw_redis, 300, 300, 300, 300)  # a full claim, of another bucket only
    await step(runner)  # bucket 512 full: runs; 16 and 128 were held once: run too
    assert sorted(map(sorted, recorder.passes)) == [[10, 10], [100, 100], [300] * 4]
    assert held(raw_redis) == [] and len(answered(raw_redis)) == 8


async def test_no_hold_when_the_model_is_not_busy(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder, runner = await holding(make_runner, raw_redis)
    push(raw_redis, 30)
    await step(runner)  # one entry came: the held ones run, nothing new is held
    assert held(raw_redis) == [] and len(answered(raw_redis)) == 5
    push(raw_redis, 40)
    await step(runner)  # a lone request: answered in its own batch, not held over
    assert recorder.passes[-1] == [40] and len(answered(raw_redis)) == 6
    assert held(raw_redis) == [] and inflight(raw_redis) == []


async def test_a_lone_request_is_not_held_after_packs_shrank_the_claim(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=8))
    runner._claim_count = 1  # as after multi-row packs: one entry makes a "full" claim
    push(raw_redis, 10)
    batch = await step(runner)
    assert batch is not None and batch.hold == [] and recorder.passes == [[10]]
    assert held(raw_redis) == [] and len(answered(raw_redis)) == 1


async def test_hold_buckets_off_live_stops_holding_and_the_held_items_still_run(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder, runner = await holding(make_runner, raw_redis)
    # `redbatch config held hold_buckets=false`, as the next heartbeat applies it
    LiveKnobs(runner).update({b"hold_buckets": b"false"})
    push(raw_redis, 11, 100, 300, 301)  # full: buckets 128 and 512 would be held
    await step(runner)
    assert sorted(map(sorted, recorder.passes)) == [[10, 10, 11], [20, 20], [100],
                                                    [300, 301]]
    assert held(raw_redis) == [] and inflight(raw_redis) == []
    assert len(answered(raw_redis)) == 8


async def test_an_item_near_its_deadline_is_not_held(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4))
    urgent = entry(20, deadline_in_ms=40)  # less than 3 passes + 50 ms of slack
    raw_redis.rpush(protocol.queue_key(MODEL), entry(10), urgent, entry(10), entry(20))
    await step(runner)
    assert recorder.passes == [[20, 20]]  # its bucket runs now, the other waits
    assert len(held(raw_redis)) == 2 and len(answered(raw_redis)) == 2


async def test_the_slack_counts_two_passes_per_bucket_of_the_batch(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=8))
    runner.stats.pass_times.ms = {8: 10.0}  # 10 ms a pass; 4 buckets: 2*40+10+50 ms
    soon, late = entry(20, deadline_in_ms=120), entry(20, deadline_in_ms=10_000)
    raw_redis.rpush(protocol.queue_key(MODEL), *(entry(n) for n in (10, 100, 300)),
                    soon, late, *(entry(n) for n in (10, 100, 300)))
    await step(runner)  # (3 passes + 50 ms = 80 ms would have held all 4 buckets)
    assert recorder.passes == [[20, 20]] and len(held(raw_redis)) == 6


async def test_the_slack_counts_each_buckets_own_pass_time(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4))
    for _ in range(4):  # bucket 512's passes take 100 ms; the others' 1 ms
        runner.stats.sizer.observe(512, 4, 100.0)
    soon = entry(300, deadline_in_ms=300)  # < 2*(100+1)+100+50 ms
    raw_redis.rpush(protocol.queue_key(MODEL), entry(10), soon, entry(10), entry(300))
    await step(runner)
    assert recorder.passes == [[300, 300]] and len(held(raw_redis)) == 2


async def test_a_request_more_urgent_than_the_default_level_is_not_held(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    policy = BatchPolicy(max_batch_size=4, batch_wait_timeout_s=0.0, auto_batch=True)
    runner = make_runner(Model(MODEL, fn=recorder, spec=TOKENS, policy=policy, inline=True,
                               priority_levels=3, default_priority=2))

    def at(level: int, length: int) -> bytes:
        now = protocol.now_ms()
        return codec.encode(protocol.Request(
            protocol.new_request_id(), MODEL, now, now + 10_000, REPLY_TO,
            np.arange(1, length + 1, dtype=np.int64), priority=level).to_wire())

    raw_redis.rpush(protocol.queue_key(MODEL, 1), at(1, 10), at(1, 10))
    raw_redis.rpush(protocol.queue_key(MODEL), at(2, 20), at(2, 20))
    await step(runner)  # bucket 16 (level 1) runs now; bucket 32 (default level) waits
    assert recorder.passes == [[10, 10]] and len(held(raw_redis)) == 2


async def test_a_held_item_whose_deadline_passed_is_answered_deadline_exceeded(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=2))
    raw_redis.rpush(protocol.queue_key(MODEL), entry(10, 200, "soon"), entry(20, 10_000))
    await step(runner)
    assert len(held(raw_redis)) == 2
    await asyncio.sleep(0.25)
    await step(runner)  # nothing new: the held ones run (one of them too late)
    replies = {r.id: r for r in answered(raw_redis)}
    assert len(replies) == 2 and replies["soon"].error_code == "deadline_exceeded"
    assert recorder.passes == [[20]] and held(raw_redis) == []


async def test_a_reap_requeues_held_entries_first_and_nothing_twice(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis,
        redis_url: str) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4))
    first = push(raw_redis, 10, 20, 10, 20)
    await step(runner)
    second = push(raw_redis, 11, 21, 11, 21)
    batch = await runner._take()  # claimed, with the held ones: then the worker "dies"
    assert batch is not None and held(raw_redis) == first and inflight(raw_redis) == second
    raw_redis.zadd(protocol.workers_key(MODEL), {"w1": protocol.now_ms() - 1})
    conn = aioredis.Redis.from_url(redis_url)
    try:
        assert await Reaper(conn, MODEL, max_attempts=3).reap("w1") == 8
    finally:
        await conn.aclose()
    assert held(raw_redis) == [] and inflight(raw_redis) == []
    queued = [codec.decode(e)[protocol.F_ID] for e in
              raw_redis.lrange(protocol.queue_key(MODEL), 0, -1)]
    assert queued == [codec.decode(e)[protocol.F_ID] for e in first + second]
    with pytest.raises(LeaseLost):  # the old worker's late publish acks nothing
        await runner._publish_batch(batch, await runner._compute(batch))
    other = make_runner(lens_model(Recorder(), max_batch_size=8), "w2")
    await step(other)
    replies = answered(raw_redis)
    assert sorted(r.id for r in replies) == sorted(set(r.id for r in replies))
    assert len({r.id for r in replies}) == 8  # each answered, once


async def test_returning_its_own_entries_returns_the_held_ones(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    runner = make_runner(lens_model(Recorder(), max_batch_size=4))
    first = push(raw_redis, 10, 20, 10, 20)
    await step(runner)
    assert held(raw_redis) == first
    runner._unacked = True
    await runner._return_unacked()  # (after an error: REAP with 'force')
    assert held(raw_redis) == [] and raw_redis.lrange(protocol.queue_key(MODEL), 0, -1) \
        == first


async def test_a_graceful_stop_answers_held_items(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4))
    stop = asyncio.Event()
    runner.claimer.stop = stop
    push(raw_redis, 10, 20, 10, 20)
    await step(runner)
    assert len(held(raw_redis)) == 4
    push(raw_redis, 30)  # queued: left for another worker
    stop.set()
    await asyncio.wait_for(runner._serve_one(stop), 10)
    assert sorted(map(sorted, recorder.passes)) == [[10, 10], [20, 20]]
    assert len(answered(raw_redis)) == 4 and held(raw_redis) == []
    assert raw_redis.llen(protocol.queue_key(MODEL)) == 1


async def test_a_worker_under_load_holds_and_answers_every_request_once(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder()
    start_worker([lens_model(recorder, max_batch_size=4)])
    await wait_live(redis_url, MODEL)
    caplog.set_level(logging.INFO, logger="redbatch.worker")
    held_before = REGISTRY.get_sample_value("redbatch_held_items_total", {"model": MODEL}) or 0
    lengths = [(10, 20, 100)[i % 3] + i % 5 for i in range(96)]
    async with Client(redis_url, pack_rows=1) as client:  # one entry per request
        outputs = await asyncio.gather(*(client.predict(MODEL, np.arange(1, n + 1),
                                                        timeout_s=20) for n in lengths))
        await asyncio.sleep(0.2)  # a second reply to any of them would be in by now
        stats = client.stats()  # (predict resolves on the first reply: count them all)
    assert stats["replies"] == 96 and stats["duplicates"] == 0
    assert not any(raw_redis.llen(key) for key in raw_redis.scan_iter(
        protocol.reply_key(MODEL, "*")))
    assert [int(out) for out in outputs] == lengths
    assert sorted(n for p in recorder.passes for n in p) == sorted(lengths)  # each once
    lines = [r.getMessage() for r in caplog.records if f"model={MODEL} n=" in r.getMessage()]
    assert any(" held=" in line for line in lines) and any(" released=" in line
                                                          for line in lines)
    assert held(raw_redis, start_worker_id(raw_redis)) == []
    logged = sum(int(m) for line in lines for m in re.findall(r" held=(\d+)", line))
    assert REGISTRY.get_sample_value("redbatch_held_items_total",
                                     {"model": MODEL}) == held_before + logged > held_before


async def test_a_draining_sub_queue_stays_open_while_a_held_list_has_entries(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis,
        redis_url: str) -> None:
    _recorder, runner = await holding(make_runner, raw_redis)
    assert inflight(raw_redis) == []
    assert raw_redis.llen(protocol.queue_key(MODEL)) == 0  # only the held list holds them
    conn = aioredis.Redis.from_url(redis_url)
    try:
        assert not await drain.close(conn, runner.model, "w1")
        assert not raw_redis.exists(protocol.closed_key(MODEL))
        await step(runner)  # the held items run: nothing is left
        assert await drain.close(conn, runner.model, "w1")
    finally:
        await conn.aclose()
        raw_redis.delete(protocol.closed_key(MODEL))


async def test_a_streaming_models_reap_reads_no_held_list(
        raw_redis: redis.Redis, redis_url: str) -> None:
    """A streaming model never holds entries over, and its REAP digests the in-flight
    list alone: its reaper does not read a held list (here, a stray entry in one)."""
    raw_redis.rpush(protocol.held_key(MODEL, "dead"), b"stray")
    raw_redis.rpush(protocol.inflight_key(MODEL, "dead"), entry(10))
    conn = aioredis.Redis.from_url(redis_url)
    try:
        assert await StreamReaper(conn, MODEL, max_attempts=3).reap("dead", force=True) == 1
    finally:
        await conn.aclose()
    assert raw_redis.llen(protocol.queue_key(MODEL)) == 1
    assert held(raw_redis, "dead") == [b"stray"]


def start_worker_id(raw: redis.Redis) -> str:
    ids = raw.zrange(protocol.workers_key(MODEL), 0, -1)
    assert len(ids) == 1
    return str(ids[0].decode())


@pytest.mark.parametrize("precise", [False, True])
async def test_held_items_meet_a_short_deadline(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis, precise: bool) -> None:
    """A blocking pop's timeout fires on Redis's hz timer, late: with a connection of its
    own the held batch's next claim ends its wait on time (CLIENT UNBLOCK); without
    (a cluster) it does not block."""
    hz = raw_redis.config_get("hz")["hz"]
    raw_redis.config_set("hz", 1)  # a blocking pop's timeout would fire up to 1 s late
    try:
        for round_ in range(3):
            runner = make_runner(lens_model(Recorder(), max_batch_size=4), f"w{round_}",
                                 precise)
            raw_redis.rpush(protocol.queue_key(MODEL), *[entry(n, deadline_in_ms=150)
                                                         for n in (10, 20, 10, 20)])
            await step(runner)
            assert len(held(raw_redis, f"w{round_}")) == 4
            await step(runner)  # the queue is empty: the held items run now
            assert held(raw_redis, f"w{round_}") == []
    finally:
        raw_redis.config_set("hz", hz)
    assert [r.error_code for r in answered(raw_redis)] == [""] * 12


@pytest.mark.parametrize("small", [False, True])
async def test_the_window_after_a_hold_closes_in_time_for_the_held_items(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis, small: bool) -> None:
    """The next batch's window counted only its new entries' deadlines: with
    ``allow_small_batch`` off it stayed open to a later one's (the held items answered
    ``deadline_exceeded`` 30 s on), and a window raised live meanwhile outlasted them."""
    model = Model(MODEL, fn=Recorder(), spec=TOKENS, inline=True, policy=BatchPolicy(
        max_batch_size=4, batch_wait_timeout_s=0.0, auto_batch=True, allow_small_batch=small))
    runner = make_runner(model, precise=True)
    raw_redis.rpush(protocol.queue_key(MODEL), *[entry(n, deadline_in_ms=1500)
                                                 for n in (10, 100, 10, 100)])
    await step(runner)
    assert len(held(raw_redis)) == 4
    if small:  # a window raised live once they are held
        LiveKnobs(runner).update({b"batch_wait_timeout_s": b"8"})
    raw_redis.rpush(protocol.queue_key(MODEL), entry(10, deadline_in_ms=30_000))
    await step(runner)
    assert [r.error_code for r in answered(raw_redis)] == [""] * 5


# --- older workers of the model (no held lists) ------------------------------------------

async def beat_as(conn: aioredis.Redis, runner: BatchRunner) -> bool:
    """A heartbeat of ``runner``'s worker, applied to it as the worker applies it."""
    beat = await heartbeat.beat(conn, [runner.model], runner._worker_id,
                                {MODEL: (b"{}", b"{}")}, lease_ttl_s=10)
    runner.peers_hold_aware = beat.held_aware[MODEL]
    return runner.peers_hold_aware


def old_worker(raw: redis.Redis, lease_ms: int = 10_000) -> None:
    """A live worker of revision 1.3 or earlier: its lease in ``workers`` alone."""
    raw.zadd(protocol.workers_key(MODEL), {"old": protocol.now_ms() + lease_ms})


async def test_no_hold_while_a_worker_that_does_not_know_held_lists_is_live(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis,
        redis_url: str) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4))
    old_worker(raw_redis)
    conn = aioredis.Redis.from_url(redis_url)
    try:
        assert not await beat_as(conn, runner)
        push(raw_redis, 10, 20, 10, 20)
        await step(runner)  # busy, both buckets under 4: run all the same
        assert held(raw_redis) == [] and len(answered(raw_redis)) == 4
        raw_redis.zrem(protocol.workers_key(MODEL), "old")  # it stopped (or was reaped)
        assert await beat_as(conn, runner)  # the next heartbeat: holding resumes
        push(raw_redis, 10, 20, 10, 20)
        await step(runner)
        assert len(held(raw_redis)) == 4
    finally:
        await conn.aclose()


async def test_holding_resumes_once_the_older_workers_lease_lapses(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis,
        redis_url: str) -> None:
    runner = make_runner(lens_model(Recorder(), max_batch_size=4))
    other = make_runner(lens_model(Recorder(), max_batch_size=4), "w2")
    old_worker(raw_redis, lease_ms=300)
    conn = aioredis.Redis.from_url(redis_url)
    try:
        assert not await beat_as(conn, runner)
        assert not await beat_as(conn, other)  # (a second aware worker changes nothing)
        await asyncio.sleep(0.4)
        assert await beat_as(conn, runner)
    finally:
        await conn.aclose()


async def serve_load(redis_url: str, caplog: pytest.LogCaptureFixture, count: int
                     ) -> list[str]:
    """``count`` requests of three length buckets at once, all answered; the batch log
    lines it brought."""
    caplog.clear()
    lengths = [(10, 20, 100)[i % 3] + i % 5 for i in range(count)]
    async with Client(redis_url, pack_rows=1) as client:  # one entry per request
        outputs = await asyncio.gather(*(client.predict(MODEL, np.arange(1, n + 1),
                                                        timeout_s=20) for n in lengths))
    assert [int(out) for out in outputs] == lengths
    return [r.getMessage() for r in caplog.records if f"model={MODEL} n=" in r.getMessage()]


async def test_a_worker_holds_only_once_the_older_worker_is_gone(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    old_worker(raw_redis, lease_ms=60_000)
    worker = start_worker([lens_model(Recorder(), max_batch_size=4)])
    await wait_live(redis_url, MODEL)
    caplog.set_level(logging.INFO, logger="redbatch.worker")
    lines = await serve_load(redis_url, caplog, 96)
    assert lines and not any(" held=" in line for line in lines)
    old_worker(raw_redis, lease_ms=-1)  # its lease lapses: the worker reaps it
    while raw_redis.zscore(protocol.workers_key(MODEL), "old") is not None \
            or not worker.runners[0].peers_hold_aware:
        await asyncio.sleep(0.05)
    assert any(" held=" in line for line in await serve_load(redis_url, caplog, 96))


async def test_a_new_worker_is_counted_aware_and_leaves_both_sets_on_a_clean_stop(
        raw_redis: redis.Redis, redis_url: str) -> None:
    model = lens_model(Recorder(), max_batch_size=4)
    conn = aioredis.Redis.from_url(redis_url)
    try:
        beat = await heartbeat.beat(conn, [model], "w1", {MODEL: (b"{}", b"{}")}, 10)
        assert beat.held_aware == {MODEL: True}
        assert raw_redis.zscore(protocol.held_aware_key(MODEL), "w1") \
            == raw_redis.zscore(protocol.workers_key(MODEL), "w1")
        await heartbeat.leave(conn, [model], "w1")
    finally:
        await conn.aclose()
    assert not raw_redis.exists(protocol.workers_key(MODEL), protocol.held_aware_key(MODEL))


async def test_the_reaper_removes_a_dead_worker_from_both_sets(
        raw_redis: redis.Redis, redis_url: str) -> None:
    model = lens_model(Recorder(), max_batch_size=4)
    conn = aioredis.Redis.from_url(redis_url)
    try:
        await heartbeat.beat(conn, [model], "dead", {MODEL: (b"{}", b"{}")}, 0.05)
        raw_redis.rpush(protocol.held_key(MODEL, "dead"), entry(10))
        await asyncio.sleep(0.1)  # its lease lapsed
        assert await Reaper(conn, MODEL, max_attempts=3).reap("dead") == 1
    finally:
        await conn.aclose()
    assert raw_redis.llen(protocol.queue_key(MODEL)) == 1
    assert raw_redis.zscore(protocol.workers_key(MODEL), "dead") is None
    assert raw_redis.zscore(protocol.held_aware_key(MODEL), "dead") is None


# --- sub-queues ------------------------------------------------------------------------

SUB1 = protocol.sub_queue_tag(MODEL, 1)


def sub_entries(tag: str, lengths: tuple[int, ...], prefix: str) -> list[bytes]:
    """Entries of sub-queue ``tag`` (their reply list in its slot), ids ``prefix-i``."""
    now = protocol.now_ms()
    return [codec.encode(protocol.Request(
        f"{prefix}-{i}", MODEL, now, now + 10_000, protocol.reply_key(tag, "c1"),
        np.arange(1, n + 1, dtype=np.int64)).to_wire()) for i, n in enumerate(lengths)]


def sub_replies(raw: redis.Redis) -> list[str]:
    return [protocol.reply_from_wire(codec.decode(r)).id
            for tag in (MODEL, SUB1) for r in raw.lrange(protocol.reply_key(tag, "c1"), 0, -1)]


async def test_no_hold_while_a_reopened_sub_queue_is_drained(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis) -> None:
    recorder = Recorder()
    runner = make_runner(lens_model(recorder, max_batch_size=4))
    runner.claimer.reopen(1)  # a reap put entries back into sub-queue 1 (count stays 1)
    raw_redis.rpush(protocol.queue_key(SUB1), *sub_entries(SUB1, (10, 20, 10, 20), "s1"))
    first = await step(runner)
    assert first is not None and first.source.tag == SUB1 and first.hold == []
    raw_redis.rpush(protocol.queue_key(MODEL), *sub_entries(MODEL, (11, 21, 11, 21), "s0"))
    for _ in range(3):  # (a held item merged into sub-queue 0's batch: LeaseLost here)
        await step(runner)
    ids = sub_replies(raw_redis)
    assert sorted(ids) == sorted({f"s{q}-{i}" for q in (0, 1) for i in range(4)})
    assert held(raw_redis) == [] and raw_redis.llen(protocol.held_key(SUB1, "w1")) == 0


@pytest.mark.parametrize("change", ["reopen", "grow"])
async def test_held_items_run_alone_once_the_claimer_reads_several_sub_queues(
        make_runner: Callable[..., BatchRunner], raw_redis: redis.Redis, change: str) -> None:
    recorder, runner = await holding(make_runner, raw_redis, precise=True)
    if change == "reopen":
        runner.claimer.reopen(1)  # a reap requeued into sub-queue 1 meanwhile
    else:
        runner.model.sub_queues = 2  # a live change (applied at the next claim)
    push(raw_redis, 11, 21)
    batch = await step(runner)  # the held items alone: nothing claimed beside them
    assert batch is not None and batch.claimed == 0 and batch.released[0] == 4
    assert sorted(map(sorted, recorder.passes)) == [[10, 10], [20, 20]]
    await step(runner)
    assert len(answered(raw_redis)) == 6 and held(raw_redis) == []


# --- the scripts -----------------------------------------------------------------------

INFLIGHT, HELD = protocol.inflight_key(MODEL, "w1"), protocol.held_key(MODEL, "w1")


def sha(entries: list[bytes]) -> str:
    return hashlib.sha1(b"".join(entries)).hexdigest()


def publish_hold(raw: redis.Redis, ack: list[bytes], released: list[bytes], digest: str,
                 positions: list[int]) -> list[object]:
    keys = [INFLIGHT, protocol.dead_letter_key(MODEL), HELD]
    argv: list[object] = [len(ack), protocol.REPLY_TTL_S, sha(ack), len(released), digest,
                          60_000, len(positions), *positions, 3600, 0]
    raw.script_load(lua.PUBLISH_HOLD)
    return list(raw.evalsha(script_sha(lua.PUBLISH_HOLD), len(keys), *keys, *argv))


def test_publish_hold_moves_held_entries_and_trims_the_released_ones(
        raw_redis: redis.Redis) -> None:
    raw_redis.rpush(HELD, b"h1", b"h2")
    raw_redis.rpush(INFLIGHT, b"a", b"b", b"c", b"next")
    assert publish_hold(raw_redis, [b"a", b"b", b"c"], [b"h1", b"h2"], sha([b"h1", b"h2"]),
                        [1, 3])[0] == 1
    assert raw_redis.lrange(HELD, 0, -1) == [b"a", b"c"]
    assert raw_redis.lrange(INFLIGHT, 0, -1) == [b"next"]
    assert 0 < raw_redis.pttl(HELD) <= 60_000


def test_publish_hold_refuses_when_the_held_list_changed(raw_redis: redis.Redis) -> None:
    raw_redis.rpush(HELD, b"h1", b"h2")
    raw_redis.rpush(INFLIGHT, b"a", b"b")
    assert publish_hold(raw_redis, [b"a", b"b"], [b"h1", b"h2"], sha([b"h1", b"x"]),
                        [2])[0] == 0  # a reaper took the held list over
    assert raw_redis.lrange(HELD, 0, -1) == [b"h1", b"h2"]  # nothing trimmed or moved
    assert raw_redis.lrange(INFLIGHT, 0, -1) == [b"a", b"b"]


def test_reap_checks_the_held_list_too(raw_redis: redis.Redis) -> None:
    raw_redis.rpush(HELD, b"h1")
    raw_redis.rpush(INFLIGHT, b"a")
    queue = protocol.queue_key(MODEL)
    keys = [INFLIGHT, queue, protocol.dead_letter_key(MODEL), INFLIGHT, INFLIGHT, INFLIGHT,
            queue, HELD]
    raw_redis.script_load(lua.REAP)

    def reap(digest: str) -> int:
        args = ["w1", "force", digest, protocol.REPLY_TTL_S, 2, b"h1", b"a", 3600, 0]
        return int(raw_redis.evalsha(script_sha(lua.REAP), len(keys), *keys, *args))

    assert reap(sha([b"a"])) == -2  # the in-flight list alone: the held entry changed it
    assert raw_redis.llen(queue) == 0
    assert reap(sha([b"h1", b"a"])) == 2
    assert raw_redis.lrange(queue, 0, -1) == [b"h1", b"a"]
    assert raw_redis.exists(HELD, INFLIGHT) == 0
