"""redbatch on a real Redis Cluster (3 primaries, 3 replicas): the model's scripts and
blocking pops on the node that owns the model's slot, MOVED after a slot migration,
and a failover: typed errors meanwhile, then the same client works again."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TryAgainError

from redbatch import codec, protocol
from redbatch.config import RedisSettings, ReplicaWait
from redbatch.errors import DeadlineExceeded, NoLiveWorkers, RedisUnavailable
from redbatch.lean import ClusterLink, LeanLink
from redbatch.producer.client import Client
from redbatch.redis_conn import async_client, translated
from redbatch.worker.claim import Claimer
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import FAST_WORKER, redbatch_cmd, test_env, until, wait_live
from tests.engines import ClusterEngine, Node
from tests.models_for_tests import adder

pytestmark = [pytest.mark.engines, pytest.mark.serial, pytest.mark.timeout(90)]
MODEL = "m"
QUEUE = protocol.queue_key(MODEL)
INFLIGHT = protocol.inflight_key(MODEL, "w1")
RECOVER_S = 20.0  # a failover (node timeout 1 s) must be over well within this


@pytest.fixture
def settings(redis_cluster: ClusterEngine) -> RedisSettings:
    return RedisSettings(redis_cluster.url, socket_timeout_s=3.0, connect_timeout_s=0.5)


@pytest.fixture
async def client(settings: RedisSettings) -> AsyncIterator[aioredis.Redis]:
    client = async_client(settings)
    yield client
    await client.aclose()


def claimer(client: aioredis.Redis) -> Claimer:
    return Claimer(client, MODEL, "w1", BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0),
                   block_timeout_s=0.3)


def entry(n: int) -> bytes:
    now = protocol.now_ms()
    return codec.encode(protocol.Request(f"id{n}", MODEL, now, now + 60_000,
                                         protocol.reply_key(MODEL, "c"), n).to_wire())


async def test_a_cluster_url_gives_a_cluster_link(client: aioredis.Redis) -> None:
    assert isinstance(LeanLink(client), ClusterLink)


def moved_sent(redis_cluster: ClusterEngine) -> int:
    """How many ``MOVED`` error replies the live nodes have sent."""
    return sum(int(n.ask("INFO", "errorstats").get("errorstat_MOVED", {}).get("count", 0))
               for n in redis_cluster.live())


async def test_a_fresh_clients_first_command_goes_to_the_slots_owner(
        redis_cluster: ClusterEngine, settings: RedisSettings) -> None:
    """A new client reads the slot map before its first command, so that command goes
    straight to the primary that owns its key (redis-py's own client sends it to its
    default node first and follows the ``MOVED``): a key on each primary, each with a
    client of its own, seeded on one node only."""
    seeded = RedisSettings("redis+cluster://" + redis_cluster.nodes[0].address,
                           socket_timeout_s=3.0, connect_timeout_s=0.5)
    keys = {redis_cluster.owner(f"{{t{i}}}").port: f"{{t{i}}}" for i in range(40)}
    assert len(keys) == 3  # one key on each primary, two of them not the seed
    for key in keys.values():
        client = async_client(seeded)
        try:
            before = moved_sent(redis_cluster)
            assert await client.set(key, "v") is True
            assert moved_sent(redis_cluster) == before, key
        finally:
            await client.aclose()


async def test_a_cluster_link_holds_a_connection_to_the_owner(
        redis_cluster: ClusterEngine, client: aioredis.Redis) -> None:
    """Replies on the held connection are raw (b"OK"); through the cluster client they
    pass redis-py's callbacks (True): the first call, and a redirected one, go through
    the client; the others go on the connection to the slot's primary."""
    key = protocol.meta_key(MODEL)
    link = LeanLink(client)
    assert await link.execute("SET", key, "a") is True  # through the client
    assert await link.execute("SET", key, "b") == b"OK"
    source = redis_cluster.owner(key)
    target = next(n for n in redis_cluster.primaries() if n is not source)
    redis_cluster.migrate(key, target)
    assert await link.execute("SET", key, "c") is True  # MOVED: through the client
    assert await link.pipeline(("SET", key, "d"), ("GET", key)) == [b"OK", b"d"]
    assert target.ask("GET", key) == b"d"


@pytest.mark.parametrize("held", [True, False], ids=["held", "through-client"])
async def test_a_redirected_transaction_runs_none_of_its_commands(
        redis_cluster: ClusterEngine, client: aioredis.Redis, held: bool) -> None:
    """A MULTI whose slot moved gets MOVED for its commands and EXECABORT: none ran.
    Sending the redirected commands again one by one (what the cluster client does
    with redirections) would run them outside the transaction; the call fails with a
    retryable error instead, and sent again, runs whole on the new owner."""
    key = protocol.meta_key(MODEL) + ":tx"
    link = LeanLink(client)
    await link.execute("DEL", key)  # the first call goes through the client
    if held:
        await link.execute("DEL", key)  # the link now holds a connection to the owner
    source = redis_cluster.owner(key)
    target = next(n for n in redis_cluster.primaries() if n is not source)
    redis_cluster.migrate(key, target)
    call = (("MULTI",), ("RPUSH", key, "x"), ("RPUSH", key, "y"), ("EXEC",))
    if not held:  # a call through the client with its slot map out of date
        link._mapped = False  # type: ignore[attr-defined]
    with pytest.raises(TryAgainError, match="none of it ran"):
        await link.pipeline(*call)
    assert target.ask("LLEN", key) == 0
    replies = await link.pipeline(*call)
    assert replies[-1] == [1, 2] and target.ask("LRANGE", key, 0, -1) == [b"x", b"y"]
    await link.execute("DEL", key)


def wait_calls(node: Node) -> int:
    stats = node.ask("INFO", "commandstats").get("cmdstat_wait")
    return int(stats["calls"]) if stats else 0


async def test_a_wait_goes_to_the_node_of_its_writes(redis_cluster: ClusterEngine,
                                                     client: aioredis.Redis) -> None:
    """``WAIT`` counts the writes of its own connection: through the cluster client
    too (a link's first call, or one made while another is in flight) it goes to the
    node of the call's keys, with them, never to the client's default node."""
    await client.initialize()  # type: ignore[attr-defined]
    default = client.get_default_node()  # type: ignore[attr-defined]
    key = next(k for k in (protocol.meta_key(f"m{i}") for i in range(100))
               if redis_cluster.owner(k).port != default.port)
    owner, link = redis_cluster.owner(key), LeanLink(client)
    assert await link.pipeline(("SET", key, "a"), ("WAIT", 1, 1000)) == [True, 1]
    blocked = asyncio.create_task(link.execute("BLMPOP", 0.3, 1, key + ":list", "LEFT"))
    await asyncio.sleep(0)  # the pop is in flight: the next call goes through the client
    assert await link.pipeline(("SET", key, "b"), ("WAIT", 1, 1000)) == [True, 1]
    assert await blocked is None
    assert wait_calls(owner) == 2


async def test_enqueue_and_claim_scripts_run_on_the_owning_node(
        redis_cluster: ClusterEngine, settings: RedisSettings, client: aioredis.Redis
) -> None:
    async with Client(settings=settings, require_workers=False) as producer:
        futures = await producer.submit_many(MODEL, list(range(20)), timeout_s=30)
        assert await client.llen(QUEUE) == 20
        items = await claimer(client).claim()
        for future in futures:
            future.cancel()
    assert len(items) == 8
    owner = redis_cluster.owner(QUEUE)
    assert owner.ask("LLEN", INFLIGHT) == 8 and owner.ask("LLEN", QUEUE) == 12


class PipelinedScript(AssertionError):
    """redis-py's cluster pipeline refused a ``Script`` object in a MULTI."""


async def test_a_push_over_one_chunk_is_one_multi(settings: RedisSettings,
                                                  client: aioredis.Redis) -> None:
    async with Client(settings=settings, require_workers=False) as producer:
        futures = await producer.submit_many(MODEL, list(range(3)) * 700, timeout_s=30)
        refused = [f.exception() for f in futures if f.done() and not f.cancelled()]
        for future in futures:
            future.cancel()
    if any("pipelined function evalsha" in str(e) for e in refused):
        raise PipelinedScript(str(refused[0]))
    assert await client.llen(QUEUE) == 2100


async def test_a_push_over_one_chunk_waits_for_a_replica(settings: RedisSettings,
                                                         client: aioredis.Redis) -> None:
    """The MULTI of a long push and its WAIT go together to the model's node."""
    async with Client(settings=settings, require_workers=False,
                      replica_wait=ReplicaWait(1, 1000)) as producer:
        futures = await producer.submit_many(MODEL, list(range(2100)), timeout_s=30)
        refused = [f.exception() for f in futures if f.done() and not f.cancelled()]
        stats = producer.stats()
        for future in futures:
            future.cancel()
    assert not refused, refused[:1]
    assert await client.llen(QUEUE) == 2100
    assert (stats["enqueue_waits"], stats["enqueue_unreplicated"]) == (1, 0)


async def test_a_blocking_pop_wakes_on_the_owning_node(client: aioredis.Redis) -> None:
    blocked = asyncio.create_task(claimer(client).claim())
    await asyncio.sleep(0.1)  # the BLMOVE is blocked (the claim times out in 0.3 s)
    await client.rpush(QUEUE, entry(1))
    assert [codec.decode(raw)["id"] for raw in await blocked] == ["id1"]


def unblocks(node: Node) -> int:
    stats = node.ask("INFO", "commandstats").get("cmdstat_client|unblock")
    return int(stats["calls"]) if stats else 0


async def _window_ends_on_time(taker: Claimer) -> None:
    """A BLMOVE of 2.5 s on an empty queue, to give up after 0.2 s: it ends on time only
    if the CLIENT UNBLOCK reaches the connection that holds it."""
    await taker._prepare()
    started = time.monotonic()
    assert await taker._block_some(2.5, 0, protocol.now_ms() + 200) == []
    assert time.monotonic() - started < 1.5  # not the 2.5 s of the pop


async def test_a_window_ends_on_time_on_the_owning_node(
        redis_cluster: ClusterEngine, settings: RedisSettings, client: aioredis.Redis) -> None:
    """A claimer with a cluster client of its own is precise: its CLIENT UNBLOCK goes to
    the primary that owns the queue's slot, for the held connection of the BLMOVE; after
    a slot migration it asks the new owner's connection and unblocks there."""
    own = async_client(settings, max_connections=4)
    try:
        taker = Claimer(client, MODEL, "w1", BatchPolicy(max_batch_size=4), 2.5, own)
        assert taker.precise
        source = redis_cluster.owner(QUEUE)
        before = unblocks(source)
        await _window_ends_on_time(taker)
        assert unblocks(source) == before + 1
        target = next(n for n in redis_cluster.primaries() if n is not source)
        redis_cluster.migrate(QUEUE, target)
        await client.rpush(QUEUE, entry(1))  # (the client learns the new owner)
        assert len(await taker.claim(4)) == 1  # MOVED, followed
        moved_before = unblocks(target)
        await _window_ends_on_time(taker)
        assert unblocks(target) == moved_before + 1
    finally:
        await own.aclose()


async def test_a_window_ending_while_its_node_pauses_writes_leaves_the_node_up(
        redis_cluster: ClusterEngine, settings: RedisSettings, client: aioredis.Redis) -> None:
    """On a cluster too, the window's unblock goes behind a no-op write on the owner's
    connection: ``CLIENT PAUSE WRITE`` there (as a manual failover's) holds it until
    the pop has run, and the node stays up (an unblock of a pop the pause holds makes
    Redis 7.0.15 abort)."""
    own = async_client(settings, max_connections=4)
    try:
        taker = Claimer(client, MODEL, "w1", BatchPolicy(max_batch_size=4), 2.5, own)
        await taker._prepare()
        owner = redis_cluster.owner(QUEUE)
        before = unblocks(owner)
        owner.ask("CLIENT", "PAUSE", 800, "WRITE")
        started = time.monotonic()
        assert await taker._block_some(5.0, 1, protocol.now_ms() + 200) == []
        assert time.monotonic() - started < 3.0  # woken once the pause was over
        assert owner.ask("PING") and unblocks(owner) == before + 1
    finally:
        await own.aclose()


async def test_a_moved_slot_is_followed(redis_cluster: ClusterEngine,
                                        client: aioredis.Redis) -> None:
    await client.rpush(QUEUE, entry(1), entry(2))
    taker = claimer(client)
    assert len(await taker.claim(1)) == 1  # the client knows the slot's owner now
    source = redis_cluster.owner(QUEUE)
    target = next(n for n in redis_cluster.primaries() if n is not source)
    redis_cluster.migrate(QUEUE, target)
    assert redis_cluster.owner(QUEUE) is target
    assert len(await taker.claim(1)) == 1  # MOVED, followed
    assert target.ask("LLEN", INFLIGHT) == 2


async def test_after_a_failover_the_same_client_works_again(
        redis_cluster: ClusterEngine, settings: RedisSettings, client: aioredis.Redis
) -> None:
    await client.rpush(QUEUE, entry(1))
    taker = claimer(client)
    assert len(await taker.claim()) == 1
    redis_cluster.owner(QUEUE).kill()
    errors, started = await _until_served(settings, client), time.monotonic()
    assert errors, "the dead primary was never noticed"
    assert all(isinstance(e, RedisUnavailable) for e in errors)
    await client.rpush(QUEUE, entry(2))
    assert [codec.decode(raw)["id"] for raw in await taker.claim()] == ["id2"]
    assert time.monotonic() - started < RECOVER_S


async def _until_served(settings: RedisSettings, client: aioredis.Redis) -> list[Exception]:
    """Push until a push succeeds (the replica promoted); the typed errors met meanwhile.
    Each try is bounded: none may hang."""
    errors: list[Exception] = []
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        try:
            async with asyncio.timeout(2 * settings.socket_timeout_s), translated(settings):
                await LeanLink(client).execute("LLEN", QUEUE)
                return errors
        except RedisUnavailable as exc:
            errors.append(exc)
            await asyncio.sleep(0.1)
    raise AssertionError(f"not served again within {RECOVER_S} s: {errors[-3:]}")


async def test_a_worker_serves_a_model_again_after_its_primarys_failover(
        redis_cluster: ClusterEngine, settings: RedisSettings, spawn: Any) -> None:
    """A worker process of two models on two primaries: after the primary of one
    model's slot dies and its replica takes over, that model is served again, though
    the worker's calls to the other model succeeded meanwhile (nothing made its cluster
    clients read the slot map again: they called the dead node for ever)."""
    kept, moved = "a1", "b2"
    assert redis_cluster.owner(protocol.queue_key(kept)) is not \
        redis_cluster.owner(protocol.queue_key(moved))
    spawn(redbatch_cmd("worker", "tests.models_for_tests:two_primaries"),
          env=test_env(REDIS_URL=settings.url), name="worker")
    await wait_live(settings.url, kept)
    await wait_live(settings.url, moved)
    async with Client(settings=settings) as producer:
        assert [await producer.predict(n, 1, timeout_s=3) for n in (kept, moved)] == [2, 2]
        redis_cluster.owner(protocol.queue_key(moved)).kill()
        deadline = time.monotonic() + RECOVER_S
        while True:  # (the cluster is down until the replica takes over: typed errors)
            try:
                assert [await producer.predict(n, 5, timeout_s=1) for n in (kept, moved)] \
                    == [6, 6]
                break
            except (RedisUnavailable, DeadlineExceeded, NoLiveWorkers):
                assert time.monotonic() < deadline, f"{moved} never served again"
                await asyncio.sleep(0.2)


async def test_worker_and_client_end_to_end(settings: RedisSettings,
                                            start_worker: object) -> None:
    start_worker([adder], url=settings.url, config=FAST_WORKER)  # type: ignore[operator]
    async with Client(settings=settings) as producer:
        await wait_live(settings.url, "adder")
        assert await producer.predict_many("adder", list(range(20)), timeout_s=3) == \
            list(range(1, 21))


async def test_an_entry_replying_outside_the_slot_is_dead_lettered_alone(
        settings: RedisSettings, client: aioredis.Redis, start_worker: object) -> None:
    """A reply list in another slot cannot be answered in the reply script (the
    cluster would refuse the whole batch's script): that entry alone is dead-lettered,
    its batch-mates (claimed with it: queued before the worker starts) are answered."""
    now = protocol.now_ms()

    def queued(i: int, reply_to: str) -> bytes:
        return codec.encode(protocol.Request(f"r{i}", "adder", now, now + 60_000, reply_to,
                                             i).to_wire())

    mine = protocol.reply_key("adder", "me")
    hostile = queued(0, protocol.legacy_reply_key("c"))
    await client.rpush(protocol.queue_key("adder"), queued(1, mine), hostile,
                       *[queued(i, mine) for i in range(2, 6)])
    start_worker([adder], url=settings.url, config=FAST_WORKER)  # type: ignore[operator]
    replies = []
    while len(replies) < 5:
        popped = await client.blpop([mine], timeout=5)
        assert popped is not None, f"only {len(replies)} replies"
        replies.append(protocol.reply_from_wire(codec.decode(popped[1])))
    assert sorted((r.id, r.payload) for r in replies) == [(f"r{i}", i + 1) for i in range(1, 6)]
    assert await client.lrange(protocol.dead_letter_key("adder"), 0, -1) == [hostile]


async def test_an_idle_listener_gives_its_node_connection_back(settings: RedisSettings) -> None:
    """A model's reply listener that stops once idle returns its held connection to
    its node's pool: restarts do not pile connections up, nor raise."""
    errors: list[object] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, ctx: errors.append(ctx.get("exception") or ctx.get("message")))
    async with Client(settings=settings, require_workers=False, listener_idle_s=0.4,
                      block_timeout_s=0.1) as producer:
        counts = []
        for _cycle in range(5):
            with pytest.raises(DeadlineExceeded):
                await producer.predict(MODEL, 1, timeout_s=0.1)
            await asyncio.sleep(0.9)  # a few pops, then idle: the listener stops
            assert producer.stats()["listeners"] == 0
            node = producer.redis.get_node_from_key(  # type: ignore[attr-defined]
                producer.reply_to(MODEL))
            counts.append(len(node._connections) - len(node._free))  # taken, not given back
        assert counts[-1] <= counts[1], counts  # given back each time, not piled up
        assert producer.stats()["listeners_started"] == 5
    assert not errors



async def test_a_cluster_link_keeps_one_connection_per_node(
        redis_cluster: ClusterEngine, client: aioredis.Redis) -> None:
    """Calls that alternate between models on two nodes reuse one held connection
    each instead of reconnecting at every switch."""
    keys = [protocol.meta_key(m) for m in ("a", "b", "c", "d", "e", "f")]
    first = redis_cluster.owner(keys[0])
    other = next(k for k in keys if redis_cluster.owner(k) is not first)
    link = LeanLink(client)
    await link.execute("SET", keys[0], "x")  # through the client: the slot map is read
    before = sum(int(n.ask("INFO", "stats")["total_connections_received"])
                 for n in redis_cluster.primaries())
    for _ in range(10):
        await link.execute("SET", keys[0], "x")
        await link.execute("SET", other, "y")
    after = sum(int(n.ask("INFO", "stats")["total_connections_received"])
                for n in redis_cluster.primaries())
    # the INFO probes' own connections (3 primaries, twice) plus one held per node
    assert after - before <= 3 + 2
    await link.release()


async def test_a_model_over_three_sub_queues_end_to_end(redis_cluster: ClusterEngine,
                                                        settings: RedisSettings,
                                                        start_worker: object) -> None:
    """Sub-queues in slots of their own (here on two primaries): every script still
    touches one slot, a dead worker's entries go back to their sub-queue, and nothing
    is lost."""
    from tests.test_reliability import TAKEOVER, raw_request
    from tests.test_shards import hot

    tags = protocol.sub_queue_tags("hot", 3)
    assert len({redis_cluster.owner(protocol.queue_key(t)).port for t in tags}) > 1
    start_worker([hot], url=settings.url, config=TAKEOVER)  # type: ignore[operator]
    async with Client(settings=settings, pack_rows=1) as producer:
        await wait_live(settings.url, "hot")
        await producer.configure("hot", sub_queues=3)
        await asyncio.sleep(1.2)  # the worker and the client see it
        ghost = [raw_request("hot", v, producer.reply_to(tags[2]))[1] for v in range(3)]
        async with translated(settings):
            await producer.redis.rpush(protocol.inflight_key(tags[2], "ghost"), *ghost)
            await producer.redis.zadd(protocol.workers_key("hot"), {"ghost": 1})
        for start in range(0, 60, 3):  # 20 ticks, a sub-queue chosen in each
            answers = await asyncio.gather(*(producer.predict("hot", v, timeout_s=10)
                                             for v in range(start, start + 3)))
            assert answers == [v + 1 for v in range(start, start + 3)]
        assert producer.stats()["listeners"] == 3
        ghost_list = protocol.inflight_key(tags[2], "ghost")
        for _ in range(250):  # reaped within its lapsed lease's next heartbeats (0.2 s)
            async with translated(settings):
                if not await producer.redis.exists(ghost_list):
                    break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the dead worker's in-flight list was never reaped")


async def test_a_draining_count_is_published_and_read_on_the_models_node(
        client: aioredis.Redis) -> None:
    from redbatch.levels import queue_depths, read_meta
    from redbatch.worker import heartbeat
    from tests.test_shards import warm

    await client.rpush(protocol.queue_key("warm:1"), b"x")  # above its one sub-queue
    await heartbeat.beat(client, [warm], "w1", {"warm": (b"{}", b"{}")}, 10,
                         heartbeat.Draining({"warm": 2}, 10_000))  # scripts loaded anew
    assert await queue_depths(client, "warm", *await read_meta(client, "warm")) == [1]



HOLD_S = 3.0  # how long a slot stays half-moved under load


def redirects(node: Node) -> dict[str, int]:
    """How many ``ASK`` and ``TRYAGAIN`` error replies ``node`` has sent."""
    stats = node.ask("INFO", "errorstats")
    return {kind: int(stats.get(f"errorstat_{kind}", {}).get("count", 0))
            for kind in ("ASK", "TRYAGAIN")}


@asynccontextmanager
async def half_move_callers(via: str, settings: RedisSettings) -> AsyncIterator[
        tuple[Callable[..., Awaitable[None]], Callable[[], Awaitable[dict[str, Any]]],
              Callable[[int], Awaitable[Any]]]]:
    """The ledger's caller through a ``Client`` or the HTTP gateway: one request's
    call, the replies' stats (``duplicates``), and a plain predict."""
    from tests.test_failover_ledger import call, gateway_http, http_call

    if via == "client":
        async with Client(settings=settings) as producer:
            async def stats() -> dict[str, Any]:
                return producer.stats()
            yield (functools.partial(call, producer), stats,
                   lambda x: producer.predict("gated", x, timeout_s=5))
        return
    async with gateway_http(settings.url) as http:
        async def http_stats() -> dict[str, Any]:
            return dict((await http.get("/v1/stats")).json())

        async def predict(x: int) -> Any:
            resp = await http.post("/v1/models/gated/predict", json={"inputs": x})
            assert resp.status_code == 200, resp.text
            return resp.json()["outputs"]
        yield functools.partial(http_call, http), http_stats, predict


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("first", "via"), [("queue", "client"), ("inflight", "client"),
                                            ("inflight", "gateway")],
                         ids=["queue-first", "inflight-first", "gateway"])
async def test_a_half_moved_slot_keeps_every_promise(
        redis_cluster: ClusterEngine, start_worker: Callable[..., Worker], first: str,
        via: str) -> None:
    """Steady load (``test_failover_ledger``'s: a client's, or the HTTP gateway's
    callers') while the model's slot is half-moved for ``HOLD_S``: the target
    ``IMPORTING``, the source ``MIGRATING``, and only the queue (or only the worker's
    in-flight list) migrated, both holding entries at that moment (the model's passes
    held until they do).  Redis answers ``ASK`` for a command whose keys the source
    lacks and ``TRYAGAIN`` for a script whose keys are split or partly missing (as a
    new request's marker, or the reply list, is): the enqueues are refused then, and
    the batch being computed cannot be acknowledged.  Every accepted request is still
    answered once, or fails with a typed error (a 503 or 504 with its code) by its
    deadline; none hangs; no entry is left behind; and once the move completes (the
    rest migrated, ``SETSLOT NODE`` everywhere) the model is served from the target."""
    from tests.test_failover_ledger import (
        GATE,
        Ledger,
        check_promises,
        gated,
        generate,
        served_again,
    )

    settings = RedisSettings(redis_cluster.url, socket_timeout_s=3.0, connect_timeout_s=0.5)
    worker = start_worker([gated], url=settings.url, config=FAST_WORKER)
    await wait_live(settings.url, "gated")
    queue, inflight = protocol.queue_key("gated"), protocol.inflight_key("gated",
                                                                         worker.worker_id)
    source = redis_cluster.owner(queue)
    target = next(n for n in redis_cluster.primaries() if n is not source)
    ledger, stop = Ledger(), asyncio.Event()
    async with half_move_callers(via, settings) as (caller, stats_of, predict):
        load = asyncio.create_task(generate(caller, ledger, stop))
        try:
            await asyncio.sleep(1.5)
            assert ledger.ok > 0, ledger.report("nothing served before the move", {})
            GATE.clear()  # the batch in the forward waits: its in-flight list stays
            try:
                await until(lambda: source.ask("LLEN", queue) > 0 and
                            source.ask("LLEN", inflight) > 0, "a queue and an in-flight list")
                before = [redirects(source), redirects(target)]
                ledger.killed_s = time.monotonic()  # (the ledger's "kill": the move began)
                move = await asyncio.to_thread(redis_cluster.begin_move, queue, target,
                                               [queue if first == "queue" else inflight])
            finally:
                GATE.set()
            await asyncio.sleep(HOLD_S / 2)
            probe, probe_s = Ledger(), time.monotonic()  # one request, mid-move
            await caller(probe, 1_000_000)
            probe_s = time.monotonic() - probe_s
            await asyncio.sleep(HOLD_S / 2)
            held = [int(n.ask("CLUSTER", "COUNTKEYSINSLOT", move.slot)) for n in (source, target)]
            met = [redirects(source), redirects(target)]
            await asyncio.to_thread(redis_cluster.finish_move, move)
            moved_s = time.monotonic()
            await served_again(ledger)
        finally:
            stop.set()
            await load
        stats = await stats_of()
        since_s, _ = ledger.served_again_s()
        mid = [ok for sent_s, ok in ledger.fates if ledger.killed_s < sent_s < moved_s - 0.5]
        print(f"\n{ledger.report(f'half-moved slot ({first} first, {via})', stats)}\n"
              f"  keys on the source, the target while half-moved: {held}\n"
              f"  ASK, TRYAGAIN sent meanwhile by the source: {before[0]} -> {met[0]}, "
              f"by the target: {before[1]} -> {met[1]}\n  move completed "
              f"{moved_s - ledger.killed_s:.1f} s after it began; every request sent from "
              f"{since_s - ledger.killed_s:.1f} s on answered\n  a request sent mid-move: "
              f"{dict(probe.refused + probe.errors) or probe.ok} in {probe_s:.2f} s; of those sent "
              f"while half-moved, {sum(mid)} of {len(mid)} answered")
        check_promises(ledger, stats, lag=False)
        for kind in ("ASK", "TRYAGAIN"):
            met_now = sum(m[kind] - b[kind] for m, b in zip(met, before, strict=True))
            assert met_now > 0, f"no {kind} met"
        assert probe.ok + sum(probe.refused.values()) + sum(probe.errors.values()) == 1
        assert not probe.untyped and probe_s < 1.0, "a request mid-move waited"
        assert redis_cluster.owner(queue) is target
        assert await asyncio.gather(*(predict(x) for x in range(20))) == list(range(1, 21))
    await until(lambda: not target.ask("EXISTS", queue, inflight, protocol.dead_letter_key(
        "gated")), "the queue and the in-flight list emptied, nothing dead-lettered", 10)
