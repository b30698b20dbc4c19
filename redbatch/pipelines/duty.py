"""A worker's part in the pipelines it serves stages of: it stores the pipelines it
declares, runs a hand-off (``Mover``) for each stage it serves, and, where it serves a
pipeline's first stage, keeps the pipeline registered under its own name (a lease and
metadata, as a model's), so that gateways and clients route to it like to a model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
import redis.asyncio as aioredis

from redbatch import defaults, protocol
from redbatch.errors import ConfigError
from redbatch.pipelines.definition import Pipeline, parse_registry, registry_mapping
from redbatch.pipelines.mover import Mover
from redbatch.redis_conn import REDIS_ERRORS, check_cancelled
from redbatch.registry import LiveCache
from redbatch.worker.model import Model

log = logging.getLogger("redbatch.pipelines")
STALE_LEASES_MS = 60_000  # a pipeline's lapsed leases are dropped this long after
STOP_TIMEOUT_S = 3.0  # at a stop: the movers' last steps, then the leave, each at most


class PipelineDuty:
    def __init__(self, redis: aioredis.Redis, models: list[Model], worker_id: str,
                 declared: list[Pipeline], interval_s: float, lease_ttl_s: float,
                 blocking: aioredis.Redis | None = None,
                 wait_s: float = defaults.HANDOFF_WAIT_S) -> None:
        self._redis = redis
        self._models = {m.name: m for m in models}
        self._worker_id = worker_id
        self._declared = declared
        self._interval_s = interval_s
        self._lease_ms = round(lease_ttl_s * 1000)
        self._blocking = blocking
        self._wait_s = wait_s
        self._live = LiveCache(redis)
        self.movers: dict[str, Mover] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._refused: set[str] = set()  # stages this worker cannot serve in a pipeline
        self._fronted: set[str] = set()  # pipelines whose first stage this worker serves

    async def run(self, stop: asyncio.Event) -> None:
        """Look at the registry every ``interval_s`` until ``stop``; then the movers
        finish their last step and this worker leaves its pipelines.  Cancelled (a stop
        that a stalled Redis held too long), the movers are cancelled at once: their
        records stay under their leases, and the pipelines' leases expire."""
        mover_stop = asyncio.Event()
        try:
            await self._ticks(stop, mover_stop)
            mover_stop.set()
            await self._movers_end()
        finally:  # (a cancel's: these run to their end, each bounded)
            await self._movers_end(0.0)
            await self._live.aclose()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._leave(), STOP_TIMEOUT_S)

    async def _ticks(self, stop: asyncio.Event, mover_stop: asyncio.Event) -> None:
        while not stop.is_set():
            check_cancelled()  # (a cancel that redis-py swallowed)
            try:
                await self.tick(mover_stop)
            except REDIS_ERRORS as exc:
                log.warning("pipelines: %s: %s", type(exc).__name__, exc)
            except Exception:  # a bug, or a bad value in Redis: the next tick again
                log.exception("pipelines: the duty's tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval_s)

    async def _movers_end(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """The movers' last steps, for ``timeout_s`` at most (a stalled Redis must not
        hold the worker's stop): those still running then are cancelled, their records
        left under their leases for the stage's other workers."""
        tasks = list(self._tasks.values())
        if not tasks:
            return
        pending = set(tasks)
        try:
            if timeout_s > 0:
                _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        finally:  # (the duty cancelled meanwhile: its movers end with it, none left running)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if pending and timeout_s > 0:
            log.warning("pipelines: %d hand-off(s) did not finish their last step in "
                        "%.0f s; their records are left to the stage's other workers",
                        len(pending), timeout_s)

    async def tick(self, mover_stop: asyncio.Event) -> None:
        """Store the declared pipelines, start the movers of new stages, renew the
        leases of the pipelines fronted here."""
        if self._declared:
            await self._redis.hset(protocol.PIPELINES_KEY,
                                   mapping=registry_mapping(self._declared))  # type: ignore[arg-type]
        known = parse_registry(await self._redis.hgetall(protocol.PIPELINES_KEY))
        self._revive(mover_stop)
        for pipe in known.values():
            if self._servable(pipe, known):
                for stage in pipe.models:
                    if stage in self._models and stage not in self.movers:
                        self._start(stage, mover_stop)
        fronted = [p for p in known.values()
                   if p.first in self._models and p.name not in self._refused]
        self._fronted = {p.name for p in fronted}
        if fronted:
            await self._beat(fronted)

    def _start(self, stage: str, stop: asyncio.Event) -> None:
        mover = Mover(self._redis, stage, self._live, self._blocking, self._wait_s)
        self.movers[stage] = mover
        self._tasks[stage] = asyncio.create_task(mover.run(stop))
        log.info("stage=%s: handing on its pipeline requests", stage)

    def _revive(self, stop: asyncio.Event) -> None:
        """Start again the movers whose task ended before ``stop`` (logged)."""
        for stage, task in list(self._tasks.items()):
            if task.done() and not stop.is_set():
                error = None if task.cancelled() else task.exception()
                log.error("stage=%s: its hand-off ended (%r); started again", stage, error)
                self._start(stage, stop)

    def _servable(self, pipe: Pipeline, known: dict[str, Pipeline]) -> bool:
        """False (logged once) if a stage of ``pipe`` is served here in a way a pipeline
        cannot route to (``unservable``), or is a pipeline (``nested_stage``)."""
        problem = unservable(pipe, list(self._models.values())) or nested_stage(pipe, known)
        if problem and pipe.name not in self._refused:
            self._refused.add(pipe.name)
            log.error("pipeline %r is not served by this worker: %s", pipe.name, problem)
        return not problem

    async def _beat(self, fronted: list[Pipeline]) -> None:
        async with self._redis.pipeline(transaction=False) as reads:  # keys of many slots
            for key in [protocol.meta_key(p.last) for p in fronted] + \
                    [protocol.meta_key(p.name) for p in fronted]:
                reads.get(key)
            metas: list[Any] = await reads.execute()
        n = len(fronted)
        beats = [(p, last) for p, last, own in zip(fronted, metas[:n], metas[n:], strict=True)
                 if not self._taken(p, own)]
        if not beats:
            return
        now = protocol.now_ms()
        async with self._redis.pipeline(transaction=False) as pipe:
            for pipeline, last in beats:
                self._beat_one(pipe, pipeline, last, now)
            pipe.zadd(protocol.MODELS_KEY, {p.name: now for p, _last in beats})
            await pipe.execute()

    def _taken(self, pipe: Pipeline, own: bytes | None) -> bool:
        """True (logged once; the pipeline then refused here) if a model's metadata
        holds the pipeline's name: a model of that name is served, never overwritten."""
        if own is None or not is_model_meta(own):
            return False
        self._refused.add(pipe.name)
        log.error("pipeline %r is not served: a model of that name is", pipe.name)
        return True

    def _beat_one(self, pipe: Any, pipeline: Pipeline, last: bytes | None, now: int) -> None:
        name, wid = pipeline.name, self._worker_id
        workers = protocol.workers_key(name)
        pipe.zadd(workers, {wid: now + self._lease_ms})
        pipe.zremrangebyscore(workers, "-inf", now - STALE_LEASES_MS)
        pipe.expire(workers, protocol.WORKERS_TTL_S)
        info = {"worker_id": wid, "stages": pipeline.stages, protocol.F_ROWS: False}
        for key in (protocol.worker_info_key(name), protocol.worker_capacity_key(name)):
            pipe.hset(key, wid, orjson.dumps(info))
            pipe.expire(key, protocol.WORKERS_TTL_S)
        pipe.set(protocol.meta_key(name), orjson.dumps(
            pipeline_meta(pipeline, self._models[pipeline.first].meta(), last)),
            ex=protocol.META_TTL_S)

    async def _leave(self) -> None:
        if not self._fronted:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in self._fronted:
                pipe.zrem(protocol.workers_key(name), self._worker_id)
                pipe.hdel(protocol.worker_info_key(name), self._worker_id)
                pipe.hdel(protocol.worker_capacity_key(name), self._worker_id)
            await pipe.execute()


OUTPUT_FIELDS = ("output_name", "outputs", "output_spec")


def unservable(pipe: Pipeline, models: list[Model]) -> str:
    """Why ``models`` cannot serve stages of ``pipe`` ("" if they can): a hand-off goes
    to a stage's one queue, so a stage split in sub-queues, or a model served as
    versions (``<name>@<version>``) where the pipeline names it bare, never gets it."""
    for model in models:
        if model.name == pipe.name:
            return "a model served here has the pipeline's name"
        base, version = protocol.split_name(model.name)
        if version is not None and base in pipe.models:
            return (f"stage {base!r} is served here as version {model.name!r}: name the "
                    f"version's served name as the stage, or serve the model unversioned")
        if model.name in pipe.models and model.sub_queues > 1:
            return (f"stage {model.name!r} has sub_queues={model.sub_queues}: a pipeline "
                    "stage takes one queue")
    return ""


def is_model_meta(raw: bytes) -> bool:
    """Whether ``raw`` is a model's metadata (a pipeline's says ``"kind": "pipeline"``)."""
    with contextlib.suppress(orjson.JSONDecodeError):
        meta = orjson.loads(raw)
        return isinstance(meta, dict) and meta.get("kind") != "pipeline"
    return False


def check_declared(pipelines: list[Pipeline], models: list[Model]) -> None:
    """``ConfigError`` if ``models`` cannot serve a stage of ``pipelines``."""
    names = {pipe.name: pipe for pipe in pipelines}
    for pipe in pipelines:
        if problem := unservable(pipe, models) or streamed_stage(pipe, models) or \
                nested_stage(pipe, names):
            raise ConfigError(f"pipeline {pipe.name!r}: {problem}")


def nested_stage(pipe: Pipeline, pipelines: dict[str, Pipeline]) -> str:
    """Why a stage of ``pipe`` cannot be run ("" if none): one that names a pipeline
    (of ``pipelines``) gets its hand-offs in a queue that nothing serves."""
    for stage in pipe.models:
        if stage in pipelines:
            return (f"stage {stage!r} is a pipeline: a stage must be a model (list the "
                    f"other pipeline's stages instead)")
    return ""


def streamed_stage(pipe: Pipeline, models: list[Model]) -> str:
    """Why a streaming model of ``models`` cannot be a stage of ``pipe`` ("" if none
    is).  Checked where a pipeline is declared; a pipeline read from the registry is
    served all the same, and the stage's first chunk fails each request clearly."""
    for model in models:
        if model.name in pipe.models and model.streaming:
            return (f"stage {model.name!r} is a streaming model: a pipeline stage must "
                    "give one reply, not chunks")
    return ""


def pipeline_meta(pipeline: Pipeline, first: dict[str, Any], last: bytes | None
                  ) -> dict[str, Any]:
    """A pipeline's metadata: its first stage's inputs, limits and levels, its last
    stage's outputs (once that stage's metadata is known), ``kind`` and ``stages``."""
    meta = {**first, "name": pipeline.name, "kind": "pipeline",
            "stages": pipeline.stages}
    meta.pop("outputs", None)
    meta.pop("output_spec", None)  # the first stage's: the last stage's, if it has one
    meta.pop("streaming", None)  # a pipeline gives one reply (a streaming stage is refused)
    with contextlib.suppress(orjson.JSONDecodeError):  # bad: the outputs left out
        last_meta = orjson.loads(last) if last else None
        if isinstance(last_meta, dict):  # all of its output fields, none of the first's
            for key in OUTPUT_FIELDS:
                meta.pop(key, None)
            meta.update({k: last_meta[k] for k in OUTPUT_FIELDS if k in last_meta})
    return meta
