"""One model's batch loop: claim -> decode -> forward -> encode -> publish."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor
from typing import Any

import redis.asyncio as aioredis

from redbatch import lua, protocol
from redbatch.errors import RedbatchError
from redbatch.protocol import Reply, Request, Timings
from redbatch.worker.claim import Claimer
from redbatch.worker.decode import Decoded, decode_batch
from redbatch.worker.forward import Forwarder
from redbatch.worker.model import BatchFn, Model
from redbatch.worker.reaper import Reaper
from redbatch.worker.replies import Outgoing, error_reply, outgoing, publish_args

log = logging.getLogger("redbatch.worker")


class BatchRunner:
    """Serves one model for one worker: forms batches and answers every request once."""

    def __init__(self, redis: aioredis.Redis, model: Model, fn: BatchFn, worker_id: str,
                 executor: Executor, block_timeout_s: float, max_attempts: int = 3,
                 blocking: aioredis.Redis | None = None) -> None:
        self._redis = redis
        self.model = model
        self._worker_id = worker_id
        self._forwarder = Forwarder(model, fn, executor)
        self._publish = redis.register_script(lua.PUBLISH)
        self.claimer = Claimer(redis, model.name, worker_id, model.policy, block_timeout_s,
                               blocking)
        self.reaper = Reaper(redis, model.name, max_attempts)
        self._unacked = False
        self.batches = 0
        self.items = 0
        self.busy_s = 0.0  # time spent serving claimed batches (not waiting for them)
        self.forward_ms = 0.0  # total forward time
        self.queue_wait_ms = 0.0  # total queue wait of computed requests

    async def run_batch(self) -> int:
        """Serve one batch; return how many entries it claimed (0 on an idle timeout)."""
        raws = await self._claim()
        if not raws:
            return 0
        claimed_ms = protocol.now_ms()
        decoded = decode_batch(raws, self.model, claimed_ms)
        started = time.perf_counter()
        results = await self._forwarder.run([item.value for item in decoded.items])
        fwd_ms = (time.perf_counter() - started) * 1000
        outs = self.encode(decoded, results, claimed_ms, fwd_ms)
        published = time.perf_counter()
        await self.publish(outs, len(raws), decoded.dead)
        self._unacked = False
        self.busy_s += time.perf_counter() - started
        reply_ms = (time.perf_counter() - published) * 1000
        self._log_batch(decoded, len(raws), claimed_ms, fwd_ms, reply_ms)
        return len(raws)

    def counters(self) -> dict[str, float]:
        """Totals since start, published with each heartbeat (``rb:{m}:worker_info``)."""
        return {"batches": self.batches, "items": self.items,
                "forward_ms": round(self.forward_ms, 3),
                "queue_wait_ms": round(self.queue_wait_ms, 3)}

    async def _claim(self) -> list[bytes]:
        if self._unacked:  # the last batch failed before its ack: requeue it, in order
            await self.reaper.reap(self._worker_id, force=True)
        self._unacked = True  # set first: a claim can fail after moving some entries
        raws = await self.claimer.claim()
        self._unacked = bool(raws)
        return raws

    def encode(self, decoded: Decoded, results: list[Any], claimed_ms: int, fwd_ms: float
               ) -> list[Outgoing]:
        name, n = self.model.name, len(decoded.items)
        outs = [outgoing(name, req, error_reply(req, exc, self._timings(req, claimed_ms, 0, 0)),
                         fmt) for req, fmt, exc in decoded.early]
        for item, result in zip(decoded.items, results, strict=True):
            timings = self._timings(item.request, claimed_ms, n, fwd_ms)
            reply = error_reply(item.request, result, timings) if isinstance(
                result, RedbatchError) else Reply(item.request.id, True, result, timings=timings)
            outs.append(outgoing(name, item.request, reply, item.fmt))
        return outs

    def _timings(self, request: Request, claimed_ms: int, n: int, fwd_ms: float) -> Timings:
        wait_ms = max(0, claimed_ms - request.enqueue_ms) if request.enqueue_ms else 0
        return Timings(wait_ms, n, fwd_ms, self._worker_id)

    async def publish(self, outs: list[Outgoing], claimed: int, dead: list[bytes]) -> None:
        """Replies (each at most once), dead letters and the ack: one atomic script."""
        keys, argv = publish_args(outs, dead)
        keys = [self.claimer.inflight, protocol.dead_letter_key(self.model.name), *keys]
        await self._publish(keys=keys, args=[claimed, protocol.REPLY_TTL_S, *argv])

    def _log_batch(self, decoded: Decoded, claimed: int, claimed_ms: int, fwd_ms: float,
                   reply_ms: float) -> None:
        self.batches += 1
        self.items += claimed
        self.forward_ms += fwd_ms
        waits = [claimed_ms - item.request.enqueue_ms for item in decoded.items] or [0]
        self.queue_wait_ms += sum(waits)
        log.info("model=%s n=%d computed=%d rejected=%d wait_ms=%.1f fwd_ms=%.2f "
                 "reply_ms=%.2f", self.model.name, claimed, len(decoded.items),
                 len(decoded.early), max(waits), fwd_ms, reply_ms)
