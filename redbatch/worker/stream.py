"""A streaming model's batch loop, with continuous batching.

The first claim forms a batch as for any model (the batch window); then the batch
runs step by step: each step calls the generator for one list of items, turns them
into numbered chunks or final messages, and sends them in one atomic script
(``lua_stream.STEP``), which also claims, without blocking, as many waiting requests
as there are free places (``max_batch_size`` less the members still running); those
join the batch before the next step.  The batch ends when its last member ends.

A sync generator steps in the forward thread, never on the event loop.  Every step
is bounded by the latest deadline of its members, and a member whose deadline passed
ends with ``deadline_exceeded``: the deadline bounds the whole stream.

A generator that raises is bisected: its running members are split in two halves,
each rerun from its first step by a generator of its own (a lane), stepped beside the
other lanes, until the member that fails alone ends with the error; a bisection splits
at most CULPRITS * ceil(log2 n) times (n: the members running when it began; enough to
isolate that many bad inputs), then a lane that raises fails its members.  A rerun
sends no chunk below the number its caller already got, and checks that it yielded
those same chunks (a hash of their bytes): a member whose rerun yields others ends
with ``model_error`` at the number it had reached.
Newcomers join the ordinary lane with the most members, or a lane of their own while
every lane reruns.  Lanes never merge again: each step of the batch steps each lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import redis

from redbatch import codec, lua_stream, protocol
from redbatch.codec import Format
from redbatch.errors import (
    BadRequest,
    DeadlineExceeded,
    InvalidPayload,
    ModelError,
    RedbatchError,
    RedisUnavailable,
)
from redbatch.lean import LeanLink
from redbatch.protocol import Request, Timings
from redbatch.redis_conn import check_cancelled
from redbatch.stream_wire import StreamChunk
from redbatch.worker import suspects
from redbatch.worker.claim import warn_cancel_refused
from redbatch.worker.decode import addressable, parse_entry
from redbatch.worker.runner import BatchRunner
from redbatch.worker.stream_batch import STOP, StreamBatch
from redbatch.worker.stream_reap import StreamReaper

log = logging.getLogger("redbatch.worker")

END: Final = object()  # the generator returned
CULPRITS: Final = 2  # the bad inputs a bisection isolates in any batch
STEP_GRACE_S = 1.0  # a step may run this long past its members' latest deadline
# a message's fate in lua_stream.STEP: sent; refused (no longer this worker's, or
# answered); dropped (its caller cancelled); refused by Redis (its reply_to holds
# another type: the entry is dead-lettered); lost track (a final error went instead)
SENT, REFUSED, CANCELLED, REDIS_REFUSED, LOST = 0, 1, 2, 3, 4
NO_CLAIM: Final = -1  # STEP's room when the batch may not grow (fixed, or stopping)
# a batch loop failing on these (Redis away, read-only, full) blames no request
TRANSIENT: Final = (RedisUnavailable, redis.ConnectionError, redis.TimeoutError, OSError,
                    redis.ReadOnlyError, redis.OutOfMemoryError,
                    redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)


@dataclass(slots=True)
class Member:
    request: Request
    raw: bytes
    fmt: Format
    claimed_ms: int
    seq: int = 0  # the next message's number
    steps: int = 0
    forward_ms: float = 0.0
    batch_size: int = 0  # the largest batch it ran in
    done: bool = False  # its final message is made (or it was dropped)
    sent: int = 0  # the chunks its caller got: a rerun sends none below this number
    digest: hashlib.blake2b = field(default_factory=hashlib.blake2b)  # of the chunks sent
    rerun: hashlib.blake2b | None = None  # a rerun's, until it passes ``sent``


@dataclass(slots=True)
class Message:
    member: Member
    data: bytes
    last: bool
    seq: int


class StreamRunner(BatchRunner):
    """``BatchRunner`` for a streaming model: the same claims, lease and reaper
    election, a step loop (``StreamLoop``) instead of one forward per batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reaper = self.stream_reaper = StreamReaper(
            self._redis, self.model.name, self.reaper.max_attempts, self.stats,
            self._dead_letters, reaper_id=self._worker_id, same_slot=self._same_slot)
        self.stream_link = LeanLink(self._redis)
        self.worker_id = self._worker_id
        self.queue_claimer = self.claimer.sub(0)  # a streaming model has one queue
        self._blame = False  # the last serve failed on something other than Redis
        # suspects (entries of a batch that failed a worker) claimed beside a running
        # batch: still in the in-flight list, each runs alone once that batch ended
        self.deferred: list[bytes] = []

    async def serve(self, stop: asyncio.Event) -> None:
        """As ``BatchRunner.serve``; after a failure other than Redis being away, the
        entries returned count an attempt (an entry that fails the loop every time is
        dead-lettered at ``max_attempts``, never retried forever)."""
        self.stream_reaper.blame = self._blame
        await self._return_unacked()
        self._unacked, self._blame, self.deferred = True, False, []
        self.claimer.stop = stop
        try:
            while not stop.is_set():
                check_cancelled()  # (a cancel that redis-py swallowed)
                if self.model.policy is not self._claimer_policy:
                    self._use_policy()  # a live knob change reaches the first claims too
                raws = await self._claimed(  # (a stop may end it: ``stuck_claiming``)
                    self.queue_claimer.claim(self.model.policy.max_batch_size),
                    not self.deferred)
                if raws:
                    await StreamLoop(self, stop).run(raws)
                await self._run_suspects(stop)
        except Exception as exc:
            self._blame = not isinstance(exc, TRANSIENT)
            raise
        self._unacked = False

    async def _run_suspects(self, stop: asyncio.Event) -> None:
        """Each deferred suspect in a batch of its own, named in this worker's crashing
        key meanwhile: if it kills the worker, it alone takes the blame (a stopping
        worker leaves them to its return of the in-flight list)."""
        while self.deferred and not stop.is_set():
            await StreamLoop(self, stop, alone=True).run([self.deferred.pop(0)])

    async def name_crashing(self, request_id: str | None) -> None:
        """Name the suspect running alone (None: none runs now)."""
        if request_id is None:
            await self._redis.delete(self._crashing)
        else:
            await self._redis.set(self._crashing, request_id, ex=protocol.CRASHING_TTL_S)

    async def send(self, messages: list[Message], room: int
                   ) -> tuple[list[int], list[bytes]]:
        """The messages and the claim of up to ``room`` entries (``NO_CLAIM``: none,
        whatever ends): one STEP script."""
        claimer = self.queue_claimer
        keys = [claimer.inflight, claimer.queue, claimer.cancelled]
        args: list[Any] = [protocol.REPLY_TTL_S, room, protocol.INFLIGHT_TTL_S * 1000,
                           len(messages)]
        now = protocol.now_ms()
        for message in messages:
            request = message.member.request
            keys += [protocol.request_key(self.model.name, request.id), request.reply_to]
            args += [message.member.raw, message.seq, 1 if message.last else 0,
                     protocol.marker_ttl_ms(request.deadline_ms, now), message.data,
                     request.id]
        status, claimed, cancels = await self.stream_link.script(lua_stream.STEP, keys, args)
        self.queue_claimer.cancels = self.queue_claimer.cancels or cancels == 1
        return [int(s) for s in status], list(claimed)

    async def cancelled(self, ids: list[str], ask: bool = False) -> set[str]:
        """Which of these requests their callers cancelled (asked only while the
        cancelled set exists, as the last STEP saw, unless ``ask``)."""
        if not (ask or self.queue_claimer.cancels) or not ids:
            return set()
        try:
            scores = await self.stream_link.execute("ZMSCORE", self.queue_claimer.cancelled, *ids)
        except redis.ResponseError as exc:  # e.g. NOPERM: they run, and STEP drops them
            warn_cancel_refused(self.model.name, exc)
            return set()
        return {rid for rid, score in zip(ids, scores, strict=True) if score is not None}

    async def drop(self, raws: list[bytes]) -> None:
        """Dead-letter unreadable entries off the in-flight list (one MULTI)."""
        dead = protocol.dead_letter_key(self.model.name)
        async with self._redis.pipeline(transaction=True) as pipe:
            for raw in raws:
                pipe.execute_command("LREM", self.queue_claimer.inflight, 1, raw)
                pipe.rpush(dead, raw[:self._dead_letters.max_bytes])
            pipe.ltrim(dead, -protocol.DEAD_LETTER_MAX, -1)
            pipe.expire(dead, self._dead_letters.ttl_s)
            await pipe.execute()
        self.stats.dead_lettered(len(raws))

    def start(self, batch: Any) -> Any:
        """The batch function's generator for ``batch``, or the ``ModelError`` that
        calling it raised (a function that checks its batch before it yields)."""
        try:
            return self.fn(batch)
        except Exception as exc:  # the model's own error: its members fail
            return _raised(self.model.name, exc)

    async def advance(self, gen: Any, timeout_s: float) -> Any:
        """The generator's next list, ``END`` once it returned, or the error it raised
        (``DeadlineExceeded`` past ``timeout_s``)."""
        try:
            if isinstance(gen, AsyncIterator):
                return await asyncio.wait_for(anext(gen), timeout_s)
            loop = asyncio.get_running_loop()
            return await asyncio.wait_for(loop.run_in_executor(self.executor, _next, gen),
                                          timeout_s)
        except StopAsyncIteration:
            return END
        except TimeoutError:
            return DeadlineExceeded(f"a step of model {self.model.name!r} ran past the "
                                    "deadline of every request in its batch")
        except Exception as exc:  # the model's own error: its members fail
            return _raised(self.model.name, exc)

    async def close(self, gen: Any) -> None:
        """Close a generator that may not have finished (runs its ``finally``)."""
        with contextlib.suppress(Exception):
            if isinstance(gen, AsyncIterator):
                await asyncio.wait_for(gen.aclose(), STEP_GRACE_S)  # type: ignore[attr-defined]
            elif isinstance(gen, Iterator):
                loop = asyncio.get_running_loop()
                await asyncio.wait_for(loop.run_in_executor(self.executor, gen.close),  # type: ignore[attr-defined]
                                       STEP_GRACE_S)

    def final(self, member: Member, error: RedbatchError | None = None) -> Message:
        """The member's final message (``error``: failed), with its timings; one that
        ends on a rerun before the number its caller reached fails."""
        member.done = True
        if member.seq < member.sent:
            error, member.seq = error or self._rerun_error(member), member.sent
        request = member.request
        timings = Timings(protocol.queue_wait_ms(member.claimed_ms, request.enqueue_ms),
                          member.batch_size, round(member.forward_ms, 3),
                          self.worker_id).to_wire()
        timings[protocol.F_STEPS] = member.steps
        chunk = StreamChunk(request.id, member.seq, last=True, ok=error is None,
                            timings=timings)
        if error is not None:
            chunk.error_code, chunk.error_message = error.code, str(error)
        self.stats.entries += 1
        self.stats.items += 1
        data = codec.encode(chunk.to_wire(), member.fmt)
        if len(data) > protocol.MAX_ENTRY_BYTES:  # (an error's message of many MiB)
            chunk.error_code, chunk.error_message = ModelError.code, self._too_large(
                "final message", len(data))
            data = codec.encode(chunk.to_wire(), member.fmt)
        return Message(member, data, True, member.seq)

    def _too_large(self, what: str, size: int) -> str:
        return (f"model {self.model.name!r} gave a {what} of {size} bytes, over the "
                f"{protocol.MAX_ENTRY_BYTES}-byte limit of an entry")

    def chunk(self, member: Member, item: Any) -> Message | None:
        """A chunk for the member's caller (its final error, if it cannot be encoded;
        None for a chunk a rerun yields again)."""
        wire = StreamChunk(member.request.id, member.seq, item).to_wire()
        try:
            data = codec.encode(wire, member.fmt)
        except InvalidPayload as exc:
            return self.final(member, ModelError(f"model {self.model.name!r} yielded a "
                                                 f"chunk that cannot be encoded: {exc}"))
        if len(data) > protocol.MAX_ENTRY_BYTES:  # no reader would take it: say so instead
            return self.final(member, ModelError(self._too_large("chunk", len(data))))
        member.seq += 1
        if member.seq <= member.sent:
            return self._replayed(member, data)
        member.digest.update(data)
        member.sent = member.seq
        return Message(member, data, False, member.seq - 1)

    def _replayed(self, member: Member, data: bytes) -> Message | None:
        """A rerun's chunk its caller got already: never sent again; the last of them
        checks that the rerun yielded the same chunks (else the member fails)."""
        if member.rerun is None:  # (a member rerun from its first chunk has none)
            return None
        member.rerun.update(data)
        if member.seq < member.sent:
            return None
        if member.rerun.digest() != member.digest.digest():
            return self.final(member, self._rerun_error(member))
        member.rerun = None
        return None

    def _rerun_error(self, member: Member) -> ModelError:
        return ModelError(f"model {self.model.name!r} failed a batch of request "
                          f"{member.request.id}, whose rerun did not yield the "
                          f"{member.sent} chunks it had sent")


def _next(gen: Iterator[Any]) -> Any:
    """One step of a sync generator (in the forward thread)."""
    return next(gen, END)


@dataclass(slots=True, eq=False)
class Bisection:
    """The reruns of a generator that raised: how many more times they may split."""

    splits_left: int


@dataclass(slots=True, eq=False)
class Lane:
    """A generator and the members it steps.  A batch runs in one lane until its
    generator raises: each half of its running members then reruns in a lane of its
    own, and every lane steps once per step of the loop, side by side."""

    batch: StreamBatch = field(default_factory=StreamBatch)
    gen: Any = None
    steps: int = 0
    bisection: Bisection | None = None  # a rerun, until it passed ``failed_at`` caught up
    failed_at: int = 0  # the step its parent raised at (0: its batch's first lane)


class StreamLoop:
    """One streaming batch, from its first claim until its last member ends."""

    def __init__(self, runner: StreamRunner, stop: asyncio.Event, alone: bool = False
                 ) -> None:
        self.r = runner
        self.stop = stop
        self.alone = alone  # a suspect's batch of one: it never grows
        self.lanes: list[Lane] = []
        self.members: dict[str, Member] = {}
        self.pending: list[Message] = []
        self.steps = 0
        self.joined = 0
        self.dropped: list[bytes] = []  # unreadable entries, to dead-letter

    @property
    def running(self) -> int:
        return sum(not m.done for m in self.members.values())

    def active(self, lane: Lane) -> list[Member]:
        """The members of a lane that did not end."""
        return [m for key in lane.batch.keys if not (m := self.members[key]).done]

    async def run(self, raws: list[bytes]) -> None:
        await self.admit(raws)
        suspect = next(iter(self.members), None) if self.alone else None
        if suspect is not None:
            await self.r.name_crashing(suspect)
        try:
            while self.running or self.pending:
                await self.step()
            await self.flush()  # a claim of only unreadable entries never stepped
        finally:
            for lane in self.lanes:
                await self.close(lane)
        if suspect is not None:
            await self.r.name_crashing(None)  # (only once it ended: else it is to blame)
        log.info("model=%s stream batch: requests=%d joined=%d steps=%d", self.r.model.name,
                 len(raws) + self.joined, self.joined, self.steps)

    async def step(self) -> None:
        self.expire()
        await self.cancel_replays()
        if self.running:
            await self.forward()
        room = self.room()
        if not self.pending and room <= 0:
            return
        status, claimed = await self.r.send(self.pending, room)
        self.settle(status)
        await self.flush()
        self.joined += len(claimed)
        await self.admit(claimed)

    async def flush(self) -> None:
        """Dead-letter the entries that cannot be run or answered."""
        if self.dropped:
            await self.r.drop(self.dropped)
            self.dropped = []

    async def close(self, lane: Lane) -> None:
        if lane.gen is not None:
            await self.r.close(lane.gen)
            lane.gen = None

    def room(self) -> int:
        """Places to fill at this step; ``NO_CLAIM`` for a fixed batch, or stopping
        (not even the places of members that end at this step)."""
        if self.stop.is_set() or not self.r.model.continuous or self.alone or \
                self.r.deferred:  # a suspect waits: this batch drains, then it runs
            return NO_CLAIM
        return max(0, self.r.model.policy.max_batch_size - self.running)

    def expire(self) -> None:
        now = protocol.now_ms()
        for member in self.members.values():
            if not member.done and member.request.deadline_ms <= now:
                self.pending.append(self.r.final(member, DeadlineExceeded(
                    f"request {member.request.id} reached its deadline mid-stream")))

    async def cancel_replays(self) -> None:
        """End the replaying members whose callers cancelled: a replay sends nothing, so
        STEP cannot see it (one ZMSCORE a step, only while a member replays)."""
        replaying = [m.request.id for m in self.members.values()
                     if not m.done and m.rerun is not None]
        for request_id in await self.r.cancelled(replaying, ask=True):
            self.pending.append(self.r.final(self.members[request_id],
                                             _cancelled(request_id)))

    async def forward(self) -> None:
        """One step of every lane's generator; a lane whose members all ended closes."""
        for lane in list(self.lanes):
            if self.active(lane):
                await self.step_lane(lane)
            else:
                await self.close(lane)
                self.lanes.remove(lane)

    async def step_lane(self, lane: Lane) -> None:
        """One step of a lane's generator (started if need be), turned into messages."""
        if lane.gen is None:
            started = self.r.start(lane.batch)
            if lane.bisection is None:  # a rerun is no new batch
                self.r.stats.batches += 1
                lane.failed_at = 0  # (a lane reused by newcomers is no rerun)
            if isinstance(started, ModelError):
                self.stop_lane(lane, started)
                return
            lane.gen, lane.steps = started, 0
        items, step_ms = await self.next_items(lane)
        if isinstance(items, list) and len(items) == len(lane.batch):
            self.route(lane, items, step_ms)
            return
        lane.gen = None
        self.stop_lane(lane, items)

    def stop_lane(self, lane: Lane, items: Any) -> None:
        """A lane that ended, failed, or broke the contract: its members end (a model
        error splits the lane first, to find the member that caused it)."""
        if not (isinstance(items, ModelError) and self.split(lane, items)):
            self.end(lane, items)

    async def next_items(self, lane: Lane) -> tuple[Any, float]:
        """A lane's next list, bounded by its members' latest deadline; its time, ms."""
        latest_ms = max(m.request.deadline_ms for m in self.active(lane))
        timeout_s = max(0.0, (latest_ms - protocol.now_ms()) / 1000) + STEP_GRACE_S
        started = time.perf_counter()
        items = await self.r.advance(lane.gen, timeout_s)
        step_ms = (time.perf_counter() - started) * 1000
        self.steps += 1
        lane.steps += 1
        self._count(lane, step_ms)
        return items, step_ms

    def end(self, lane: Lane, items: Any) -> None:
        """The running members of a lane whose generator returned (``END``), raised, or
        yielded a list of the wrong length end."""
        error = None if items is END else items if isinstance(items, RedbatchError) else \
            ModelError(f"model {self.r.model.name!r} yielded {type(items).__name__} "
                       f"{_length(items)}for a batch of {len(lane.batch)} members")
        for member in self.active(lane):
            self.pending.append(self.r.final(member, error))

    def split(self, lane: Lane, error: ModelError) -> bool:
        """Rerun each half of the running members of a lane whose generator raised in a
        lane of its own (False: it ran one member, the culprit, or its bisection spent
        its splits: they fail)."""
        running = self.active(lane)
        bisection = lane.bisection or Bisection(split_budget(len(running)))
        if len(running) < 2 or not bisection.splits_left:
            self._blamed(lane, running, error)
            return False
        bisection.splits_left -= 1
        log.log(logging.DEBUG if lane.bisection else logging.WARNING,  # (once a bisection)
                "model=%s stream generator raised at its step %d (%s): its %d running "
                "members rerun in two halves", self.r.model.name, lane.steps, error,
                len(running))
        self.lanes.remove(lane)
        mid = len(running) // 2
        self.lanes += [_rerun(half, bisection, lane.steps)
                       for half in (running[:mid], running[mid:])]
        return True

    def _blamed(self, lane: Lane, running: list[Member], error: ModelError) -> None:
        """Log what a bisection isolated: the request that fails alone, or the members
        that fail together once it spent its splits (also in a lane of a bisection
        that is ordinary again)."""
        if lane.bisection is None and not lane.failed_at:
            return
        culprits = ",".join(m.request.id for m in running)
        log.warning("model=%s stream rerun isolated %s (%s): %s", self.r.model.name,
                    culprits, "it fails alone" if len(running) == 1 else
                    "no split left: they fail", error)

    def _count(self, lane: Lane, step_ms: float) -> None:
        stats = self.r.stats
        stats.passes += 1
        stats.pass_items += len(self.active(lane))
        stats.forward_ms += step_ms
        stats.busy_s += step_ms / 1000

    def route(self, lane: Lane, items: list[Any], step_ms: float) -> None:
        size = len(self.active(lane))
        for key, item in zip(lane.batch.keys, items, strict=True):
            member = self.members[key]
            if member.done:
                continue  # a fixed batch's member that ended: its items are ignored
            _timed(member, step_ms, size)
            message = self._message(member, item)
            if message is not None:
                self.pending.append(message)
        if lane.bisection is not None and self._caught_up(lane):
            lane.bisection = None  # an ordinary lane again

    def _caught_up(self, lane: Lane) -> bool:
        """A rerun that passed the step its parent raised at, every member caught up."""
        return lane.steps >= lane.failed_at and all(
            m.seq >= m.sent for m in self.active(lane))

    def _message(self, member: Member, item: Any) -> Message | None:
        """A chunk; a final message for ``STOP``, or an exception (that member fails)."""
        if item is STOP:
            return self.r.final(member)
        if isinstance(item, BaseException):
            return self.r.final(member, item if isinstance(item, RedbatchError) else ModelError(
                f"model {self.r.model.name!r} failed request {member.request.id}: "
                f"{type(item).__name__}: {item}"))
        return self.r.chunk(member, item)

    def settle(self, status: list[int]) -> None:
        """Members whose final message went out, or whose message was refused (a
        reaper took the entry over) or cancelled (the caller went away), leave."""
        gone: set[str] = set()
        for message, code in zip(self.pending, status, strict=True):
            if message.last or code != SENT:
                message.member.done = True
                gone.add(message.member.request.id)
            if code in _REFUSALS:
                log.warning("model=%s request %s: %s", self.r.model.name,
                            message.member.request.id, _REFUSALS[code])
            if code == REDIS_REFUSED:
                self.dropped.append(message.member.raw)
        self.pending = []
        if self.r.model.continuous:
            self.leave(gone)

    def leave(self, gone: set[str]) -> None:
        """Members that ended leave a continuous batch: each lane's, and the loop's."""
        for lane in self.lanes:
            lane.batch.remove(gone)
        for key in gone:
            self.members.pop(key, None)

    async def admit(self, raws: list[bytes]) -> None:
        """Claimed entries join the batch (the ordinary lane with most members, else a
        lane of their own); one that cannot run (or whose caller cancelled it) gets its
        final error."""
        now = protocol.now_ms()
        members = [m for m in (self._member(raw, now) for raw in raws) if m is not None]
        await suspects.verify(self.r._redis, self.r.model.name, [m.request for m in members])
        cancelled = await self.r.cancelled([m.request.id for m in members])
        for member in members:
            if member.request.id in self.members:  # a second entry of a running request
                self._duplicate(member)  # (a retried push): never a second stream
                continue
            error = _refusal(member.request, now, cancelled)
            if error is not None:
                self.pending.append(self.r.final(member, error))
                continue
            if member.request.suspect and not self.alone:
                self.r.deferred.append(member.raw)  # it runs alone after this batch
                continue
            self.members[member.request.id] = member
            self._open_lane().batch.add(member.request.id, member.request.payload)

    def _duplicate(self, member: Member) -> None:
        """An entry whose request id a member of this batch has: dead-lettered, with no
        message (its chunks would interleave with the running stream's); the running
        stream goes on."""
        log.warning("model=%s request %s: a second entry of this running stream; "
                    "dead-lettered", self.r.model.name, member.request.id)
        self.dropped.append(member.raw)

    def _open_lane(self) -> Lane:
        """The lane newcomers join: the ordinary one (not rerunning) with the most
        members (``max_batch_size`` bounds them all together), else a new one."""
        ordinary = [lane for lane in self.lanes if lane.bisection is None]
        if not ordinary:
            self.lanes.append(Lane())
            return self.lanes[-1]
        return max(ordinary, key=lambda lane: len(self.active(lane)))

    def _member(self, raw: bytes, now: int) -> Member | None:
        fmt = codec.sniff_format(raw)
        try:
            return Member(parse_entry(raw, self.r.model.name, self.r._same_slot), raw, fmt,
                          now)
        except InvalidPayload as exc:
            addressed = addressable(raw, self.r.model.name, self.r._same_slot)
            if addressed is None:
                log.error("model=%s dead-lettered an unreadable entry: %s",
                          self.r.model.name, exc)
                self.dropped.append(raw)
                return None
            member = Member(addressed[0], raw, addressed[1], now)
            if member.request.id in self.members:  # its final would end the running one
                self._duplicate(member)
                return None
            self.pending.append(self.r.final(member, exc))
            return None


def _rerun(members: list[Member], bisection: Bisection, failed_at: int) -> Lane:
    """A lane that reruns these members from their first step, each checking the
    chunks its caller got (a rerun until it passed ``failed_at``, caught up)."""
    lane = Lane(bisection=bisection, failed_at=failed_at)
    for member in members:
        member.seq, member.rerun = 0, hashlib.blake2b() if member.sent else None
        lane.batch.add(member.request.id, member.request.payload)
    return lane


def split_budget(members: int) -> int:
    """How many times a bisection of a generator over this many members may split:
    enough to isolate ``CULPRITS`` bad inputs wherever they are (one takes at most
    ceil(log2 n) splits); a failure whatever the input spends them all: O(log n), not
    the n - 1 splits that isolate every member (the same below 8 members)."""
    return min(max(1, members - 1), CULPRITS * math.ceil(math.log2(max(2, members))))


def _timed(member: Member, step_ms: float, size: int) -> None:
    """Count a step in the member's timings (a replayed step counted when it first ran)."""
    if member.seq >= member.sent:
        member.steps += 1
        member.forward_ms += step_ms
    member.batch_size = max(member.batch_size, size)


def _cancelled(request_id: str) -> BadRequest:
    return BadRequest(f"request {request_id} was cancelled by its caller")


def _refusal(request: Request, now: int, cancelled: set[str]) -> RedbatchError | None:
    if request.id in cancelled:
        return _cancelled(request.id)
    if request.deadline_ms <= now:
        return DeadlineExceeded(f"request {request.id} expired in the queue")
    if request.rows:
        return InvalidPayload("a streaming model takes one input per request (no rows)")
    return None


_REFUSALS: Final = {
    REFUSED: "its message was refused (its entry is no longer this worker's, or was "
             "answered)",
    REDIS_REFUSED: "Redis refused its message (its reply_to holds a value of another "
                   "type); dead-lettered it",
    LOST: "its marker expected another chunk number (it expired, or was changed); its "
          "stream ended with an error",
}


def _length(items: Any) -> str:
    return f"of {len(items)} items " if isinstance(items, list) else ""


def _raised(model: str, exc: Exception) -> ModelError:
    return ModelError(f"model {model!r} raised {type(exc).__name__}: {exc}")
