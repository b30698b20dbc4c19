"""A least-privilege Redis user (docs/redis.md): the worker serves, and says once, at
start, what it cannot do (CLIENT UNBLOCK, CONFIG GET refused)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from redbatch import Client, batch, defaults, placement, protocol, scaling
from redbatch.checks import CONFIG_REFUSED, UNBLOCK_REFUSED
from redbatch.placement import model_slot
from redbatch.worker.claim import LMOVE_REFUSED, LPOS_REFUSED
from redbatch.worker.process import Worker
from tests.conftest import ROOT, RedisServer, wait_live
from tests.stream_models import counter
from tests.test_placement import A, OneNode, slot_map


@batch(name="acl_double", max_batch_size=8, batch_wait_timeout_s=0.01)
def double(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


def acl_url(server: RedisServer, rules: str) -> str:
    server.client().execute_command("ACL", "SETUSER", "rb", "reset", "on", ">rb-pw",
                                    *rules.split())
    return f"redis://rb:rb-pw@127.0.0.1:{server.port}/0"


@pytest.fixture(scope="module")
def acl_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory()


async def test_least_privilege_user_serves_and_warns_once(
        acl_server: RedisServer, start_worker: Callable[..., Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    url = acl_url(acl_server, "~rb:* &* +@all -@admin -@dangerous")
    with caplog.at_level(logging.WARNING):
        start_worker([double], url=url)
        await wait_live(acl_server.url, "acl_double")
        async with Client(acl_server.url) as client:  # the default user: no warning
            assert await client.predict_many("acl_double", [1, 2, 3], timeout_s=10) == [2, 4, 6]
            assert await client.predict("acl_double", 5, timeout_s=10) == 10
    assert caplog.text.count(UNBLOCK_REFUSED) == 1, caplog.text
    assert caplog.text.count(CONFIG_REFUSED) == 1, caplog.text


def documented_rules() -> str:
    """The rules of the ``ACL SETUSER redbatch`` line in docs/redis.md."""
    text = (ROOT / "docs" / "redis.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("ACL SETUSER redbatch "))
    return line.removeprefix("ACL SETUSER redbatch ").replace(">CHANGE-ME", "").strip()


async def serves(start_worker: Callable[..., Worker], server: RedisServer, url: str) -> None:
    """A worker of ``double``, as the user of ``url``, answers that user's client (a
    batch, then a lone request)."""
    start_worker([double], url=url)
    await wait_live(server.url, "acl_double")
    async with Client(url) as client:
        assert await client.predict_many("acl_double", [1, 2, 3], timeout_s=10) == [2, 4, 6]
        assert await client.predict("acl_double", 5, timeout_s=10) == 10


async def test_the_documented_user_gets_no_warning(
        acl_server: RedisServer, start_worker: Callable[..., Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    url = acl_url(acl_server, documented_rules())
    with caplog.at_level(logging.WARNING):
        await serves(start_worker, acl_server, url)
        async with Client(url) as client:
            # a caller went away: the cancelled set exists, and workers consult it
            await client.mark_cancelled("acl_double", "gone", protocol.now_ms() + 10_000)
            assert await client.predict("acl_double", 6, timeout_s=10) == 12
        gauges = aioredis.Redis.from_url(url)  # the gateway's scrape-time read
        try:
            assert (await scaling.FleetReader(gauges).rates("acl_double")).live == 1
        finally:
            await gauges.aclose()
    assert "NOPERM" not in caplog.text and "retrying" not in caplog.text, caplog.text
    assert LPOS_REFUSED.split(" (", 1)[0] not in caplog.text, caplog.text


async def test_a_user_without_lmove_claims_by_script(
        acl_server: RedisServer, start_worker: Callable[..., Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    """A least-privilege user set up before claims used LMOVE: the worker serves (by the
    CLAIM script), and says so once."""
    url = acl_url(acl_server, documented_rules().replace(" +lmove", ""))
    with caplog.at_level(logging.WARNING):
        await serves(start_worker, acl_server, url)
    assert caplog.text.count(LMOVE_REFUSED) == 1, caplog.text
    assert "retrying" not in caplog.text, caplog.text


async def test_a_user_without_lpos_acks_by_sha1_after_one_refusal(
        acl_server: RedisServer, start_worker: Callable[..., Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    """A least-privilege user set up before the ack of a small batch used LPOS: the
    worker asks once, at its first claim, says so once, and acks every batch by its
    SHA-1: no publish meets a refusal (``ACL LOG``, ``rejected_calls``), and none fails
    and comes back ("retrying" after the lost lease it would be taken for)."""
    admin = acl_server.client()
    admin.config_resetstat()
    admin.acl_log_reset()
    url = acl_url(acl_server, documented_rules().replace(" +lpos", ""))
    with caplog.at_level(logging.WARNING):
        await serves(start_worker, acl_server, url)
        async with Client(url) as client:
            for x in range(10):  # lone requests: batches of one entry
                assert await client.predict("acl_double", x, timeout_s=10) == 2 * x
    denials = [e for e in admin.acl_log() if e["object"] == "lpos"]
    assert [(e["context"], e["count"]) for e in denials] == [("toplevel", 1)], denials
    assert admin.info("commandstats")["cmdstat_lpos"]["rejected_calls"] == 1
    assert caplog.text.count(LPOS_REFUSED.split(" (", 1)[0]) == 1, caplog.text
    assert "retrying" not in caplog.text, caplog.text


async def test_the_documented_user_serves_versions_and_drains_them(
        acl_server: RedisServer, start_worker: Callable[..., Worker],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Registering a version, changing the split and draining: scripts and plain reads
    only (no EVAL, WATCH or HSETNX, which the documented user lacks)."""
    monkeypatch.setattr(defaults, "DRAIN_SETTLE_S", 0.3)
    url = acl_url(acl_server, documented_rules())

    def plus(step: int) -> Callable[[list[int]], list[int]]:
        return lambda xs: [x + step for x in xs]

    with caplog.at_level(logging.WARNING):
        old = start_worker([batch(name="acl_v", version="1")(plus(100))], url=url)
        await wait_live(acl_server.url, "acl_v@1")
        start_worker([batch(name="acl_v", version="2")(plus(200))], url=url)
        await wait_live(acl_server.url, "acl_v@2")
        async with Client(url) as client:
            assert await client.predict("acl_v", 1, timeout_s=10) == 101  # 2: a canary
            await client.versions("acl_v", weights={"1": 0, "2": 1})
            await client.versions("acl_v", drain="1")
            assert await client.predict("acl_v", 1, timeout_s=10, version="2") == 201
        for _ in range(100):
            if old.drained:
                break
            await asyncio.sleep(0.05)
    assert old.drained
    assert "NOPERM" not in caplog.text and "retrying" not in caplog.text, caplog.text


async def test_the_documented_user_serves_a_streaming_model(
        acl_server: RedisServer, start_worker: Callable[..., Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    """The streaming scripts (STEP: LPOS, LREM) run under the documented rules."""
    url = acl_url(acl_server, documented_rules())
    with caplog.at_level(logging.WARNING):
        start_worker([counter()], url=url)
        await wait_live(acl_server.url, "counter")
        async with Client(url) as client:
            chunks = [c async for c in client.stream("counter", {"n": 3, "tag": "s"}, 10)]
        assert chunks == ["s0", "s1", "s2"]
    assert "NOPERM" not in caplog.text and "can't run" not in caplog.text, caplog.text


@batch(name="acl_inc", max_batch_size=8, batch_wait_timeout_s=0.01)
def acl_inc(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


async def test_the_documented_user_reaps_a_dead_worker_and_serves_a_pipeline(
        acl_server: RedisServer, start_worker: Callable[..., Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    """The reapers' election reads the dead worker's info (HGET) and a pipeline stage's
    mover reads its requests' contexts (MGET): both in the documented rules."""
    from redbatch import codec
    from redbatch.pipelines import Pipeline

    admin = acl_server.client()
    now = protocol.now_ms()
    reply_to = protocol.reply_key("acl_inc", "zombie-caller")
    request = protocol.Request("left1", "acl_inc", now, now + 20_000, reply_to, 4)
    admin.rpush(protocol.inflight_key("acl_inc", "zombie"), codec.encode(request.to_wire()))
    admin.zadd(protocol.workers_key("acl_inc"), {"zombie": now - 1})
    url = acl_url(acl_server, documented_rules())
    with caplog.at_level(logging.WARNING):
        start_worker([acl_inc, double], url=url,
                     pipelines=[Pipeline("acl_pipe", ["acl_inc", "acl_double"])])
        await wait_live(acl_server.url, "acl_pipe")
        got = await asyncio.to_thread(admin.blpop, [reply_to], 15)
        assert got is not None and protocol.reply_from_wire(codec.decode(got[1])).payload == 5
        async with Client(url) as client:
            assert await client.predict("acl_pipe", 3, timeout_s=10) == 8
    assert "NOPERM" not in caplog.text and "no permissions" not in caplog.text, caplog.text


def test_the_documented_user_plans_slot_placement(acl_server: RedisServer) -> None:
    """``place-slots`` without ``--apply`` reads each model's live S as the documented
    user, who may not run ``EVAL`` (it loads the script and runs it by its SHA-1)."""
    acl_server.client().set(protocol.meta_key("acl_hot"), b'{"name":"acl_hot","sub_queues":3}')
    user = redis.Redis.from_url(acl_url(acl_server, documented_rules()))
    node = OneNode(user)
    owners = slot_map({model_slot("acl_hot"): A})
    assert placement.sub_queue_count(node, owners, "acl_hot") == 3  # type: ignore[arg-type]
