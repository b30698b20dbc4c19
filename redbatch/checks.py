"""Start-up checks against the Redis server we were given: settings that lose
requests, and commands a least-privilege ACL refuses (see docs/redis.md)."""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoPermissionError, ResponseError

log = logging.getLogger("redbatch.checks")
SAFE_POLICIES = frozenset({"noeviction"})
CONFIG_REFUSED = ("the redis user may not run CONFIG GET (NOPERM): maxmemory-policy is not "
                  "checked, and a Redis that evicts keys loses requests; allow "
                  "+config|get or make sure the policy is noeviction (docs/redis.md)")
UNBLOCK_REFUSED = ("the redis user may not run CLIENT UNBLOCK (NOPERM): batch windows are "
                   "not cut short when a batch fills or its window ends, so batches wait up "
                   "to the block timeout; allow +client|unblock (docs/redis.md)")


async def check_eviction(redis: aioredis.Redis) -> str | None:
    """Warn if Redis may evict keys under memory pressure: an evicted queue, in-flight
    list or marker loses requests.  Returns the warning (None when safe or unknown)."""
    warning = await eviction_warning(redis)
    if warning:
        log.warning("%s", warning)
    return warning


async def eviction_warning(redis: aioredis.Redis) -> str | None:
    """``check_eviction``'s warning, not logged."""
    try:
        configs = await _maxmemory(redis)
    except NoPermissionError:
        return CONFIG_REFUSED
    except Exception as exc:  # CONFIG is often disabled (managed Redis, fakeredis)
        log.debug("cannot read maxmemory settings (%s): eviction not checked", exc)
        pool = getattr(redis, "connection_pool", None)  # (a cluster client has none)
        if pool is not None:
            await pool.disconnect()  # some servers drop the link on an error
        return None
    return next((w for w in map(_evicts, configs) if w is not None), None)


async def _maxmemory(redis: aioredis.Redis) -> list[Any]:
    """The ``maxmemory*`` settings of the server, or of every primary of a cluster (a
    cluster client asks one node by default: another may evict)."""
    if not isinstance(redis, RedisCluster):
        return [await redis.config_get("maxmemory*")]
    answers: Any = await redis.config_get(
        "maxmemory*", target_nodes=RedisCluster.PRIMARIES)
    single = "maxmemory" in answers or b"maxmemory" in answers  # (one primary's answer)
    return [answers] if single else list(answers.values())


def _evicts(config: Any) -> str | None:
    """The warning for one server's settings, None if it never evicts."""
    limit = int(config.get("maxmemory") or config.get(b"maxmemory") or 0)
    policy = config.get("maxmemory-policy") or config.get(b"maxmemory-policy") or b""
    policy = policy.decode() if isinstance(policy, bytes) else str(policy)
    if limit == 0 or policy in SAFE_POLICIES:
        return None
    return (f"redis has maxmemory={limit} with maxmemory-policy={policy}: it may evict "
            "redbatch's queues and in-flight lists under memory pressure and lose "
            "requests; use maxmemory-policy noeviction")


async def unblock_warning(redis: aioredis.Redis) -> str | None:
    """Whether this user may end a blocked pop early (``CLIENT UNBLOCK 0`` answers 0
    when allowed: no client has id 0).  Connection errors propagate (callers retry)."""
    try:
        await redis.client_unblock(0)
    except NoPermissionError:
        return UNBLOCK_REFUSED
    except ResponseError as exc:  # e.g. fakeredis: no such command
        log.debug("CLIENT UNBLOCK refused (%s): batch windows may be imprecise", exc)
    return None


async def worker_warnings(redis: aioredis.Redis) -> list[str]:
    """What a worker warns about at start, once: eviction, and refused commands."""
    found = [await eviction_warning(redis), await unblock_warning(redis)]
    return [warning for warning in found if warning]
