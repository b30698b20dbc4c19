"""The reaper: give a dead worker's in-flight requests back to the queue.

It runs inside every worker, piggybacked on the heartbeat (one extra command per
model per beat when nothing is dead).  For each worker whose lease expired it reads
the in-flight list, bumps each request's ``attempt``, and in one atomic script
pushes them back to the *front* of the queue (in order; a model of several priority
levels: of its most urgent level's queue, ringing its bell), dead-letters those that
reached ``max_attempts`` (their callers get ``worker_crashed``) and forgets the worker.
The script re-checks the lease and the list's digest, so a worker that woke up, or a
second reaper, makes it a no-op.  The entries a worker held over for its next batch
(its held list, ``protocol.held_key``) go back too, ahead of its in-flight ones (they
are older), under the same digest.

Every live worker of the model sees the same expired lease, so the reapers first hold
an election per dead worker (``SET reaping_key NX PX REAPING_TTL_MS``): only the winner
reads the dead worker's list; the others skip it.  A winner that dies mid-reap holds
the election no longer than its TTL, after which the next live worker's beat wins it.
The REAP script's re-checks stay the safety net.

A model of several sub-queues (``Model.sub_queues``) has an in-flight list per
sub-queue (each in its sub-queue's slot, with the sub-queue's queue and dead letters):
the elected reaper reads them all (``tags``) and requeues each list's entries to its
own sub-queue's front.  Sub-queue 0 (the model's own tag, with the leases) goes last:
its REAP re-checks the lease and forgets the worker; the others go with ``force`` in
the script (no lease check: the lease is in another slot), guarded by their digest.

A crash may be the fault of one input: the requeued entries are marked ``suspect``,
and a worker runs suspects each in passes of its own, naming the one it runs in its
crashing key.  When that worker dies too, the named entry alone takes the blame
(attempt + 1); its batch-mates go back unchanged.  Every crash blames someone, so a
killer input reaches ``max_attempts`` and is dead-lettered.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
import redis.asyncio as aioredis

from redbatch import codec, knobs, lua, protocol
from redbatch.errors import InvalidPayload, WorkerCrashed
from redbatch.levels import ONE, Levels
from redbatch.logs import utf8
from redbatch.protocol import Request, Timings
from redbatch.splice import requeue_entry
from redbatch.worker import suspects
from redbatch.worker.decode import addressable, parse_entry
from redbatch.worker.replies import (
    DEFAULT_DEAD_LETTERS,
    DeadLetters,
    Outgoing,
    error_reply,
    outgoing,
    publish_args,
)
from redbatch.worker.stats import WorkerStats

log = logging.getLogger("redbatch.reaper")

NOT_ELECTED: Final = -3  # reap's answer when another live worker is reaping the worker
LEASE_LIVE: Final = -1  # reap's answer (and REAP's) when the worker's lease is live again


@dataclass
class Plan:
    requeue: list[bytes] = field(default_factory=list)
    dead: list[bytes] = field(default_factory=list)
    replies: list[Outgoing] = field(default_factory=list)  # to callers of dead entries
    suspects: list[Request] = field(default_factory=list)  # requeued, marked by this reap


class Reaper:
    held_lists = True  # a worker may hold entries over in its held lists (``hold``)

    def __init__(self, redis: aioredis.Redis, model: str, max_attempts: int,
                 stats: WorkerStats | None = None,
                 dead_letters: DeadLetters = DEFAULT_DEAD_LETTERS,
                 levels: Levels = ONE, reaper_id: str | None = None,
                 same_slot: bool = False) -> None:
        """``same_slot`` (Redis Cluster): an entry's reply list must be in the model's
        slot, else it is dead-lettered unanswered."""
        self._redis = redis
        self._same_slot = same_slot
        self.reaper_id = reaper_id or protocol.new_id()[:12]  # its name in elections
        self.model = model
        self._levels = levels
        # the sub-queues whose in-flight lists it reads (the runner's, for a sharded model)
        self.tags: Callable[[], list[str]] = lambda: [model]
        # told the index of each sub-queue it put entries back into (the runner's
        # claimer drains one above the count again: ``ShardClaimer.reopen``)
        self.requeued: Callable[[int], None] = _nobody
        self.sub_queue_count: Callable[[], int] = lambda: protocol.MAX_SUB_QUEUES
        self.max_attempts = max_attempts
        self.stats = stats
        self.dead_letters = dead_letters
        self._script = redis.register_script(lua.REAP)

    async def _put_back(self, index: int) -> None:
        """Entries went back into sub-queue ``index``: this worker drains it again if
        it is at or above the count (``requeued``), and so does every other, by a shrink
        notice (a worker returning its batch at a stop: the others finished draining)."""
        self.requeued(index)
        if index >= self.sub_queue_count():
            await knobs.notice_shrink(self._redis, self.model, index + 1)

    def plan(self, raws: list[bytes], bump: bool, crashing: str | None = None,
             tag: str | None = None, elsewhere: bool = False) -> Plan:
        """What to do with a worker's in-flight entries (of sub-queue ``tag``, by
        default the model's own).  ``bump`` (the worker died): the entry named by
        ``crashing`` (the suspect it was running alone) takes the blame, attempt + 1;
        with no such entry, all of them do, unless it is in another sub-queue's list
        (``elsewhere``): then none here does.  Every requeued entry of a dead worker
        is marked suspect, to run alone next time."""
        plan, tag = Plan(), tag or self.model
        requests = [self._parse(raw, plan, tag) for raw in raws]
        named = crashing if any(r is not None and r.id == crashing for r in requests) else None
        for raw, request in zip(raws, requests, strict=True):
            if request is not None:
                blamed = bump and (request.id == named if named or elsewhere else True)
                self._place(raw, request, plan, (blamed, bump), tag)
        return plan

    def _parse(self, raw: bytes, plan: Plan, tag: str) -> Request | None:
        """The entry's request; a malformed one is dead-lettered, and answered
        ``invalid_payload`` when its id and reply_to can be read (as a live worker would)."""
        try:
            return parse_entry(raw, self.model, self._same_slot, tag)
        except InvalidPayload as exc:
            plan.dead.append(raw)
            addressed = addressable(raw, self.model, self._same_slot, tag)
            if addressed is not None:
                stub, fmt = addressed
                plan.replies.append(outgoing(self.model, stub,
                                             error_reply(stub, exc, Timings()), fmt, tag))
            return None

    def _place(self, raw: bytes, request: Request, plan: Plan, blame: tuple[bool, bool],
               tag: str) -> None:
        """Requeue ``request`` (``blame``: whether it takes the blame, whether it was
        in a crash: a suspect), or dead-letter it past ``max_attempts``."""
        blamed, suspect = blame
        fmt = codec.sniff_format(raw)
        request.attempt += 1 if blamed else 0
        request.suspect = request.suspect or suspect
        why = f"request crashed {request.attempt} workers"
        if request.attempt < self.max_attempts:
            entry = requeue_entry(raw, request, fmt)
            if entry is not None:
                plan.requeue.append(entry)
                if suspect:
                    plan.suspects.append(request)
                return
            why = "its worker died and it cannot be requeued (over the entry limit)"
        plan.dead.append(raw)
        exc = WorkerCrashed(f"{why}; dead-lettered")
        reply = error_reply(request, exc, Timings())
        plan.replies.append(outgoing(self.model, request, reply, fmt, tag))

    async def _read(self, worker_id: str, force: bool, tags: list[str]
                    ) -> tuple[list[list[bytes]], str | None]:
        """The worker's in-flight entries and the suspect it ran alone (``_read_all``)."""
        lists, crashing, _live = await self._read_all(worker_id, force, tags)
        return lists, crashing

    async def _read_all(self, worker_id: str, force: bool, tags: list[str]
                        ) -> tuple[list[list[bytes]], str | None, bool]:
        """The worker's in-flight entries (one list per sub-queue of ``tags``: its held
        list's entries, then its in-flight list's; a streaming model's in-flight list
        alone), and, if it died, the suspect it ran
        alone and whether its lease is live again (only looked at with several
        sub-queues: the REAP of the others checks no lease), in one round trip."""
        keys = [key for tag in tags for key in self._lists_of(tag, worker_id)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.lrange(key, 0, -1)
            if not force:
                pipe.get(protocol.crashing_key(self.model, worker_id))
            if not force and len(tags) > 1:
                pipe.zscore(protocol.workers_key(self.model), worker_id)
            results: list[Any] = await pipe.execute()
        parts, rest, per_tag = results[:len(keys)], results[len(keys):], 1 + self.held_lists
        lists = [[raw for part in parts[i:i + per_tag] for raw in part]
                 for i in range(0, len(parts), per_tag)]
        crashing = rest[0].decode(errors="replace") if rest and rest[0] else None
        live = len(rest) > 1 and rest[1] is not None and rest[1] > protocol.now_ms()
        return lists, crashing if any(lists) else None, live

    def _lists_of(self, tag: str, worker_id: str) -> list[str]:
        """The worker's lists of sub-queue ``tag`` that a reap reads, oldest entries
        first: its held list (entries held over by an earlier batch), its in-flight
        list."""
        inflight = protocol.inflight_key(tag, worker_id)
        return [protocol.held_key(tag, worker_id), inflight] if self.held_lists else [inflight]

    async def _elected(self, worker_id: str) -> bool:
        """Win (or already hold) the election to reap ``worker_id`` (``_elect``)."""
        return (await self._elect(worker_id))[0]

    async def _elect(self, worker_id: str) -> tuple[bool, int]:
        """Win (or already hold) the election to reap ``worker_id``: one ``SET NX PX
        GET``, whose old value is nil when this call won it; in the same round trip,
        the sub-queues the worker published having seen (``F_SUB_QUEUES_SEEN``)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(protocol.reaping_key(self.model, worker_id), self.reaper_id, nx=True,
                     get=True, px=protocol.REAPING_TTL_MS)
            pipe.hget(protocol.worker_info_key(self.model), worker_id)
            holder, info = await pipe.execute()
        won = holder is None or holder.decode(errors="replace") == self.reaper_id
        return won, seen_in(info)

    def _tags_for(self, seen: int) -> list[str]:
        """The sub-queues to read: this worker's view (``tags``), or as many as the
        reaped worker saw, if more (it may hold entries of one this worker never knew)."""
        tags = self.tags()
        return tags if seen <= len(tags) else protocol.sub_queue_tags(self.model, seen)

    async def reap(self, worker_id: str, *, force: bool = False) -> int:
        """Requeue ``worker_id``'s in-flight requests.  ``force`` (a stopping worker
        returning its own batch) skips the election, the lease check and the attempt
        bump.  Returns how many were requeued, or a negative number if nothing was done
        (``NOT_ELECTED``: another live worker is reaping it)."""
        seen = 1
        if not force:
            won, seen = await self._elect(worker_id)
            if not won:
                return NOT_ELECTED
        tags = self._tags_for(seen)
        lists, crashing, live = await self._read_all(worker_id, force, tags)
        if live:
            return LEASE_LIVE
        holder = _holder(lists, crashing)
        total = 0
        for index in reversed(range(len(tags))):  # the model's own tag last: the lease
            if not lists[index] and tags[index] != self.model:
                continue  # nothing held there: no REAP
            plan = self.plan(lists[index], bump=not force, crashing=crashing, tag=tags[index],
                             elsewhere=holder is not None and holder != index)
            await suspects.record(self._redis, tags[index], plan.suspects)
            result = await self._reap_list(worker_id, force, tags[index], lists[index], plan)
            if result < 0:
                return result
            if plan.requeue:
                await self._put_back(index)
            total += result
            await self._done(worker_id, force, plan, (len(lists[index]), crashing),
                             forget=not force and tags[index] == self.model)
        return total

    async def _reap_list(self, worker_id: str, force: bool, tag: str, raws: list[bytes],
                         plan: Plan) -> int:
        """One REAP: sub-queue ``tag``'s in-flight list of ``worker_id`` per ``plan``.
        A sub-queue other than the model's own passes its in-flight list in place of the
        lease keys (in another slot), and ``force`` to the script, which then leaves
        the lease alone."""
        own = tag == self.model
        queue = self._levels.queues(tag)[0]  # the front of the most urgent level's queue
        bell = protocol.bell_key(tag) if self._levels.many else queue
        inflight = protocol.inflight_key(tag, worker_id)
        pair_keys, tail = publish_args(plan.replies, plan.dead, self.dead_letters)
        lease_keys = [protocol.workers_key(tag), protocol.worker_info_key(tag),
                      protocol.crashing_key(tag, worker_id)] if own else [inflight] * 3
        keys = [inflight, queue, protocol.dead_letter_key(tag), *lease_keys, bell,
                protocol.held_key(tag, worker_id), *pair_keys]
        now = "force" if force or not own else protocol.now_ms()
        digest = hashlib.sha1(b"".join(raws), usedforsecurity=False).hexdigest()
        args = [worker_id, now, digest, protocol.REPLY_TTL_S, len(plan.requeue),
                *plan.requeue, *tail]
        return int(await self._script(keys=keys, args=args))

    async def _done(self, worker_id: str, force: bool, plan: Plan,
                    seen: tuple[int, str | None], *, forget: bool) -> None:
        """After a REAP that acted (``seen``: the entries it read, the suspect named):
        count and log; with ``forget`` (the model's own list, reaped last) the reaped
        worker's capacity field, held-aware lease (``held_aware_key``) and election go
        (REAP removed its lease and info), in one round trip."""
        read, crashing = seen
        if forget:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hdel(protocol.worker_capacity_key(self.model), worker_id)
                pipe.zrem(protocol.held_aware_key(self.model), worker_id)
                pipe.delete(protocol.reaping_key(self.model, worker_id))
                await pipe.execute()
        if self.stats is not None:
            self.stats.dead_lettered(len(plan.dead))
            self.stats.retried(0 if force else len(plan.requeue))
        if read:
            log.warning("model=%s %s worker %s: requeued %d, dead-lettered %d%s",
                        self.model, "returned the batch of" if force else "reaped",
                        utf8(worker_id),  # (a foreign id that is not UTF-8: its bytes escaped)
                        len(plan.requeue), len(plan.dead),
                        f" (it crashed running request {crashing} alone)" if crashing else "")


def _nobody(index: int) -> None:
    return None


def seen_in(info: bytes | None) -> int:
    """The sub-queues a worker's published info (``worker_info``) says it saw; 1 when
    it says none (a model of one sub-queue) or cannot be read."""
    if not info or protocol.F_SUB_QUEUES_SEEN.encode() not in info:
        return 1
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
        seen = orjson.loads(info).get(protocol.F_SUB_QUEUES_SEEN)
        if type(seen) is int and 1 <= seen <= protocol.MAX_SUB_QUEUES:
            return seen
    return 1


def _holder(lists: list[list[bytes]], crashing: str | None) -> int | None:
    """Which in-flight list holds the entry ``crashing`` names (by its id's bytes), if
    any: the others' entries take no blame."""
    if not crashing:
        return None
    needle = crashing.encode()
    return next((i for i, raws in enumerate(lists) if any(needle in raw for raw in raws)),
                None)
