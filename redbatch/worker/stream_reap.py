"""The reaper of a streaming model: a dead worker's stream is ended, never re-run.

A request whose chunks began to go out cannot run again (its caller would get them
twice): its caller gets a final ``worker_crashed`` message, numbered after the last
chunk sent.  A request that sent nothing goes back to the queue's front, as with any
model (attempt + 1; at ``max_attempts`` it gets that final message and is
dead-lettered).  Whether chunks went out is read from the request's marker in the
same script that decides (``lua_stream.REAP``), so no chunk can slip in between.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

from redbatch import codec, lua_stream, protocol
from redbatch.errors import InvalidPayload
from redbatch.protocol import Request
from redbatch.worker.decode import parse_entry
from redbatch.worker.reaper import NOT_ELECTED, Plan, Reaper

CRASHED = "the worker serving this stream died mid-stream; its stream ends here"
STOPPED = "the worker serving this stream stopped mid-stream; its stream ends here"


class StreamReaper(Reaper):
    """``Reaper`` for a streaming model (one priority level)."""

    async def reap(self, worker_id: str, *, force: bool = False) -> int:
        if not force and not await self._elected(worker_id):
            return NOT_ELECTED
        lists, _crashing = await self._read(worker_id, force, [self.model])
        raws = lists[0]  # (a streaming model has one queue: no sub-queues, one level)
        keys = [protocol.inflight_key(self.model, worker_id), protocol.queue_key(self.model),
                protocol.dead_letter_key(self.model), protocol.workers_key(self.model),
                protocol.worker_info_key(self.model)]
        dead: list[bytes] = []
        per_entry: list[Any] = []
        for raw in raws:
            self._plan_one(raw, not force, keys, per_entry, dead)
        digest = hashlib.sha1(b"".join(raws), usedforsecurity=False).hexdigest()
        args = [worker_id, "force" if force else protocol.now_ms(), digest,
                protocol.REPLY_TTL_S, self.dead_letters.ttl_s, len(dead), *dead,
                len(per_entry) // 6, *per_entry]
        script = self._redis.register_script(lua_stream.REAP)
        result = int(await script(keys=keys, args=args))
        if result >= 0:
            counted = Plan([b""] * result, [b""] * len(dead))  # what _done counts
            await self._done(worker_id, force, counted, (len(raws), None), forget=not force)
        return result

    def _plan_one(self, raw: bytes, bump: bool, keys: list[str], per_entry: list[Any],
                  dead: list[bytes]) -> None:
        try:
            request = parse_entry(raw, self.model, self._same_slot)
        except InvalidPayload:
            dead.append(raw[:self.dead_letters.max_bytes])
            return
        fmt = codec.sniff_format(raw)
        keys += [protocol.request_key(self.model, request.id), request.reply_to]
        ttl = protocol.marker_ttl_ms(request.deadline_ms, protocol.now_ms())
        per_entry += [self._requeued(request, bump, fmt), raw, request.id, fmt, ttl,
                      CRASHED if bump else STOPPED]

    def _requeued(self, request: Request, bump: bool, fmt: codec.Format) -> bytes:
        """The entry to requeue, or b"" when it may not run again."""
        request.attempt += 1 if bump else 0
        if request.attempt >= self.max_attempts:
            return b""
        with contextlib.suppress(InvalidPayload):
            return codec.encode(request.to_wire(), fmt)
        return b""

