"""Coalesced enqueue: the pushes of one event-loop tick go to Redis as ONE call of
the ENQUEUE script per model, so a busy gateway pays one round trip for many
requests instead of one each; and lone requests of one shape travel as multi-row
requests (``packing``), one queue entry for many.  A push never raises: its outcome
is the list of its requests that were refused or failed, each with its error.

The flushes of one sub-queue write in the order of their ticks (``Turn``), so one
process's requests enter a queue in the order they were submitted, across ticks too."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from redbatch import defaults, lua, protocol
from redbatch.codec import Format
from redbatch.config import RedisSettings, ReplicaWait
from redbatch.errors import RedbatchError
from redbatch.lean import LeanLink, script_sha
from redbatch.levels import Levels
from redbatch.producer import packing
from redbatch.producer.admission import Admission, no_live_workers
from redbatch.producer.packing import Failures, RoutePack, Unit
from redbatch.producer.replication import ReplicaWaiter
from redbatch.producer.routing import Router
from redbatch.protocol import Request
from redbatch.redis_conn import drop_idle, is_stale, translated

log = logging.getLogger(__name__)

ENQUEUE_CHUNK = 1000  # entries per script call: keeps each call short for Redis
Outcome = list[tuple[str, Exception]]  # a push's refused or failed requests: id, error
ALL_IN: Outcome = []  # the outcome of a push whose requests all went in (never mutated)
OnFailed = Callable[[str, Outcome], None]  # a sub-queue's refused or failed requests
GroupKey = tuple[int, int | None, int | None]  # a flush's call: level, own cap, cap scale


@dataclass(slots=True)
class Push:
    requests: list[Request]
    entries: list[bytes] | None  # None: encoded (or packed) at the flush
    cap: int | None  # the caller's own queue cap for the model, if any
    done: asyncio.Future[Outcome] | None  # None: no one awaits it (``on_failed`` alone)
    level: int = 0  # the priority level the caller asked for; 0: the model's default


@dataclass(frozen=True, slots=True)
class Target:
    """Where a flush's entries go: the enqueue script, its keys before the requests'
    markers and its arguments before their TTLs."""

    source: str
    keys: tuple[str, ...]
    args: tuple[Any, ...]
    tail: tuple[str, ...] = ()  # keys after the markers: a versioned name's closed marker


def accepted_prefix(counts: list[int], sizes: list[int]) -> int:
    """How many entries, in order, were pushed before the first refusal."""
    total = 0
    for count, size in zip(counts, sizes, strict=True):
        total += count
        if count < size:
            break
    return total


class Turn:
    """A flush's place among the flushes of its sub-queue (``tag``): it writes once the
    flush before it has started its write (``prev``), then lets the next one write
    (``done``).  A flush never waits for the reply of the one before: replies may take
    a ``WAIT``'s timeout, and flushes of a queue must not queue up behind them.  On the
    one held connection (``LeanLink``, connected first: ``LeanLink.ready``) the writes
    reach Redis in that order; a write
    that goes through the pool (the held one busy) or a cluster client may be passed
    by the next.  No future is made unless a flush has to wait (``later``)."""

    __slots__ = ("done", "prev", "started", "waiter", "writes")

    def __init__(self, prev: Turn | None) -> None:
        self.prev = prev  # the tag's flush before (None once this one is done)
        self.started = False  # its task ran (one cancelled first never does)
        self.writes = 1  # script calls still to write (a multi-level flush: one a level)
        self.done = False  # written, or ended without writing
        self.waiter: asyncio.Future[None] | None = None  # the next flush's, if it waits

    def later(self) -> asyncio.Future[None]:
        """What the next flush awaits while this one has not written."""
        if self.waiter is None:
            self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    def wrote(self) -> None:
        """One of the flush's writes went out; once all have, the next may write."""
        self.writes -= 1
        if self.writes <= 0:
            self.end()

    def end(self) -> None:
        """The next flush may write (this one wrote, or ended without writing)."""
        if not self.done:
            self.done, self.prev, waiter = True, None, self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


class Enqueuer:
    def __init__(self, redis: aioredis.Redis, settings: RedisSettings, admission: Admission,
                 on_failed: OnFailed, fmt: Format = "msgpack", pack_rows: int = 1,
                 route_pack: RoutePack | None = None,
                 replica_wait: ReplicaWait | None = None) -> None:
        """``on_failed(tag, outcome)``: called with a push's refused or failed requests
        (never with none) once its flush into sub-queue ``tag`` has them: once per such
        push, so possibly several times a flush; an exception in it is logged."""
        self._redis = redis
        self._settings = settings
        self._admission = admission
        self._fmt: Format = fmt
        self._pack_rows = pack_rows
        self._route_pack = route_pack
        self._on_failed = on_failed
        self._link = LeanLink(redis)
        # opt-in: WAIT for replicas after each enqueue (None: off, nothing more is sent)
        self.waiter = ReplicaWaiter(self._link, replica_wait) \
            if replica_wait is not None and replica_wait.wait_replicas else None
        self._pending: dict[str, list[Push]] = {}  # by sub-queue tag (a model's name)
        self._turns: dict[str, Turn] = {}  # by sub-queue tag: its latest flush's
        self._tasks: set[asyncio.Task[None]] = set()
        self.router = Router()  # a sharded model's sub-queue lengths (``routing``)

    async def drain(self, timeout_s: float = defaults.ENQUEUE_DRAIN_S) -> None:
        """Let the pushes in flight finish (bounded), before the connection closes; the
        ones still running then are cancelled (their requests fail) and ended: one left
        running would reconnect on the closed pool (behind Sentinel, ask the closed
        sentinels too) and leave those connections open."""
        if self._pending:  # this tick's pushes, whose flush is scheduled: start them now
            self._flush()
        end = time.monotonic() + timeout_s
        while self._tasks:  # (a flush may start while the ones before it end)
            _done, late = await asyncio.wait(set(self._tasks),
                                             timeout=max(0.0, end - time.monotonic()))
            if late and time.monotonic() >= end:
                for task in late:
                    task.cancel()
                await asyncio.wait(late)
                return

    def push(self, tag: str, requests: list[Request], entries: list[bytes] | None,
             cap: int | None = None, level: int = 0) -> None:
        """Queue a push for this tick's flush into the sub-queue ``tag`` (a model's
        name, or one of its ``protocol.sub_queue_tag``s: ``Router.pick``) (``cap``:
        the caller's own queue cap for the model; ``level``: a priority level, 0 for
        the model's default); its refused or failed requests go to ``on_failed``.  No
        future, no callback per push: most pushes go in whole."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.setdefault(tag, []).append(Push(requests, entries, cap, None, level))

    def push_watched(self, tag: str, requests: list[Request], entries: list[bytes] | None,
                     cap: int | None = None, level: int = 0) -> asyncio.Future[Outcome]:
        """``push``, with a future that resolves to its refused or failed requests
        (``ALL_IN``: none) once ``on_failed`` has had them."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Outcome] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(tag, []).append(Push(requests, entries, cap, done, level))
        return done

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        self.router.tick()
        for tag, pushes in pending.items():
            try:
                self._start(tag, pushes)
            except Exception as exc:  # (a closed loop)
                self._fail_all(tag, pushes, exc)

    def _start(self, tag: str, pushes: list[Push]) -> None:
        """Sub-queue ``tag``'s flush, in a task, after the tag's flush before it."""
        turn = Turn(self._turns.get(tag))
        task = asyncio.create_task(self._send(tag, pushes, turn))
        self._turns[tag] = turn  # (the task made: a flush that has none holds no turn)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, tag, pushes, turn))

    def _ended(self, tag: str, pushes: list[Push], turn: Turn, task: asyncio.Task[None]
               ) -> None:
        """A flush's task ended: the next may write; cancelled before its start (a
        loop's shutdown), its pushes fail."""
        self._tasks.discard(task)
        if not turn.done:
            turn.end()
        if self._turns.get(tag) is turn:
            del self._turns[tag]
        if not turn.started:
            self._fail_all(tag, pushes, _cancelled(tag))

    async def _send(self, tag: str, pushes: list[Push], turn: Turn) -> None:
        """One flush of sub-queue ``tag``: each push learns its refused or failed
        requests; a cancel fails them all (``RedbatchError``), then goes on."""
        turn.started = True
        try:
            async with translated(self._settings):
                levels = await self._admission.levels(protocol.model_of_tag(tag))  # cached
                groups = await self._groups(tag, pushes, levels)
                failed = await (self._send_groups(tag, pushes, groups, levels, turn)
                                if len(groups) > 1 else
                                self._send_level(tag, pushes, next(iter(groups))[0], levels,
                                                 turn))
        except Exception as exc:
            self._fail_all(tag, pushes, exc)
            return
        except BaseException:  # cancelled: no waiter is left to its deadline
            self._fail_all(tag, pushes, _cancelled(tag))
            raise
        for index, push in enumerate(pushes):
            self._settle(tag, push, failed.get(index, ALL_IN))

    def _fail_all(self, tag: str, pushes: list[Push], exc: Exception) -> None:
        for push in pushes:
            self._settle(tag, push, [(r.id, exc) for r in push.requests])

    def _settle(self, tag: str, push: Push, outcome: Outcome) -> None:
        """A push's outcome: its refused or failed requests to ``on_failed`` (an error
        there is logged: the other pushes are still settled), then its future (if any)
        resolved."""
        try:
            if outcome:
                self._on_failed(tag, outcome)
        except Exception:
            log.exception("on_failed raised for %d request(s) of %r", len(outcome), tag)
        finally:
            if push.done is not None and not push.done.done():
                push.done.set_result(outcome)

    async def _send_level(self, tag: str, pushes: list[Push], level: int, levels: Levels,
                          turn: Turn) -> Failures:
        """The pushes' entries into one queue (``level``: of a multi-level model)."""
        units, failed = await self._plan(tag, pushes)
        if units:
            refused, full = await self._enqueue(tag, pushes, units, (level, levels), turn)
            if full is not None:
                _add_refused(failed, refused, full)
        return failed

    async def _groups(self, tag: str, pushes: list[Push], levels: Levels
                      ) -> dict[GroupKey, list[int]]:
        """The flush's pushes by what one script call holds alike: the level (of a
        multi-level model; 0 otherwise), the caller's own queue cap, and the admission
        cap that the earliest deadline sets (``Admission.cap``), by powers of two (None:
        the deadline lowers nothing).  So a request with a short deadline or a low cap
        of its own makes no other request refused (one whose cap is less than half as
        high, at most); requests alike share one call, as most do."""
        rate = await self._admission.capacity(protocol.model_of_tag(tag))  # (cached)
        groups: dict[GroupKey, list[int]] = {}
        for index, push in enumerate(pushes):
            level = (push.level if 0 < push.level <= levels.count else levels.default) \
                if levels.many else 0  # (levels may change under a push)
            deadline_ms = min((r.deadline_ms for r in push.requests), default=0)
            cap = self._admission.cap_at(rate, deadline_ms, push.cap)
            scale = cap.bit_length() if cap < self._admission.limit(push.cap) else None
            groups.setdefault((level, push.cap, scale), []).append(index)
        return groups

    async def _send_groups(self, tag: str, pushes: list[Push],
                           groups: dict[GroupKey, list[int]], levels: Levels, turn: Turn
                           ) -> Failures:
        """A flush's groups of pushes (``_groups``), each in a script call of its own
        (concurrently)."""
        turn.writes = len(groups)
        results = await asyncio.gather(*(
            self._send_group(tag, [pushes[i] for i in indices], key[0], levels, turn)
            for key, indices in groups.items()))
        failed: Failures = {}
        for indices, part in zip(groups.values(), results, strict=True):
            failed.update({indices[i]: errors for i, errors in part.items()})
        return failed

    async def _send_group(self, tag: str, pushes: list[Push], level: int, levels: Levels,
                          turn: Turn) -> Failures:
        """One group's pushes of a flush of several (``_groups``): an error fails those
        alone (the other groups' requests may be queued already)."""
        try:
            async with translated(self._settings):
                return await self._send_level(tag, pushes, level, levels, turn)
        except Exception as exc:
            return {i: [(r.id, exc) for r in push.requests] for i, push in enumerate(pushes)}

    async def _plan(self, tag: str, pushes: list[Push]) -> tuple[list[Unit], Failures]:
        """The flush's entries (same-shape requests packed, while the model's workers
        take multi-row requests), and the requests that could not be encoded.  A
        pack's reply comes to the sub-queue's listener (``tag``'s)."""
        route = self._route_pack
        packing_on = route is not None and self._pack_rows > 1 and \
            any(p.entries is None for p in pushes) and \
            await self._admission.takes_rows(protocol.model_of_tag(tag))
        return packing.plan([p.requests for p in pushes], [p.entries for p in pushes],
                            self._fmt, self._pack_rows,
                            _routed(route, tag) if packing_on and route else None)

    async def _enqueue(self, tag: str, pushes: list[Push], units: list[Unit],
                       at: tuple[int, Levels], turn: Turn
                       ) -> tuple[list[Unit], RedbatchError | None]:
        """Push the units under the queue cap (a multi-level model's: the entries at
        ``level`` and above, and ``level``'s own cap): the refused ones, and why.  A
        model of S sub-queues caps each at the model's cap (and the level's) less what
        the others hold as this process knows (``Router.caps``); a refusal counts the
        entries of every sub-queue (``Router.learn``).  ``at``: the level and the
        model's levels."""
        (level, levels), own, model = at, _own_cap(pushes), protocol.model_of_tag(tag)
        cap = await self._admission.cap(model, min(u.request.deadline_ms for u in units), own)
        count = await self._admission.sub_queues(model)
        caps = (cap, levels.cap(level) if levels.many else None)
        accepted, depths = await self._run(
            tag, _target(tag, self.router.caps(tag, count, caps, level) if count > 1 else caps,
                         level, levels), [u.request for u in units], [u.entry for u in units],
            turn)
        if depths[0] < 0:  # a drained version's closed sub-queue
            return units, no_live_workers(model)
        if count > 1:
            depths = self.router.learn(tag, count, level, depths)
        if accepted == len(units):
            return [], None
        if not levels.many:
            return units[accepted:], await self._admission.queue_full(model, depths[0], cap,
                                                                      own)
        return units[accepted:], await self._admission.level_full(
            model, level, (depths[0], depths[1]), cap, caps[1], own)

    async def _run(self, tag: str, target: Target, requests: list[Request],
                   entries: list[bytes], turn: Turn) -> tuple[int, list[int]]:
        """The enqueue script, once the sub-queue's flush before has written (``turn``),
        sent once more on a broken connection (Redis restarted): the requests' markers
        make a push that did land count once, not twice.  The pool's idle connections
        are dropped then, stale as well."""
        calls = _calls(tag, target, requests, entries)
        prev = turn.prev
        if prev is not None and not prev.done:  # (at once in the steady state)
            await prev.later()
        await self._link.ready()  # a first call's connect: before the next may write
        turn.wrote()  # the call goes out now: never wait for its reply (a WAIT's)
        return await self._retried(target, calls, requests)

    async def _retried(self, target: Target, calls: list[tuple[list[str], list[Any]]],
                       requests: list[Request]) -> tuple[int, list[int]]:
        try:
            return await self._call(target, calls, requests)
        except redis.ConnectionError as exc:
            if not is_stale(exc):
                raise
            await drop_idle(self._redis)
            return await self._call(target, calls, requests)

    async def _call(self, target: Target, calls: list[tuple[list[str], list[Any]]],
                    requests: list[Request]) -> tuple[int, list[int]]:
        """One call of the script; over ``ENQUEUE_CHUNK`` entries, chunks in one MULTI
        (no worker drains the queue between them, so the cap holds for all); then the
        WAIT for replicas, when it is on.  Returns the entries accepted and the
        script's depths after."""
        if self.waiter is not None:
            return _tally(target, calls, await self.waiter.call(target.source, calls,
                                                                requests))
        if len(calls) == 1:
            accepted, *depths = await self._link.script(target.source, *calls[0])
            return int(accepted), [int(d) for d in depths]
        try:
            results = await self._multi(target.source, calls)
        except NoScriptError:  # Redis lost its scripts (a restart, a promoted replica)
            await self._redis.script_load(target.source)
            results = await self._multi(target.source, calls)
        return _tally(target, calls, results)

    async def _multi(self, source: str, calls: list[tuple[list[str], list[Any]]]
                     ) -> list[Any]:
        """The script's calls in one MULTI, as plain EVALSHA commands (a cluster
        pipeline refuses redis-py's ``Script`` objects)."""
        sha = script_sha(source)
        async with self._redis.pipeline(transaction=True) as pipe:
            for keys, args in calls:
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            return list(await pipe.execute())


def _tally(target: Target, calls: list[tuple[list[str], list[Any]]], results: list[Any]
           ) -> tuple[int, list[int]]:
    """The entries accepted by the script's calls (in order, up to the first refusal),
    and the depths after the last."""
    sizes = [len(keys) - len(target.keys) - len(target.tail) for keys, _args in calls]
    return accepted_prefix([int(r[0]) for r in results], sizes), \
        [int(d) for d in results[-1][1:]]


def _routed(route: RoutePack, tag: str) -> RoutePack:
    """``route`` with a pack's replies sent to sub-queue ``tag``'s listener."""
    return lambda _model, pack_id, members, deadline_ms: route(tag, pack_id, members,
                                                               deadline_ms)


def _target(tag: str, caps: tuple[int, int | None], level: int, levels: Levels) -> Target:
    """Sub-queue ``tag``'s plain queue (one level), or its level ``level``'s queue,
    which the cap counts with the more urgent ones, and the bell (``caps``: the queue's
    cap and the level's own, if any).  A version's sub-queue (``m@v``, ``m@v:1``...) is
    refused once its drain closed it (``protocol.closed_key``): the script's variant
    that checks the marker."""
    ttl_ms = protocol.QUEUE_TTL_S * 1000
    cap, own_cap = caps
    versioned = protocol.VERSION_SEP in tag
    tail = (protocol.closed_key(tag),) if versioned else ()
    if not levels.many:
        return Target(lua.ENQUEUE_OPEN if versioned else lua.ENQUEUE,
                      (protocol.queue_key(tag),), (cap, ttl_ms), tail)
    queues = levels.queues(tag)
    ahead = queues[:level - 1]
    return Target(lua.ENQUEUE_LEVEL_OPEN if versioned else lua.ENQUEUE_LEVEL,
                  (queues[level - 1], protocol.bell_key(tag), *ahead),
                  (cap, cap if own_cap is None else own_cap, ttl_ms, len(ahead)), tail)


def _calls(tag: str, target: Target, requests: list[Request], entries: list[bytes]
           ) -> list[tuple[list[str], list[Any]]]:
    now = protocol.now_ms()
    calls = []
    for start in range(0, len(requests), ENQUEUE_CHUNK):
        chunk = requests[start:start + ENQUEUE_CHUNK]
        keys = [*target.keys, *(protocol.request_key(tag, r.id) for r in chunk), *target.tail]
        ttls = [protocol.marker_ttl_ms(r.deadline_ms, now) for r in chunk]
        args: list[Any] = [*target.args, *ttls, *entries[start:start + ENQUEUE_CHUNK]]
        calls.append((keys, args))
    return calls


def _cancelled(tag: str) -> RedbatchError:
    return RedbatchError(f"enqueue into {tag!r} cancelled")


def _own_cap(pushes: list[Push]) -> int | None:
    """The lowest of the pushes' own queue caps (one script call holds one cap)."""
    caps = [p.cap for p in pushes if p.cap is not None]
    return min(caps) if caps else None


def _add_refused(failed: Failures, refused: list[Unit], full: RedbatchError) -> None:
    """Each request of a refused entry (a pack's members too) fails with ``full``."""
    for unit in refused:
        for index, request in unit.members:
            failed.setdefault(index, []).append((request.id, full))
