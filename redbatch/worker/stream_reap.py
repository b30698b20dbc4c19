"""The reaper of a streaming model: a dead worker's stream is ended, never re-run.

A request whose chunks began to go out cannot run again (its caller would get them
twice): its caller gets a final ``worker_crashed`` message, numbered after the last
chunk sent.  A request that sent nothing goes back to the queue's front, as with any
model (attempt + 1; at ``max_attempts`` it gets that final message and is
dead-lettered), marked suspect: a worker runs it alone, naming it in its crashing key,
and a crash then blames that request alone.  Whether chunks went out is read from the
request's marker in the same script that decides (``lua_stream.REAP``), so no chunk
can slip in between.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from redbatch import codec, lua_stream, protocol
from redbatch.errors import InvalidPayload, WorkerCrashed
from redbatch.protocol import Request
from redbatch.splice import requeue_entry
from redbatch.worker import suspects
from redbatch.worker.decode import addressable, parse_entry
from redbatch.worker.reaper import NOT_ELECTED, Plan, Reaper

CRASHED = "the worker serving this stream died mid-stream; its stream ends here"
STOPPED = "the worker serving this stream stopped mid-stream; its stream ends here"
PER_ENTRY = 7  # arguments per entry of lua_stream.REAP


@dataclass(slots=True)
class _Entry:
    raw: bytes
    request: Request | None  # None: unreadable
    fmt: codec.Format
    error: InvalidPayload | None = None  # why it is unreadable


class StreamReaper(Reaper):
    """``Reaper`` for a streaming model (one priority level)."""

    blame = False  # (set by its runner) a force reap after a failure bumps attempts too
    held_lists = False  # a streaming model never holds entries over: none read

    async def reap(self, worker_id: str, *, force: bool = False) -> int:
        """As ``Reaper.reap``; ``force`` with ``blame`` (the worker's own batch loop
        failed, e.g. on an entry Redis refuses) bumps attempts as a death would, so
        that an entry that fails its worker every time reaches ``max_attempts``.  The
        entries requeued after a failure are marked suspect (a worker runs each alone);
        the one named in the worker's crashing key, if any, alone takes the blame."""
        if not force and not await self._elected(worker_id):
            return NOT_ELECTED
        lists, crashing = await self._read(worker_id, force and not self.blame, [self.model])
        raws = lists[0]  # (a streaming model has one queue: no sub-queues, one level)
        keys = [protocol.inflight_key(self.model, worker_id), protocol.queue_key(self.model),
                protocol.dead_letter_key(self.model), protocol.workers_key(self.model),
                protocol.worker_info_key(self.model)]
        dead: list[bytes] = []
        per_entry: list[Any] = []
        entries = [self._entry(raw) for raw in raws]
        named = crashing if any(e.request is not None and e.error is None and
                                e.request.id == crashing for e in entries) else None
        failed = not force or self.blame
        for entry in entries:
            self._plan_one(entry, failed, named, keys, per_entry, dead)
        if failed:  # every entry it may requeue is a suspect
            await suspects.record(self._redis, self.model, [
                e.request for e in entries if e.request is not None and e.error is None])
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
        await self._done(worker_id, force, counted, (len(raws), named), forget=not force)
        return requeued

    def _entry(self, raw: bytes) -> _Entry:
        """The entry's request; an unreadable one's sender, if it can be read."""
        fmt = codec.sniff_format(raw)
        try:
            return _Entry(raw, parse_entry(raw, self.model, self._same_slot), fmt)
        except InvalidPayload as exc:
            addressed = addressable(raw, self.model, self._same_slot)
            if addressed is None:
                return _Entry(raw, None, fmt, exc)
            return _Entry(raw, addressed[0], addressed[1], exc)

    def _plan_one(self, entry: _Entry, failed: bool, named: str | None, keys: list[str],
                  per_entry: list[Any], dead: list[bytes]) -> None:
        """The entry's keys and arguments; an unreadable one is dead-lettered, and
        answered ``invalid_payload`` when its id and reply_to can be read.  ``failed``:
        the worker died or failed; ``named``: the suspect it was running alone."""
        request, raw = entry.request, entry.raw
        if request is None:
            dead.append(raw[:self.dead_letters.max_bytes])
            return
        if entry.error is not None:
            requeued, code, message = b"", entry.error.code, str(entry.error)
        else:
            blamed = failed and named in (None, request.id)
            requeued = self._requeued(entry, blamed, failed)
            code, message = WorkerCrashed.code, CRASHED if failed else STOPPED
        keys += [protocol.request_key(self.model, request.id), request.reply_to]
        ttl = protocol.marker_ttl_ms(request.deadline_ms, protocol.now_ms())
        # (the entry's copy is what a dead letter keeps: its first bytes, as anywhere)
        per_entry += [requeued, raw[:self.dead_letters.max_bytes], request.id, entry.fmt, ttl,
                      message, code]

    def _requeued(self, entry: _Entry, blamed: bool, suspect: bool) -> bytes:
        """The entry to requeue, or b"" when it may not run again."""
        request = entry.request
        assert request is not None
        request.attempt += 1 if blamed else 0
        request.suspect = request.suspect or suspect
        if request.attempt >= self.max_attempts:
            return b""
        return requeue_entry(entry.raw, request, entry.fmt) or b""
