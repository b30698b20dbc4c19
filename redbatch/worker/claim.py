"""Reliable claim: move requests from a model's queue into this worker's in-flight list.

Items never live only in a worker's memory: ``BLMOVE``, ``LMOVE`` and the ``CLAIM``
script move them atomically into ``inflight_key(model, worker_id)``, where they stay
until the batch's replies are published together with the ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import orjson
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from redbatch import lua, protocol
from redbatch.lean import LeanLink, script_sha, unblock
from redbatch.worker.decode import Decoded, drop_requests
from redbatch.worker.policy import BatchPolicy

log = logging.getLogger("redbatch.worker")
_CLAIM_SHA = script_sha(lua.CLAIM)

MIN_BLOCK_S = 0.001
MOVE_MAX = 8  # claims of up to this many entries go as plain LMOVEs, larger ones by script
MOVE_AHEAD = 3  # LMOVEs that ride behind a blocking pop, for the entries queued behind it
GAIN_MIN = 0.5  # waiting is worth it while a window adds this many requests on average
GAIN_SMOOTHING = 0.2
PROBE_EVERY = 16  # lone batches: one in this many waits anyway, to re-measure the gain
SERVER_TIMER_SLACK_S = 0.11  # a blocked client's timeout may fire up to 1/hz s late
WINDOW_SAFETY = 1.5  # a window closes this many measured passes before a deadline...
WINDOW_MARGIN_MS = 50  # ...and this much more (decode, reply, its delivery)
PACE_STEP_S = 0.25  # a stride's wait re-reads the stride this often (a live change)


def _peek_msgpack(raw: bytes, name: str) -> Any:
    """One top-level field of a msgpack map; the values before it are skipped unbuilt."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    for _ in range(unpacker.read_map_header()):
        if unpacker.unpack() == name:
            return unpacker.unpack()
        unpacker.skip()
    return None


def _peek_int(raw: bytes, name: str) -> int | None:
    """An entry's integer field ``name``, without validating the rest of it."""
    try:
        if raw[:1] == b"{":
            wire: Any = orjson.loads(raw)
            value = wire.get(name) if isinstance(wire, dict) else None
        else:
            value = _peek_msgpack(raw, name)
    except Exception:  # a bad entry is rejected later, by the decode step
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def peek_enqueue_ms(raw: bytes, fallback_ms: int) -> int:
    """Read an entry's enqueue time without validating the rest of it, never later than
    ``fallback_ms`` (the claim time)."""
    value = _peek_int(raw, protocol.F_ENQUEUE_MS)
    # a producer clock ahead of ours must not hold a batch
    return fallback_ms if value is None else min(value, fallback_ms)


def peek_deadline_ms(raw: bytes) -> int | None:
    """An entry's deadline (epoch ms), None if it cannot be read."""
    return _peek_int(raw, protocol.F_DEADLINE_MS)


def peek_rows(raw: bytes) -> int:
    """The items an entry brings: its ``rows`` (a multi-row request), else 1."""
    rows = _peek_int(raw, protocol.F_ROWS)
    return rows if rows is not None and rows > 1 else 1


def _cold(size: int) -> float | None:
    return None


_CANCEL_REFUSED: set[str] = set()  # models already warned about
LMOVE_REFUSED = ("the redis user may not run LMOVE (NOPERM): claims go by the CLAIM script "
                 "instead, at more Redis CPU per request; allow +lmove (docs/redis.md)")
LPOS_REFUSED = ("the redis user may not run LPOS (%s): batches are acked by their SHA-1 "
                "instead (Redis reads the in-flight head into the script and hashes it), at "
                "more Redis CPU per request for entries of a few KB and up; allow +lpos "
                "(docs/redis.md)")
# whether the user of a worker's Redis client may run LPOS: probed once per client (one
# worker), by the first claimer to claim; the others await that one probe
_LPOS_PROBES: weakref.WeakKeyDictionary[aioredis.Redis, asyncio.Future[bool]] = (
    weakref.WeakKeyDictionary())


def warn_cancel_refused(model: str, exc: ResponseError) -> None:
    if model in _CANCEL_REFUSED:
        return
    _CANCEL_REFUSED.add(model)
    log.warning("model=%s Redis refused ZMSCORE on the cancelled set (%s): requests whose "
                "callers went away are computed anyway, streams replayed to the end (see "
                "docs/redis.md; logged once)", model, exc)


class Claimer:
    """Forms one batch at a time for one model under a ``BatchPolicy``.

    With ``blocking``, a client of its own (one connection), the batch window is
    precise: a timer sends ``CLIENT UNBLOCK`` for that connection's ``BLMOVE`` when
    the window (or a quiet gap) ends, instead of relying on Redis's own 100 ms timer.
    """

    def __init__(self, redis: aioredis.Redis, model: str, worker_id: str, policy: BatchPolicy,
                 block_timeout_s: float, blocking: aioredis.Redis | None = None,
                 tag: str | None = None, link: LeanLink | None = None) -> None:
        self._redis = redis
        self._precise = blocking is not None
        self._policy = policy
        self.block_timeout_s = block_timeout_s
        self.model = model
        # the sub-queue it claims from (``protocol.sub_queue_tag``; the model's own queue
        # by default): every key below carries its tag
        self.tag = tag or model
        self.queue = protocol.queue_key(self.tag)
        self.inflight = protocol.inflight_key(self.tag, worker_id)
        self.cancelled = protocol.cancelled_key(self.tag)
        self.unblock_guard = protocol.unblock_guard_key(self.tag)
        self.cancels = False  # the cancelled set existed at the last claim: look into it
        self.skipped = 0  # cancelled requests acked without computing
        # the earliest deadline of items held over for this claim's batch (``hold``):
        # its window closes in time for them too (set by the runner around the claim)
        self.held_deadline_ms: int | None = None
        # claims and blocking pops: one connection (``link``: shared by the claimers of
        # one model's sub-queues, which claim one at a time)
        self._link = link or LeanLink(blocking or redis)
        self._last_claim = 0.0
        self._loaded = False
        self._client_id: int | None = None
        self._node: str | None = None  # the node of that connection (a cluster's)
        self._unblocks: set[asyncio.Task[Any]] = set()
        self._gain = 1.0  # requests a window wait added, smoothed; starts hopeful
        self._lone = 0
        self._rows = 0  # the items (rows) of the batch a window fills, where it counts them
        self._drained = False  # the queue was empty at the last look: block at once
        self._moves = True  # the user may run LMOVE (checked at the first claim)
        # the user may run LPOS (checked once per worker, at its first claim): a batch
        # of few or large entries is acked by them (``protocol.ACK_BY_ENTRIES``), not
        # their SHA-1
        self.acks_by_entries = False
        self._left = 0  # the queue's length that the last blocking pop saw
        # the measured time of a pass of n items (None: not measured yet), set by the
        # runner: a window closes early enough for its most urgent request's pass
        self.pass_ms: Callable[[int], float | None] = _cold
        self.stop: asyncio.Event | None = None  # set: a window waits no more (shutdown)
        # the model's policy as it is now (set by the runner): a live change reaches a
        # stride being waited out, and a batch window already open; None: the one set
        # between batches (``set_policy``)
        self.live_policy: Callable[[], BatchPolicy] | None = None

    def set_policy(self, policy: BatchPolicy) -> None:
        """Form the next batches under ``policy`` (a live change, between batches)."""
        self._policy = policy

    @property
    def precise(self) -> bool:
        """Its waits end on time: a connection of its own, which ``CLIENT UNBLOCK``
        can end (on a cluster, a connection to the primary of the queue's slot)."""
        return self._precise

    def reconnected(self) -> None:
        """Its connection may have been replaced (a claim on the link it shares failed):
        the next claim asks the connection's id again."""
        self._client_id = None

    async def claim_now(self, count: int) -> list[bytes]:
        """Up to ``count`` entries from the queue's head at once, never waiting and with
        no batch window ([] when it is empty): a steal from another sub-queue, by the
        CLAIM script (two commands, where an empty queue would cost ``count`` LMOVEs)."""
        return await self._claiming(self._steal, count)

    async def _steal(self, count: int) -> list[bytes]:
        return await self._claim_script(count)

    @property
    def drained(self) -> bool:
        """The queue was empty at the last look."""
        return self._drained

    script = lua.CLAIM  # loaded once, before the first claim

    async def _take(self, count: int) -> list[bytes]:
        """Up to ``count`` entries from the queue's head, moved to the in-flight list:
        a few by plain ``LMOVE``s (``_move``), more by the CLAIM script."""
        if count <= MOVE_MAX and self._moves:
            return await self._move(count)
        return await self._claim_script(count)

    async def _move(self, count: int) -> list[bytes]:
        """``count`` LMOVEs in one write (each moves one entry atomically: an entry is
        always in the queue or in the in-flight list; a nil once the queue ran out), the
        in-flight list's TTL, the queue's length after and an EXISTS of the cancelled
        set.  Cheaper for Redis than a script for a few entries (no copy through Lua)."""
        move = ("LMOVE", self.queue, self.inflight, "LEFT", "RIGHT")
        *moved, _ttl, left, exists = await self._link.pipeline(
            *[move] * count, ("PEXPIRE", self.inflight, protocol.INFLIGHT_TTL_S * 1000),
            ("LLEN", self.queue), ("EXISTS", self.cancelled))
        self.cancels = self.cancels or exists == 1
        self._drained = left == 0
        return [item for item in moved if isinstance(item, bytes)]

    async def _claim_script(self, count: int) -> list[bytes]:
        """CLAIM, with an EXISTS of the cancelled set riding in the same write."""
        claim = ("EVALSHA", _CLAIM_SHA, 2, self.queue, self.inflight, count,
                 protocol.INFLIGHT_TTL_S * 1000)
        items, exists = await self._link.pipeline_loading(lua.CLAIM, claim,
                                                          ("EXISTS", self.cancelled))
        self.cancels = self.cancels or exists == 1  # (a batch may mix both claims)
        self._drained = not items  # found some: more may come while this batch runs
        return list(items)

    async def drop_cancelled(self, decoded: Decoded) -> None:
        """Drop the batch's requests whose caller went away (``cancelled_key``): they
        are acked with the batch, unanswered and not computed.  Asked only while the
        cancelled set exists."""
        ids = [i.request.id for i in decoded.items if i.pack is None] + \
            [p.request.id for p in decoded.packs]
        if not self.cancels or not ids:
            return
        try:
            scores = await self._link.execute("ZMSCORE", self.cancelled, *ids)
        except ResponseError as exc:  # e.g. NOPERM: cancelled requests get computed
            warn_cancel_refused(self.model, exc)
            return
        gone = {rid for rid, score in zip(ids, scores, strict=True) if score is not None}
        if gone:
            self.skipped += drop_requests(decoded, gone)
            log.info("model=%s skipped %d cancelled requests (their callers went away)",
                     self.model, len(gone))

    async def _block(self, timeout_s: float, count: int, wake_at_ms: int | None = None
                     ) -> list[bytes]:
        """Up to ``count`` entries once one comes (blocking), [] when none came: the pop
        brings up to ``MOVE_AHEAD`` more in its write, and those the pop's LLEN still
        saw behind them follow (``_top_up``)."""
        ahead = min(count - 1, MOVE_AHEAD) if self._moves else 0
        got = await self._block_some(timeout_s, ahead, wake_at_ms)
        if not got:
            return []
        return [*got, *await self._top_up(min(count - len(got), self._left))]

    async def _blocking(self, wake_at_ms: int | None, *commands: tuple[Any, ...]
                        ) -> list[Any]:
        """``commands`` in one write, the first a blocking pop; with ``wake_at_ms``
        (precise mode) the pop gives up at that moment (``CLIENT UNBLOCK``)."""
        timer = None
        if wake_at_ms is not None and self._client_id is not None:
            delay_s = max(0.0, (wake_at_ms - protocol.now_ms()) / 1000)
            timer = asyncio.get_running_loop().call_later(delay_s, self._unblock,
                                                          self._client_id)
        try:
            return await self._link.pipeline(*commands)
        finally:
            if timer is not None:
                timer.cancel()
            if self._unblocks:  # a fired unblock must land before our next blocking pop
                await asyncio.gather(*self._unblocks, return_exceptions=True)

    async def _block_some(self, timeout_s: float, ahead: int, wake_at_ms: int | None = None
                          ) -> list[bytes]:
        """BLMOVE one entry, with ``ahead`` LMOVEs behind it in the same write (Redis
        runs them once the pop is served: the entries queued behind the first come in
        the same round trip); with ``wake_at_ms`` (precise mode) give up at that moment.
        An LLEN rides along too, so the next step knows, without a round trip, whether
        the queue holds more.  Every entry moved is returned, even after a pop that
        gave up (an LMOVE may still have found one)."""
        timeout: Any = max(timeout_s, MIN_BLOCK_S)  # redis takes fractional seconds
        move = ("LMOVE", self.queue, self.inflight, "LEFT", "RIGHT")
        first, *moved, left, exists = await self._blocking(
            wake_at_ms, ("BLMOVE", self.queue, self.inflight, "LEFT", "RIGHT", timeout),
            *[move] * ahead, ("LLEN", self.queue), ("EXISTS", self.cancelled))
        self._drained = left == 0
        self._left = int(left)
        self.cancels = self.cancels or exists == 1
        return [item for item in (first, *moved) if isinstance(item, bytes)]

    async def _top_up(self, count: int) -> list[bytes]:
        """Up to ``count`` more entries, unless the last pop left the queue empty."""
        return [] if self._drained or count < 1 else await self._take(count)

    def _unblock(self, client_id: int) -> None:
        task = asyncio.create_task(self._send_unblock(client_id))
        self._unblocks.add(task)
        task.add_done_callback(self._unblocks.discard)

    async def _send_unblock(self, client_id: int) -> None:
        with contextlib.suppress(Exception):  # at worst the BLMOVE times out by itself
            await unblock(self._redis, self._node, client_id, self.unblock_guard)

    async def pace(self) -> None:
        """Wait out the stride since the last claim, re-reading it every
        ``PACE_STEP_S``: a live change (``live_policy``), down as well as up, applies
        to the wait under way; shutdown (``stop``) ends it."""
        while (wait_s := self._last_claim + self._stride_s() - time.monotonic()) > 0:
            if self.stop is not None and self.stop.is_set():
                break
            await asyncio.sleep(min(wait_s, PACE_STEP_S))
        self._last_claim = time.monotonic()

    def _stride_s(self) -> float:
        return (self._policy if self.live_policy is None else self.live_policy()).stride_s

    async def _prepare(self) -> None:
        if not self._loaded:  # EVALSHA then never misses (fakeredis drops the link on a miss)
            await self._link.execute("SCRIPT", "LOAD", self.script)
            self._moves = await self._may_move()
            self.acks_by_entries = await self._may_lpos()
            self._loaded = True
        if self._precise and (self._client_id is None
                              or self._node != self._link.node_of(self.queue)):
            self._node, self._client_id = await self._link.connection_id(self.queue)

    async def _may_move(self) -> bool:
        """Whether the user may run LMOVE (a least-privilege user set up before claims
        used it may not; it then claims by script): an LMOVE of the cancelled set onto
        itself, which moves nothing (the set is missing, or refused: WRONGTYPE)."""
        try:
            await self._link.execute("LMOVE", self.cancelled, self.cancelled, "LEFT", "RIGHT")
        except NoPermissionError:
            log.warning("model=%s %s", self.model, LMOVE_REFUSED)
            return False
        except ResponseError:  # WRONGTYPE: LMOVE is allowed
            pass
        return True

    async def _may_lpos(self) -> bool:
        """Whether the user may run LPOS: the worker's one probe (``_probe_lpos``),
        shared by its claimers; a probe that failed (a lost connection) is asked again
        at the next claim."""
        probe = _LPOS_PROBES.get(self._redis)
        if probe is None:
            probe = _LPOS_PROBES[self._redis] = asyncio.ensure_future(self._probe_lpos())
        try:
            return await asyncio.shield(probe)  # (a cancelled claim leaves it running)
        except Exception:
            if _LPOS_PROBES.get(self._redis) is probe:
                del _LPOS_PROBES[self._redis]
            raise

    async def _probe_lpos(self) -> bool:
        """An LPOS on this worker's in-flight list, which changes nothing: refused
        (NOPERM, or a server that does not know LPOS), it is logged once, and every
        batch is acked by its SHA-1, so that no publish meets a refusal (each one would
        count in ``ACL LOG`` and ``rejected_calls``)."""
        try:
            await self._redis.lpos(self.inflight, "")
        except ResponseError as exc:  # (WRONGTYPE: LPOS is allowed)
            if not isinstance(exc, NoPermissionError) and "unknown command" not in str(
                    exc).lower():
                return True
            log.warning("model=%s " + LPOS_REFUSED, self.model, exc)
            return False
        return True

    async def claim(self, count: int | None = None, wait_s: float | None = None,
                    precise: bool = False, paced: bool = False) -> list[bytes]:
        """Return up to ``count`` (default ``max_batch_size``) raw entries, or [] after
        the block timeout (``wait_s``: this claim's wait for a first entry, in place of
        ``block_timeout_s``; a batch window still fills as long as it is open).  With
        ``precise`` (and a connection of its own) that wait ends on time (``CLIENT
        UNBLOCK``), not up to Redis's ``hz`` timer later.  ``paced``: the stride was
        waited out already (by the claim of several sub-queues this one is part of)."""
        if not paced:
            await self.pace()
        size = count or self._policy.max_batch_size
        if wait_s is not None:  # never a blocking pop longer than the socket allows
            wait_s = min(wait_s, self.block_timeout_s)
        if wait_s is None:
            return await self._claiming(self._claim_batch, size)
        return await self._claiming(functools.partial(self._claim_batch, wait_s=wait_s,
                                                      precise=precise), size)

    async def _claiming(self, claim: Callable[[int], Awaitable[list[bytes]]], count: int
                        ) -> list[bytes]:
        """``claim(count)`` once the scripts are loaded, the cancelled flag reset."""
        self.cancels = False
        try:
            await self._prepare()
            return await claim(count)
        except BaseException:  # an error, or a cancel (the pipeline abandoning a claim):
            self._client_id = None  # the connection may have been replaced: ask again
            raise

    async def _claim_batch(self, size: int, wait_s: float | None = None,
                           precise: bool = False) -> list[bytes]:
        items = await self._top_up(size)
        if not items:  # and those behind it
            wake_at_ms = protocol.now_ms() + round(1000 * (wait_s or 0)) if precise else None
            items = await self._block(self.block_timeout_s if wait_s is None else wait_s,
                                      size, wake_at_ms)
            if not items:
                return []
        return await self._windowed(items, size)

    async def _windowed(self, items: list[bytes], size: int) -> list[bytes]:
        """A batch begun with ``items``, topped up through the policy's window (none for
        a full one, or a lone request in a quiet spell)."""
        self._recount(items)
        if self._full(items, size) or not self._worth_waiting(len(items)):
            return items  # full, or a lone request in a quiet spell: not even a top-up
        if self._policy.batch_wait_timeout_s > 0 or not self._policy.allow_small_batch:
            found = len(items)
            await self._fill(items, size, self._window_end_ms(items, size))
            self._gain += GAIN_SMOOTHING * (len(items) - found - self._gain)
        return items

    async def complete(self, items: list[bytes], size: int) -> list[bytes]:
        """A batch begun by ``claim_now`` (a steal from this sub-queue), topped up
        through the window as a claim of its own would be (``allow_small_batch=False``
        holds there too)."""
        if not items:
            return items
        cancels = self.cancels  # as ``claim_now`` found it: the window's claims add to it
        try:
            return await self._claiming(functools.partial(self._windowed, items), size)
        finally:
            self.cancels = self.cancels or cancels

    def _window_end_ms(self, items: list[bytes], size: int) -> int:
        """The policy's window, closed early by the most urgent request's slack.  A
        window that ends within ``WINDOW_MARGIN_MS`` anyway skips reading deadlines."""
        claimed_ms = protocol.now_ms()
        oldest_ms = peek_enqueue_ms(items[0], claimed_ms)
        policy_end_ms = self._policy.window_end_ms(oldest_ms, claimed_ms)
        if self._policy.allow_small_batch and policy_end_ms - claimed_ms <= WINDOW_MARGIN_MS:
            return policy_end_ms
        return self._policy.window_end_ms(oldest_ms, claimed_ms, self._urgent_ms(items, size))

    def _urgent_ms(self, items: list[bytes], size: int) -> int | None:
        """When the batch must run for its most urgent request (of ``items``, and of
        the items held over for it) to be answered in time: its deadline less the pass
        time and margins; None if no deadline can be read."""
        deadlines = [d for d in map(peek_deadline_ms, items) if d is not None]
        if self.held_deadline_ms is not None:
            deadlines.append(self.held_deadline_ms)
        if not deadlines:
            return None
        return self.urgent_by(min(deadlines), size)

    def urgent_by(self, deadline_ms: int, size: int) -> int:
        """When a batch of ``size`` must run to be answered by ``deadline_ms``."""
        pass_ms = self.pass_ms(size) or 0.0
        return deadline_ms - round(WINDOW_SAFETY * pass_ms) - WINDOW_MARGIN_MS

    def _closer(self, window_end_ms: int, new: list[bytes], size: int) -> int:
        """The window after ``new`` joined the batch (an urgent one closes it early; a
        window ending within ``WINDOW_MARGIN_MS`` anyway is left as it is)."""
        if window_end_ms - protocol.now_ms() <= WINDOW_MARGIN_MS:
            return window_end_ms
        urgent_ms = self._urgent_ms(new, size)
        return window_end_ms if urgent_ms is None else min(window_end_ms, urgent_ms)

    def _worth_waiting(self, found: int) -> bool:
        """Skip the window for a lone request while windows have been bringing nothing."""
        policy = self._policy
        if found > 1 or not (policy.adaptive and policy.allow_small_batch):
            return True
        self._lone += 1
        return self._gain >= GAIN_MIN or self._lone % PROBE_EVERY == 0

    def _by_rows(self) -> bool:
        """Whether a window counts its batch in items (a multi-row request's rows),
        not entries: where it may wait long (``allow_small_batch`` off, or a window
        longer than ``WINDOW_MARGIN_MS``), so that a batch full of rows runs at once,
        and one whose claim took few entries (multi-row requests came before) fills
        up to ``max_batch_size`` items."""
        policy = self._policy
        return not policy.allow_small_batch or \
            policy.batch_wait_timeout_s * 1000 > WINDOW_MARGIN_MS

    def _recount(self, items: list[bytes]) -> None:
        self._rows = 0
        self._count(items)

    def _count(self, new: list[bytes]) -> None:
        if self._by_rows():
            self._rows += sum(map(peek_rows, new))

    def _full(self, items: list[bytes], size: int) -> bool:
        return self._rows >= self._policy.max_batch_size if self._by_rows() \
            else len(items) >= size

    def _room(self, items: list[bytes], size: int) -> int:
        """Entries a top-up may still take: up to the claim's count of entries (the
        runner's, fewer while multi-row requests come), at most the items still
        missing; past that count, while items are still missing, as many as the
        batch's own items per entry so far says."""
        if not self._by_rows():
            return size - len(items)
        missing = self._policy.max_batch_size - self._rows
        if len(items) < size:  # the claim's own count first (multi-row: fewer entries)
            return min(missing, size - len(items))
        return max(1, missing * len(items) // self._rows) if self._rows else missing

    def _add(self, items: list[bytes], new: list[bytes]) -> None:
        items.extend(new)
        self._count(new)

    def _open(self, items: list[bytes], size: int) -> bool:
        """Keep filling: not full, and the worker is not stopping."""
        return not self._full(items, size) and not (self.stop is not None
                                                    and self.stop.is_set())

    def _relive(self, items: list[bytes], size: int, window_end_ms: int) -> tuple[int, int]:
        """The batch's size and window after a live change of the policy while its
        window was open (a lower ``max_batch_size``, a shorter window, or
        ``allow_small_batch`` turned on apply to the wait under way)."""
        policy = self._policy if self.live_policy is None else self.live_policy()
        if policy is self._policy:
            return size, window_end_ms
        self._policy = policy
        self._recount(items)  # (items are counted only where the new policy counts them)
        size = min(size, policy.max_batch_size)
        return size, min(window_end_ms, self._window_end_ms(items, size))

    async def _fill(self, items: list[bytes], size: int, window_end_ms: int) -> None:
        if self._precise and self._client_id is not None:
            await self._fill_precise(items, size, window_end_ms)
        else:
            await self._fill_coarse(items, size, window_end_ms)

    async def _fill_precise(self, items: list[bytes], size: int, window_end_ms: int) -> None:
        """Top up until full, or the window ends, or (adaptive) no request came for a
        quiet gap: nobody else is on the way, so the batch goes now."""
        quiet_ms = self._policy.quiet_ms()
        while True:
            size, window_end_ms = self._relive(items, size, window_end_ms)
            if not self._open(items, size):
                return
            now = protocol.now_ms()
            if window_end_ms - now < 1:
                return
            wake_at = min(window_end_ms, now + quiet_ms) if quiet_ms else window_end_ms
            remaining_s = min((window_end_ms - now) / 1000, self.block_timeout_s)
            new = await self._block(remaining_s, self._room(items, size), wake_at)
            if not new:
                if wake_at < window_end_ms:
                    return
                continue
            self._add(items, new)
            window_end_ms = self._closer(window_end_ms, new, size)

    async def _fill_coarse(self, items: list[bytes], size: int, window_end_ms: int) -> None:
        """Top the batch up until it is full or its window closes, without a connection of
        our own: Redis wakes blocked clients on its own timer (``hz``, 100 ms by default),
        so a server-side timeout is only used while it cannot overshoot the window; the
        last stretch is a client-side sleep followed by one non-blocking claim."""
        while True:
            size, window_end_ms = self._relive(items, size, window_end_ms)
            if not self._open(items, size):
                return
            remaining_s = (window_end_ms - protocol.now_ms()) / 1000
            if remaining_s < MIN_BLOCK_S:
                return
            if remaining_s <= SERVER_TIMER_SLACK_S + MIN_BLOCK_S:
                await asyncio.sleep(remaining_s)
                self._add(items, await self._take(self._room(items, size)))
                return
            new = await self._block(min(remaining_s - SERVER_TIMER_SLACK_S,
                                        self.block_timeout_s), self._room(items, size))
            if new:
                self._add(items, new)
                window_end_ms = self._closer(window_end_ms, new, size)
