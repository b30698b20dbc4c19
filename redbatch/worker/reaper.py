"""The reaper: give a dead worker's in-flight requests back to the queue.

It runs inside every worker, piggybacked on the heartbeat (one extra command per
model per beat when nothing is dead).  For each worker whose lease expired it reads
the in-flight list, bumps each request's ``attempt``, and in one atomic script
pushes them back to the *front* of the queue (in order), dead-letters those that
reached ``max_attempts`` (their callers get ``worker_crashed``) and forgets the worker.
The script re-checks the lease and the list length, so a worker that woke up, or a
second reaper, makes it a no-op.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from redbatch import codec, lua, protocol
from redbatch.errors import InvalidPayload, WorkerCrashed
from redbatch.protocol import Timings
from redbatch.worker.decode import parse_entry
from redbatch.worker.meters import WorkerMeters
from redbatch.worker.replies import Outgoing, error_reply, outgoing, publish_args

log = logging.getLogger("redbatch.reaper")


@dataclass
class Plan:
    requeue: list[bytes] = field(default_factory=list)
    dead: list[bytes] = field(default_factory=list)
    crashed: list[Outgoing] = field(default_factory=list)


class Reaper:
    def __init__(self, redis: aioredis.Redis, model: str, max_attempts: int,
                 meters: WorkerMeters | None = None) -> None:
        self._redis = redis
        self.model = model
        self.max_attempts = max_attempts
        self.meters = meters
        self._script = redis.register_script(lua.REAP)

    def plan(self, raws: list[bytes], bump: bool) -> Plan:
        plan = Plan()
        for raw in raws:
            try:
                request = parse_entry(raw, self.model)
            except InvalidPayload:
                plan.dead.append(raw)
                continue
            request.attempt += 1 if bump else 0
            if request.attempt < self.max_attempts:
                plan.requeue.append(codec.encode(request.to_wire(), codec.sniff_format(raw)))
                continue
            plan.dead.append(raw)
            exc = WorkerCrashed(f"request crashed {request.attempt} workers; dead-lettered")
            reply = error_reply(request, exc, Timings())
            plan.crashed.append(outgoing(self.model, request, reply, codec.sniff_format(raw)))
        return plan

    async def reap(self, worker_id: str, *, force: bool = False) -> int:
        """Requeue ``worker_id``'s in-flight requests.  ``force`` (a stopping worker
        returning its own batch) skips the lease check and the attempt bump.
        Returns how many were requeued, or a negative number if nothing was done."""
        inflight = protocol.inflight_key(self.model, worker_id)
        raws: Any = await self._redis.lrange(inflight, 0, -1)
        plan = self.plan(raws, bump=not force)
        pair_keys, tail = publish_args(plan.crashed, plan.dead)
        keys = [inflight, protocol.queue_key(self.model), protocol.dead_letter_key(self.model),
                protocol.workers_key(self.model), protocol.worker_info_key(self.model),
                *pair_keys]
        now = "force" if force else protocol.now_ms()
        digest = hashlib.sha1(b"".join(raws), usedforsecurity=False).hexdigest()
        args = [worker_id, now, digest, protocol.REPLY_TTL_S, len(plan.requeue),
                *tail[:1], *plan.requeue, *tail[1:]]
        result = int(await self._script(keys=keys, args=args))
        if result >= 0 and self.meters is not None:
            self.meters.dead_letters.inc(len(plan.dead))
            self.meters.retries.inc(0 if force else len(plan.requeue))
        if result >= 0 and raws:
            log.warning("model=%s %s worker %s: requeued %d, dead-lettered %d",
                        self.model, "returned the batch of" if force else "reaped", worker_id,
                        len(plan.requeue), len(plan.dead))
        return result
