"""KServe v2 / Triton extensions on the gateway: the model repository index and model
statistics (``docs/v2.md``).

Statistics come from what live workers publish with each heartbeat (their totals since
start, ``Runner.counters``); a worker that stopped takes its totals with it.  Workers
count forward passes, items, queue entries and the time those spent queued and in the
model; they publish no failure counts, so ``fail`` is 0.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson
import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from redbatch import protocol
from redbatch.api import body
from redbatch.errors import BadRequest
from redbatch.redis_conn import translated
from redbatch.registry import live_workers

log = logging.getLogger("redbatch.api")

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

VERSION = "1"
INDEX_BODY_MAX_BYTES = 4096  # the index request is {"ready": bool} at most
NS_PER_MS = 1_000_000


def _stat(count: int, ns: int = 0) -> dict[str, int]:
    return {"count": count, "ns": ns}


def _total(workers: list[dict[str, Any]], key: str) -> float:
    total = 0.0
    for worker in workers:
        value = worker.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            total += value
    return total


def model_stats(name: str, workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Triton's statistics of one model from its live workers' heartbeat totals.

    ``inference_count`` is rows computed, ``execution_count`` forward passes.  Every
    ``count`` of ``inference_stats`` is the queue entries (requests) the workers took, as
    Triton counts requests in each; ``queue.ns`` is their total queue wait,
    ``compute_infer.ns`` the forward passes' total time (a batch's pass counted once,
    shared by its requests), ``success.ns`` the two together (a lower bound: the hops
    through the gateway and Redis are not in it)."""
    entries, batches = int(_total(workers, "entries")), int(_total(workers, "batches"))
    queue_ns = round(_total(workers, "queue_wait_ms") * NS_PER_MS)
    compute_ns = round(_total(workers, "forward_ms") * NS_PER_MS)
    stats = {"success": _stat(entries, queue_ns + compute_ns), "fail": _stat(0),
             "queue": _stat(entries, queue_ns), "compute_input": _stat(entries),
             "compute_infer": _stat(entries, compute_ns), "compute_output": _stat(entries),
             "cache_hit": _stat(0), "cache_miss": _stat(0)}
    return {**_named(name), "last_inference": 0,
            "inference_count": int(_total(workers, "items")), "execution_count": batches,
            "inference_stats": stats, "batch_stats": []}


def _named(name: str) -> dict[str, str]:
    """A registered name as v2 names it: a version's served name split."""
    model, version = protocol.split_name(name)
    return {"name": model, "version": version or VERSION}


def _ready_only(raw: bytes) -> bool:
    """The index request's optional ``{"ready": bool}``; tritonclient sends no body."""
    if not raw.strip():
        return False
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    ready = data.get("ready", False) if isinstance(data, dict) else None
    if not isinstance(ready, bool):
        raise BadRequest("the body must be a JSON object with an optional boolean 'ready'")
    return ready


class RepositoryApi:
    """``POST /v2/repository/index`` and ``GET /v2/models[/{name}[/versions/1]]/stats``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _workers(self, name: str) -> list[dict[str, Any]] | None:
        """The live workers of ``name``; None (logged) when its keys cannot be read (a
        key of another type, written by something else: one model, not every one)."""
        async with translated(self.gateway.redis_settings):
            try:
                return await live_workers(self.gateway.redis, name)
            except redis.ResponseError as exc:
                _unreadable(name, exc)
                return None

    async def _live(self, name: str) -> int | None:
        async with translated(self.gateway.redis_settings):
            try:
                return int(await self.gateway.redis.zcount(protocol.workers_key(name),
                                                           protocol.now_ms(), "+inf"))
            except redis.ResponseError as exc:
                _unreadable(name, exc)
                return None

    async def index(self, request: Request) -> Response:
        raw = await body.read_body(dict(request.headers.raw), request.receive,
                                   INDEX_BODY_MAX_BYTES)
        ready_only = _ready_only(raw)
        models = []
        for name in await self.gateway.directory.model_names():
            live = await self._live(name)
            if live is not None and (live or not ready_only):
                models.append({**_named(name),
                               "state": "READY" if live else "UNAVAILABLE",
                               "reason": "" if live else "no live worker"})
        return JSONResponse(models)

    async def stats(self, request: Request, names: list[str]) -> Response:
        read = [(name, await self._workers(name)) for name in names]
        return JSONResponse({"model_stats": [model_stats(name, workers)
                                             for name, workers in read if workers is not None]})

    async def all_stats(self, request: Request) -> Response:
        return await self.stats(request, await self.gateway.directory.model_names())


def _unreadable(name: str, exc: Exception) -> None:
    log.warning("model %r left out: its keys in Redis cannot be read (%s)", name, exc)
