"""Redis clients with timeouts on, and the translation of redis errors.

Every socket timeout is longer than any blocking command we issue (checked by
``config.check_socket_timeout``), so a dead connection is noticed and a
blocking pop is never cut short by its own socket.

A ``redis+cluster://`` URL gives redis-py's ``RedisCluster`` (it routes each command
to the primary owning its key's slot and follows ``MOVED``/``ASK``), a
``redis+sentinel://`` URL a client of the service's current primary (``master_for``).
Which one is decided here, once per client: the plain-Redis client is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import ClusterError, RedisClusterException
from redis.retry import Retry as SyncRetry
from redis.sentinel import Sentinel as SyncSentinel

from redbatch import defaults, protocol
from redbatch.config import RedisSettings, Topology
from redbatch.errors import DeadlineExceeded, RedisUnavailable

T = TypeVar("T")

# ResponseError too: OOM, READONLY (a replica after failover), MISCONF... are Redis
# refusing work, which callers must see as a typed, retryable error.  A cluster client
# raises RedisClusterException when no node it knows answers (or a slot has no owner),
# and ClusterError ("TTL exhausted", a RedisError that is neither of the others) when
# a command was redirected 16 times: a script whose keys are split between the two
# nodes of a slot being moved gets TRYAGAIN at each try (tests/test_cluster.py,
# test_a_half_moved_slot_keeps_every_promise).
# (``InvalidResponse``: something other than Redis answers on the port, a common
# mistake in a URL)
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError,
                RedisClusterException, ClusterError, redis.exceptions.InvalidResponse)


def _no_retry() -> AsyncRetry:
    # Async clients never re-send a command on their own: a re-run BLMOVE or CLAIM after
    # a lost reply would break the in-flight accounting.  Our loops retry, with backoff.
    return AsyncRetry(NoBackoff(), 0)


# Names read back from Redis (worker ids) are decoded with this, so that one that is not
# UTF-8 (a foreign worker's) makes keys that encode back to its exact bytes.
ID_ERRORS: Final = "surrogateescape"


def async_client(settings: RedisSettings,
                 max_connections: int = defaults.REDIS_MAX_CONNECTIONS) -> aioredis.Redis:
    """An asyncio client (bytes replies) with connect and socket timeouts.

    Its pool blocks (up to the socket timeout) for a free connection instead of
    failing when all ``max_connections`` are busy.  (On a cluster, each node has a
    pool of ``max_connections`` that fails at once when all are busy: redis-py's.)"""
    nodes = settings.topology
    if nodes is not None:
        return _async_nodes(settings, nodes, max_connections)
    pool = ShieldedBlockingPool.from_url(
        settings.url,
        max_connections=max_connections,
        timeout=settings.socket_timeout_s,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=_no_retry(),
        health_check_interval=30,
        encoding_errors=ID_ERRORS,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) its pool


class SlotMappedCluster(RedisCluster):
    """redis-py's asyncio cluster client, which reads the slot map before its first
    command: redis-py's own sends a fresh client's first keyed command to its default
    node, before it knows the slots, and follows the ``MOVED`` (a round trip more on a
    gateway's or worker's first call).  Once the map is read, ``initialize`` returns at
    once; a failed read raises as the first command would have."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.initialize()
        return await super().execute_command(*args, **kwargs)


class ShieldedRelease:
    """A pool whose ``release`` survives its caller's cancel.  redis-py gives a
    command's connection back in a ``finally`` that waits for the pool's lock when
    other tasks hold or wait for it; a cancel there (a request's deadline) lost the
    connection: held by nothing but the pool's weak set of connections in use, it
    stayed open until the collector found it (a ``ResourceWarning``), and in a
    blocking pool it took a slot of ``max_connections`` until then.  The release now
    runs to its end in a task of its own when the lock is busy."""

    async def release(self, connection: AbstractConnection) -> None:
        parent: Any = super()
        if self._lock_free():  # (then the release never waits: nothing to cancel)
            await parent.release(connection)
            return
        await asyncio.shield(parent.release(connection))

    def _lock_free(self) -> bool:
        """Whether the locks the release takes are free with nobody waiting for them
        (an ``asyncio.Lock`` with waiters makes a newcomer wait too)."""
        pool: Any = self
        condition = getattr(pool, "_condition", None)
        locks = [pool._lock, getattr(condition, "_lock", condition)]
        return not any(lock is not None and (lock.locked() or getattr(lock, "_waiters", None))
                       for lock in locks)


class ShieldedPool(ShieldedRelease, aioredis.ConnectionPool):
    """A plain pool (a sentinel's own links) with ``ShieldedRelease``."""


class ShieldedBlockingPool(ShieldedRelease, aioredis.BlockingConnectionPool):
    """A blocking pool (a plain Redis) with ``ShieldedRelease``."""


class BlockingSentinelPool(ShieldedRelease, SentinelConnectionPool,
                           aioredis.BlockingConnectionPool):
    """The service's primary, found through the sentinels at each (re)connect; a caller
    waits for a free connection, as with a plain Redis."""


class ShieldedSentinel(Sentinel):
    """redis-py's ``Sentinel`` whose links to the sentinels use ``ShieldedPool``: the
    lookups of every reconnect go through them, many at once after a failover.  Its
    ``discover_master`` moves the sentinel that answered to the front as redis-py's
    does, but by where that sentinel is at the moment of the move: redis-py's swap
    used the index its loop had before an ``await``, so two lookups at once (after a
    failover, every connection's) could write one sentinel twice and drop another
    from the list (never asked again, and never closed: its open link a
    ``ResourceWarning``).  ``aclose`` closes every sentinel link made."""

    def __init__(self, sentinels: Any, **kwargs: Any) -> None:
        init: Any = super().__init__  # (untyped in redis-py)
        init(sentinels, **kwargs)
        for client in self.sentinels:
            old = client.connection_pool
            client.connection_pool = ShieldedPool(connection_class=old.connection_class,
                                                  max_connections=old.max_connections,
                                                  **old.connection_kwargs)
        self._links: list[Any] = list(self.sentinels)

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        errors = []
        for sentinel in list(self.sentinels):  # (a copy: other lookups reorder it)
            try:
                masters: Any = await sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(f"{sentinel} - {exc!r}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                at = self.sentinels.index(sentinel)  # (where it is now: no await since)
                self.sentinels[0], self.sentinels[at] = sentinel, self.sentinels[0]
                forced: Any = getattr(self, "_force_master_ip", None)
                return (forced if forced is not None else state["ip"]), state["port"]
        detail = f" : {', '.join(errors)}" if errors else ""
        raise MasterNotFoundError(f"No master found for {service_name!r}{detail}")

    async def aclose(self) -> None:
        await close_all(*self._links)


class SentinelRedis(aioredis.Redis):
    """A client of a Sentinel service's primary that closes its sentinel links too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:  # the sentinels' own clients, even if the primary's pool failed to close
            manager: Any = getattr(self.connection_pool, "sentinel_manager", None)
            if manager is not None:
                await manager.aclose()


async def close_all(*clients: Any) -> None:
    """``aclose`` every client, each even if one before it failed to close (its
    connections and, behind Sentinel, its sentinels' would be left open); the first
    failure is raised once all are closed."""
    results = await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a Redis Cluster client (no single connection pool)."""
    return isinstance(client, RedisCluster)


# what a node gone (a failover) raises: the slot map may be stale
NODE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError,
               redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError)


REMAP_GAP_S: Final = 0.5  # a cluster client's slot map is read again at most this often
_REMAPS: weakref.WeakKeyDictionary[RedisCluster, tuple[asyncio.Lock, list[float]]] = \
    weakref.WeakKeyDictionary()


async def remap_after(client: object, exc: BaseException) -> None:
    """After ``exc`` from a node of ``client``'s cluster, read the slot map again (one
    read at a time per client, and none within ``REMAP_GAP_S`` of the last: an error
    seen by several layers reads it once; a read that fails is left to the next error).
    redis-py does so itself after one command's broken connection, but not after a pipeline's
    (sent without retries, as here), nor after one on a connection held outside it
    (``lean.ClusterLink``): a process whose other calls kept succeeding would go on
    calling the dead primary for ever.  (Not by redis-py's ``_initialize`` flag: while
    it is set, ``aclose`` closes nothing.)"""
    if not isinstance(client, RedisCluster) or not isinstance(exc, NODE_ERRORS):
        return
    lock, last = _REMAPS.setdefault(client, (asyncio.Lock(), [-math.inf]))
    if lock.locked() or time.monotonic() - last[0] < REMAP_GAP_S:
        return  # (a read under way, or just done, will do)
    async with lock:
        with contextlib.suppress(*REDIS_ERRORS):
            await client.nodes_manager.initialize()
        last[0] = time.monotonic()


def _timeouts(settings: RedisSettings) -> dict[str, Any]:
    return {"socket_timeout": settings.socket_timeout_s,
            "socket_connect_timeout": settings.connect_timeout_s}


def _options(settings: RedisSettings, nodes: Topology) -> dict[str, Any]:
    """The data nodes' credentials, TLS and timeouts."""
    return {"username": nodes.username, "password": nodes.password, **dict(nodes.options.tls),
            **_timeouts(settings)}


def _sentinel_options(settings: RedisSettings, nodes: Topology, retry: Any
                      ) -> dict[str, Any]:
    """The sentinels' own credentials and TLS (URL options), the timeouts, and no
    retry of redis-py's own: its default (10 tries, backoff up to 0.5 s) spent about
    3.5 s on one dead sentinel before asking the next, past the callers' deadlines."""
    return {**nodes.options.sentinel_kwargs(), **_timeouts(settings), "retry": retry}


# (redis-py leaves these untyped)
_ASYNC_SEED: Any = ClusterNode
_ASYNC_SENTINEL: Any = ShieldedSentinel
_SYNC_SEED: Any = SyncClusterNode
_SYNC_SENTINEL: Any = SyncSentinel


def _async_nodes(settings: RedisSettings, nodes: Topology,
                 max_connections: int) -> aioredis.Redis:
    options = {**_options(settings, nodes), "retry": _no_retry(),
               "health_check_interval": 30, "max_connections": max_connections,
               "encoding_errors": ID_ERRORS}
    if nodes.mode == "cluster":
        seeds = [_ASYNC_SEED(host, port) for host, port in nodes.seeds]
        return cast(aioredis.Redis, SlotMappedCluster(startup_nodes=seeds, **options))
    sentinel = _ASYNC_SENTINEL(list(nodes.seeds),
                               sentinel_kwargs=_sentinel_options(settings, nodes, _no_retry()))
    return cast(aioredis.Redis, sentinel.master_for(
        nodes.service, redis_class=SentinelRedis, connection_pool_class=BlockingSentinelPool,
        timeout=settings.socket_timeout_s, db=nodes.db, **options))


def sync_client(settings: RedisSettings) -> redis.Redis:
    """A blocking client with the same timeouts (``redbatch status``, ``redbatch jobs``)."""
    nodes = settings.topology
    if nodes is None:
        return redis.Redis.from_url(settings.url, **_timeouts(settings))
    if nodes.mode == "cluster":
        seeds = [_SYNC_SEED(host, port) for host, port in nodes.seeds]
        return cast(redis.Redis, SyncRedisCluster(startup_nodes=seeds,
                                                  **_options(settings, nodes)))
    sentinel = _SYNC_SENTINEL(list(nodes.seeds), sentinel_kwargs=_sentinel_options(
        settings, nodes, SyncRetry(NoBackoff(), 0)))
    return cast(redis.Redis, sentinel.master_for(nodes.service, db=nodes.db,
                                                 **_options(settings, nodes)))


UNAVAILABLE_DETAIL_CHARS = 300  # of redis-py's message (a Sentinel's quotes its client)


def unavailable(settings: RedisSettings, exc: BaseException) -> RedisUnavailable:
    detail = str(exc).partition(" : <")[0]  # ("No master found for 'svc' : <Redis(<...)")
    if len(detail) > UNAVAILABLE_DETAIL_CHARS:
        detail = detail[:UNAVAILABLE_DETAIL_CHARS] + "..."
    what = "refused a command" if isinstance(exc, redis.ResponseError) else "unavailable"
    return RedisUnavailable(f"redis at {settings.safe_url} {what}: {type(exc).__name__}: "
                            f"{detail}")  # (a refusal: a key of another type, an ACL, ...)


@asynccontextmanager
async def translated(settings: RedisSettings) -> AsyncIterator[None]:
    """Turn redis connection, timeout and refusal errors into ``RedisUnavailable``; so
    too an ``AttributeError`` raised inside redis-py (``stream_gone``)."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise unavailable(settings, exc) from exc
    except AttributeError as exc:
        if not stream_gone(exc):
            raise
        raise unavailable(settings, redis.ConnectionError(
            f"the connection closed during a command: {exc}")) from exc


def stream_gone(exc: AttributeError) -> bool:
    """Whether ``exc`` was raised in redis-py's own code: a connection whose stream
    another task tore down (a cluster client resetting its nodes disconnects the
    connections it lent out) between redis-py's connect and its write, which runs in
    a task of its own a loop iteration later, meets ``None`` there."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith(
        "redis.")


def is_stale(exc: BaseException) -> bool:
    """Whether ``exc`` is a broken connection (closed or reset by the server, refused):
    one that a fresh connection may not meet.  A pool with no free connection is not."""
    return isinstance(exc, redis.ConnectionError) and not isinstance(exc.__cause__,
                                                                     TimeoutError)


async def drop_idle(client: aioredis.Redis) -> None:
    """Disconnect the pool's idle connections: after one broke (Redis restarted), the
    others are stale too, and each would fail once more.  They reconnect when next used.
    (A cluster client does it itself, for the node that failed: nothing to do.)"""
    if is_cluster(client):
        return
    with contextlib.suppress(Exception):
        await client.connection_pool.disconnect(inuse_connections=False)


async def add_by_deadline(client: aioredis.Redis, key: str, deadlines: Mapping[str, int],
                          keep: int) -> None:
    """Add request ids (-> their deadlines, epoch ms) to the sorted set ``key``, in one
    MULTI: the ids past their deadlines go, at most ``keep`` (the latest) stay, and the
    set expires with its latest deadline plus the marker grace (a cancelled set, a
    suspects set)."""
    now = protocol.now_ms()
    ttl_ms = protocol.marker_ttl_ms(max(deadlines.values()), now)
    async with client.pipeline(transaction=True) as pipe:
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zadd(key, dict(deadlines))
        pipe.zremrangebyrank(key, 0, -keep - 1)
        pipe.pexpire(key, ttl_ms, nx=True)  # a new set: expires with its latest deadline
        pipe.pexpire(key, ttl_ms, gt=True)  # else only ever later
        await pipe.execute()


async def idempotent(client: aioredis.Redis, call: Callable[[], Awaitable[T]]) -> T:
    """Run a read that is safe to repeat; on a broken connection, drop the pool's idle
    connections and run it once more (on a fresh one)."""
    try:
        return await call()
    except redis.ConnectionError as exc:
        if not is_stale(exc):
            raise
        await drop_idle(client)
        return await call()


@asynccontextmanager
async def deadline_bound(deadline_ms: int | None, what: str) -> AsyncIterator[None]:
    """Bound the block by an absolute deadline (epoch ms; None: unbounded): past it,
    the block is cancelled and ``DeadlineExceeded`` raised (a stalled Redis included)."""
    if deadline_ms is None:
        yield
        return
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(loop.time() + (deadline_ms - protocol.now_ms()) / 1000):
            yield
    except TimeoutError as exc:
        raise DeadlineExceeded(f"deadline passed while {what}") from exc
    except (RedisUnavailable, *REDIS_ERRORS) as exc:  # the cancel may surface as these
        if protocol.now_ms() < deadline_ms:
            raise
        raise DeadlineExceeded(f"deadline passed while {what}") from exc


def cancel_requested() -> bool:
    """Whether this task was asked to cancel (a ``CancelledError`` raised without that
    is a model's or a library's own, not a stop)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def check_cancelled() -> None:
    """Raise ``CancelledError`` where this task was cancelled but something swallowed
    the cancel: on Python 3.11, ``asyncio.wait_for`` (redis-py sends every command
    through it) returns normally when the cancel lands just as the wrapped write
    completes.  A loop that runs until an event calls this at each turn, so that a
    cancelled worker still ends."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
