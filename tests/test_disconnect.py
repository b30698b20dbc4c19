"""Clients that go away: a disconnected HTTP client frees its waiter at once, and its
queued request is skipped by the worker, not computed."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
import redis
import uvicorn
from prometheus_client import REGISTRY

from redbatch import GatewayConfig, Model, RedisSettings, batch, protocol
from redbatch.api import create_app, streaming
from redbatch.api.gateway import Gateway
from redbatch.embedded import free_port
from redbatch.errors import BadRequest
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import connected, ping_once_ended, wait_live
from tests.test_gateway import _wait_registered

pytestmark = pytest.mark.e2e


@batch(name="echo", batch_wait_timeout_s=0)
def echo(xs: list[int]) -> list[int]:
    return xs


def recording_model() -> tuple[Model, threading.Event, list[int]]:
    """A model whose first pass waits for ``release``, recording every input it runs."""
    release, seen = threading.Event(), []

    def forward(xs: list[int]) -> list[int]:
        seen.extend(xs)
        release.wait(20)
        return xs

    policy = BatchPolicy(max_batch_size=1, batch_wait_timeout_s=0)
    return Model("held", fn=forward, policy=policy), release, seen


@asynccontextmanager
async def served(url: str, **config: object) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway under a real uvicorn (disconnects are real), on a free port."""
    port = free_port()
    app = create_app(GatewayConfig(**config), RedisSettings(url))  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            yield http
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


async def send_and_leave(http: httpx.AsyncClient, model: str, value: int
                         ) -> asyncio.StreamWriter:
    """Send a whole predict request on a connection of its own; the caller closes it."""
    port = http.base_url.port
    assert port is not None
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = orjson.dumps({"inputs": value})
    writer.write(b"POST /v1/models/%s/predict HTTP/1.1\r\nhost: gw\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (model.encode(), len(body), body))
    await writer.drain()
    return writer


async def test_disconnected_clients_free_their_waiters(start_worker: Callable[..., Worker],
                                                       redis_url: str) -> None:
    held, release, _seen = recording_model()
    start_worker([held])
    start_worker([echo])  # a worker of its own: the held one blocks its thread
    try:
        async with served(redis_url, max_waiters=20, default_timeout_s=20) as http:
            await _wait_registered(http)
            before = {o: outcomes("held", o) for o in ("cancelled", "invalid")}
            writers = [await send_and_leave(http, "held", i) for i in range(20)]
            await until(http, lambda stats: stats["waiting"] == 20)  # the waiters are full
            for writer in writers:
                writer.close()
            await until(http, lambda stats: stats["waiting"] == 0)  # freed on disconnect
            for _ in range(250):  # counted as the answers nobody reads are made
                if outcomes("held", "cancelled") == before["cancelled"] + 20:
                    break
                await asyncio.sleep(0.02)
            assert outcomes("held", "cancelled") == before["cancelled"] + 20
            assert outcomes("held", "invalid") == before["invalid"]  # they sent nothing bad
            resp = await http.post("/v1/models/echo/predict", json={"inputs": 7})
            assert resp.status_code == 200, resp.text  # not 503 max_waiters
            assert (await http.get("/v1/stats")).json()["waiting"] == 0
    finally:
        release.set()


def outcomes(model: str, outcome: str) -> float:
    found = REGISTRY.get_sample_value("redbatch_requests_total",
                                      {"model": model, "outcome": outcome})
    return found or 0.0


async def until(http: httpx.AsyncClient, done: Callable[[dict[str, int]], bool],
                timeout_s: float = 20.0) -> None:
    """Poll the gateway's /v1/stats until ``done`` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not done((await http.get("/v1/stats")).json()):
        assert time.monotonic() < deadline, "timed out waiting on the gateway's stats"
        await asyncio.sleep(0.02)


async def test_a_cancelled_queued_request_is_not_computed(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    held, release, seen = recording_model()
    worker = start_worker([held])
    try:
        async with served(redis_url, default_timeout_s=20) as http:
            await _wait_registered(http)
            first = asyncio.create_task(http.post("/v1/models/held/predict",
                                                  json={"inputs": 0}))
            for _ in range(1000):  # the first request holds the worker
                if seen:
                    break
                await asyncio.sleep(0.02)
            writers = [await send_and_leave(http, "held", i) for i in range(1, 6)]
            await until(http, lambda stats: stats["waiting"] == 6)  # queued behind it
            for writer in writers:
                writer.close()
            for _ in range(500):  # the gateway marks them cancelled
                if raw_redis.zcard(protocol.cancelled_key("held")) == 5:
                    break
                await asyncio.sleep(0.02)
            release.set()
            assert (await first).status_code == 200
            resp = await http.post("/v1/models/held/predict", json={"inputs": 99})
            assert resp.status_code == 200 and resp.json() == {"outputs": 99}
    finally:
        release.set()
    assert seen == [0, 99]  # 1-5 were skipped, not computed
    assert worker.runners[0].claimer.skipped == 5
    assert raw_redis.llen(protocol.queue_key("held")) == 0


def _inc(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


async def test_a_disconnected_pipeline_request_is_skipped_at_its_next_stage(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """A pipeline request whose client went away is marked cancelled at every stage:
    queued at the held second stage, it is skipped there, never computed."""
    from redbatch.pipelines import Pipeline
    from tests.test_pipelines import Workers

    held, release, seen = recording_model()
    pipe = Pipeline("hp", ["pinc", "held"])
    workers = Workers(redis_url)
    workers.start([Model("pinc", fn=_inc, policy=BatchPolicy(batch_wait_timeout_s=0),
                         inline=True)], [pipe])
    workers.start([held], [pipe])
    try:
        await wait_live(redis_url, "hp")
        async with served(redis_url, default_timeout_s=20) as http:
            first = asyncio.create_task(http.post("/v1/models/hp/predict", json={"inputs": 0}))
            for _ in range(1000):  # the first request holds the second stage
                if seen:
                    break
                await asyncio.sleep(0.02)
            writers = [await send_and_leave(http, "hp", i) for i in range(1, 6)]
            await until(http, lambda stats: stats["waiting"] == 6)
            for _ in range(500):  # past the first stage, at the second
                if not raw_redis.llen(protocol.queue_key("pinc")):
                    break
                await asyncio.sleep(0.02)
            for writer in writers:
                writer.close()
            marked = [protocol.cancelled_key(stage) for stage in ("pinc", "held")]
            for _ in range(500):  # the gateway marks them cancelled at each stage
                if [raw_redis.zcard(key) for key in marked] == [5, 5]:
                    break
                await asyncio.sleep(0.02)
            assert [raw_redis.zcard(key) for key in marked] == [5, 5]
            release.set()
            assert (await first).json() == {"outputs": 1}
            resp = await http.post("/v1/models/hp/predict", json={"inputs": 98})
            assert resp.status_code == 200 and resp.json() == {"outputs": 99}
    finally:
        release.set()
        await workers.stop_all()
    assert seen == [1, 99]  # 2-6 were skipped at the second stage, not computed


async def test_the_gateways_watchers_end_before_its_client_closes(redis_url: str) -> None:
    """A disconnect watcher or cancel mark still under way when the gateway stops ends
    (cancelled) before the client's pool closes: one that marked after would take a
    connection of the closed pool and leave it open."""
    gateway = Gateway(GatewayConfig(), RedisSettings(redis_url))
    await gateway.start()
    pool = gateway.client.redis.connection_pool
    watching = asyncio.Event()
    task = asyncio.create_task(ping_once_ended(gateway.client.redis, watching))  # a mark
    gateway.core._watchers.add(task)
    await watching.wait()
    await gateway.close()
    assert task.cancelled() and connected(pool) == 0


async def test_a_call_that_swallows_its_cancel_and_fails_later_is_not_logged() -> None:
    """A client hangs up while the gateway waits: the call is cancelled, but swallows
    the cancel (as ``wait_for`` may on Python 3.11) and fails once the stream is
    closed, with nobody left to wait for it.  Its error is read, not logged by asyncio
    as "Task exception was never retrieved" (an ERROR with a traceback)."""
    release = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await release.wait()
        raise BadRequest("the stream was closed")

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        with pytest.raises(BadRequest, match="disconnected before the answer"):
            await streaming.unless_gone(work(), receive)
        release.set()
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert not unretrieved, unretrieved
