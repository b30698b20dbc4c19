"""Start-up checks against the Redis server we were given."""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger("redbatch.checks")
SAFE_POLICIES = frozenset({"noeviction"})


async def check_eviction(redis: aioredis.Redis) -> str | None:
    """Warn if Redis may evict keys under memory pressure: an evicted queue, in-flight
    list or marker loses requests.  Returns the warning (None when safe or unknown)."""
    try:
        config: Any = await redis.config_get("maxmemory*")
    except Exception as exc:  # CONFIG is often disabled (managed Redis, fakeredis)
        log.debug("cannot read maxmemory settings (%s): eviction not checked", exc)
        await redis.connection_pool.disconnect()  # some servers drop the link on an error
        return None
    limit = int(config.get("maxmemory") or config.get(b"maxmemory") or 0)
    policy = config.get("maxmemory-policy") or config.get(b"maxmemory-policy") or b""
    policy = policy.decode() if isinstance(policy, bytes) else str(policy)
    if limit == 0 or policy in SAFE_POLICIES:
        return None
    warning = (f"redis has maxmemory={limit} with maxmemory-policy={policy}: it may evict "
               "redbatch's queues and in-flight lists under memory pressure and lose "
               "requests; use maxmemory-policy noeviction")
    log.warning("%s", warning)
    return warning
