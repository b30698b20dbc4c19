"""Worker registration, leases and heartbeats: who serves which model, on what device,
and which workers' leases have expired (for the reaper).  Reading who is live is
``redbatch.registry``'s."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from redbatch import lua, protocol
from redbatch.lean import script_sha
from redbatch.redis_conn import ID_ERRORS
from redbatch.worker.model import Model
from redbatch.worker.stats import WorkerStats

REAP_SCAN = 16  # expired workers looked at per model per heartbeat


def static_info(worker_id: str, device: str) -> dict[str, Any]:
    return {"worker_id": worker_id, "device": device, "pid": os.getpid(),
            "host": socket.gethostname(), "started_ms": protocol.now_ms(),
            protocol.F_ROWS: True}  # this worker understands multi-row requests


def published(info: dict[str, Any], stats: WorkerStats) -> tuple[bytes, bytes]:
    """A model's two heartbeat fields: its full info (``static_info``, the counters and
    histograms: ``redbatch status``, the v2 statistics, the benchmark) and its compact
    capacity (``items_per_s``, ``rows``: all that admission reads; ``served_per_s``: what
    the gateways' autoscaling gauges read).  Samples the rates: call once per
    heartbeat."""
    capacity = {protocol.F_ITEMS_PER_S: stats.sample_capacity(),
                protocol.F_ROWS: info[protocol.F_ROWS],
                protocol.F_SERVED_PER_S: round(stats.sample_served(), 3)}
    return orjson.dumps({**info, **stats.counters()}), orjson.dumps(capacity)


@dataclass(frozen=True)
class Beat:
    """What one heartbeat read back, per model: the ids of workers whose lease has
    expired, the model's stored knob overrides (``config_key``, raw), and whether
    every live worker of it knows held lists (``held_aware_key``: this one may hold)."""

    expired: dict[str, list[str]]
    overrides: dict[str, dict[bytes, bytes]]
    versions: dict[str, bytes | None]  # a versioned model's row of its routing table
    live: dict[str, list[bytes]] = field(default_factory=dict)  # a sharded model's live ids
    held_aware: dict[str, bool] = field(default_factory=dict)
    live_counts: dict[str, int] = field(default_factory=dict)  # live leases, this one's too
    shrunk: dict[str, bytes | None] = field(default_factory=dict)  # sub_queues_shrunk_key

    def unranked(self) -> frozenset[str]:
        """The models with more live workers than ``RANKED_WORKERS_MAX``: the next beat
        reads none of their ids (their workers take hashed homes)."""
        return frozenset(name for name, count in self.live_counts.items()
                         if count > protocol.RANKED_WORKERS_MAX)


@dataclass(frozen=True)
class Draining:
    """The sub-queues this worker still claims from above a model's shrunk count (per
    model it drains; ``ShardClaimer.draining``), and how long the count it publishes
    outlives its beat: ``protocol.DRAINING_TTL_BEATS`` heartbeat intervals."""

    counts: dict[str, int]
    ttl_ms: int


async def beat(redis: aioredis.Redis, models: list[Model], worker_id: str,
               fields: dict[str, tuple[bytes, bytes]], lease_ttl_s: float,
               draining: Draining | None = None, unranked: frozenset[str] = frozenset()
               ) -> Beat:
    """Renew this worker's lease, its published fields (per model: ``published``) and
    its models' metadata (and ``draining``'s counts), and read each model's knob
    overrides, in one round trip (sent once more, after loading them, when Redis lost
    its scripts: the beat's other commands are idempotent).  ``unranked``: sharded
    models whose live ids it does not read (``Beat.unranked`` of the last beat)."""
    try:
        return await _beat(redis, models, worker_id, fields, lease_ttl_s, draining, unranked)
    except NoScriptError:
        for script in BEAT_SCRIPTS:
            await redis.script_load(script)
        return await _beat(redis, models, worker_id, fields, lease_ttl_s, draining, unranked)


async def _beat(redis: aioredis.Redis, models: list[Model], worker_id: str,
                fields: dict[str, tuple[bytes, bytes]], lease_ttl_s: float,
                draining: Draining | None, unranked: frozenset[str]) -> Beat:
    now = protocol.now_ms()
    lease_until = now + round(lease_ttl_s * 1000)
    scans: list[int] = []  # where each model's scan of expired leases answers
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            _beat_model(pipe, model, worker_id, fields[model.name], lease_until)
            pipe.zrangebyscore(protocol.workers_key(model.name), "-inf", now, 0, REAP_SCAN)
            pipe.hgetall(protocol.config_key(model.name))
            pipe.get(protocol.sub_queues_shrunk_key(model.name))
            scans.append(len(pipe) - 3)
        rows = _version_rows(pipe, models,
                             round(lease_ttl_s * 1000) * protocol.BASE_SETTLE_LEASES)
        live = _live_ids(pipe, [m for m in models if m.name not in unranked], now)
        aware = _count_aware(pipe, models, now)
        _publish_draining(pipe, draining)
        pipe.zadd(protocol.MODELS_KEY, {m.name: now for m in models})
        pipe.zremrangebyscore(protocol.MODELS_KEY, "-inf",  # (their metadata expired)
                              now - protocol.META_TTL_S * 1000)
        pipe.expire(protocol.MODELS_KEY, protocol.META_TTL_S)
        results = await pipe.execute()
    return Beat({m.name: [w for w in _ids(results[i]) if w != worker_id]
                 for m, i in zip(models, scans, strict=True)},
                {m.name: results[i + 1] for m, i in zip(models, scans, strict=True)},
                {name: results[i] for name, i in rows.items()},
                {**{m.name: [] for m in models if m.sub_queues > 1 and m.name in unranked},
                 **{name: list(results[i]) for name, i in live.items()}},
                {name: results[i] == results[i + 1] for name, i in aware.items()},
                {name: int(results[i]) for name, i in aware.items()},
                {m.name: results[i + 2] for m, i in zip(models, scans, strict=True)})


def _ids(raw: list[bytes]) -> list[str]:
    """Worker ids as read (``ID_ERRORS``: one that is not UTF-8 still names its keys)."""
    return [w.decode(errors=ID_ERRORS) for w in raw]


def _publish_draining(pipe: Any, draining: Draining | None) -> None:
    """Publish the sub-queues this worker drains per model, outside the meta that every
    worker rewrites (``lua.PUBLISH_DRAINING``: the most any drainer claims from)."""
    if draining is None:
        return
    for name, count in draining.counts.items():
        pipe.execute_command("EVALSHA", DRAINING_SHA, 1,
                             protocol.sub_queues_draining_key(name), count, draining.ttl_ms)


def _live_ids(pipe: Any, models: list[Model], now: int) -> dict[str, int]:
    """Read the ids of each sharded model's live workers (this one's lease renewed
    already: it is among them; raw, as foreign workers may name themselves), whose
    ranks choose their home sub-queues; where each answers.  Every id each beat, so a
    pool of N reads N ids N times a beat interval: only while N is at most
    ``RANKED_WORKERS_MAX`` (the caller leaves out the models with more)."""
    live: dict[str, int] = {}
    for model in models:
        if model.sub_queues > 1:
            pipe.zrangebyscore(protocol.workers_key(model.name), now, "+inf")
            live[model.name] = len(pipe) - 1
    return live


def _count_aware(pipe: Any, models: list[Model], now: int) -> dict[str, int]:
    """Count each model's live leases (this one's renewed already) and those of them
    that know held lists (``held_aware_key``, whose expired members go: an older
    reaper removes a worker from ``workers_key`` alone); where each pair answers.
    Equal counts: no live worker of an older revision, whose reaper or drainer would
    miss a held list."""
    aware: dict[str, int] = {}
    for model in models:
        held_aware = protocol.held_aware_key(model.name)
        pipe.zremrangebyscore(held_aware, "-inf", f"({now}")
        pipe.zcount(protocol.workers_key(model.name), now, "+inf")
        pipe.zcount(held_aware, now, "+inf")
        aware[model.name] = len(pipe) - 2
    return aware


NEW_VERSION_ROW = orjson.dumps({"weight": None, "draining": False})
CANARY_ROW = orjson.dumps({"weight": 0.0, "draining": False})  # while another serves
REGISTER_SHA = script_sha(lua.REGISTER_VERSION)
DRAINING_SHA = script_sha(lua.PUBLISH_DRAINING)
BEAT_SCRIPTS = (lua.REGISTER_VERSION, lua.PUBLISH_DRAINING)  # what a beat runs by SHA


def _version_rows(pipe: Any, models: list[Model], settle_ms: int) -> dict[str, int]:
    """Register each versioned model's version in its routing table
    (``lua.REGISTER_VERSION``: an operator's weights stay; a version new to a model
    served already takes no unpinned traffic until promoted; a version "1" takes a
    stored base row over once the workers without versions are gone ``settle_ms``)
    and read its row back; where each row answers."""
    rows: dict[str, int] = {}
    for model in models:
        if model.version is not None:
            base = protocol.split_name(model.name)[0]
            pipe.execute_command("EVALSHA", REGISTER_SHA, 2, protocol.versions_key(base),
                                 protocol.workers_key(base), model.version,
                                 protocol.now_ms(), NEW_VERSION_ROW, CANARY_ROW, settle_ms)
            rows[model.name] = len(pipe) - 1
    return rows


def _beat_model(pipe: Any, model: Model, worker_id: str, fields: tuple[bytes, bytes],
                lease_until: int) -> None:
    for workers in (protocol.workers_key(model.name), protocol.held_aware_key(model.name)):
        pipe.zadd(workers, {worker_id: lease_until})
        pipe.expire(workers, protocol.WORKERS_TTL_S)
    for key, value in zip((protocol.worker_info_key(model.name),
                           protocol.worker_capacity_key(model.name)), fields, strict=True):
        pipe.hset(key, worker_id, value)
        pipe.expire(key, protocol.WORKERS_TTL_S)
    pipe.set(protocol.meta_key(model.name), orjson.dumps(model.meta()),
             ex=protocol.META_TTL_S)


async def leave(redis: aioredis.Redis, models: list[Model], worker_id: str) -> None:
    """Deregister on a clean stop, so live-worker counts drop at once."""
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.zrem(protocol.workers_key(model.name), worker_id)
            pipe.zrem(protocol.held_aware_key(model.name), worker_id)
            pipe.hdel(protocol.worker_info_key(model.name), worker_id)
            pipe.hdel(protocol.worker_capacity_key(model.name), worker_id)
        await pipe.execute()
