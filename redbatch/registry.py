"""Who is live: the workers whose lease on a model has not expired, with the info each
published (``worker.heartbeat`` writes the leases; gateways, clients, ``redbatch
status`` and the benchmark read them here)."""

from __future__ import annotations

from typing import Any

import orjson
import redis.asyncio as aioredis

from redbatch import protocol


async def live_workers(redis: aioredis.Redis, model: str) -> list[dict[str, Any]]:
    """Workers whose lease has not expired, with their info."""
    ids: Any = await redis.zrangebyscore(protocol.workers_key(model), protocol.now_ms(), "+inf")
    if not ids:
        return []
    return _with_info(ids, await redis.hmget(protocol.worker_info_key(model), ids))


def live_workers_sync(redis: Any, model: str) -> list[dict[str, Any]]:
    """``live_workers`` for a synchronous client (``redbatch status``)."""
    ids: Any = redis.zrangebyscore(protocol.workers_key(model), protocol.now_ms(), "+inf")
    return _with_info(ids, redis.hmget(protocol.worker_info_key(model), ids)) if ids else []


def _with_info(ids: Any, infos: Any) -> list[dict[str, Any]]:
    return [orjson.loads(raw) if raw else {"worker_id": wid.decode()}
            for wid, raw in zip(ids, infos, strict=True)]
