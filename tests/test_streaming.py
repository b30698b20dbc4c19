"""Streaming models: numbered chunks, continuous batching, cancels, deadlines, errors,
the Python iterators, and HTTP (SSE, NDJSON, Triton's generate) against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from redbatch import GatewayConfig, RedisSettings, codec, lua_stream, protocol
from redbatch.api import create_app
from redbatch.bench.stream import MAX_TOKENS, MIN_TOKENS, NaiveServer, Result, _drive
from redbatch.codec import Format
from redbatch.demo import adder
from redbatch.errors import (
    DeadlineExceeded,
    InvalidPayload,
    ModelError,
    QueueFull,
    WorkerCrashed,
)
from redbatch.generate import generate_model
from redbatch.producer.client import Client
from redbatch.producer.sync import SyncClient
from redbatch.stream_wire import StreamChunk
from redbatch.worker.process import Worker
from redbatch.worker.stream_reap import StreamReaper
from tests import stream_models
from tests.conftest import Proc, redbatch_cmd, test_env, wait_live
from tests.stream_models import counter, counter_async
from tests.test_disconnect import served
from tests.test_reliability import FAST_LEASE


@pytest.fixture(autouse=True)
def _fresh_steps() -> None:
    stream_models.STEPS.clear()


async def _collect(client: Client, model: str, value: Any, timeout_s: float = 10
                   ) -> list[StreamChunk]:
    return [chunk async for chunk in client.stream(model, value, timeout_s, chunks=True)]


async def test_chunks_numbered_in_order_then_a_final_with_timings(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    start_worker([counter()])
    await wait_live(redis_url, "counter")
    async with Client(redis_url) as client:
        stream = client.stream("counter", {"n": 5, "tag": "a"}, 10, chunks=True)
        chunks = [chunk async for chunk in stream]
        assert [c.seq for c in chunks] == [0, 1, 2, 3, 4]
        assert [c.payload for c in chunks] == ["a0", "a1", "a2", "a3", "a4"]
        assert stream.timings[protocol.F_STEPS] == 6  # 5 chunks, then the STOP
        assert stream.timings[protocol.F_BATCH_SIZE] == 1
        assert client.stats()["duplicates"] == 0
    assert raw_redis.get(protocol.request_key("counter", stream.request_id)) == b"d"
    assert not raw_redis.keys(protocol.inflight_key("counter", "*")) or all(
        raw_redis.llen(k) == 0 for k in raw_redis.keys(protocol.inflight_key("counter", "*")))


async def _three(client: Client, model: str) -> tuple[list[str], dict[str, str]]:
    """A long and a short stream fill the batch of two; a third waits.  The order in
    which they end, and each one's request id."""
    ended: list[str] = []
    ids: dict[str, str] = {}

    async def run(tag: str, n: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        stream = client.stream(model, {"n": n, "tag": tag}, 10)
        assert [x async for x in stream] == [f"{tag}{i}" for i in range(n)]
        ids[tag] = stream.request_id
        ended.append(tag)

    await asyncio.gather(run("long", 12, 0), run("short", 1, 0), run("late", 2, 0.02))
    return ended, ids


async def _three_on(start_worker: Callable[..., Worker], redis_url: str, continuous: bool,
                    monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict[str, str]]:
    """``_three`` on a counter of batches of 2 whose steps take 10 ms."""
    monkeypatch.setattr(stream_models, "STEP_S", 0.01)
    start_worker([counter(size=2, continuous=continuous)])
    await wait_live(redis_url, "counter")
    async with Client(redis_url) as client:
        return await _three(client, "counter")


async def test_continuous_batching_a_waiting_request_joins_mid_batch(
        start_worker: Callable[..., Worker], redis_url: str, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    ended, ids = await _three_on(start_worker, redis_url, True, monkeypatch)
    assert ended[-1] == "long"  # the short and the late one never wait for it
    together = [keys for keys in stream_models.STEPS
                if ids["long"] in keys and ids["late"] in keys]
    assert together, "the waiting request joined the long one's batch"
    assert max(len(keys) for keys in stream_models.STEPS) == 2  # never past max_batch_size


async def test_run_to_completion_batches_make_the_late_request_wait(
        start_worker: Callable[..., Worker], redis_url: str, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    ended, ids = await _three_on(start_worker, redis_url, False, monkeypatch)
    assert ended.index("late") > ended.index("long")
    assert not [keys for keys in stream_models.STEPS if ids["late"] in keys and len(keys) > 1]


async def test_async_generator_and_the_sync_iterator(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([counter_async()])
    await wait_live(redis_url, "acounter")
    async with Client(redis_url) as client:
        assert [c.payload for c in await _collect(client, "acounter", {"n": 3})] == \
            ["0", "1", "2"]
    with SyncClient(redis_url) as sync:
        got = await asyncio.to_thread(lambda: list(sync.stream("acounter", {"n": 4, "tag": "s"},
                                                               10)))
    assert got == ["s0", "s1", "s2", "s3"]


async def test_model_error_and_deadline_end_the_stream_with_a_typed_error(
        start_worker: Callable[..., Worker], redis_url: str, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    await _slow_counter(start_worker, redis_url, monkeypatch, 0.05)
    async with Client(redis_url) as client:
        seen: list[Any] = []
        with pytest.raises(ModelError, match="asked to fail"):
            async for chunk in client.stream("counter", {"n": 5, "fail": 2}, 10):
                seen.append(chunk)
        assert seen == ["0", "1"]
        seen = []
        with pytest.raises(DeadlineExceeded):
            async for chunk in client.stream("counter", {"n": 10_000}, 0.4):
                seen.append(chunk)
        assert 0 < len(seen) < 100


async def _slow_counter(start_worker: Callable[..., Worker], redis_url: str,
                        monkeypatch: pytest.MonkeyPatch, step_s: float) -> None:
    """A counter of batches of 4 whose steps take ``step_s``, live."""
    monkeypatch.setattr(stream_models, "STEP_S", step_s)
    start_worker([counter(size=4)])
    await wait_live(redis_url, "counter")


async def _assert_dropped(raw_redis: redis.Redis, request_id: str) -> None:
    """The worker dropped and acked the request (its marker turned to ``d``), and
    steps no more."""
    marker = protocol.request_key("counter", request_id)
    for _ in range(250):
        if raw_redis.get(marker) == b"d":
            break
        await asyncio.sleep(0.02)
    assert raw_redis.get(marker) == b"d"
    steps = len(stream_models.STEPS)
    await asyncio.sleep(0.2)
    assert len(stream_models.STEPS) == steps
    inflight = raw_redis.keys(protocol.inflight_key("counter", "*"))
    assert all(raw_redis.llen(k) == 0 for k in inflight)


async def test_closing_a_stream_cancels_it_at_the_next_step(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await _slow_counter(start_worker, redis_url, monkeypatch, 0.02)
    async with Client(redis_url) as client:
        stream = client.stream("counter", {"n": 10_000}, 20)
        assert [await anext(stream), await anext(stream)] == ["0", "1"]
        await stream.aclose()
        await _assert_dropped(raw_redis, stream.request_id)


# --- HTTP -------------------------------------------------------------------------
@asynccontextmanager
async def gateway(url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(GatewayConfig(), RedisSettings(url))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=10) as http:
            yield http


def _sse(text: str) -> list[dict[str, Any]]:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [orjson.loads(e[len("data: "):]) for e in events]


async def test_http_sse_ndjson_and_v2_generate_stream(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([generate_model(max_batch_size=8), counter()])
    await wait_live(redis_url, "generate")
    body = {"prompt": "hello", "max_tokens": 6}
    async with gateway(redis_url) as http:
        sse = await http.post("/v1/models/generate/predict", json=body,
                              headers={"accept": "text/event-stream"})
        assert sse.status_code == 200
        assert sse.headers["content-type"].startswith("text/event-stream")
        events = _sse(sse.text)
        assert [e["seq"] for e in events[:-1]] == list(range(6))
        assert events[-1]["last"] is True and events[-1]["timings"]["steps"] == 7
        text = "".join(e["text"] for e in events[:-1])
        nd = await http.post("/v1/models/generate/predict", json=body)
        assert nd.headers["content-type"].startswith("application/x-ndjson")
        lines = [orjson.loads(line) for line in nd.text.splitlines()]
        assert "".join(e["text"] for e in lines[:-1]) == text  # seeded, greedy
        assert lines[-1]["last"] is True
        v2 = await http.post("/v2/models/generate/generate_stream",
                             json={"text_input": "hello", "max_tokens": 6})
        v2_events = _sse(v2.text)
        assert "".join(e["text_output"] for e in v2_events) == text
        assert v2_events[0]["model_name"] == "generate"
        whole = await http.post("/v2/models/generate/generate",
                                json={"text_input": "hello", "parameters": {"max_tokens": 6}})
        assert whole.json()["text_output"] == text
        listing = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
        assert listing["generate"]["streaming"] is True
        failed = await http.post("/v1/models/counter/predict", json={"n": 3, "fail": 0})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_error"
        late = await http.post("/v1/models/counter/predict", json={"n": 3, "fail": 1})
        assert late.status_code == 200  # the failure comes after a chunk: the last event
        assert [e.get("error", {}).get("code") for e in
                [orjson.loads(x) for x in late.text.splitlines()]] == [None, "model_error"]


async def test_a_generate_answer_over_its_byte_limit_is_refused_and_cancelled(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """v2 ``generate`` gathers the chunks in the gateway: past ``GENERATE_MAX_BYTES``
    (here 2 KB) it answers 400 naming ``generate_stream``, and the stream
    is cancelled (before: no limit, 300 MB gathered for one call)."""
    from redbatch import defaults

    monkeypatch.setattr(defaults, "GENERATE_MAX_BYTES", 2000)
    start_worker([counter()])
    await wait_live(redis_url, "counter")
    async with gateway(redis_url) as http:
        small = await http.post("/v2/models/counter/generate", json={"n": 3})
        assert small.status_code == 200 and small.json()["text_output"] == "012"
        big = await http.post("/v2/models/counter/generate", json={"n": 100_000})
    assert big.status_code == 400 and "generate_stream" in big.text, big.text
    assert raw_redis.zcard(protocol.cancelled_key("counter")) == 1


def test_a_caller_leaves_a_bounded_number_of_bytes_unread() -> None:
    """A stream fails on this side once its unread chunks hold more than
    ``STREAM_MAX_BUFFERED_BYTES`` (before: only their number was bounded, 4,096 chunks
    of up to 16 MiB each)."""
    from redbatch.producer.streams import ChunkQueue

    big = protocol.STREAM_MAX_BUFFERED_BYTES // 2 + 1

    async def run() -> None:
        queue = ChunkQueue("r1", protocol.now_ms() + 10_000)
        queue.put(StreamChunk("r1", 0, "a", size=big))
        assert (await queue.get()).payload == "a"  # read: its bytes no longer count
        queue.put(StreamChunk("r1", 1, "b", size=big))
        queue.put(StreamChunk("r1", 2, "c", size=big))  # over: the stream fails
        assert (await queue.get()).payload == "b"
        with pytest.raises(QueueFull, match="bytes left unread"):
            await queue.get()

    asyncio.run(run())


# --- a worker that dies mid-stream ------------------------------------------------
async def _ledger(client: Client, model: str, n: int) -> tuple[list[int], str]:
    """A stream's chunk numbers as they came, and how it ended (``ok`` or the code)."""
    seqs: list[int] = []
    try:
        async for chunk in client.stream(model, {"n": n}, 30, chunks=True):
            seqs.append(chunk.seq)
    except WorkerCrashed as exc:
        return seqs, exc.code
    return seqs, "ok"


@pytest.mark.e2e
async def test_worker_killed_mid_stream_ends_started_streams_with_a_typed_error(
        spawn: Callable[..., Proc], redis_url: str, raw_redis: redis.Redis,
        tmp_path: Path) -> None:
    """The replica dies once, at chunk 3 of a batch of 4 streams; its restart reaps it
    and serves the 2 streams that waited.  A ledger of every stream's chunks."""
    env = test_env(STREAM_DIE_AT="3", STREAM_STEP_S="0.05",
                   STREAM_DIE_FILE=str(tmp_path / "died"), **FAST_LEASE)
    spawn(redbatch_cmd("worker", "tests.stream_models:crasher", "--redis-url", redis_url,
                       "--lease-ttl-s", "1"), env=env, name="crasher")
    await wait_live(redis_url, "crasher")
    async with Client(redis_url) as client:
        streams = [asyncio.create_task(_ledger(client, "crasher", 8)) for _ in range(6)]
        ledgers = await asyncio.wait_for(asyncio.gather(*streams), 25)
        assert client.stats()["duplicates"] == 0
    assert (tmp_path / "died").exists()
    crashed = [seqs for seqs, end in ledgers if end == "worker_crashed"]
    served = [seqs for seqs, end in ledgers if end == "ok"]
    assert len(crashed) == 4 and len(served) == 2  # the batch of 4; the 2 that waited
    assert all(seqs == [0, 1, 2] for seqs in crashed)  # no gap, no repeat, no re-run
    assert all(seqs == list(range(8)) for seqs in served)
    inflight = raw_redis.keys(protocol.inflight_key("crasher", "*"))
    assert all(raw_redis.llen(k) == 0 for k in inflight)


@pytest.mark.e2e
async def test_http_client_that_disconnects_cancels_its_stream(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await _slow_counter(start_worker, redis_url, monkeypatch, 0.02)
    sse = {"accept": "text/event-stream"}
    async with served(redis_url) as http, http.stream(
            "POST", "/v1/models/counter/predict", json={"n": 10_000}, headers=sse) as response:
        request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                break  # and hang up
    await _assert_dropped(raw_redis, request_id)


def _scraped(text: str, name: str) -> float:
    """The sample ``name{model="counter"}`` of a /metrics scrape (0: none yet)."""
    for family in text_string_to_metric_families(text):
        for each in family.samples:
            if each.name == name and each.labels.get("model") == "counter":
                return float(each.value)
    return 0.0


async def test_a_streamed_answer_is_in_flight_and_timed_to_its_last_chunk(
        start_worker: Callable[..., Worker], redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first chunk is timed on its own; its request duration is observed, and it
    leaves the in-flight gauge, once the last chunk is sent, not at the first."""
    await _slow_counter(start_worker, redis_url, monkeypatch, 0.05)
    async with served(redis_url) as http:
        await http.post("/v1/models/counter/predict", json={"n": 1})  # the model known
        before = (await http.get("/metrics")).text
        durations = _scraped(before, "redbatch_request_duration_seconds_count")
        firsts = _scraped(before, "redbatch_stream_first_chunk_seconds_count")
        async with http.stream("POST", "/v1/models/counter/predict", json={"n": 20},
                               headers={"accept": "text/event-stream"}) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    break
            mid = (await http.get("/metrics")).text
            assert _scraped(mid, "redbatch_stream_first_chunk_seconds_count") == firsts + 1
            assert _scraped(mid, "redbatch_inflight_requests") == 1  # still streaming
            assert _scraped(mid, "redbatch_request_duration_seconds_count") == durations
            events = [line async for line in lines if line.startswith("data:")]
            assert '"last":true' in events[-1]
        for _ in range(100):  # counted once the server has sent the last event
            after = (await http.get("/metrics")).text
            if _scraped(after, "redbatch_inflight_requests") == 0:
                break
            await asyncio.sleep(0.02)
        assert _scraped(after, "redbatch_request_duration_seconds_count") == durations + 1
        assert _scraped(after, "redbatch_inflight_requests") == 0
        assert _scraped(after, "redbatch_stream_first_chunk_seconds_count") == firsts + 1


# --- the stream reaper, on entries laid out by hand --------------------------------
def _entry(reply_to: str, attempt: int = 0, fmt: Format = "msgpack"
           ) -> tuple[protocol.Request, bytes]:
    now = protocol.now_ms()
    request = protocol.Request(protocol.new_id(), "counter", now, now + 30_000, reply_to,
                               {"n": 3}, attempt)
    return request, codec.encode(request.to_wire(), fmt)


async def test_the_stream_reaper_ends_started_streams_and_requeues_the_others(
        redis_url: str, raw_redis: redis.Redis) -> None:
    reply_to = protocol.reply_key("counter", "c1")
    started, started_raw = _entry(reply_to, fmt="json")
    fresh, fresh_raw = _entry(reply_to)
    answered, answered_raw = _entry(reply_to)
    spent, spent_raw = _entry(reply_to, attempt=2)  # max_attempts 3: may not run again
    raw_redis.set(protocol.request_key("counter", started.id), "s2")
    raw_redis.set(protocol.request_key("counter", fresh.id), "q")
    raw_redis.set(protocol.request_key("counter", answered.id), "d")
    raw_redis.rpush(protocol.inflight_key("counter", "dead"), started_raw, fresh_raw,
                    answered_raw, spent_raw)
    raw_redis.zadd(protocol.workers_key("counter"), {"dead": protocol.now_ms() - 1000})
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await StreamReaper(client, "counter", max_attempts=3).reap("dead") == 1
    finally:
        await client.aclose()
    finals = [codec.decode(raw) for raw in raw_redis.lrange(reply_to, 0, -1)]
    assert [(m["id"], m["seq"], m["last"], m["ok"], m["error"]["code"]) for m in finals] == [
        (started.id, 2, True, False, "worker_crashed"), (spent.id, 0, True, False,
                                                         "worker_crashed")]
    requeued = [codec.decode(raw) for raw in raw_redis.lrange(protocol.queue_key("counter"),
                                                              0, -1)]
    assert [(r["id"], r["attempt"]) for r in requeued] == [(fresh.id, 1)]
    assert raw_redis.lrange(protocol.dead_letter_key("counter"), 0, -1) == [spent_raw]
    assert not raw_redis.exists(protocol.inflight_key("counter", "dead"))
    assert raw_redis.get(protocol.request_key("counter", started.id)) == b"d"


async def test_stream_and_predict_on_the_wrong_kind_of_model_fail_at_once(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([counter(), adder])
    await wait_live(redis_url, "counter")
    await wait_live(redis_url, "adder")
    async with Client(redis_url) as client:
        with pytest.raises(InvalidPayload, match="does not stream"):
            await _collect(client, "adder", 1, timeout_s=20)
        with pytest.raises(InvalidPayload, match="streams its answers"):
            await asyncio.wait_for(client.predict("counter", {"n": 2}, 20), 5)


async def test_v2_infer_on_a_streaming_model_names_the_generate_endpoints(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([counter()])
    await wait_live(redis_url, "counter")
    body = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [2]}]}
    async with gateway(redis_url) as http:
        for path in ("/v2/models/counter/infer", "/v2/models/counter/versions/1/infer"):
            resp = await http.post(path, json=body)
            assert resp.status_code == 400, resp.text
            assert "generate_stream" in resp.json()["error"], resp.text


async def test_a_priority_header_a_streaming_model_lacks_is_refused(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """A streaming model has one priority level: ``X-Redbatch-Priority`` may name it (1,
    or 0 for the default) on v1 and on v2 generate; anything else is a 400 naming the
    header (it was ignored: 200)."""
    start_worker([counter()])
    await wait_live(redis_url, "counter")
    calls = [("/v1/models/counter/predict", {"n": 2}),
             ("/v2/models/counter/generate", {"n": 2}),
             ("/v2/models/counter/generate_stream", {"n": 2})]
    async with gateway(redis_url) as http:
        for path, body in calls:
            for level in ("abc", "2", "-1", "99999999999999999999"):
                resp = await http.post(path, json=body,
                                       headers={"x-redbatch-priority": level})
                assert resp.status_code == 400, (path, level, resp.text)
                assert "X-Redbatch-Priority" in resp.text, resp.text
            for level in ("1", "0"):
                resp = await http.post(path, json=body,
                                       headers={"x-redbatch-priority": level})
                assert resp.status_code == 200, (path, level, resp.text)


async def test_bench_naive_server_streams_one_request_at_a_time() -> None:
    server = NaiveServer(step_ms=0)
    task = asyncio.create_task(server.serve())
    try:
        tokens, wall_s, ttft = await _drive(server.stream, streams=3, per_stream=2, seed=1)
    finally:
        task.cancel()
    assert len(ttft) == 6 and wall_s > 0
    assert MIN_TOKENS * 6 <= tokens <= MAX_TOKENS * 6
    row = Result("naive", 0, 3, 6, tokens, wall_s, ttft).row()
    assert row["ttft_p50_ms"] <= row["ttft_p95_ms"]


def test_the_step_script_sends_each_seq_once_acks_finals_and_drops_cancelled(
        raw_redis: redis.Redis) -> None:
    reply_to = protocol.reply_key("counter", "c1")
    inflight, queue = protocol.inflight_key("counter", "w1"), protocol.queue_key("counter")
    one, one_raw = _entry(reply_to)
    two, two_raw = _entry(reply_to)
    gone, gone_raw = _entry(reply_to)
    raw_redis.rpush(inflight, one_raw, two_raw, gone_raw)
    raw_redis.rpush(queue, b"next", b"later")
    raw_redis.zadd(protocol.cancelled_key("counter"), {gone.id: protocol.now_ms() + 9000})
    step = raw_redis.register_script(lua_stream.STEP)

    def send(*messages: tuple[protocol.Request, bytes, int, bool]) -> Any:
        keys = [inflight, queue, protocol.cancelled_key("counter")]
        args: list[Any] = [60, 0, 60_000, len(messages)]
        for request, raw, seq, last in messages:
            keys += [protocol.request_key("counter", request.id), reply_to]
            args += [raw, seq, int(last), 30_000, f"{request.id}:{seq}", request.id]
        return step(keys=keys, args=args)

    # the cancelled one is dropped and acked, and its place taken at once
    assert send((one, one_raw, 0, False), (two, two_raw, 0, False),
                (gone, gone_raw, 0, False)) == [[0, 0, 2], [b"next"], 1]
    # a repeat of an entry still ours: not sent; its stream ends with a typed error,
    # numbered as its caller expects, and the entry is acked
    assert send((one, one_raw, 0, False)) == [[4], [b"later"], 1]
    assert send((two, two_raw, 1, True)) == [[0], [], 1]  # the final: sent, acked
    replies = raw_redis.lrange(reply_to, 0, -1)
    assert [replies[0], replies[1], replies[3]] == [f"{one.id}:0".encode(),
                                                    f"{two.id}:0".encode(),
                                                    f"{two.id}:1".encode()]
    lost = codec.decode(replies[2])
    assert (lost["id"], lost["seq"], lost["last"], lost["error"]["code"]) == \
        (one.id, 1, True, "internal")
    assert raw_redis.lrange(inflight, 0, -1) == [b"next", b"later"]
    assert [raw_redis.get(protocol.request_key("counter", r.id)) for r in (one, two, gone)] \
        == [b"d", b"d", b"d"]
