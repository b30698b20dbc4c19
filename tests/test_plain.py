"""The plain path (``redbatch.producer.plain``): a model served without versions, in
one sub-queue, and no pipeline, skips the full path's steps; a model that leaves the
plain case live (sub-queues raised, a version added, a pipeline of its name, its last
worker gone) is routed as the full path routes it once the caches refresh, never stuck
on the plain path; the gateway's look-up skips its steps alike, for no pinned version."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import NoReturn

import httpx
import orjson
import pytest
import redis
from starlette.applications import Starlette

from redbatch import Client, Model, batch, protocol
from redbatch.config import RedisSettings
from redbatch.errors import NoLiveWorkers
from redbatch.pipelines import Pipeline
from redbatch.pipelines.definition import publish_sync
from redbatch.producer.plain import PlainModels
from redbatch.registry import LiveSummary
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import FAST_WORKER, wait_live
from tests.test_gateway import gateway_app
from tests.test_shards import markers
from tests.test_versions import _answers_become, adder, version

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@batch(name="warm", max_batch_size=16, batch_wait_timeout_s=0)
def warm(xs: list[int]) -> list[int]:
    return [x * 2 for x in xs]


@batch(name="inc", max_batch_size=16, batch_wait_timeout_s=0)
def inc(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


async def _plain_now(client: Client, model: str, value: int, expected: int) -> None:
    """A few requests answered; by then the client takes ``model`` as plain."""
    assert await asyncio.gather(*(client.predict(model, value) for _ in range(5))) == \
        [expected] * 5
    assert client.direct(model)


async def _direct_again(client: Client, model: str) -> None:
    """The cached summary read anew if a second old (the plain path reads nothing, so
    a slow test would leave it): the client still takes ``model`` as plain."""
    await client.live_workers(model)
    assert client.direct(model)


@asynccontextmanager
async def _worker(redis_url: str, model: Model) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """A worker of ``model``, live; yields the function that stops it (and waits)."""
    stop = asyncio.Event()
    task = asyncio.create_task(Worker([model], RedisSettings(redis_url), FAST_WORKER).run(stop))

    async def stopped() -> None:
        stop.set()
        await asyncio.wait_for(task, 10)

    await wait_live(redis_url, model.name)
    try:
        yield stopped
    finally:
        await stopped()


class _FullPath(Exception):
    """Raised by a patched full path: the request did not take the plain one."""


async def test_a_plain_model_takes_no_step_of_the_full_path(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([warm])
    await wait_live(redis_url, "warm")
    async with Client(redis_url) as client:
        await _plain_now(client, "warm", 1, 2)

        async def full_path(*_args: object) -> NoReturn:
            raise _FullPath

        client._resolve = full_path
        await _direct_again(client, "warm")  # no await between it and the submit
        assert await client.predict("warm", 3) == 6
        await _direct_again(client, "warm")
        assert await client.predict_many("warm", [1, 2, 3]) == [2, 4, 6]
        with pytest.raises(_FullPath):  # a version pinned: the full path
            await client.predict("warm", 3, version="1")


async def test_a_plain_model_given_sub_queues_live_spreads_over_them(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, redis_url: str) -> None:
    start_worker([warm])
    await wait_live(redis_url, "warm")
    tags = protocol.sub_queue_tags("warm", 3)
    async with Client(redis_url, pack_rows=1) as client:
        await _plain_now(client, "warm", 1, 2)
        await client.configure("warm", sub_queues=3)
        await asyncio.sleep(1.3)  # the cached count is a second old at most
        ticks = [await asyncio.gather(*(client.predict("warm", v) for v in range(s, s + 3)))
                 for s in range(0, 60, 3)]  # 20 ticks, a choice each
        assert [a for tick in ticks for a in tick] == [2 * v for v in range(60)]
        assert not client.direct("warm")
    assert markers(raw_redis, tags[1]) + markers(raw_redis, tags[2]) > 0


async def test_a_plain_model_given_a_version_live_follows_its_weights(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([Model("vm", fn=adder(0), policy=BatchPolicy(max_batch_size=4,
                                                               batch_wait_timeout_s=0.002))])
    await wait_live(redis_url, "vm")
    async with Client(redis_url) as client:
        await _plain_now(client, "vm", 1, 1)
        start_worker([version(2)])
        await wait_live(redis_url, "vm@2")
        await client.versions("vm", weights={"1": 0, "2": 100})
        await asyncio.sleep(1.0)  # the cached table is a second old at most
        await _answers_become(client, {201})
        assert not client.direct("vm")


async def test_a_plain_model_that_a_pipeline_takes_the_name_of_enters_it(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, redis_url: str) -> None:
    start_worker([warm])
    start_worker([inc])  # a worker that serves a model of the pipeline's name refuses it
    await wait_live(redis_url, "warm")
    await wait_live(redis_url, "inc")
    async with Client(redis_url) as client:
        await _plain_now(client, "warm", 3, 6)
        publish_sync(raw_redis, [Pipeline("warm", ["inc"])])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4.0  # the registry is read once a second at most
        while (answer := await client.predict("warm", 3)) != 4:
            assert answer == 6
            assert loop.time() < deadline, "still served as the plain model"
            await asyncio.sleep(0.05)
        assert not client.direct("warm")


async def test_a_plain_model_whose_worker_stops_is_refused(
        raw_redis: redis.Redis, redis_url: str) -> None:
    async with _worker(redis_url, warm) as stop, Client(redis_url) as client:
        await _plain_now(client, "warm", 1, 2)
        await stop()
        await asyncio.sleep(1.2)  # past the cached summary
        with pytest.raises(NoLiveWorkers):
            await client.predict("warm", 1, timeout_s=2)
        # the summary read just now, which shows no worker, is fresh: refused again
        with pytest.raises(NoLiveWorkers):
            await client.predict("warm", 1, timeout_s=2)
    assert raw_redis.llen(protocol.queue_key("warm")) == 0


async def test_the_gateway_refuses_a_version_of_a_plain_model_and_one_gone(
        redis_url: str) -> None:
    async with _worker(redis_url, warm) as stop, gateway_app(redis_url) as (app, http):
        for value in range(3):
            resp = await http.post("/v1/models/warm/predict", json={"inputs": value})
            assert resp.json() == {"outputs": 2 * value}
        await _direct_again(app.state.gateway.client, "warm")
        resp = await http.post("/v1/models/warm/versions/7/predict", json={"inputs": 1})
        assert resp.status_code == 404, resp.text
        resp = await http.post("/v1/models/warm/versions/1/predict", json={"inputs": 1})
        assert resp.status_code == 200, resp.text
        await stop()
        await asyncio.sleep(1.2)  # past the cached summary
        for _ in range(2):  # read anew, then the fresh summary that shows no worker
            resp = await http.post("/v1/models/warm/predict", json={"inputs": 1},
                                   headers={"X-Redbatch-Timeout-Ms": "2000"})
            assert resp.status_code == 503, resp.text


async def test_the_gateway_judges_a_plain_model_once_per_request(redis_url: str) -> None:
    """The plain verdict is taken when the request arrives and passed down, judged once
    more after the body read (a cached verdict) and nowhere else: no judging in the
    look-up or the submit, and no look-up step (the info from the directory's fresh
    cache, no routing, no live-worker check), while the answer is unchanged."""
    async with _worker(redis_url, warm), gateway_app(redis_url) as (app, http):
        client = await _gateway_plain(app, http)
        judged: list[str] = []
        plain = client._plain.plain

        def counted(model: str) -> bool:
            judged.append(model)
            return plain(model)

        async def full_path(*_args: object) -> NoReturn:
            raise _FullPath

        client._plain.plain = counted
        client._resolve = full_path
        app.state.gateway.core.served = full_path
        resp = await http.post("/v1/models/warm/predict", json={"inputs": 5})
        assert resp.status_code == 200 and resp.json() == {"outputs": 10}, resp.text
        assert judged == ["warm", "warm"]


async def test_a_pipeline_that_takes_the_name_during_a_slow_upload_gets_the_request(
        start_worker: Callable[..., Worker], raw_redis: redis.Redis, redis_url: str) -> None:
    """The plain verdict taken when the request arrived does not outlive the body read:
    a pipeline of the model's name, learned while the body was on its way, serves it."""
    start_worker([warm])
    start_worker([inc])
    await wait_live(redis_url, "inc")
    async with gateway_app(redis_url) as (app, http):
        client = await _gateway_plain(app, http)
        body, sent = asyncio.Event(), []

        async def receive() -> dict[str, object]:
            await body.wait()  # the upload ends once the pipeline is known
            return {"type": "http.request", "body": b'{"inputs": 3}', "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/models/warm/predict",
                 "headers": [(b"content-type", b"application/json")], "query_string": b""}
        task = asyncio.create_task(app.state.gateway.core.serve("warm", scope, receive,
                                                                send))
        await asyncio.sleep(0.05)  # judged plain, waiting for its body
        publish_sync(raw_redis, [Pipeline("warm", ["inc"])])
        for _ in range(100):  # the client learns of it (the book is read once a second)
            if await client.predict("warm", 3) == 4:  # the pipeline's stage: 3 + 1
                break
            await asyncio.sleep(0.05)
        assert not client.direct("warm")
        body.set()
        await task
        assert sent[0]["status"] == 200 and orjson.loads(sent[1]["body"]) == {"outputs": 4}


async def _gateway_plain(app: Starlette, http: httpx.AsyncClient) -> Client:
    """The gateway's client, once a few requests for ``warm`` are answered and it takes
    ``warm`` as plain; the directory's entry fetched anew as well (fresh for
    ``META_REFRESH_S`` from now: a slow test would leave it stale, and the look-up
    step would run)."""
    for value in range(3):
        resp = await http.post("/v1/models/warm/predict", json={"inputs": value})
        assert resp.json() == {"outputs": 2 * value}
    client: Client = app.state.gateway.client
    await _direct_again(client, "warm")
    directory = app.state.gateway.core.directory
    directory._cache.pop("warm", None)
    await directory.get("warm")
    return client


class _Book:
    """A pipeline book that answers for every name, from ``pipelines``."""

    def __init__(self) -> None:
        self.pipelines: dict[str, object] = {}
        self.changes = 0

    def settled(self, name: str) -> bool:
        return True

    def known(self, name: str) -> object:
        return self.pipelines.get(name)

    def quiet_until(self) -> float:
        return float("inf")


class _Summaries:
    """Admission's cached summaries: ``summary``, fresh for 50 ms from its read."""

    def __init__(self, summary: LiveSummary) -> None:
        self.summary = summary

    def summary_cached(self, model: str) -> LiveSummary | None:
        return self.summary if time.monotonic() <= self.fresh_until(self.summary) else None

    def fresh_until(self, summary: LiveSummary) -> float:
        return summary.at + 0.05


def test_a_plain_verdict_ends_when_the_book_changes_or_the_summary_goes_stale() -> None:
    summary = LiveSummary(at=time.monotonic(), live=1, items_per_s=0.0, rows=True,
                          known=True)
    book, summaries = _Book(), _Summaries(summary)
    plain = PlainModels(summaries, book)  # type: ignore[arg-type]
    assert plain.plain("m") and plain.plain("m")
    book.pipelines["m"] = object()  # a read landed: a pipeline took the name
    book.changes += 1
    assert not plain.plain("m")
    del book.pipelines["m"]
    book.changes += 1
    assert plain.plain("m")
    time.sleep(0.06)  # the summary judged goes stale: no verdict outlives it
    assert not plain.plain("m")
    summaries.summary = replace(summary, at=time.monotonic(), sub_queues=2)
    assert not plain.plain("m")
    summaries.summary = replace(summary, at=time.monotonic())
    assert plain.plain("m")
