"""A worker's claims over a model's sub-queues (``Model.sub_queues``, a live knob).

A model of S sub-queues has S queues, each in a hash slot of its own
(``protocol.sub_queue_tag``); one ``Claimer`` per sub-queue claims into that
sub-queue's in-flight list, so that the batch's ack, replies and markers stay in its
slot.  Each worker has a home sub-queue: its rank among the model's live workers (ids
sorted, as its heartbeat last read them: ``rank``) modulo S, so that S workers have S
homes; ``crc32(worker_id) % S`` until its first heartbeat of the sharded model:

- when home was empty at its last look, and before every ``STEAL_EVERY``-th claim,
  it steals first: a non-blocking claim from each other sub-queue in turn, the first
  that holds entries giving the batch; so a sub-queue that no worker calls home is
  served too;
- while the model is busy (a claim found entries in the last ``BUSY_FOR_S``) it never
  blocks: home is claimed without blocking too, and a round that found nothing sleeps
  ``BUSY_BLOCK_S``, twice that after the next empty round, and so on (a blocking
  pop's timeout fires on Redis's ``hz`` timer, up to 100 ms late: a short one would
  hold the worker while entries wait elsewhere); a sleep that would reach
  ``STEAL_BLOCK_S`` ends the busy spell, so light traffic costs a few polls per
  request, not a poll every few milliseconds;
- once idle, it blocks on home for at most ``STEAL_BLOCK_S`` between steals (the
  whole ``block_timeout_s`` with one sub-queue: the wait of each claimer follows
  ``high``, and a busy claim passes its short wait per call, never leaving it behind).

Shrinking S strands nothing: a worker keeps stealing from the sub-queues at and above
the new S (``high``) until, ``DRAIN_GRACE_S`` after the change (producers have moved
by then), a steal finds them all empty.  A model of one sub-queue claims from it
alone, exactly as a plain ``Claimer``: no steal, no extra command.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from redbatch import protocol
from redbatch.worker.claim import Claimer
from redbatch.worker.policy import BatchPolicy

if TYPE_CHECKING:
    from redbatch.worker.decode import Decoded

STEAL_EVERY: Final = 4  # while home has entries, one claim in this many steals first
STEAL_BLOCK_S: Final = 0.1  # a sharded model's blocking claim on home waits at most this
BUSY_BLOCK_S: Final = 0.002  # while claims keep finding entries: a poll's gap
BUSY_FOR_S: Final = 0.5  # a claim that found entries keeps the short wait this long
DRAIN_GRACE_S: Final = 5.0  # sub-queues above a shrunk S are drained at least this long

# makes the claimer of one sub-queue: (its tag, its blocking wait in seconds)
MakeClaimer = Callable[[str, float], Claimer]


def _cold(size: int) -> float | None:
    return None


class ShardClaimer:
    """The claims of one worker over one model's sub-queues (see the module doc); the
    runner reads the sub-queue of the last claim in ``source``."""

    def __init__(self, make: MakeClaimer, model: str, worker_id: str, count: int,
                 block_timeout_s: float) -> None:
        self.model = model
        self._make = make
        self._block_timeout_s = block_timeout_s
        self._worker_id = worker_id
        self._hash = zlib.crc32(worker_id.encode())
        self._rank: int | None = None  # among the model's live workers (``rank``)
        self._subs: dict[int, Claimer] = {}
        self._pass_ms: Callable[[int], float | None] = _cold
        self._stop: asyncio.Event | None = None
        self._policy: BatchPolicy | None = None
        self.count = count  # the model's sub-queues now
        self.high = count  # sub-queues 0..high-1 are claimed from (count..high-1: draining)
        self.seen = count  # the most sub-queues seen: the reaper looks at that many
        self._shrunk_at = 0.0
        self._claims = 0
        self._turn = 0
        self._busy_until = 0.0  # a claim found entries lately: the model is busy till then
        self._gap_s = BUSY_BLOCK_S  # a busy poll's sleep after an empty round (doubles)
        self.source = self.sub(self.home)  # the sub-queue of the last claim

    @property
    def home(self) -> int:
        return (self._hash if self._rank is None else self._rank) % self.count

    def rank(self, live_ids: Sequence[bytes] | None) -> None:
        """The ids of the model's live workers, raw as a heartbeat read them (None: not
        read, the model has one sub-queue): home is this worker's rank among them,
        sorted bytewise; the hashed home while unread or without this worker (an empty
        list: more live workers than ``RANKED_WORKERS_MAX``, none read)."""
        if live_ids is None:
            return
        ranked, mine = sorted(live_ids), self._worker_id.encode()
        self._rank = ranked.index(mine) if mine in ranked else None

    def _wait_s(self) -> float:
        return self._block_timeout_s if self.high == 1 else min(self._block_timeout_s,
                                                                 STEAL_BLOCK_S)

    def sub(self, index: int) -> Claimer:
        """Sub-queue ``index``'s claimer (made at its first use)."""
        claimer = self._subs.get(index)
        if claimer is None:
            claimer = self._make(protocol.sub_queue_tag(self.model, index), self._wait_s())
            claimer.pass_ms, claimer.stop = self._pass_ms, self._stop
            if self._policy is not None:
                claimer.set_policy(self._policy)
            self._subs[index] = claimer
        return claimer

    # --- what the runner sets and reads, for every sub-queue ----------------------
    @property
    def pass_ms(self) -> Callable[[int], float | None]:
        return self._pass_ms

    @pass_ms.setter
    def pass_ms(self, estimate: Callable[[int], float | None]) -> None:
        self._pass_ms = estimate
        for claimer in self._subs.values():
            claimer.pass_ms = estimate

    @property
    def stop(self) -> asyncio.Event | None:
        return self._stop

    @stop.setter
    def stop(self, event: asyncio.Event | None) -> None:
        self._stop = event
        for claimer in self._subs.values():
            claimer.stop = event

    def set_policy(self, policy: BatchPolicy) -> None:
        self._policy = policy
        for claimer in self._subs.values():
            claimer.set_policy(policy)

    @property
    def cancels(self) -> bool:
        return self.source.cancels

    @property
    def skipped(self) -> int:
        return sum(claimer.skipped for claimer in self._subs.values())

    async def drop_cancelled(self, decoded: Decoded) -> None:
        await self.source.drop_cancelled(decoded)

    # --- live changes ------------------------------------------------------------
    def resize(self, count: int) -> None:
        """The model's sub-queues are now ``count`` (a live change): a new home; the
        sub-queues from ``count`` up are drained (``DRAIN_GRACE_S``)."""
        if count < self.count:
            self._shrunk_at = time.monotonic()
        self.count = count
        self.high = max(self.high, count)
        self.seen = max(self.seen, count)
        self._retime()

    def draining(self, count: int) -> int | None:
        """The sub-queues this worker still claims from when the model has ``count``
        (its drain range, or the count it has not resized from yet), if more; else
        None."""
        held = max(self.high, self.count)
        return held if held > count else None

    def reopen(self, index: int) -> None:
        """Entries went back into sub-queue ``index`` (a reap, or this worker returning
        its own batch): one at or above the count is drained again, for the grace."""
        if index < self.count:
            return
        self._shrunk_at = time.monotonic()
        self.high = max(self.high, index + 1)
        self.seen = max(self.seen, index + 1)
        self._retime()

    def _retime(self) -> None:
        """Every sub-queue's blocking wait, after ``high`` changed (``_wait_s``)."""
        for claimer in self._subs.values():
            claimer.block_timeout_s = self._wait_s()

    # --- claims ------------------------------------------------------------------
    async def claim(self, count: int, wait_s: float | None = None) -> list[bytes]:
        """Up to ``count`` raw entries (see the module doc), [] after the wait.  The
        sub-queues' claimers share one connection: a claim that fails or is cancelled
        (the connection may be replaced) makes each ask its id again (``CLIENT
        UNBLOCK`` of a window must reach the new one).  ``wait_s``: this claim's wait
        for a first entry, in place of the block timeout, ended on time (one sub-queue
        only)."""
        try:
            if self.high == 1:  # one sub-queue: the plain claim
                self.source = self.sub(0)
                return await self.source.claim(count, wait_s, precise=wait_s is not None)
            return await self._claim_sharded(count)
        except BaseException:
            self._reconnected()
            raise

    async def claim_from(self, source: Claimer, count: int, wait_s: float) -> list[bytes]:
        """Up to ``count`` entries from ``source`` alone (the sub-queue that items held
        over came from: their held list and markers are in its slot), waiting at most
        ``wait_s`` for a first one, ended on time; without a connection of its own
        (``Claimer.precise``) it cannot end on time: no wait, what is queued now."""
        self.source = source
        try:
            if not source.precise:
                return await source.claim_now(count)
            return await source.claim(count, wait_s, precise=True)
        except BaseException:
            self._reconnected()
            raise

    def _reconnected(self) -> None:
        for claimer in self._subs.values():
            claimer.reconnected()

    async def _claim_sharded(self, count: int) -> list[bytes]:
        """One claim over the sub-queues: one stride (the home's clock), whichever it
        takes from, and a stolen or polled batch topped up through its window."""
        self._claims += 1
        home = self.sub(self.home)
        await home.pace()
        busy = time.monotonic() < self._busy_until
        if (busy or home.drained or self._claims % STEAL_EVERY == 0) and \
                (items := await self._steal(count)):
            return items
        if busy and home.drained:
            return await self._poll(home, count)
        wait_s = BUSY_BLOCK_S if busy else None  # this claim's wait: the claimer keeps its own
        return self._took(home, await home.claim(count, wait_s, paced=True)) or \
            await self._steal(count)

    async def _poll(self, home: Claimer, count: int) -> list[bytes]:
        """While the model is busy: home without blocking, then a sleep if it was empty
        (a blocking pop's timeout fires only on Redis's ``hz`` timer, up to 100 ms
        late: no use for a wait of milliseconds).  The sleep doubles with each empty
        round, from ``BUSY_BLOCK_S``; once it would reach ``STEAL_BLOCK_S`` the model
        is idle (light traffic polls a few rounds per request, not for ``BUSY_FOR_S``)."""
        items = await home.complete(self._took(home, await home.claim_now(count)), count)
        if not items:
            await asyncio.sleep(self._gap_s)
            self._gap_s *= 2
            if self._gap_s >= STEAL_BLOCK_S:
                self._busy_until = 0.0
        return items

    def _took(self, claimer: Claimer, items: list[bytes]) -> list[bytes]:
        """``items`` claimed by ``claimer``: the batch's source, and the model busy."""
        if items:
            self.source, self._busy_until = claimer, time.monotonic() + BUSY_FOR_S
            self._gap_s = BUSY_BLOCK_S
        return items

    async def _steal(self, count: int) -> list[bytes]:
        """A non-blocking claim from the other sub-queues, in turn, until one has
        entries; [] when none has (which ends a drain past its grace)."""
        others = [index for index in range(self.high) if index != self.home]
        self._turn += 1
        for k in range(len(others)):
            claimer = self.sub(others[(self._turn + k) % len(others)])
            if items := self._took(claimer, await claimer.claim_now(count)):
                return await claimer.complete(items, count)
        if self.high > self.count and time.monotonic() - self._shrunk_at > DRAIN_GRACE_S:
            self.high = self.count  # every sub-queue above the count is empty: drained
            self._retime()
        return []

    def describe(self) -> dict[str, Any]:
        """For logs and tests: the count, home and drain range."""
        return {"sub_queues": self.count, "home": self.home, "high": self.high}
