"""The opt-in WAIT after an enqueue, against a real primary and a real replica: the
enqueue returns once the replica holds it, a WAIT that times out is bounded (by its
timeout and the request's deadline) and counted while the request is still served,
and with the option off no WAIT is ever sent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from redbatch import Client, DeadlineExceeded, batch, protocol
from redbatch.api.gateway import Gateway
from redbatch.config import GatewayConfig, RedisSettings, ReplicaWait, from_env
from redbatch.errors import ConfigError
from redbatch.worker.process import Worker
from tests.conftest import RedisServer

NOT_YET_S = 0.3  # how long an enqueue must still be waiting for a stopped replica


@batch(name="twice", max_batch_size=8, batch_wait_timeout_s=0.002)
def twice(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


@pytest.fixture(scope="module")
def pair(redis_server_factory: Callable[..., RedisServer]) -> tuple[RedisServer, RedisServer]:
    """A primary and a replica of it, linked."""
    primary = redis_server_factory()
    replica = redis_server_factory("--replicaof", "127.0.0.1", str(primary.port))
    client = replica.client()
    deadline = time.monotonic() + 10
    while client.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never linked to the primary"
        time.sleep(0.02)
    client.close()
    return primary, replica


@pytest.fixture
def primary(pair: tuple[RedisServer, RedisServer]) -> Iterator[redis.Redis]:
    """The primary, empty (the replica too: WAIT for it) and with fresh command stats."""
    client = pair[0].client()
    client.flushall()
    assert client.execute_command("WAIT", 1, 5000) == 1
    client.config_resetstat()
    yield client
    client.close()


@pytest.fixture
def replica(pair: tuple[RedisServer, RedisServer]) -> Iterator[redis.Redis]:
    client = pair[1].client()
    yield client
    client.close()


@contextlib.contextmanager
def stopped(server: RedisServer) -> Iterator[None]:
    """The server SIGSTOPped (it neither reads the replication stream nor acks it)."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def client_for(server: RedisServer, wait: ReplicaWait, **kwargs: Any) -> Client:
    return Client(server.url, require_workers=False, replica_wait=wait, pack_rows=1, **kwargs)


async def served(start_worker: Callable[..., Worker], server: RedisServer,
                 futures: list[Any]) -> list[Any]:
    """Start a worker on ``server`` and return the futures' results."""
    start_worker([twice], url=server.url)
    return list(await asyncio.wait_for(asyncio.gather(*futures), 20))


async def test_the_enqueue_returns_once_the_replica_holds_it(
        pair: tuple[RedisServer, RedisServer], primary: redis.Redis, replica: redis.Redis,
        start_worker: Callable[..., Worker]) -> None:
    async with client_for(pair[0], ReplicaWait(1, 5000)) as client:
        with stopped(pair[1]):
            push = asyncio.create_task(client.submit_many("twice", [21], timeout_s=20))
            done, _ = await asyncio.wait([push], timeout=NOT_YET_S)
            assert not done, "the enqueue returned before the replica acknowledged it"
        futures = await asyncio.wait_for(push, 10)
        marker = protocol.request_key("twice", futures[0].request_id)
        assert replica.exists(marker) and replica.llen(protocol.queue_key("twice")) == 1
        assert client.stats()["enqueue_unreplicated"] == 0
        assert await served(start_worker, pair[0], futures) == [42]
    assert int(primary.info("commandstats")["cmdstat_wait"]["calls"]) >= 1


async def test_a_wait_that_times_out_is_counted_and_the_request_still_served(
        pair: tuple[RedisServer, RedisServer], primary: redis.Redis,
        start_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="redbatch.producer")
    async with client_for(pair[0], ReplicaWait(1, 200)) as client:
        with stopped(pair[1]):
            started = time.monotonic()
            futures = await asyncio.wait_for(client.submit_many("twice", [5], timeout_s=20),
                                             5)
            elapsed_s = time.monotonic() - started
            assert 0.15 <= elapsed_s < 1.5, elapsed_s  # about wait_timeout_ms, no hang
            assert not futures[0].done()  # queued on the primary: its caller keeps waiting
            assert client.stats()["enqueue_unreplicated"] == 1
            assert "acknowledged by 0 of 1 replicas" in caplog.text
            assert await served(start_worker, pair[0], futures) == [10]


async def test_the_wait_ends_by_the_request_deadline(
        pair: tuple[RedisServer, RedisServer], primary: redis.Redis) -> None:
    """A 5 s WAIT for a request of 0.3 s is cut to its deadline: the push is over (the
    client's close waits for pushes in flight) well before 5 s."""
    started = time.monotonic()
    with stopped(pair[1]):
        async with client_for(pair[0], ReplicaWait(1, 5000)) as client:
            futures = await asyncio.wait_for(client.submit_many("twice", [1], timeout_s=0.3),
                                             5)
            with pytest.raises(DeadlineExceeded):
                await asyncio.wait_for(futures[0], 5)
        assert time.monotonic() - started < 1.5  # the deadline's 0.3 s, not 5 s
    assert "cmdstat_wait" in primary.info("commandstats")


async def test_a_big_push_and_concurrent_pushes_are_waited_for_on_their_connection(
        pair: tuple[RedisServer, RedisServer], primary: redis.Redis,
        replica: redis.Redis) -> None:
    """Over one script call's chunk (one MULTI), and two models' pushes in one tick (the
    second goes through another connection than the first): each WAIT follows its own
    writes."""
    async with client_for(pair[0], ReplicaWait(1, 5000)) as client:
        with stopped(pair[1]):
            pushes = asyncio.gather(client.submit_many("big", list(range(1500)), timeout_s=20),
                                    client.submit_many("small", [1], timeout_s=20))
            done, _ = await asyncio.wait([pushes], timeout=NOT_YET_S)
            assert not done
        big, small = await asyncio.wait_for(pushes, 10)
        assert replica.llen(protocol.queue_key("big")) == 1500
        assert replica.llen(protocol.queue_key("small")) == 1
        assert client.stats()["enqueue_waits"] == 2
        for future in (*big, *small):
            client.abandon(future.request_id, DeadlineExceeded("test over"))
        await asyncio.gather(*big, *small, return_exceptions=True)


async def test_off_sends_no_wait(pair: tuple[RedisServer, RedisServer], primary: redis.Redis,
                                 start_worker: Callable[..., Worker]) -> None:
    start_worker([twice], url=pair[0].url)
    async with client_for(pair[0], ReplicaWait()) as client:
        assert await client.predict_many("twice", [1, 2], timeout_s=20) == [2, 4]
        assert "enqueue_waits" not in client.stats()
    assert "cmdstat_wait" not in primary.info("commandstats")
    async with client_for(pair[0], ReplicaWait(1, 100)) as client:
        assert await client.predict("twice", 3, timeout_s=20) == 6
    assert "cmdstat_wait" in primary.info("commandstats")


@pytest.mark.parametrize(("replicas", "timeout_ms"), [
    (-1, 100), (1, 0), (1, -5), (1, 10_001), (0, -1), (True, 100), (1, 1.5)])
def test_bad_settings_are_refused(replicas: Any, timeout_ms: Any) -> None:
    with pytest.raises(ConfigError, match="wait_"):
        ReplicaWait(replicas, timeout_ms)


def test_the_wait_must_fit_the_deadline_and_the_socket_timeout() -> None:
    ReplicaWait(0, 0)  # off: the timeout is unused
    with pytest.raises(ConfigError, match="default_timeout_s"):
        Client("redis://127.0.0.1:1/0", default_timeout_s=0.1,
               replica_wait=ReplicaWait(1, 100))
    with pytest.raises(ConfigError, match="socket_timeout_s"):
        Client(settings=RedisSettings("redis://127.0.0.1:1/0", socket_timeout_s=3),
               replica_wait=ReplicaWait(1, 2500))
    with pytest.raises(ConfigError, match="default_timeout_s"):
        GatewayConfig(default_timeout_s=1, wait_replicas=1, wait_timeout_ms=1000)
    with pytest.raises(ConfigError, match="wait_timeout_ms"):
        GatewayConfig(wait_replicas=1, wait_timeout_ms=0)


def test_the_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"REDBATCH_WAIT_REPLICAS": "2", "REDBATCH_WAIT_TIMEOUT_MS": "250"}
    assert ReplicaWait.from_env(env) == ReplicaWait(2, 250)
    assert from_env(GatewayConfig, env=env).replica_wait == ReplicaWait(2, 250)
    with pytest.raises(ConfigError, match="REDBATCH_WAIT_REPLICAS"):
        ReplicaWait.from_env({"REDBATCH_WAIT_REPLICAS": "one"})
    with pytest.raises(ConfigError, match="wait_replicas"):
        ReplicaWait.from_env({"REDBATCH_WAIT_REPLICAS": "-1"})
    monkeypatch.setenv("REDBATCH_WAIT_REPLICAS", "1")
    monkeypatch.setenv("REDBATCH_WAIT_TIMEOUT_MS", "300")
    assert Client("redis://127.0.0.1:1/0").replica_wait == ReplicaWait(1, 300)


async def test_the_gateway_passes_its_settings_to_its_client() -> None:
    gateway = Gateway(GatewayConfig(wait_replicas=1, wait_timeout_ms=150),
                      RedisSettings("redis://127.0.0.1:1/0"))
    try:
        assert gateway.client.replica_wait == ReplicaWait(1, 150)
    finally:
        await gateway.close()


async def test_a_user_that_may_not_wait_is_refused_at_start(
        pair: tuple[RedisServer, RedisServer], primary: redis.Redis) -> None:
    primary.execute_command("ACL", "SETUSER", "nowait", "on", ">pw", "~*", "&*", "+@all",
                            "-wait")
    url = f"redis://nowait:pw@127.0.0.1:{pair[0].port}/0"
    try:
        with pytest.raises(ConfigError, match=r"\+wait"):
            await Client(url, require_workers=False, replica_wait=ReplicaWait(1, 100)).start()
        async with Client(url, require_workers=False, replica_wait=ReplicaWait()):
            pass  # off: WAIT is never needed
        gateway = Gateway(GatewayConfig(wait_replicas=1), RedisSettings(url))
        with pytest.raises(ConfigError):
            await gateway.start()
        await gateway.close()
    finally:
        primary.execute_command("ACL", "DELUSER", "nowait")


async def test_fewer_connected_replicas_than_asked_is_a_warning_at_start(
        pair: tuple[RedisServer, RedisServer], primary: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="redbatch.producer")
    async with client_for(pair[0], ReplicaWait(1, 100)):
        assert "connected replicas" not in caplog.text
    async with client_for(pair[0], ReplicaWait(2, 100)):
        assert "wait_replicas=2 but the primary has 1 connected replicas" in caplog.text


async def test_a_wait_refused_after_the_enqueue_leaves_the_push_standing(
        pair: tuple[RedisServer, RedisServer], primary: redis.Redis,
        start_worker: Callable[..., Worker], caplog: pytest.LogCaptureFixture) -> None:
    """WAIT refused once the push went in (an ACL changed, a primary demoted under the
    connection): its requests are queued, so the call does not fail; they count as
    unreplicated, the log says why, and they are still served."""
    caplog.set_level(logging.WARNING, logger="redbatch.producer")
    primary.execute_command("ACL", "SETUSER", "waiter", "on", ">pw", "~*", "&*", "+@all")
    url = f"redis://waiter:pw@127.0.0.1:{pair[0].port}/0"
    try:
        async with Client(url, require_workers=False, replica_wait=ReplicaWait(1, 100),
                          pack_rows=1) as client:
            primary.execute_command("ACL", "SETUSER", "waiter", "-wait")
            futures = await client.submit_many("twice", [1, 2, 3], timeout_s=5)
            assert primary.llen(protocol.queue_key("twice")) == 3
            assert client.stats()["enqueue_unreplicated"] == 3
            assert "WAIT failed" in caplog.text
            assert await served(start_worker, pair[0], futures) == [2, 4, 6]
    finally:
        primary.execute_command("ACL", "DELUSER", "waiter")
