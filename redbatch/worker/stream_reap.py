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
from redbatch.errors import InvalidPayload, WorkerCrashed
from redbatch.protocol import Request
from redbatch.worker.decode import addressable, parse_entry
from redbatch.worker.reaper import NOT_ELECTED, Plan, Reaper

CRASHED = "the worker serving this stream died mid-stream; its stream ends here"
STOPPED = "the worker serving this stream stopped mid-stream; its stream ends here"
PER_ENTRY = 7  # arguments per entry of lua_stream.REAP


class StreamReaper(Reaper):
    """``Reaper`` for a streaming model (one priority level)."""

    blame = False  # (set by its runner) a force reap after a failure bumps attempts too

    async def reap(self, worker_id: str, *, force: bool = False) -> int:
        """As ``Reaper.reap``; ``force`` with ``blame`` (the worker's own batch loop
        failed, e.g. on an entry Redis refuses) bumps attempts as a death would, so
        that an entry that fails its worker every time reaches ``max_attempts``."""
        if not force and not await self._elected(worker_id):
            return NOT_ELECTED
        raws, _crashing = await self._read(worker_id, force)
        keys = [protocol.inflight_key(self.model, worker_id), self.queue,
                protocol.dead_letter_key(self.model), protocol.workers_key(self.model),
                protocol.worker_info_key(self.model)]
        dead: list[bytes] = []
        per_entry: list[Any] = []
        bump = not force or self.blame
        for raw in raws:
            self._plan_one(raw, bump, keys, per_entry, dead)
        digest = hashlib.sha1(b"".join(raws), usedforsecurity=False).hexdigest()
        args = [worker_id, "force" if force else protocol.now_ms(), digest,
                protocol.REPLY_TTL_S, self.dead_letters.ttl_s, len(dead), *dead,
                len(per_entry) // PER_ENTRY, *per_entry]
        script = self._redis.register_script(lua_stream.REAP)
        result: Any = await script(keys=keys, args=args)
        if not isinstance(result, list):
            return int(result)
        requeued, dead_lettered = (int(x) for x in result)
        counted = Plan([b""] * requeued, [b""] * dead_lettered)  # what _done counts
        await self._done(worker_id, force, counted, len(raws), None)
        return requeued

    def _plan_one(self, raw: bytes, bump: bool, keys: list[str], per_entry: list[Any],
                  dead: list[bytes]) -> None:
        """The entry's keys and arguments; an unreadable one is dead-lettered, and
        answered ``invalid_payload`` when its id and reply_to can be read."""
        fmt = codec.sniff_format(raw)
        try:
            request = parse_entry(raw, self.model, self._same_slot)
            requeued, code = self._requeued(request, bump, fmt), WorkerCrashed.code
            message = CRASHED if bump else STOPPED
        except InvalidPayload as exc:
            addressed = addressable(raw, self.model, self._same_slot)
            if addressed is None:
                dead.append(raw[:self.dead_letters.max_bytes])
                return
            request, fmt = addressed
            requeued, code, message = b"", exc.code, str(exc)
        keys += [protocol.request_key(self.model, request.id), request.reply_to]
        ttl = protocol.marker_ttl_ms(request.deadline_ms, protocol.now_ms())
        per_entry += [requeued, raw, request.id, fmt, ttl, message, code]

    def _requeued(self, request: Request, bump: bool, fmt: codec.Format) -> bytes:
        """The entry to requeue, or b"" when it may not run again."""
        request.attempt += 1 if bump else 0
        if request.attempt >= self.max_attempts:
            return b""
        with contextlib.suppress(InvalidPayload):
            return codec.encode(request.to_wire(), fmt)
        return b""
