"""Streaming models under faults: hostile entries, cancels in fixed batches, junk
claims, a failing batch loop, and the streams' client side, against a real Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from redbatch import codec, protocol
from redbatch.api import streaming
from redbatch.bench import stream as bench_stream
from redbatch.errors import (
    InvalidPayload,
    ModelError,
    QueueFull,
    RedbatchError,
    RedisUnavailable,
    WorkerCrashed,
)
from redbatch.producer import streams
from redbatch.producer.client import Client
from redbatch.producer.streams import ChunkQueue
from redbatch.stream_wire import StreamChunk, chunk_from_wire
from redbatch.worker import stream as worker_stream
from redbatch.worker.process import Worker
from redbatch.worker.stats import WorkerStats
from redbatch.worker.stream_reap import StreamReaper
from tests import stream_models
from tests.conftest import connected, wait_live
from tests.stream_models import bytes_model, counter, fixed
from tests.test_disconnect import served

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _fresh_steps() -> None:
    stream_models.reset()


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    assert check()


async def _live(start_worker: Callable[..., Worker], redis_url: str,
                monkeypatch: pytest.MonkeyPatch, size: int = 4, step_s: float = 0.02) -> None:
    """A counter of batches of ``size`` whose steps take ``step_s``, live."""
    monkeypatch.setattr(stream_models, "STEP_S", step_s)
    start_worker([counter(size=size)])
    await wait_live(redis_url, "counter")


def _idle(raw_redis: redis.Redis, model: str) -> bool:
    """Nothing queued, nothing held in flight."""
    inflight = raw_redis.keys(protocol.inflight_key(model, "*"))
    return raw_redis.llen(protocol.queue_key(model)) == 0 and \
        all(raw_redis.llen(k) == 0 for k in inflight)


def _request(request_id: str, reply_to: str, value: Any, attempt: int = 0
             ) -> protocol.Request:
    now = protocol.now_ms()
    return protocol.Request(request_id, "counter", now, now + 20_000, reply_to, value, attempt)


async def test_an_entry_whose_reply_list_redis_refuses_is_dead_lettered_not_retried(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([counter(size=4)])
    await wait_live(redis_url, "counter")
    raw_redis.set("rb:reply:evil", "x")  # a string where a list must be
    evil = _request("evil1", "rb:reply:evil", {"n": 3})
    async with Client(redis_url) as client:
        stream = client.stream("counter", {"n": 40, "tag": "a"}, 8)
        await stream.open()
        raw_redis.rpush(protocol.queue_key("counter"), codec.encode(evil.to_wire(), "json"))
        assert len([x async for x in stream]) == 40
        await _until(lambda: raw_redis.llen(protocol.dead_letter_key("counter")) == 1)
        assert [x async for x in client.stream("counter", {"n": 2}, 5)] == ["0", "1"]
    assert b"evil1" in raw_redis.lindex(protocol.dead_letter_key("counter"), 0)
    assert _idle(raw_redis, "counter")


async def test_a_batch_loop_failing_on_an_entry_counts_its_attempts(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure of the worker's own loop (not Redis) returns the batch with attempt
    + 1: an entry that fails it every time ends at ``max_attempts``."""
    forward = worker_stream.StreamLoop.forward

    async def failing(loop: worker_stream.StreamLoop) -> None:
        if any(m.request.payload.get("tag") == "boom" for m in loop.members.values()):
            raise RuntimeError("a failure outside the model")
        await forward(loop)

    monkeypatch.setattr(worker_stream.StreamLoop, "forward", failing)
    start_worker([counter(size=4)])
    await wait_live(redis_url, "counter")
    async with Client(redis_url) as client:
        with pytest.raises(WorkerCrashed):
            _ = [x async for x in client.stream("counter", {"n": 3, "tag": "boom"}, 10)]
        assert [x async for x in client.stream("counter", {"n": 2}, 5)] == ["0", "1"]
    dead = [codec.decode(raw) for raw in
            raw_redis.lrange(protocol.dead_letter_key("counter"), 0, -1)]
    # dead-lettered as last claimed: its third attempt (max_attempts 3) failed too
    assert [(d[protocol.F_PAYLOAD]["tag"], d[protocol.F_ATTEMPT]) for d in dead] == \
        [("boom", 2)]


async def test_a_cancel_in_a_fixed_batch_never_pulls_a_newcomer_in(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_models, "STEP_S", 0.02)
    start_worker([fixed()])
    await wait_live(redis_url, "fixed")
    async with Client(redis_url) as client:
        a = client.stream("fixed", {"n": 20, "tag": "a"}, 10)
        b = client.stream("fixed", {"n": 20, "tag": "b"}, 10)
        await asyncio.gather(a.open(), b.open())
        assert [await anext(b) for _ in range(2)] == ["b0", "b1"]
        c = client.stream("fixed", {"n": 3, "tag": "c"}, 10)
        await c.open()
        await asyncio.sleep(0.05)
        await b.aclose()  # a member of the run-to-completion batch leaves
        assert [x async for x in a] == [f"a{i}" for i in range(20)]
        assert [x async for x in c] == ["c0", "c1", "c2"]
    assert all(len(keys) <= 2 for keys in stream_models.STEPS)


async def test_a_claim_of_only_unreadable_entries_is_dead_lettered(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([counter(size=4)])
    await wait_live(redis_url, "counter")
    for i in range(3):
        raw_redis.rpush(protocol.queue_key("counter"), b"\xc1garbage%d" % i)
        await asyncio.sleep(0.1)
    await _until(lambda: raw_redis.llen(protocol.dead_letter_key("counter")) == 3)
    assert _idle(raw_redis, "counter")


async def test_a_cancelled_set_of_another_type_cancels_nothing_and_fails_no_stream(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    """A string where the cancelled set belongs (a hostile or broken writer) is read
    as "nothing cancelled": the streams run to their end."""
    raw_redis.set(protocol.cancelled_key("counter"), "x")
    start_worker([counter(size=4)])
    await wait_live(redis_url, "counter")
    async with Client(redis_url) as client:
        got = await asyncio.gather(*(_all(client.stream("counter", {"n": 5}, 10))
                                     for _ in range(3)))
    assert got == [[str(i) for i in range(5)]] * 3
    assert raw_redis.llen(protocol.dead_letter_key("counter")) == 0


async def _all(stream: Any) -> list[Any]:
    return [x async for x in stream]


async def test_a_second_entry_of_a_running_stream_is_dead_lettered_not_streamed(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same entry pushed twice (a push retried by a foreign producer), claimed
    together or while its stream runs: one stream, each chunk once, in order."""
    await _live(start_worker, redis_url, monkeypatch)
    reply_to = protocol.reply_key("counter", "dup")
    queue = protocol.queue_key("counter")
    for rid, gap_s in (("dup1", 0.0), ("dup2", 0.15)):
        entry = codec.encode(_request(rid, reply_to, {"n": 12}).to_wire(), "json")
        raw_redis.rpush(queue, entry)
        await asyncio.sleep(gap_s)
        raw_redis.rpush(queue, entry)
    dead = protocol.dead_letter_key("counter")
    await _until(lambda: raw_redis.llen(dead) == 2 and _idle(raw_redis, "counter"))
    chunks = [chunk_from_wire(orjson.loads(raw)) for raw in raw_redis.lrange(reply_to, 0, -1)]
    for rid in ("dup1", "dup2"):
        mine = [c for c in chunks if c.id == rid]
        assert [c.seq for c in mine] == list(range(13)), rid
        assert [c.payload for c in mine[:-1]] == [str(i) for i in range(12)], rid
        assert mine[-1].last and mine[-1].ok, rid


async def test_a_streams_chunks_never_shorten_a_reply_lists_longer_ttl(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply list that holds a reply with a longer TTL (PUBLISH sets it from that
    request's deadline) keeps it: a stream's chunks set a TTL only on a new list, or
    lengthen it, as PUBLISH does."""
    await _live(start_worker, redis_url, monkeypatch)
    reply_to = protocol.reply_key("counter", "ttl")
    raw_redis.rpush(reply_to, b"an earlier reply")
    raw_redis.expire(reply_to, 3600)
    entry = codec.encode(_request("ttl1", reply_to, {"n": 3}).to_wire(), "json")
    raw_redis.rpush(protocol.queue_key("counter"), entry)
    await _until(lambda: raw_redis.llen(reply_to) == 5 and _idle(raw_redis, "counter"))
    assert raw_redis.ttl(reply_to) > 3000
    fresh = protocol.reply_key("counter", "fresh")  # a new list still gets a TTL
    entry = codec.encode(_request("ttl2", fresh, {"n": 3}).to_wire(), "json")
    raw_redis.rpush(protocol.queue_key("counter"), entry)
    await _until(lambda: raw_redis.llen(fresh) == 4 and _idle(raw_redis, "counter"))
    assert 0 < raw_redis.ttl(fresh) <= 3000


async def test_a_request_cancelled_while_queued_is_never_stepped(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await _live(start_worker, redis_url, monkeypatch, size=1)
    async with Client(redis_url) as client:
        busy = client.stream("counter", {"n": 10}, 10)
        assert await anext(busy) == "0"  # the one place is taken
        stream = client.stream("counter", {"n": 3, "tag": "gone"}, 10)
        await stream.open()
        await stream.aclose()  # it waits in the queue, cancelled
        assert len([x async for x in busy]) == 9
        await _until(lambda: _idle(raw_redis, "counter"))
    assert stream.request_id not in {key for keys in stream_models.STEPS for key in keys}
    assert raw_redis.get(protocol.request_key("counter", stream.request_id)) == b"d"


async def test_the_reaper_answers_an_addressable_unreadable_entry_and_counts_dead_letters(
        redis_url: str, raw_redis: redis.Redis) -> None:
    reply_to = protocol.reply_key("counter", "c1")
    bad = codec.encode({"v": 1, "id": "bad1", "reply_to": reply_to}, "json")  # no deadline
    spent = _request("spent1", reply_to, {"n": 3}, attempt=2)
    raw_redis.rpush(protocol.inflight_key("counter", "dead"), bad,
                    codec.encode(spent.to_wire(), "msgpack"), b"\xc1junk")
    raw_redis.zadd(protocol.workers_key("counter"), {"dead": protocol.now_ms() - 1000})
    counted: list[int] = []

    class Stats(WorkerStats):
        def dead_lettered(self, count: int) -> None:
            counted.append(count)

    client = aioredis.Redis.from_url(redis_url)
    try:
        reaper = StreamReaper(client, "counter", 3, Stats("counter", 4))
        assert await reaper.reap("dead") == 0
    finally:
        await client.aclose()
    assert counted == [3]
    finals = [codec.decode(raw) for raw in raw_redis.lrange(reply_to, 0, -1)]
    assert [(m["id"], m["seq"], m["error"]["code"]) for m in finals] == [
        ("bad1", 0, "invalid_payload"), ("spent1", 0, "worker_crashed")]
    assert raw_redis.llen(protocol.dead_letter_key("counter")) == 3


# --- the client's side --------------------------------------------------------------
def test_chunks_buffered_before_the_deadline_are_read_after_it() -> None:
    async def read() -> list[StreamChunk]:
        queue = ChunkQueue("r1", protocol.now_ms() - 60_000)  # long past, grace too
        queue.put(StreamChunk("r1", 0, "x"))
        queue.put(StreamChunk("r1", 1, last=True))
        return [await queue.get(), await queue.get()]

    chunks = asyncio.run(read())
    assert [(c.seq, c.last) for c in chunks] == [(0, False), (1, True)]


async def test_closing_a_stream_that_failed_on_the_client_side_cancels_it(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Too many chunks left unread: the listener fails the stream here and cancels it
    in Redis; the reader's error and its ``aclose`` send no second cancel."""
    await _live(start_worker, redis_url, monkeypatch)
    monkeypatch.setattr(protocol, "STREAM_MAX_BUFFERED", 3)
    async with Client(redis_url) as client:
        stream = client.stream("counter", {"n": 10_000}, 20)
        assert await anext(stream) == "0"
        await _until(lambda: raw_redis.zscore(protocol.cancelled_key("counter"),
                                              stream.request_id) is not None)
        with pytest.raises(QueueFull, match="left unread"):
            while True:
                await anext(stream)
        assert stream.ended
        assert stream.close_soon() is None  # cancelled already: no second cancel
    marker = protocol.request_key("counter", stream.request_id)
    await _until(lambda: raw_redis.get(marker) == b"d")


# --- the gateway ----------------------------------------------------------------------
async def test_a_chunk_that_is_not_json_ends_the_http_stream_with_an_error_event(
        start_worker: Callable[..., Worker], redis_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    start_worker([bytes_model()])
    await wait_live(redis_url, "bytesm")
    async with served(redis_url) as http:
        response = await http.post("/v1/models/bytesm/predict", json={"n": 1},
                                   headers={"x-timeout-ms": "5000"})
        assert response.status_code == 200
        events = [orjson.loads(line) for line in response.text.splitlines()]
        assert [(e["last"], e["error"]["code"]) for e in events] == [(True, "model_error")]
        whole = await http.post("/v2/models/bytesm/generate", json={"n": 1},
                                headers={"x-timeout-ms": "5000"})
        assert whole.status_code == 500 and "cannot be written as JSON" in whole.json()["error"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback


async def test_an_http_client_gone_before_its_first_chunk_cancels_its_stream(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await _live(start_worker, redis_url, monkeypatch, size=1)
    async with Client(redis_url) as client, served(redis_url) as http:
        busy = client.stream("counter", {"n": 10_000}, 10)
        assert await anext(busy) == "0"  # the one place is taken: the next one waits
        port = http.base_url.port
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = orjson.dumps({"n": 5, "tag": "late"})
        writer.write(b"POST /v1/models/counter/predict HTTP/1.1\r\nhost: gw\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(data), data))
        await writer.drain()
        await _until(lambda: raw_redis.llen(protocol.queue_key("counter")) == 1)
        writer.close()
        cancelled = protocol.cancelled_key("counter")
        await _until(lambda: raw_redis.zcard(cancelled) == 1)
        busy_marker = raw_redis.get(protocol.request_key("counter", busy.request_id))
        assert busy_marker and busy_marker.startswith(b"s")  # cancelled while it waited
        await busy.aclose()
        await _until(lambda: _idle(raw_redis, "counter"))
    late = {m.decode() for m in raw_redis.zrange(cancelled, 0, -1)} - {busy.request_id}
    assert len(late) == 1 and not late & {key for keys in stream_models.STEPS for key in keys}


async def test_a_streams_cancel_under_way_ends_before_its_client_closes(
        redis_url: str) -> None:
    """``Client.close`` waits for its streams' cancels (``close_soon``) before its pool
    closes: a cancel that marked its request after would take a connection of the
    closed pool and leave it open."""
    client = Client(redis_url, require_workers=False)
    await client.start()
    pool = client.redis.connection_pool
    stream = streams.Stream(client, "counter", {}, protocol.now_ms() + 60_000)
    await stream.open()
    real_mark, marked = client.mark_cancelled, asyncio.Event()

    async def late_mark(*args: Any) -> None:
        await asyncio.sleep(0.2)  # a Redis that answers late
        await real_mark(*args)
        marked.set()

    client.mark_cancelled = late_mark  # type: ignore[method-assign]
    stream.close_soon()
    await client.close()
    assert marked.is_set() and connected(pool) == 0


class StreamsClient:
    """The part of ``Client`` that a ``Stream`` calls, for a stream "r1" (no Redis)."""

    def abandon(self, *_args: Any) -> None:
        pass

    async def _routed(self, model: str, *_args: Any) -> str:
        return model  # (no versions here)

    async def _open_stream(self, *_args: Any) -> tuple[str, ChunkQueue]:
        return "r1", ChunkQueue("r1", protocol.now_ms() + 60_000)

    def __init__(self) -> None:
        self._cancels: set[asyncio.Task[None]] = set()
        self._redis: Any = object()  # (started)
        self._loop: Any = None

    _cancel_soon = Client._cancel_soon  # the client's own cancel, on the fake's mark
    _mark_cancelled = Client._mark_cancelled


def test_closing_a_stream_never_waits_long_on_redis_nor_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from redbatch.producer import client as client_module

    monkeypatch.setattr(client_module, "CANCEL_TIMEOUT_S", 0.05)

    class Stalled(StreamsClient):
        async def mark_cancelled(self, *_args: Any) -> None:
            await asyncio.sleep(60)  # a Redis that stalls

    class Failing(Stalled):
        async def mark_cancelled(self, *_args: Any) -> None:
            raise RedisUnavailable("Redis is away")

    async def close(client: Any) -> None:
        stream = streams.Stream(client, "counter", {}, protocol.now_ms() + 60_000)
        await stream.open()
        await asyncio.wait_for(stream.aclose(), 1)

    asyncio.run(close(Stalled()))
    asyncio.run(close(Failing()))


async def test_the_stream_bench_warms_up_and_measures_enough_requests_per_level(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_stream, "CONCURRENCY", (1, 2))
    monkeypatch.setattr(bench_stream, "MIN_SAMPLES", 6)
    server = bench_stream.NaiveServer(step_ms=0)
    task = asyncio.create_task(server.serve())
    opened: list[int] = []

    def open_stream(prompt: str, tokens: int) -> AsyncIterator[Any]:
        opened.append(tokens)
        return server.stream(prompt, tokens)

    try:
        results = await bench_stream._levels(open_stream, "naive", 0, per_stream=1)
    finally:
        task.cancel()
    assert [(r.streams, r.requests, len(r.ttft_ms)) for r in results] == [(1, 6, 6), (2, 6, 6)]
    assert len(opened) == bench_stream.WARM_UP_STREAMS + 12  # the warm-up is not measured


async def test_a_client_that_stops_reading_is_cut_off_and_its_stream_cancelled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "SEND_GRACE_S", 0.05)
    cancels: list[str] = []

    class Listening(StreamsClient):
        async def mark_cancelled(self, _model: str, request_id: str, _deadline: int) -> None:
            cancels.append(request_id)

    stream = streams.Stream(Listening(), "counter", {},  # type: ignore[arg-type]
                            protocol.now_ms() - protocol.STREAM_GRACE_MS)
    await stream.open()
    answer = streaming.StreamAnswer(stream, StreamChunk("r1", 0, "x"),
                                    streaming.v1_shapes("out"), False, "r1")
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            await asyncio.sleep(60)  # its TCP window stays shut

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    await asyncio.wait_for(answer({"type": "http"}, receive, send), 2)
    await asyncio.sleep(0)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert cancels == ["r1"]


# --- poison isolation -------------------------------------------------------------
async def test_an_exception_yielded_for_one_member_fails_that_member_alone(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await _live(start_worker, redis_url, monkeypatch, step_s=0.01)
    async with Client(redis_url) as client:
        bad = client.stream("counter", {"n": 5, "fail_one": 2}, 10)
        good = client.stream("counter", {"n": 5, "tag": "g"}, 10)
        await asyncio.gather(bad.open(), good.open())
        seen: list[str] = []
        with pytest.raises(ModelError, match="asked to fail this one"):
            async for chunk in bad:
                seen.append(chunk)
        assert seen == ["0", "1"]
        assert [x async for x in good] == [f"g{i}" for i in range(5)]
    assert any(bad.request_id in keys and good.request_id in keys
               for keys in stream_models.STEPS)


async def test_a_batch_function_that_raises_when_called_fails_its_culprit_alone(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the worker's loop: the culprit gets ``model_error`` at once (no retries
    ending in ``worker_crashed``), and its batch-mates stream on."""
    monkeypatch.setattr(stream_models, "STEP_S", 0.01)
    start_worker([stream_models.checked()])
    await wait_live(redis_url, "checked")
    async with Client(redis_url) as client:
        bad = client.stream("checked", {"n": 3, "refuse": True}, 10)
        good = client.stream("checked", {"n": 3, "tag": "g"}, 10)
        await asyncio.gather(bad.open(), good.open())
        with pytest.raises(ModelError, match="refused before its first step"):
            _ = [x async for x in bad]
        assert [x async for x in good] == ["g0", "g1", "g2"]
    assert raw_redis.llen(protocol.dead_letter_key("checked")) == 0


async def test_a_generator_that_raises_fails_its_culprit_alone_the_others_rerun(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await _live(start_worker, redis_url, monkeypatch, step_s=0.01)
    async with Client(redis_url) as client:
        streams_ = [client.stream("counter", value, 10, chunks=True) for value in
                    ({"n": 5, "tag": "a"}, {"n": 5, "fail": 2}, {"n": 5, "tag": "c"}, {"n": 1})]
        await asyncio.gather(*(s.open() for s in streams_))
        good_a, bad, good_c, short = streams_
        seen: list[StreamChunk] = []
        with pytest.raises(ModelError, match="asked to fail"):
            async for chunk in bad:
                seen.append(chunk)
        assert [(c.seq, c.payload) for c in seen] == [(0, "0"), (1, "1")]
        for stream, tag in ((good_a, "a"), (good_c, "c")):  # each chunk once, none lost
            assert [(c.seq, c.payload) async for c in stream] == \
                [(i, f"{tag}{i}") for i in range(5)]
        assert [c.payload async for c in short] == ["0"]
        assert client.stats()["duplicates"] == 0
    ids = {s.request_id for s in streams_}
    assert ids in [set(keys) for keys in stream_models.STEPS]  # they ran as one batch


async def test_a_rerun_that_yields_other_chunks_ends_that_stream_with_an_error(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([stream_models.noisy()])
    await wait_live(redis_url, "noisy")
    async with Client(redis_url) as client:
        good = client.stream("noisy", {"n": 4}, 10, chunks=True)
        bad = client.stream("noisy", {"n": 4, "fail": 2}, 10, chunks=True)
        await asyncio.gather(good.open(), bad.open())
        seen: list[StreamChunk] = []
        with pytest.raises(ModelError, match="rerun"):
            async for chunk in good:
                seen.append(chunk)
        assert [c.seq for c in seen] == [0, 1]  # never a chunk again, nor a silent end
        seen = []
        with pytest.raises(ModelError):  # its own rerun differs before it raises
            async for chunk in bad:
                seen.append(chunk)
        assert [c.seq for c in seen] == [0, 1]


async def _ended(stream: Any) -> tuple[list[int], str | None]:
    """The numbers of a stream's chunks, and the code of the error it ended with."""
    seqs: list[int] = []
    try:
        async for chunk in stream:
            seqs.append(chunk.seq)
    except RedbatchError as exc:
        return seqs, exc.code
    return seqs, None


async def _open(client: Client, model: str, values: list[dict[str, Any]]) -> list[Any]:
    streams_ = [client.stream(model, value, 20, chunks=True) for value in values]
    await asyncio.gather(*(s.open() for s in streams_))
    return streams_


async def test_a_fixed_batch_whose_generator_raises_fails_its_culprit_alone(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """A fixed batch keeps its ended members: a rerun lane holds only its own half."""
    start_worker([fixed(size=4)])
    await wait_live(redis_url, "fixed")
    async with Client(redis_url) as client:
        streams_ = await _open(client, "fixed", [{"n": 5}, {"n": 5}, {"n": 5, "fail": 2},
                                                 {"n": 5}])
        ended = await asyncio.gather(*(_ended(s) for s in streams_))
    assert ended == [([0, 1, 2, 3, 4], None)] * 2 + [([0, 1], "model_error")] + \
        [([0, 1, 2, 3, 4], None)]
    assert len(stream_models.STEPS[0]) == 4  # they ran as one batch
    assert streams_[0].timings[protocol.F_STEPS] == 6  # its replayed steps count once


async def test_the_halves_of_a_batch_that_raised_rerun_side_by_side(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Neither half waits for the other's whole streams: they step in turn; one line
    says what the bisection isolated."""
    caplog.set_level(logging.WARNING, "redbatch.worker")
    await _live(start_worker, redis_url, monkeypatch, step_s=0.005)
    async with Client(redis_url) as client:
        streams_ = await _open(client, "counter", [{"n": 12}, {"n": 12, "fail": 2},
                                                   {"n": 12}, {"n": 12}])
        ended = await asyncio.gather(*(_ended(s) for s in streams_))
    assert ended == [(list(range(12)), None), ([0, 1], "model_error")] + \
        [(list(range(12)), None)] * 2
    steps = [frozenset(keys) for keys in stream_models.STEPS]
    assert len(steps[0]) == 4 and steps[2] == steps[0]  # it raised at its third step
    assert steps[3] | steps[4] == steps[0] and not steps[3] & steps[4]  # both halves
    isolated = [r.getMessage() for r in caplog.records if "isolated" in r.getMessage()]
    assert len(isolated) == 1 and streams_[1].request_id in isolated[0]


async def test_a_lane_whose_generator_returned_counts_a_new_generators_steps_anew(
        start_worker: Callable[..., Worker], redis_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Two queued requests join the lane whose generator returned as its members
    ended: the new generator raises at its first step, and says so."""
    caplog.set_level(logging.WARNING, "redbatch.worker")
    start_worker([stream_models.brief()])
    await wait_live(redis_url, "brief")
    async with Client(redis_url) as client:
        first = await _open(client, "brief", [{}, {}])
        assert (await anext(aiter(first[0]))).seq == 0  # they run: the next two wait
        queued = await _open(client, "brief", [{"fail": True}, {}])
        ended = await asyncio.gather(*(_ended(s) for s in first + queued))
    assert ended == [([1], None), ([0, 1], None), ([], "model_error"), ([0, 1], None)]
    raised = [r.getMessage() for r in caplog.records if "raised at its step" in
              r.getMessage()]
    assert len(raised) == 1 and "raised at its step 1 " in raised[0]


async def test_a_culprit_isolated_once_its_lane_is_ordinary_again_is_logged(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two bad inputs that raise at other steps: the second raises alone after its
    lane's rerun caught up; each gets its line."""
    caplog.set_level(logging.WARNING, "redbatch.worker")
    await _live(start_worker, redis_url, monkeypatch, size=2, step_s=0.005)
    async with Client(redis_url) as client:
        streams_ = await _open(client, "counter", [{"n": 10, "fail": 2},
                                                   {"n": 10, "fail": 6}])
        ended = await asyncio.gather(*(_ended(s) for s in streams_))
    assert ended == [([0, 1], "model_error"), (list(range(6)), "model_error")]
    isolated = [r.getMessage() for r in caplog.records if "isolated" in r.getMessage()]
    assert [s.request_id in line for s, line in zip(streams_, isolated, strict=True)] == \
        [True, True]


async def test_an_async_generator_that_raises_fails_its_culprit_alone(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([stream_models.counter_async()])
    await wait_live(redis_url, "acounter")
    async with Client(redis_url) as client:
        streams_ = await _open(client, "acounter", [{"n": 6}, {"n": 6, "fail": 3}])
        ended = await asyncio.gather(*(_ended(s) for s in streams_))
    assert ended == [(list(range(6)), None), ([0, 1, 2], "model_error")]


async def test_a_batch_whose_every_member_raises_splits_a_bounded_number_of_times(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """Sixteen members that all raise at their fourth step: at most 2 * ceil(log2 16)
    = 8 splits (1 + 16 generators), not one per member (31); each ends after its 3
    chunks."""
    start_worker([counter(size=16, wait_s=0.3)])
    await wait_live(redis_url, "counter")
    async with Client(redis_url) as client:
        streams_ = await _open(client, "counter", [{"n": 9, "fail": 3}] * 16)
        ended = await asyncio.gather(*(_ended(s) for s in streams_))
    assert len(stream_models.STEPS[0]) == 16
    assert ended == [([0, 1, 2], "model_error")] * 16
    assert stream_models.STARTS[0] == 1 + 2 * worker_stream.split_budget(16) == 17


async def test_a_failure_whatever_the_input_stays_bounded_when_members_joined_late(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """One member, then fifteen that joined after its third chunk; every generator
    raises at the step its cache is full: a rerun whose late members yield new chunks
    before that step keeps its bisection's budget (at most 1 + 2 * splits generators,
    not one per member: 31)."""
    start_worker([stream_models.full()])
    await wait_live(redis_url, "full")
    async with Client(redis_url) as client:
        first = client.stream("full", {"n": 100}, 20, chunks=True)
        await first.open()
        chunks = aiter(first)
        assert [(await anext(chunks)).seq for _ in range(3)] == [0, 1, 2]
        late = await _open(client, "full", [{"n": 100}] * 15)
        ended = await asyncio.gather(_ended(chunks), *(_ended(s) for s in late))
    assert stream_models.FULL_AT[0] is not None  # the sixteen ran as one batch
    assert all(code == "model_error" for _, code in ended)
    assert stream_models.STARTS[0] <= 1 + 2 * worker_stream.split_budget(16) == 17


async def test_two_bad_inputs_in_different_halves_each_fail_alone(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """Two members of eight raise at their fourth step, one in each half: each is
    isolated, the six others end whole."""
    start_worker([counter(size=8, wait_s=0.3)])
    await wait_live(redis_url, "counter")
    values: list[dict[str, Any]] = [{"n": 6}] * 8
    values[0] = values[5] = {"n": 6, "fail": 3}
    async with Client(redis_url) as client:
        streams_ = await _open(client, "counter", values)
        ended = await asyncio.gather(*(_ended(s) for s in streams_))
    assert len(stream_models.STEPS[0]) == 8
    assert ended == [([0, 1, 2], "model_error") if value.get("fail") else
                     (list(range(6)), None) for value in values]


async def test_a_request_joins_while_the_others_of_a_batch_that_raised_rerun(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await _live(start_worker, redis_url, monkeypatch, step_s=0.02)
    async with Client(redis_url) as client:
        good, bad = await _open(client, "counter", [{"n": 60}, {"n": 60, "fail": 2}])
        assert await _ended(bad) == ([0, 1], "model_error")
        late = client.stream("counter", {"n": 2}, 20)
        assert [x async for x in late] == ["0", "1"]
        assert await _ended(good) == (list(range(60)), None)
    joint = [keys for keys in stream_models.STEPS if late.request_id in keys]
    assert good.request_id in joint[0]  # it joined the running lane


async def test_a_request_joins_the_largest_lane_once_a_bisection_is_over(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the bisection of [a, bad, c, d], the lanes [c, d] and [a] go on; a
    newcomer joins [c, d], the lane with most members, not the last one."""
    await _live(start_worker, redis_url, monkeypatch, step_s=0.02)
    async with Client(redis_url) as client:
        a, bad, c, d = await _open(client, "counter", [{"n": 60}, {"n": 60, "fail": 2},
                                                       {"n": 60}, {"n": 60}])
        assert await _ended(bad) == ([0, 1], "model_error")
        late = client.stream("counter", {"n": 2}, 20)
        assert [x async for x in late] == ["0", "1"]
        assert [await _ended(s) for s in (a, c, d)] == [(list(range(60)), None)] * 3
    joint = [keys for keys in stream_models.STEPS if late.request_id in keys]
    assert set(joint[0]) == {c.request_id, d.request_id, late.request_id}


async def test_a_caller_that_cancels_during_a_replay_is_not_replayed_to_the_end(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_models, "STEP_S", 0.002)
    start_worker([stream_models.held()])
    await wait_live(redis_url, "held")
    async with Client(redis_url) as client:
        gone, bad = await _open(client, "held", [{"n": 100}, {"n": 100, "fail": 30}])
        await asyncio.to_thread(stream_models.HELD.wait, 10)  # a rerun begins
        raw_redis.zadd(protocol.cancelled_key("held"), {gone.request_id: protocol.now_ms()})
        stream_models.RELEASE.set()
        assert (await _ended(bad))[1] == "model_error"
    marker = protocol.request_key("held", gone.request_id)
    await _until(lambda: raw_redis.get(marker) == b"d")
    alone = [keys for keys in stream_models.STEPS if keys == [gone.request_id]]
    assert len(alone) < 5  # not its 30 steps replayed


async def test_a_worker_that_may_not_read_the_cancelled_set_warns_once_not_per_replay(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A Redis user without ZMSCORE: a replay of twenty steps logs one warning."""
    caplog.set_level(logging.WARNING, "redbatch.worker")
    monkeypatch.setattr(stream_models, "STEP_S", 0.002)
    raw_redis.execute_command("ACL", "SETUSER", "nozms", "on", ">pw", "~*", "&*", "+@all",
                              "-zmscore")
    try:
        start_worker([counter(size=2, name="nozms")],
                     url=redis_url.replace("redis://", "redis://nozms:pw@"))
        await wait_live(redis_url, "nozms")
        async with Client(redis_url) as client:
            streams_ = await _open(client, "nozms", [{"n": 25}, {"n": 25, "fail": 20}])
            ended = await asyncio.gather(*(_ended(s) for s in streams_))
    finally:
        raw_redis.execute_command("ACL", "DELUSER", "nozms")
    assert ended == [(list(range(25)), None), (list(range(20)), "model_error")]
    refused = [r for r in caplog.records if "ZMSCORE" in r.getMessage()
               or "cannot read the cancelled set" in r.getMessage()]
    assert len(refused) == 1


async def test_a_deadline_that_passes_during_a_replay_ends_the_stream_where_it_was(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun stuck past its members' deadlines: each ends with
    ``deadline_exceeded`` after the chunks its caller got, never a chunk again."""
    monkeypatch.setattr(stream_models, "STEP_S", 0.002)
    start_worker([stream_models.held()])
    await wait_live(redis_url, "held")
    async with Client(redis_url) as client:
        streams_ = [client.stream("held", value, 1.5, chunks=True)
                    for value in ({"n": 100}, {"n": 100, "fail": 20})]
        await asyncio.gather(*(s.open() for s in streams_))
        try:
            ended = await asyncio.gather(*(_ended(s) for s in streams_))
        finally:
            stream_models.RELEASE.set()
    assert ended == [(list(range(20)), "deadline_exceeded")] * 2


async def test_a_suspect_never_joins_a_running_batch_and_runs_alone_after_it(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """... and the running batch takes no newcomer meanwhile: under steady load it
    would never end, and the suspect would wait in the worker's hands to its deadline."""
    await _live(start_worker, redis_url, monkeypatch)
    reply_to = protocol.reply_key("counter", "t1")
    suspect = _request("suspect1", reply_to, {"n": 3, "tag": "s"})
    suspect.suspect = True
    async with Client(redis_url) as client:
        busy = client.stream("counter", {"n": 15}, 10)
        assert await anext(busy) == "0"
        raw_redis.zadd(protocol.suspects_key("counter"), {"suspect1": suspect.deadline_ms})
        raw_redis.rpush(protocol.queue_key("counter"), codec.encode(suspect.to_wire(), "json"))
        await _until(lambda: raw_redis.llen(protocol.queue_key("counter")) == 0)
        late = client.stream("counter", {"n": 2, "tag": "l"}, 10)
        assert [x async for x in late] == ["l0", "l1"]  # served: after the suspect
        assert len([x async for x in busy]) == 14
        await _until(lambda: raw_redis.llen(reply_to) == 4)
    messages = [codec.decode(raw) for raw in raw_redis.lrange(reply_to, 0, -1)]
    assert [m.get(protocol.F_PAYLOAD) for m in messages[:3]] == ["s0", "s1", "s2"]
    assert messages[3]["ok"] is True
    steps = stream_models.STEPS
    alone = [i for i, keys in enumerate(steps) if "suspect1" in keys]
    assert all(steps[i] == ["suspect1"] for i in alone)
    assert max(i for i, keys in enumerate(steps) if busy.request_id in keys) < min(alone)
    assert max(alone) < min(i for i, keys in enumerate(steps) if late.request_id in keys)
    assert not raw_redis.keys(protocol.crashing_key("counter", "*"))  # named while it ran


async def test_the_suspect_a_worker_died_running_alone_takes_the_blame_alone(
        redis_url: str, raw_redis: redis.Redis) -> None:
    reply_to = protocol.reply_key("counter", "c1")
    culprit = _request("culprit", reply_to, {"n": 3}, attempt=1)
    waiting = _request("waiting", reply_to, {"n": 3})
    inflight = protocol.inflight_key("counter", "dead")
    raw_redis.rpush(inflight, codec.encode(waiting.to_wire(), "msgpack"),
                    codec.encode(culprit.to_wire(), "msgpack"))
    raw_redis.set(protocol.crashing_key("counter", "dead"), "culprit")
    raw_redis.zadd(protocol.workers_key("counter"), {"dead": protocol.now_ms() - 1000})
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await StreamReaper(client, "counter", 3).reap("dead") == 2
    finally:
        await client.aclose()
    requeued = [codec.decode(raw) for raw in
                raw_redis.lrange(protocol.queue_key("counter"), 0, -1)]
    assert [(r["id"], r[protocol.F_ATTEMPT], r.get(protocol.F_SUSPECT)) for r in requeued] == \
        [("waiting", 0, True), ("culprit", 2, True)]
    assert set(raw_redis.zrange(protocol.suspects_key("counter"), 0, -1)) == \
        {b"waiting", b"culprit"}  # recorded: workers honour these two flags


async def test_a_forged_suspect_flag_neither_waits_nor_holds_newcomers_back(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry pushed with ``suspect`` set that no reaper requeued joins the running
    batch as any other (a forged flag would hold every newcomer back for its stream)."""
    await _live(start_worker, redis_url, monkeypatch)
    reply_to = protocol.reply_key("counter", "t2")
    forged = _request("forged1", reply_to, {"n": 3, "tag": "f"})
    forged.suspect = True
    async with Client(redis_url) as client:
        busy = client.stream("counter", {"n": 15}, 10)
        assert await anext(busy) == "0"
        raw_redis.rpush(protocol.queue_key("counter"), codec.encode(forged.to_wire(), "json"))
        await _until(lambda: raw_redis.llen(reply_to) == 4)
        assert len([x async for x in busy]) == 14
    steps = stream_models.STEPS
    assert any("forged1" in keys and busy.request_id in keys for keys in steps)


async def test_a_stream_whose_input_cannot_be_encoded_leaves_no_waiter(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([counter(size=4)])
    await wait_live(redis_url, "counter")
    async with Client(redis_url, max_waiters=3) as client:
        for _ in range(4):
            with pytest.raises(RedbatchError, match="cannot encode"):
                await client.stream("counter", {"n": 1, "x": object()}, 30).open()
        assert client.waiting == 0
        assert [x async for x in client.stream("counter", {"n": 2, "tag": "t"}, 5)] == [
            "t0", "t1"]


async def test_a_hostile_marker_fails_its_own_stream_alone(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    """``snan`` in a request's marker once made a NaN that failed the STEP script's
    encode for the whole batch, and every reap of it after.  It now reads as no
    marker: that stream runs as any other."""
    start_worker([counter(size=4)])
    await wait_live(redis_url, "counter")
    reply_to = protocol.reply_key("counter", "evil")
    evil = _request("evil2", reply_to, {"n": 3})
    raw_redis.set(protocol.request_key("counter", "evil2"), "snan", px=20_000)
    async with Client(redis_url) as client:
        good = client.stream("counter", {"n": 30, "tag": "g"}, 10)
        await good.open()
        raw_redis.rpush(protocol.queue_key("counter"), codec.encode(evil.to_wire(), "json"))
        assert len([x async for x in good]) == 30
    await _until(lambda: raw_redis.llen(reply_to) == 4)
    messages = [orjson.loads(m) for m in raw_redis.lrange(reply_to, 0, -1)]
    assert [m.get("payload") for m in messages[:3]] == ["0", "1", "2"]
    assert messages[3]["last"] is True and messages[3]["ok"] is True


async def test_the_stream_reaper_dead_letters_an_entrys_first_bytes(
        redis_url: str, raw_redis: redis.Redis) -> None:
    now = protocol.now_ms()
    bad = orjson.dumps({"v": 1, "id": "x1", "model": "counter", "enqueue_ms": "bad",
                        "deadline_ms": now + 60_000, "reply_to": "rb:reply:{counter}:c",
                        "attempt": 0, "payload": "A" * 200_000})
    raw_redis.rpush(protocol.inflight_key("counter", "w1"), bad)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await StreamReaper(client, "counter", 3).reap("w1", force=True)
    finally:
        await client.aclose()
    assert [len(x) for x in raw_redis.lrange(protocol.dead_letter_key("counter"), 0, -1)] \
        == [4096]


async def test_a_malformed_entry_with_a_running_streams_id_leaves_that_stream_be(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad entry carrying a running stream's id is dead-lettered quietly, as a
    retried copy is (its final error ended the running stream, and went to the bad
    entry's reply list)."""
    await _live(start_worker, redis_url, monkeypatch)
    other = protocol.reply_key("counter", "t3")
    async with Client(redis_url) as client:
        busy = client.stream("counter", {"n": 15}, 10)
        assert await anext(busy) == "0"
        bad = _request(busy.request_id, other, {"n": 3}, attempt=-1)  # malformed
        raw_redis.rpush(protocol.queue_key("counter"), codec.encode(bad.to_wire(), "json"))
        await _until(lambda: raw_redis.llen(protocol.dead_letter_key("counter")) == 1)
        assert len([x async for x in busy]) == 14  # every chunk, then its own final
    assert raw_redis.llen(other) == 0


async def test_a_stream_given_up_on_this_side_is_cancelled_in_redis(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its worker stops at its next step (before: it ran the stream to its end or its
    deadline for nobody): a ``break`` out of ``async for``, a reading task cancelled
    (an ``asyncio.timeout``), chunks left unread past the buffer, ``predict`` on a
    streaming model, and a client closed with a stream open."""
    await _live(start_worker, redis_url, monkeypatch)
    monkeypatch.setattr(protocol, "STREAM_MAX_BUFFERED", 5)

    def cancelled(request_id: str) -> bool:
        return raw_redis.zscore(protocol.cancelled_key("counter"), request_id) is not None

    async with Client(redis_url) as client:
        ids = []
        stream = client.stream("counter", {"n": 500}, 20)
        async for _chunk in stream:
            break
        ids.append(stream.request_id)
        del stream  # (dropped: nothing else holds it)
        stream = client.stream("counter", {"n": 500}, 20)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                async for _chunk in stream:
                    pass
        ids.append(stream.request_id)
        stream = client.stream("counter", {"n": 500}, 20)
        assert await anext(stream) == "0"
        await _until(lambda: cancelled(stream.request_id))  # unread past 5 chunks
        with pytest.raises(InvalidPayload, match="stream"):
            await client.predict("counter", {"n": 500, "tag": "p"}, timeout_s=20)
        await _until(lambda: raw_redis.zcard(protocol.cancelled_key("counter")) == 4)
        for request_id in ids:
            assert cancelled(request_id)
        last = client.stream("counter", {"n": 500}, 20)
        assert await anext(last) == "0"
    assert cancelled(last.request_id)


def _oversized(batch: Any) -> Any:
    """Per member: ``"chunk"`` yields a chunk over an entry's limit, ``"error"`` an
    exception whose message is, anything else one small chunk."""
    too_many = "x" * (protocol.MAX_ENTRY_BYTES + 10)
    yield [too_many if v == "chunk" else ValueError(too_many) if v == "error" else "small"
           for v in batch]


async def test_a_chunk_or_error_over_an_entrys_limit_ends_its_stream_with_a_model_error(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """The chunk went out all the same (the caller's client dropped it, then failed
    the stream on the gap: 'chunk 1 came where 0 was due'; over HTTP a 500); the error
    message's final message never arrived (the caller waited out its deadline and the
    grace)."""
    from redbatch.worker.model import Model

    start_worker([Model("oversized", fn=_oversized, policy=stream_models.policy(4, 0.0))])
    await wait_live(redis_url, "oversized")
    async with Client(redis_url) as client:
        for value, what in (("chunk", "chunk"), ("error", "final message")):
            started = asyncio.get_running_loop().time()
            with pytest.raises(ModelError, match=f"gave a {what} of .* over the"):
                async for _chunk in client.stream("oversized", value, 10):
                    pass
            assert asyncio.get_running_loop().time() - started < 5
        assert [c async for c in client.stream("oversized", "ok", 10)] == ["small"]
