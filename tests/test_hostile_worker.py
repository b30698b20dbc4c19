"""Hostile and clumsy queue entries against a worker: none may stop a model, take
innocent batch-mates down with it, fill Redis with dead letters, or fail unseen."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import pytest
import redis

from redbatch import Client, WorkerCrashed, batch, codec, defaults, protocol
from redbatch.config import WorkerConfig
from redbatch.worker.forward import Forwarder
from redbatch.worker.model import Model
from redbatch.worker.process import Worker
from tests.conftest import Proc, redbatch_cmd, test_env, wait_live
from tests.crash_models import KILLER_INPUT
from tests.test_packing import doubler, inputs
from tests.test_reliability import FAST_LEASE, TAKEOVER, inflight_total, read_reply

pytestmark = pytest.mark.e2e
HUGE_DEADLINES = [2**63 - 1, 2**64 - 1]  # "no deadline" as Long.MAX_VALUE, or as uint64


@batch(name="echo", max_batch_size=8, batch_wait_timeout_s=0.05)
def echo(xs: list[int]) -> list[int]:
    return xs


def entry(value: Any, reply_to: str, model: str = "echo", *, deadline_ms: int | None = None,
          attempt: int = 0) -> tuple[str, bytes]:
    """A raw msgpack entry, as a foreign client would RPUSH it (any deadline)."""
    now = protocol.now_ms()
    request_id = protocol.new_id()
    wire = protocol.Request(request_id, model, now, now + 30_000, reply_to, value,
                            attempt).to_wire()
    if deadline_ms is not None:
        wire[protocol.F_DEADLINE_MS] = deadline_ms
    return request_id, msgpack.packb(wire, use_bin_type=True)


def ghost_holds(raw: redis.Redis, model: str, *entries: bytes) -> None:
    """A dead worker ("ghost") whose lease expired while it held ``entries``."""
    raw.rpush(protocol.inflight_key(model, "ghost"), *entries)
    raw.zadd(protocol.workers_key(model), {"ghost": protocol.now_ms() - 1})


async def still_serves(redis_url: str, value: int = 4242) -> None:
    await wait_live(redis_url, "echo")
    async with Client(redis_url) as client:
        assert await client.predict("echo", value, timeout_s=10) == value


# --- one entry cannot stop a model ---------------------------------------------------
@pytest.mark.parametrize("deadline_ms", HUGE_DEADLINES)
async def test_a_huge_deadline_does_not_stop_the_model(
        raw_redis: redis.Redis, redis_url: str, start_worker: Callable[..., Worker],
        deadline_ms: int) -> None:
    reply_to = protocol.reply_key("echo", "huge")
    request_id, raw = entry(7, reply_to, deadline_ms=deadline_ms)
    raw_redis.rpush(protocol.queue_key("echo"), raw)
    start_worker([echo], config=TAKEOVER)
    reply = await asyncio.to_thread(read_reply, raw_redis, reply_to)
    assert reply.id == request_id  # answered (with 7, or refused as invalid): never wedged
    assert reply.payload == 7 or reply.error_code == "invalid_payload"
    await still_serves(redis_url)
    assert inflight_total(raw_redis, "echo") == 0


async def test_a_reply_key_of_another_type_fails_that_request_alone(
        raw_redis: redis.Redis, redis_url: str, start_worker: Callable[..., Worker]) -> None:
    """Someone SET a caller's reply key as a string: Redis refuses to push the reply
    (WRONGTYPE).  That request is dead-lettered; its batch-mate is answered."""
    spoiled, good = protocol.reply_key("echo", "spoiled"), protocol.reply_key("echo", "good")
    raw_redis.set(spoiled, "not a list")
    bad_id, bad = entry(1, spoiled)
    _good_id, fine = entry(2, good)
    raw_redis.rpush(protocol.queue_key("echo"), bad, fine)  # one batch, the bad one first
    start_worker([echo], config=TAKEOVER)
    assert (await asyncio.to_thread(read_reply, raw_redis, good)).payload == 2
    await still_serves(redis_url)
    dead = raw_redis.lrange(protocol.dead_letter_key("echo"), 0, -1)
    assert [codec.decode(d)[protocol.F_ID] for d in dead] == [bad_id]
    assert raw_redis.get(spoiled) == b"not a list" and inflight_total(raw_redis, "echo") == 0


@pytest.mark.parametrize("hostility", ["huge_deadline", "wrong_type_reply_key"])
async def test_the_reaper_is_not_stopped_by_one_entry(
        raw_redis: redis.Redis, redis_url: str, start_worker: Callable[..., Worker],
        hostility: str) -> None:
    """A dead worker held a request at its last attempt (its caller is owed
    ``worker_crashed``) whose reply cannot be sent as is, and an innocent one."""
    reply_to, good = protocol.reply_key("echo", "reaped"), protocol.reply_key("echo", "innocent")
    last = defaults.MAX_ATTEMPTS - 1
    if hostility == "huge_deadline":
        bad_id, bad = entry(1, reply_to, deadline_ms=2**63 - 1, attempt=last)
    else:
        raw_redis.set(reply_to, "not a list")
        bad_id, bad = entry(1, reply_to, attempt=last)
    ghost_holds(raw_redis, "echo", bad, entry(2, good)[1])
    start_worker([echo], config=TAKEOVER)
    assert (await asyncio.to_thread(read_reply, raw_redis, good)).payload == 2
    if hostility == "huge_deadline":
        crashed = await asyncio.to_thread(read_reply, raw_redis, reply_to)
        assert crashed.id == bad_id and crashed.error_code in {"worker_crashed",
                                                               "invalid_payload"}
    await still_serves(redis_url)
    assert raw_redis.lrange(protocol.dead_letter_key("echo"), 0, -1) == [bad]  # once
    assert not raw_redis.exists(protocol.inflight_key("echo", "ghost"))


async def test_a_worker_id_that_is_not_utf8_is_reaped_like_any_other(
        raw_redis: redis.Redis, redis_url: str, start_worker: Callable[..., Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    """A foreign worker named itself with bytes that are not UTF-8, and died holding a
    request: the live workers' heartbeats go on, and its request is requeued and served;
    the reap's log line names it with its bytes escaped (valid UTF-8 for any handler)."""
    ghost = b"\xff\xfe-ghost"
    good = protocol.reply_key("echo", "innocent")
    raw_redis.rpush(b"rb:{echo}:inflight:" + ghost, entry(7, good)[1])
    raw_redis.zadd(protocol.workers_key("echo"), {ghost: protocol.now_ms() - 1})
    start_worker([echo], config=TAKEOVER)
    assert (await asyncio.to_thread(read_reply, raw_redis, good)).payload == 7
    await still_serves(redis_url)
    assert not raw_redis.exists(b"rb:{echo}:inflight:" + ghost)
    assert raw_redis.zscore(protocol.workers_key("echo"), ghost) is None
    assert r"reaped worker \xff\xfe-ghost: requeued 1" in caplog.text
    caplog.text.encode()


# --- the reaper answers what a live worker would ----------------------------------------
async def test_the_reaper_answers_a_malformed_entry_it_can_address(
        raw_redis: redis.Redis, start_worker: Callable[..., Worker]) -> None:
    reply_to = protocol.reply_key("echo", "malformed")
    wire = {"v": 1, "id": "m-1", "reply_to": reply_to, "model": "echo"}  # no payload...
    bad = msgpack.packb(wire)
    ghost_holds(raw_redis, "echo", bad)
    start_worker([echo], config=TAKEOVER)
    reply = await asyncio.to_thread(read_reply, raw_redis, reply_to, 10)
    assert not reply.ok and reply.id == "m-1" and reply.error_code == "invalid_payload"
    assert raw_redis.lrange(protocol.dead_letter_key("echo"), 0, -1) == [bad]


# --- dead letters are bounded in bytes --------------------------------------------------
@pytest.mark.parametrize("config", [TAKEOVER, WorkerConfig(
    block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=1.0, dead_letter_max_bytes=100,
    dead_letter_ttl_s=50)])
async def test_dead_letters_keep_a_bounded_copy(
        raw_redis: redis.Redis, redis_url: str, start_worker: Callable[..., Worker],
        config: WorkerConfig) -> None:
    junk = b"\xc1" * 1_000_000  # a 1 MB entry that is not msgpack
    raw_redis.rpush(protocol.queue_key("echo"), junk)
    ghost_holds(raw_redis, "echo", junk)  # and one through the reaper
    start_worker([echo], config=config)
    await still_serves(redis_url)
    key = protocol.dead_letter_key("echo")
    for _ in range(100):
        if raw_redis.llen(key) == 2:
            break
        await asyncio.sleep(0.05)
    assert raw_redis.lrange(key, 0, -1) == [junk[:config.dead_letter_max_bytes]] * 2
    assert 0 < raw_redis.ttl(key) <= config.dead_letter_ttl_s <= 24 * 3600


# --- a killer input takes nobody down with it --------------------------------------------
def spawn_killer(spawn: Callable[..., Proc], redis_url: str) -> Proc:
    return spawn(redbatch_cmd("worker", "tests.crash_models:killer", "--redis-url", redis_url),
                 env=test_env(**FAST_LEASE), name="killer-worker")


@pytest.mark.timeout(150)  # three crash, respawn and lease-expiry cycles
async def test_a_killer_input_is_isolated_and_its_batch_mates_answered(
        spawn: Callable[..., Proc], redis_url: str, raw_redis: redis.Redis) -> None:
    proc = spawn_killer(spawn, redis_url)
    values = [1, 2, 3, KILLER_INPUT, 5, 6, 7, 8]
    await wait_live(redis_url, "killer")
    async with Client(redis_url) as client:
        futures = await client.submit_many("killer", values, timeout_s=50)
        out = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 55)
    assert isinstance(out[3], WorkerCrashed), (out, proc.log()[-3000:])
    assert [o for i, o in enumerate(out) if i != 3] == [v * 10 for v in values if v > 0], \
        proc.log()[-3000:]
    dead = raw_redis.lrange(protocol.dead_letter_key("killer"), 0, -1)
    assert [codec.decode(d)[protocol.F_PAYLOAD] for d in dead] == [KILLER_INPUT]


# --- batch sizes count items per forward pass -------------------------------------------
async def test_batch_size_counts_items_per_pass(
        start_worker: Callable[..., Worker], redis_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "redbatch.worker")
    worker = start_worker([doubler("double4", max_batch_size=4)])
    await wait_live(redis_url, "double4")
    async with Client(redis_url, pack_rows=10) as client:  # one entry of 10 rows
        outputs = await client.predict_many("double4", inputs(10))
    assert len(outputs) == 10
    (runner,) = worker.runners
    for _ in range(100):  # the batch is counted once its replies are out
        if runner.stats.passes:
            break
        await asyncio.sleep(0.02)
    counters = runner.stats.counters()
    assert (counters["passes"], counters["pass_items"], counters["entries"]) == (3, 10, 1)
    assert sum(counters["hist"]["batch_size"]) == 3  # passes of 4, 4 and 2 items
    assert sum(counters["hist"]["batch_entries"]) == 1
    assert "model=double4 n=4 items=10 entries=1 passes=3" in caplog.text


# --- failures are logged so that they can be fixed ---------------------------------------
async def test_a_model_error_logs_its_traceback_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    def fails(xs: list[int]) -> list[int]:
        raise ValueError("broken weights")

    caplog.set_level(logging.WARNING, "redbatch.worker")
    with ThreadPoolExecutor(1) as pool:
        forwarder = Forwarder(Model("f", fn=fails), fails, pool)
        for _ in range(3):
            await forwarder.run([1])
    records = [r for r in caplog.records if "broken weights" in r.getMessage()]
    assert len(records) == 3
    assert [r.exc_info is not None for r in records] == [True, False, False]
    assert "in fails" in caplog.text  # the model's own frame


async def test_a_length_mismatch_is_logged_as_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    def short(xs: list[int]) -> list[int]:
        return xs[:1]

    caplog.set_level(logging.WARNING, "redbatch.worker")
    with ThreadPoolExecutor(1) as pool:
        forwarder = Forwarder(Model("f", fn=short), short, pool)
        results = await forwarder.run([1, 2, 3])
    assert all(isinstance(r, Exception) for r in results)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "returned 1 outputs for a batch of 3" in errors[0].getMessage()


def test_the_marker_ttl_is_clamped() -> None:
    now = protocol.now_ms()
    for deadline in (*HUGE_DEADLINES, -(2**63)):
        assert 1 <= protocol.marker_ttl_ms(deadline, now) <= protocol.MAX_MARKER_TTL_MS
    assert protocol.marker_ttl_ms(now + 7000, now) == 7000 + protocol.MARKER_GRACE_MS
