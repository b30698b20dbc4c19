"""Worker registration, leases and heartbeats: who serves which model, on what device,
and which workers' leases have expired (for the reaper).  Reading who is live is
``redbatch.registry``'s."""

from __future__ import annotations

import os
import socket
from typing import Any

import orjson
import redis.asyncio as aioredis

from redbatch import protocol
from redbatch.worker.model import Model

REAP_SCAN = 16  # expired workers looked at per model per heartbeat


def static_info(worker_id: str, device: str) -> dict[str, Any]:
    return {"worker_id": worker_id, "device": device, "pid": os.getpid(),
            "host": socket.gethostname(), "started_ms": protocol.now_ms(),
            protocol.F_ROWS: True}  # this worker understands multi-row requests


async def beat(redis: aioredis.Redis, models: list[Model], worker_id: str,
               infos: dict[str, bytes], lease_ttl_s: float) -> dict[str, list[str]]:
    """Renew this worker's lease and its models' metadata in one round trip; return,
    per model, the ids of workers whose lease has expired."""
    now = protocol.now_ms()
    lease_until = now + round(lease_ttl_s * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            _beat_model(pipe, model, worker_id, infos[model.name], lease_until)
            pipe.zrangebyscore(protocol.workers_key(model.name), "-inf", now, 0, REAP_SCAN)
        pipe.zadd(protocol.MODELS_KEY, {m.name: now for m in models})
        pipe.expire(protocol.MODELS_KEY, protocol.META_TTL_S)
        results = await pipe.execute()
    expired = results[5::6]
    return {m.name: [w.decode() for w in ids if w.decode() != worker_id]
            for m, ids in zip(models, expired, strict=True)}


def _beat_model(pipe: Any, model: Model, worker_id: str, info: bytes, lease_until: int) -> None:
    workers = protocol.workers_key(model.name)
    infos = protocol.worker_info_key(model.name)
    pipe.zadd(workers, {worker_id: lease_until})
    pipe.expire(workers, protocol.WORKERS_TTL_S)
    pipe.hset(infos, worker_id, info)
    pipe.expire(infos, protocol.WORKERS_TTL_S)
    pipe.set(protocol.meta_key(model.name), orjson.dumps(model.meta()),
             ex=protocol.META_TTL_S)


async def leave(redis: aioredis.Redis, models: list[Model], worker_id: str) -> None:
    """Deregister on a clean stop, so live-worker counts drop at once."""
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.zrem(protocol.workers_key(model.name), worker_id)
            pipe.hdel(protocol.worker_info_key(model.name), worker_id)
        await pipe.execute()
