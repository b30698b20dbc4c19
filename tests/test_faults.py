"""Redis faults: an outage mid-load, recovery without restarts, retried pushes,
and the start-up check for eviction."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from redbatch import (
    Client,
    DeadlineExceeded,
    Model,
    RedbatchError,
    RedisUnavailable,
    batch,
    protocol,
)
from redbatch.checks import check_eviction
from redbatch.config import RedisSettings, WorkerConfig
from redbatch.levels import ONE
from redbatch.producer.enqueuer import Turn, _target
from redbatch.worker.process import Worker
from tests.conftest import RedisServer, wait_live
from tests.test_gateway import _wait_registered, gateway

pytestmark = [pytest.mark.e2e, pytest.mark.serial]
CONFIG = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=1.0)


@batch(name="echo", max_batch_size=16, batch_wait_timeout_s=0.002)
def echo(xs: list[int]) -> list[int]:
    return xs


async def _load(client: Client, stop: asyncio.Event, outcomes: list[tuple[str, float]]) -> None:
    i = 0
    while not stop.is_set():
        started = time.monotonic()
        try:
            assert await client.predict("echo", i, timeout_s=1.0) == i
            outcomes.append(("ok", time.monotonic() - started))
        except (RedisUnavailable, DeadlineExceeded) as exc:
            outcomes.append((exc.code, time.monotonic() - started))
            await asyncio.sleep(0.05)
        i += 1


async def test_redis_restart_mid_load(redis_server_factory: Callable[..., RedisServer],
                                      start_worker: Callable[..., Worker]) -> None:
    server = redis_server_factory()
    start_worker([echo], url=server.url, config=CONFIG)
    async with Client(server.url, block_timeout_s=0.5, require_workers=False) as client:
        stop, outcomes = asyncio.Event(), []
        loaders = [asyncio.create_task(_load(client, stop, outcomes)) for _ in range(8)]
        await asyncio.sleep(1.0)
        server.kill()
        await asyncio.sleep(1.5)
        errors_during = [o for o in outcomes if o[0] != "ok"]
        await asyncio.to_thread(server.start)  # same port, empty: scripts and data gone
        before = len(outcomes)
        await asyncio.sleep(4.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loaders), 10)
        after = outcomes[before:]
        assert client.waiting == 0
    assert errors_during, "the outage went unnoticed"
    assert all(elapsed < 1.0 + 3.0 for _code, elapsed in outcomes)  # deadline + slack
    assert [o for o in after[-20:] if o[0] != "ok"] == [], "did not recover"


async def test_gateway_answers_503_or_504_during_an_outage(
        redis_server_factory: Callable[..., RedisServer],
        start_worker: Callable[..., Worker]) -> None:
    server = redis_server_factory()
    start_worker([echo], url=server.url, config=CONFIG)
    async with gateway(server.url, default_timeout_s=1.0) as http:
        for _ in range(100):
            if (await http.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert (await http.post("/v1/models/echo/predict", json={"inputs": 1})).status_code \
            == 200
        server.kill()
        started = time.monotonic()
        statuses = [(await http.post("/v1/models/echo/predict", json={"inputs": 1})).status_code
                    for _ in range(5)]
        assert set(statuses) <= {503, 504} and time.monotonic() - started < 15
        await asyncio.to_thread(server.start)
        for _ in range(100):
            resp = await http.post("/v1/models/echo/predict", json={"inputs": 2})
            if resp.status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert resp.status_code == 200 and resp.json() == {"outputs": 2}


async def test_a_retried_push_is_not_queued_twice(redis_url: str) -> None:
    async with Client(redis_url) as client:
        request = client._request("m", 1, protocol.now_ms() + 5000, "fixed-id",
                                  client.reply_to("m"))
        entry = b"entry"
        for _ in range(3):  # e.g. the connection reset after the first push
            assert client._enqueuer is not None
            target = _target("m", (100, None), 0, ONE)
            accepted, depths = await client._enqueuer._run("m", target, [request], [entry],
                                                           Turn(None))
            assert accepted == 1
        assert depths == [1]
        assert await client.redis.llen(protocol.queue_key("m")) == 1


async def test_eviction_policy_warning(redis_server_factory: Callable[..., RedisServer]) -> None:
    risky = redis_server_factory("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    safe = redis_server_factory("--maxmemory", "100mb", "--maxmemory-policy", "noeviction")
    for server, expect_warning in ((risky, True), (safe, False)):
        client = aioredis.Redis.from_url(server.url)
        warning = await check_eviction(client)
        await client.aclose()
        assert (warning is not None) == expect_warning
        if warning:
            assert "allkeys-lru" in warning


def test_socket_timeout_longer_than_blocking() -> None:
    from redbatch.errors import ConfigError

    with pytest.raises(ConfigError):
        Client(settings=RedisSettings(socket_timeout_s=1.0), block_timeout_s=1.0)
    with pytest.raises(ConfigError):
        Worker([echo], RedisSettings(socket_timeout_s=1.5), WorkerConfig(block_timeout_s=1.0))


def _register(server: RedisServer, name: str) -> None:
    """A model's metadata and a live lease, as a worker's heartbeat leaves them."""
    raw = server.client()
    raw.set(protocol.meta_key(name), orjson.dumps(Model(name, fn=lambda xs: xs).meta()))
    raw.zadd(protocol.workers_key(name), {"w1": protocol.now_ms() + 60_000})
    raw.close()


@contextlib.contextmanager
def stalled(server: RedisServer) -> Iterator[list[float]]:
    """Redis paused (SIGSTOP) for the block; yields a list that receives the block's
    duration in seconds."""
    assert server.proc is not None
    elapsed: list[float] = []
    os.kill(server.proc.pid, signal.SIGSTOP)  # every look-up must now go to a dead Redis
    started = time.monotonic()
    try:
        yield elapsed
    finally:
        elapsed.append(time.monotonic() - started)
        os.kill(server.proc.pid, signal.SIGCONT)


V2_INFER = {"inputs": [{"name": "inputs", "shape": [1], "datatype": "INT64", "data": [1]}]}


TIMEOUT_HEADER = {"x-redbatch-timeout-ms": "1000"}


@pytest.mark.parametrize(("method", "path", "body", "headers"), [
    ("POST", "/v1/models/stalled/predict", {"inputs": 1}, TIMEOUT_HEADER),
    ("POST", "/v2/models/stalled/infer", V2_INFER, TIMEOUT_HEADER),
    # the caller's timeout in its body or query (they bounded nothing before the model's
    # look-up: a 503 after the 10 s socket timeout)
    ("POST", "/v1/models/stalled/predict", {"inputs": 1, "timeout_ms": 1000}, {}),
    ("GET", "/v1/models/stalled/predict?inputs=1&timeout_ms=1000", None, {}),
    ("POST", "/v2/models/stalled/infer", {**V2_INFER, "parameters": {"timeout": 1_000_000}},
     {}),
    ("POST", "/v2/models/stalled/generate", {"inputs": 1, "parameters": {"timeout_ms": 1000}},
     {}),
])
async def test_gateway_answers_by_the_deadline_while_redis_is_stalled(
        redis_server_factory: Callable[..., RedisServer], method: str, path: str, body: Any,
        headers: dict[str, str]) -> None:
    server = redis_server_factory()
    _register(server, "stalled")
    async with gateway(server.url, meta_refresh_s=0.1) as http:
        await asyncio.sleep(0.2)  # (the model's info cached at the start is stale)
        with stalled(server) as elapsed:
            resp = await http.request(method, path, json=body, headers=headers)
    assert resp.status_code == 504 and "deadline" in resp.text, resp.text
    assert elapsed[0] < 1.8, elapsed  # the deadline, not the 10 s socket timeout


async def test_readiness_answers_503_in_time_while_redis_is_stalled(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    """A readiness probe (Kubernetes waits 1 s by default) gets its 503 within
    ``PROBE_TIMEOUT_S``, not after the 10 s socket timeout."""
    server = redis_server_factory()
    _register(server, "stalled")
    server.client().zadd(protocol.MODELS_KEY, {"stalled": protocol.now_ms()})
    async with gateway(server.url, meta_refresh_s=0.1) as http:
        assert (await http.get("/readyz")).status_code == 200
        await asyncio.sleep(1.2)  # the model's cached live workers are stale
        with stalled(server) as elapsed:
            answers = [await http.get(path) for path in (
                "/readyz", "/v2/health/ready", "/v2/models/stalled/ready")]
    assert [a.status_code for a in answers] == [503, 503, 503], answers
    # (its code was deadline_exceeded, which protocol.md gives 504)
    assert answers[0].json()["error"]["code"] == "redis_unavailable"
    assert elapsed[0] < 3 * 1.2, elapsed  # three probes of at most 0.8 s each


async def test_a_metrics_scrape_answers_in_time_while_redis_is_stalled(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    """It answered after the 10 s socket timeout: Prometheus's default scrape timeout,
    the scrape failed."""
    server = redis_server_factory()
    _register(server, "stalled")
    server.client().zadd(protocol.MODELS_KEY, {"stalled": protocol.now_ms()})
    async with gateway(server.url, meta_refresh_s=0.1) as http:
        assert (await http.get("/metrics")).status_code == 200
        with stalled(server) as elapsed:
            resp = await http.get("/metrics")
    assert resp.status_code == 200 and "redbatch_queue_depth" in resp.text
    assert elapsed[0] < 2.0 + 1.0, elapsed  # (``metrics_view.READ_TIMEOUT_S``, and slack)


async def test_a_gateway_starts_in_time_on_a_stalled_redis(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    """Its start gives Redis ``CONNECT_TIMEOUT_S`` (before: the 10 s socket timeout,
    the port unbound meanwhile), then it serves: 503s until Redis answers."""
    server = redis_server_factory()
    _register(server, "stalled")
    with stalled(server):
        begun = time.monotonic()
        async with gateway(server.url) as http:
            assert (await http.get("/healthz")).status_code == 200
            serving_s = time.monotonic() - begun
    assert serving_s < 3.0, serving_s


async def test_client_fails_by_the_deadline_while_redis_is_stalled(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    """The client's worker look-up (a cold cache) counts against the request's deadline."""
    server = redis_server_factory()
    _register(server, "stalled")
    async with Client(server.url) as client:
        with stalled(server) as elapsed, pytest.raises(DeadlineExceeded):
            await client.predict("stalled", 1, timeout_s=1.0)
    assert elapsed[0] < 1.8, elapsed


async def test_a_pipeline_request_fails_by_its_deadline_while_redis_is_stalled(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    """Entering a pipeline's first stage (its levels, its cap, the hand-off) counts
    against the request's deadline (before: the 10 s socket timeout)."""
    from redbatch.pipelines import Pipeline
    from redbatch.pipelines.duty import pipeline_meta

    server = redis_server_factory()
    _register(server, "stalled")
    raw = server.client()
    first = Model("stalled", fn=lambda xs: xs).meta()
    raw.set(protocol.meta_key("stalledp"), orjson.dumps(
        pipeline_meta(Pipeline("stalledp", ["stalled", "other"]), first, None)))
    raw.zadd(protocol.workers_key("stalledp"), {"w1": protocol.now_ms() + 60_000})
    raw.hset(protocol.PIPELINES_KEY, "stalledp",
             Pipeline("stalledp", ["stalled", "other"]).to_json())
    raw.close()
    async with Client(server.url, require_workers=False) as client:  # as a gateway's
        warm = await client.submit("stalledp", 0, timeout_s=30)
        await asyncio.sleep(1.5)  # the first stage's cached levels and cap are stale
        with stalled(server) as elapsed, pytest.raises(DeadlineExceeded):
            await client.predict("stalledp", 1, timeout_s=1.0)
        warm.cancel()
    assert elapsed[0] < 1.8, elapsed


@pytest.mark.parametrize("priority", [None, 1])
async def test_a_sub_queue_or_level_look_up_ends_by_the_deadline_while_redis_is_stalled(
        redis_server_factory: Callable[..., RedisServer], priority: int | None) -> None:
    """A client that queues for workers to come (as a gateway's) reads a model's
    sub-queue count (and, for a request that asks for a priority, its levels first)
    once its cache is stale: by the request's deadline."""
    server = redis_server_factory()
    _register(server, "stalled")
    async with Client(server.url, require_workers=False) as client:
        warm = await client.submit("stalled", 0, timeout_s=30)
        await asyncio.sleep(1.5)  # the cached count is stale
        with stalled(server) as elapsed, pytest.raises(DeadlineExceeded):
            await client.predict("stalled", 1, timeout_s=1.0, priority=priority)
        warm.cancel()
    assert elapsed[0] < 1.8, elapsed


@pytest.mark.timeout(60)
async def test_closing_a_client_ends_a_push_stuck_on_a_stalled_redis(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    """A push still in flight once the close's drain is over ends with the close (its
    request fails), never left running past it."""
    server = redis_server_factory()
    _register(server, "stalled")
    client = Client(server.url)
    await client.start()
    warm = await client.submit("stalled", 0, timeout_s=30)  # the look-ups are cached
    enqueuer = client._enqueuer
    assert enqueuer is not None and not warm.done()
    with stalled(server):
        pending = await client.submit("stalled", 1, timeout_s=30)
        await asyncio.sleep(0.2)  # the push is written: its reply never comes
        assert enqueuer._tasks
        await client.close()
        assert not enqueuer._tasks  # ended, not left running on the closed pool
        with pytest.raises(RedbatchError):
            await pending
    warm.cancel()


@batch(name="plus1", max_batch_size=16, batch_wait_timeout_s=0.002)
def plus1(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


async def test_the_first_pipeline_request_after_a_redis_restart_succeeds(
        redis_server_factory: Callable[..., RedisServer],
        start_worker: Callable[..., Worker]) -> None:
    """A pipeline request enters its first stage on the client's one held connection:
    stale after a restart, it is sent once more on a fresh one (before: a 503)."""
    from redbatch.pipelines import Pipeline

    server = redis_server_factory()
    start_worker([echo, plus1], url=server.url, config=CONFIG,
                 pipelines=[Pipeline("chain", ["plus1", "echo"])])
    await wait_live(server.url, "chain")
    async with Client(server.url) as client:
        assert await client.predict("chain", 1, timeout_s=10) == 2
        server.kill()
        await asyncio.to_thread(server.start)  # same port, empty
        raw = aioredis.Redis.from_url(server.url)
        while not await raw.zcount(protocol.workers_key("chain"), protocol.now_ms(), "+inf"):
            await asyncio.sleep(0.05)  # the pipeline is fronted again
        await raw.aclose()
        await asyncio.sleep(1.2)  # the client's caches are stale: look-ups go to Redis
        assert await client.predict("chain", 2, timeout_s=10) == 3


async def test_first_requests_after_a_redis_restart_succeed(
        redis_server_factory: Callable[..., RedisServer],
        start_worker: Callable[..., Worker]) -> None:
    server = redis_server_factory()
    start_worker([echo], url=server.url, config=CONFIG)
    async with gateway(server.url, default_timeout_s=5.0, meta_refresh_s=0.2) as http:
        await _wait_registered(http)
        for _ in range(3):  # several pooled connections, all stale after the restart
            await asyncio.gather(*(http.post("/v1/models/echo/predict", json={"inputs": i})
                                   for i in range(16)))
        server.kill()
        await asyncio.to_thread(server.start)  # same port, empty
        raw = aioredis.Redis.from_url(server.url)
        while not await raw.zcount(protocol.workers_key("echo"), protocol.now_ms(), "+inf"):
            await asyncio.sleep(0.05)  # the worker registered again
        await raw.aclose()
        await asyncio.sleep(1.2)  # the gateway's caches are stale: look-ups go to Redis
        statuses = [(await http.post("/v1/models/echo/predict", json={"inputs": i})).status_code
                    for i in range(8)]
    assert statuses[1:] == [200] * 7, statuses  # one warm-up at most, not a run of 503s


@pytest.mark.parametrize(("pipelines", "grace_s", "streaming"), [
    (True, 0.5, False), (False, 30.0, False), (False, 30.0, True)])
async def test_a_worker_stops_in_bounded_time_while_redis_is_stalled(
        redis_server_factory: Callable[..., RedisServer], pipelines: bool,
        grace_s: float, streaming: bool) -> None:
    """With pipeline stages to hand on, the stop waited on the duty's tick and the
    movers' last steps with no bound: it took over 40 s (each Redis call's socket
    timeout, and retries) while Redis stayed stalled.  An idle batch loop's claim
    held the stop for the 10 s socket timeout, within a long grace."""
    from redbatch.pipelines import Pipeline
    from redbatch.worker.process import LEAVE_TIMEOUT_S, STUCK_CLAIM_S

    server = redis_server_factory()
    stop = asyncio.Event()
    config = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=1.0,
                          grace_s=grace_s)
    from tests.stream_models import counter

    model = counter() if streaming else echo
    worker = Worker([model], RedisSettings(server.url), config,
                    pipelines=[Pipeline("twice", ["echo", "echo2"])] if pipelines else None)
    task = asyncio.create_task(worker.run(stop))
    await wait_live(server.url, "twice" if pipelines else model.name)
    await asyncio.sleep(0.3)  # (the batch loop in its blocking claim)
    with stalled(server):
        stop.set()
        started = time.monotonic()
        await asyncio.wait([task], timeout=25)
        took = time.monotonic() - started
    assert task.done(), "the worker did not stop"
    loops_s = min(grace_s, 0.2 + STUCK_CLAIM_S)  # the batch loop's end
    # then the heartbeat and the duty side by side, then the leave; 2 s of slack
    assert took < loops_s + 2 * LEAVE_TIMEOUT_S + 2.0, took
