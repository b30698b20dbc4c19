"""What the gateway knows of models: metadata published by workers, cached briefly."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from redbatch import defaults, protocol, versions
from redbatch.config import RedisSettings
from redbatch.errors import RedbatchError
from redbatch.levels import by_level, queue_depths, read_meta
from redbatch.producer.admission import no_live_workers, unknown_model
from redbatch.redis_conn import deadline_bound, idempotent, translated
from redbatch.registry import live_workers
from redbatch.spec import ModelInfo

__all__ = ["MAX_CACHED", "ModelDirectory", "ModelInfo"]

log = logging.getLogger("redbatch.api")

MAX_CACHED = 1024


class ModelDirectory:
    """Looks models up in Redis; remembers hits for ``refresh_s`` and misses for
    ``MISS_REFRESH_S`` at most (a model whose first worker just registered is found
    within that, by every gateway process)."""

    def __init__(self, redis: aioredis.Redis, settings: RedisSettings, refresh_s: float) -> None:
        self._redis = redis
        self._settings = settings
        self._refresh_s = refresh_s
        self._cache: dict[str, tuple[float, ModelInfo | None]] = {}
        self._known_at: dict[str, float] = {}  # when each name's metadata was last read

    async def get(self, name: str, deadline_ms: int | None = None) -> ModelInfo:
        """The model's info, or ``UnknownModel`` if no worker ever registered it (one
        read within ``KNOWN_GRACE_S``: ``NoLiveWorkers``, a Redis that lost the
        registration until the next heartbeat); a lookup in Redis (a cache miss) ends
        by ``deadline_ms`` (``DeadlineExceeded``)."""
        hit = self._cache.get(name)
        if hit is None or self._stale(hit):
            async with deadline_bound(deadline_ms, f"looking up model {name!r}"):
                hit = (time.monotonic(), await self._fetch(name))
            if len(self._cache) >= MAX_CACHED:  # names come from URLs: keep this bounded
                self._cache.clear()
                self._known_at.clear()
            self._cache[name] = hit
            if hit[1] is not None:
                self._known_at[name] = hit[0]
        if hit[1] is None:
            known_at = self._known_at.get(name)
            if known_at is not None and time.monotonic() - known_at < defaults.KNOWN_GRACE_S:
                raise no_live_workers(name)
            raise unknown_model(name)
        return hit[1]

    def cached(self, name: str) -> ModelInfo | None:
        """The model's info while the cache holds it fresh (no I/O); None otherwise
        (stale, never read, or no worker registered it: ``get`` says which)."""
        hit = self._cache.get(name)
        if hit is not None and hit[1] is not None and \
                time.monotonic() - hit[0] <= self._refresh_s:
            return hit[1]
        return None

    def _stale(self, hit: tuple[float, ModelInfo | None]) -> bool:
        refresh_s = self._refresh_s if hit[1] is not None else \
            min(self._refresh_s, defaults.MISS_REFRESH_S)
        return time.monotonic() - hit[0] > refresh_s

    async def _fetch(self, name: str) -> ModelInfo | None:
        protocol.check_model_name(name)
        async with translated(self._settings):
            raw = await idempotent(self._redis, lambda: self._redis.get(protocol.meta_key(name)))
        if not raw:
            return None
        try:
            return ModelInfo.from_meta(orjson.loads(raw))
        except (ValueError, TypeError, KeyError, AttributeError, RedbatchError) as exc:
            log.warning("model %r: its metadata cannot be read (%s); answered as unknown",
                        name, exc)
            return None

    async def listing(self) -> list[dict[str, Any]]:
        """Every known model with its queue depth, live workers and ``versions``; a
        model served in versions is one entry (its latest version's fields, under the
        model's name, with the queue depths and live workers of every version summed,
        and every version's workers), with a row per version (its own queue depth, and
        depths per level for a multi-level version)."""
        async with translated(self._settings):
            groups = by_model(await self._model_names())
            entries = [await self._readable(name, groups[name]) for name in sorted(groups)]
        return [entry for entry in entries if entry is not None]

    async def _readable(self, name: str, served: list[str]) -> dict[str, Any] | None:
        """``_entry``, or None (logged) for a model whose keys in Redis cannot be read
        (metadata that is not a JSON object, a key of another type): one bad entry,
        written by something else, never fails the whole listing."""
        try:
            return await self._entry(name, served)
        except (ValueError, TypeError, KeyError, redis.ResponseError) as exc:
            log.warning("model %r left out of the listing: its keys in Redis cannot be "
                        "read (%s: %s)", name, type(exc).__name__, exc)
            return None

    async def _entry(self, name: str, served: list[str]) -> dict[str, Any]:
        if not served:  # served without versions: its one version, "1"
            entry = await self._describe(name)
            return {**entry, "versions": [versions.unversioned_row(
                name, entry["live_workers"], entry["queue_depth"])]}
        table = await versions.load(self._redis, name)
        rows = (await versions.describe(self._redis, name, table))["versions"]
        described = {row["name"]: await self._describe(row["name"]) for row in rows}
        for row in rows:  # each version's own depths (its levels may differ)
            row.update({k: v for k, v in described[row["name"]].items()
                        if k in ("queue_depth", "queue_depths")})
        latest = table.served(name, table.latest) if table.latest else served[0]
        entry = {**(described.get(latest) or await self._describe(latest)), "name": name}
        entry.pop("queue_depths", None)
        return {**entry, "versions": rows,
                "queue_depth": sum(r["queue_depth"] for r in rows),
                "live_workers": sum(r["live_workers"] for r in rows),
                "workers": [w for d in described.values() for w in d["workers"]]}

    async def _describe(self, name: str) -> dict[str, Any]:
        raw, draining = await read_meta(self._redis, name)
        depths = await queue_depths(self._redis, name, raw, draining)
        workers = await live_workers(self._redis, name)
        meta = orjson.loads(raw) if raw else {"name": name}
        if not isinstance(meta, dict):
            raise TypeError(f"metadata is a JSON {type(meta).__name__}, not an object")
        if len(depths) > 1:  # a multi-level model: its depth counts every level
            meta["queue_depths"] = by_level(depths)
        return {"kind": "model", **meta,  # a pipeline's: its own
                protocol.F_STREAMING: meta.get(protocol.F_STREAMING) is True,
                "queue_depth": sum(depths), "live_workers": len(workers),
                "workers": workers}

    def known(self, name: str) -> bool:
        """Whether a worker registered ``name`` (as far as the cache knows)."""
        hit = self._cache.get(name)
        return hit is not None and hit[1] is not None

    async def model_names(self) -> list[str]:
        """Every model a worker ever registered."""
        async with translated(self._settings):
            return await self._model_names()

    async def _model_names(self, newest_first: bool = False) -> list[str]:
        """The names a worker registered within ``META_TTL_S`` (an older one's metadata
        expired: the name is pruned by the heartbeats), oldest heartbeat first; a name
        that is not UTF-8 (written by something else) is left out."""
        since = protocol.now_ms() - protocol.META_TTL_S * 1000
        raw: Any = await (self._redis.zrange(protocol.MODELS_KEY, "+inf", since, desc=True,
                                             byscore=True)  # (ZRANGE: in the ACL)
                          if newest_first else
                          self._redis.zrangebyscore(protocol.MODELS_KEY, since, "+inf"))
        return [name for name in map(_text, raw) if name is not None]

    async def any_live_worker(self) -> bool:
        """Whether a worker of any model holds a live lease, asking of the models with
        the latest heartbeats first (a live one is among them: the names of retired
        models are never pruned); ``DeadlineExceeded`` when Redis takes longer than a
        probe waits (``PROBE_TIMEOUT_S``)."""
        async with deadline_bound(probe_deadline_ms(), "looking for a live worker"), \
                translated(self._settings):
            now = protocol.now_ms()
            for name in await self._model_names(newest_first=True):
                with contextlib.suppress(redis.ResponseError):  # (a key of another type)
                    if await self._redis.zcount(protocol.workers_key(name), now, "+inf"):
                        return True
        return False


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def by_model(names: list[str]) -> dict[str, list[str]]:
    """Registered names grouped by model: model -> its versions' served names (empty
    for a model served without versions)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        base, version = protocol.split_name(name)
        groups.setdefault(base, [])
        if version is not None:
            groups[base].append(name)
    return groups


def probe_deadline_ms() -> int:
    """When a readiness probe's look-ups must have ended (``PROBE_TIMEOUT_S`` from now:
    a probe answers 503 rather than hang on a stalled Redis)."""
    return protocol.now_ms() + round(1000 * defaults.PROBE_TIMEOUT_S)
