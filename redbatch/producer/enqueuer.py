"""Coalesced enqueue: the pushes of one event-loop tick go to Redis as ONE call of
the ENQUEUE script per model, so a busy gateway pays one round trip for many
requests instead of one each; and lone requests of one shape travel as multi-row
requests (``packing``), one queue entry for many.  A push never raises: its outcome
is the list of its requests that were refused or failed, each with its error."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from redbatch import defaults, lua, protocol
from redbatch.codec import Format
from redbatch.config import RedisSettings
from redbatch.errors import QueueFull
from redbatch.lean import LeanLink
from redbatch.producer import packing
from redbatch.producer.admission import Admission
from redbatch.producer.packing import Failures, RoutePack, Unit
from redbatch.protocol import Request
from redbatch.redis_conn import drop_idle, is_stale, translated

ENQUEUE_CHUNK = 1000  # entries per script call: keeps each call short for Redis
Outcome = list[tuple[str, Exception]]  # a push's refused or failed requests: id, error
ALL_IN: Outcome = []  # the outcome of a push whose requests all went in (never mutated)


@dataclass(slots=True)
class Push:
    requests: list[Request]
    entries: list[bytes] | None  # None: encoded (or packed) at the flush
    cap: int | None  # the caller's own queue cap for the model, if any
    done: asyncio.Future[Outcome]


def accepted_prefix(counts: list[int], sizes: list[int]) -> int:
    """How many entries, in order, were pushed before the first refusal."""
    total = 0
    for count, size in zip(counts, sizes, strict=True):
        total += count
        if count < size:
            break
    return total


class Enqueuer:
    def __init__(self, redis: aioredis.Redis, settings: RedisSettings, admission: Admission,
                 fmt: Format = "msgpack", pack_rows: int = 1,
                 route_pack: RoutePack | None = None) -> None:
        self._redis = redis
        self._settings = settings
        self._admission = admission
        self._fmt: Format = fmt
        self._pack_rows = pack_rows
        self._route_pack = route_pack
        self._script = redis.register_script(lua.ENQUEUE)
        self._link = LeanLink(redis)
        self._pending: dict[str, list[Push]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def drain(self, timeout_s: float = defaults.ENQUEUE_DRAIN_S) -> None:
        """Let the pushes in flight finish (bounded), before the connection closes."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    def push(self, model: str, requests: list[Request], entries: list[bytes] | None,
             cap: int | None = None) -> asyncio.Future[Outcome]:
        """Queue a push for this tick's flush (``cap``: the caller's own queue cap for
        ``model``); resolves to its refused or failed requests (``ALL_IN``: none)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Outcome] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(model, []).append(Push(requests, entries, cap, done))
        return done

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for model, pushes in pending.items():
            task = asyncio.create_task(self._send(model, pushes))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, model: str, pushes: list[Push]) -> None:
        """One flush of ``model``: each push learns its refused or failed requests."""
        try:
            async with translated(self._settings):
                units, failed = await self._plan(model, pushes)
                refused, full = await self._enqueue(model, pushes, units) if units \
                    else ([], None)
        except Exception as exc:
            for push in pushes:
                _settle(push, [(r.id, exc) for r in push.requests])
            return
        if full is not None:
            _add_refused(failed, refused, full)
        for index, push in enumerate(pushes):
            _settle(push, failed.get(index, ALL_IN))

    async def _plan(self, model: str, pushes: list[Push]) -> tuple[list[Unit], Failures]:
        """The flush's entries (same-shape requests packed, while the model's workers
        take multi-row requests), and the requests that could not be encoded."""
        packing_on = self._pack_rows > 1 and any(p.entries is None for p in pushes) and \
            await self._admission.takes_rows(model)
        return packing.plan([p.requests for p in pushes], [p.entries for p in pushes],
                            self._fmt, self._pack_rows,
                            self._route_pack if packing_on else None)

    async def _enqueue(self, model: str, pushes: list[Push], units: list[Unit]
                       ) -> tuple[list[Unit], QueueFull | None]:
        """Push the units under the queue cap: the refused ones, and why."""
        own = _own_cap(pushes)
        cap = await self._admission.cap(model, min(u.request.deadline_ms for u in units), own)
        accepted, depth = await self._run(model, [u.request for u in units],
                                          [u.entry for u in units], cap)
        if accepted == len(units):
            return [], None
        return units[accepted:], await self._admission.queue_full(model, depth, cap, own)

    async def _run(self, model: str, requests: list[Request], entries: list[bytes], cap: int
                   ) -> tuple[int, int]:
        """The ENQUEUE script, sent once more on a broken connection (Redis restarted):
        the requests' markers make a push that did land count once, not twice.  The
        pool's idle connections are dropped then, stale as well."""
        calls = _calls(model, requests, entries, cap)
        try:
            return await self._call(calls)
        except redis.ConnectionError as exc:
            if not is_stale(exc):
                raise
            await drop_idle(self._redis)
            return await self._call(calls)

    async def _call(self, calls: list[tuple[list[str], list[Any]]]) -> tuple[int, int]:
        """One call of the script; over ``ENQUEUE_CHUNK`` entries, chunks in one MULTI
        (no worker drains the queue between them, so the cap holds for all)."""
        if len(calls) == 1:
            accepted, depth = await self._link.script(lua.ENQUEUE, *calls[0])
            return int(accepted), int(depth)
        async with self._redis.pipeline(transaction=True) as pipe:
            for keys, args in calls:
                await self._script(keys=keys, args=args, client=pipe)
            results = await pipe.execute()
        sizes = [len(keys) - 1 for keys, _args in calls]
        return accepted_prefix([int(r[0]) for r in results], sizes), int(results[-1][1])


def _calls(model: str, requests: list[Request], entries: list[bytes], cap: int
           ) -> list[tuple[list[str], list[Any]]]:
    now = protocol.now_ms()
    queue = protocol.queue_key(model)
    calls = []
    for start in range(0, len(requests), ENQUEUE_CHUNK):
        chunk = requests[start:start + ENQUEUE_CHUNK]
        keys = [queue, *(protocol.request_key(model, r.id) for r in chunk)]
        ttls = [protocol.marker_ttl_ms(r.deadline_ms, now) for r in chunk]
        args: list[Any] = [cap, protocol.QUEUE_TTL_S * 1000, *ttls,
                           *entries[start:start + ENQUEUE_CHUNK]]
        calls.append((keys, args))
    return calls


def _own_cap(pushes: list[Push]) -> int | None:
    """The lowest of the pushes' own queue caps (one script call holds one cap)."""
    caps = [p.cap for p in pushes if p.cap is not None]
    return min(caps) if caps else None


def _add_refused(failed: Failures, refused: list[Unit], full: QueueFull) -> None:
    """Each request of a refused entry (a pack's members too) fails with ``full``."""
    for unit in refused:
        for index, request in unit.members:
            failed.setdefault(index, []).append((request.id, full))


def _settle(push: Push, outcome: Outcome) -> None:
    if not push.done.done():
        push.done.set_result(outcome)
