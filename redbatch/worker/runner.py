"""One model's batch loop: claim -> decode -> forward -> encode -> publish."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis

from redbatch import defaults, lua, protocol
from redbatch.errors import RedbatchError
from redbatch.lean import LeanLink
from redbatch.protocol import Reply, Request, Timings
from redbatch.redis_conn import check_cancelled, is_cluster
from redbatch.worker import hold, suspects
from redbatch.worker.claim import Claimer
from redbatch.worker.claim_levels import LevelClaimer
from redbatch.worker.deadlines import (
    DROP_FACTOR,
    REPLY_MARGIN_MS,
    drop_late,
    fixed_plan,
    order_by_deadline,
)
from redbatch.worker.decode import Decoded, Item, decode_batch
from redbatch.worker.forward import Forwarder, run_into
from redbatch.worker.hold import Held
from redbatch.worker.model import BatchFn, Model
from redbatch.worker.reaper import Reaper
from redbatch.worker.replies import (
    DEFAULT_DEAD_LETTERS,
    DeadLetters,
    Outgoing,
    error_reply,
    outgoing,
    pack_reply,
    publish_args,
    refused_entries,
)
from redbatch.worker.shards import ShardClaimer
from redbatch.worker.stats import WorkerStats

log = logging.getLogger("redbatch.worker")
T = TypeVar("T")


class LeaseLost(RedbatchError):
    """The worker's in-flight list was taken over: stop, and return what is left."""


PREFETCH_MAX_MS = 50.0  # prefetch the next batch only while recent passes were shorter
ROWS_SMOOTHING = 0.5  # weight of the last claim in the rows-per-entry estimate
DROP_ROUNDS = 8  # plans of a batch that hopeless requests are dropped from, at most


@dataclass(slots=True)
class Claimed:
    """A claimed batch, decoded: ``claimed`` entries moved to the in-flight list, which
    the ack checks by their SHA-1 (``digest``) or, a batch of few or large entries, by
    the entries themselves (``raws``, kept only then; ``digest`` is then made only if
    needed)."""

    claimed: int
    decoded: Decoded
    claimed_ms: int
    digest: str
    source: Claimer  # the sub-queue it came from: its in-flight list, its slot's keys
    late: int = 0  # answered deadline_exceeded uncomputed: too little time for a pass
    # holding (``hold``): the entries the batch before held, which this one runs (how
    # many, their SHA-1), and the positions (1-based) of those this one holds over
    released: tuple[int, str] = (0, "")
    hold: list[int] = field(default_factory=list)
    # the claimed entries, in claim order, when the ack goes by them (``acks_by_entries``)
    raws: list[bytes] = field(default_factory=list)

    @property
    def ack_check(self) -> list[bytes | str]:
        """PUBLISH's ARGV[3..]: what the ack checks the in-flight head against (the
        entries themselves for a few or large ones, which Redis compares in place; else
        their SHA-1)."""
        if self.raws:
            return [protocol.ACK_BY_ENTRIES, *self.raws]
        return [self.digest]

    @property
    def sha1(self) -> str:
        """The entries' SHA-1 (PUBLISH_HOLD's check), made now if the ack went by them."""
        if self.raws and not self.digest:
            self.digest = entries_digest(self.raws)
        return self.digest

    @property
    def size(self) -> int:
        """The batch's size in items: entries, counting each row of a multi-row one."""
        return self.claimed + sum(p.request.rows - 1 for p in self.decoded.packs)


@dataclass(slots=True)
class Computed:
    outs: list[Outgoing]
    fwd_ms: float
    busy_s: float  # forward and encode
    failed: int  # items the model failed on
    passes: list[int]  # items in each forward pass
    padding: tuple[int, int] = (0, 0)  # padded and real lengths (variable-length models)
    fwd_cpu_ms: float = 0.0  # CPU time of the threads that ran the sync passes


class BusyClock:
    """Time during which at least one of overlapping batches was computing: each batch,
    as its compute ends, gets the share since the previous one ended, so that the
    shares add up to the union (the worker's items/s, not ``N`` times lower)."""

    def __init__(self) -> None:
        self._active = 0
        self._since = self._closed = self._taken = 0.0

    def start(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def end(self) -> float:
        """This batch's share of the busy time (seconds)."""
        total = self._closed + time.perf_counter() - self._since
        self._active -= 1
        if self._active == 0:
            self._closed = total
        share, self._taken = total - self._taken, total
        return share


async def _settle(task: asyncio.Task[Any] | None, *, abandon: bool = False) -> None:
    """Wait for ``task`` and raise its error; with ``abandon``, cancel it if it still
    runs and swallow its outcome (the error being handled is already on its way)."""
    if task is None:
        return
    if not abandon:
        await task
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class BatchRunner:
    """Serves one model for one worker: forms batches and answers every request once."""

    def __init__(self, redis: aioredis.Redis, model: Model, fn: BatchFn, worker_id: str,
                 executor: Executor, block_timeout_s: float,
                 max_attempts: int = defaults.MAX_ATTEMPTS,
                 blocking: aioredis.Redis | None = None, device: str = "cpu",
                 dead_letters: DeadLetters = DEFAULT_DEAD_LETTERS) -> None:
        self._redis = redis
        self._same_slot = is_cluster(redis)  # reply lists must be in the model's slot
        self._dead_letters = dead_letters
        self._crashing = protocol.crashing_key(model.name, worker_id)
        self.model = model
        self.fn, self.executor = fn, executor  # (a streaming runner steps them itself)
        self._worker_id = worker_id
        self.stats = WorkerStats(model.name, model.policy.max_batch_size)
        self._forwarder = Forwarder(model, fn, executor, device, self.stats.sizer)
        # one Forwarder per batch in flight (``max_concurrent_batches``): each counts
        # its own batch's passes and padding
        self._limit = model.policy.max_concurrent_batches  # read at start only
        self._forwarders = [self._forwarder] + [
            Forwarder(model, fn, executor, device, self.stats.sizer)
            for _ in range(self._limit - 1)]
        self._in_flight = 0  # batches between claim and publish (many-batch mode)
        self._clock = BusyClock()
        # a sync model's passes share the one forward thread: its batches compute one
        # at a time (their forward times stay the pass's own), overlapping the others'
        # claims and replies; an async model's calls overlap
        self._computing: asyncio.Lock | contextlib.nullcontext[None] = (
            contextlib.nullcontext() if model.is_async else asyncio.Lock())
        self._link = LeanLink(redis)
        claims = LeanLink(blocking or redis)  # one connection for every sub-queue's claims
        self.claimer = ShardClaimer(
            lambda tag, wait_s: claimer_for(redis, model, worker_id, wait_s, blocking,
                                            tag=tag, link=claims),
            model.name, worker_id, model.sub_queues, block_timeout_s)
        self.claimer.pass_ms = self.stats.pass_times.estimate_ms  # the window's slack
        self.reaper = Reaper(redis, model.name, max_attempts, self.stats, dead_letters,
                             model.priorities, reaper_id=worker_id,
                             same_slot=self._same_slot)
        self.reaper.tags = self._tags  # every sub-queue's in-flight list
        self.reaper.requeued = self.claimer.reopen  # entries put back above the count
        self.reaper.sub_queue_count = lambda: self.claimer.count
        self._unacked = False
        self._claim_count = model.policy.max_batch_size  # entries per claim
        self._rows_per_entry = 1.0  # smoothed over recent claims
        self._busy = False  # the last claim came back full
        self._steady = 0  # entries of the last claim (several in a row: busy too)
        self._held: Held | None = None  # items held over for the next batch (``hold``)
        # when (monotonic) the loop began to wait on a claim with no batch of its own in
        # hand (``stuck_claiming``); None while it holds or runs one
        self._idle_claim_since: float | None = None
        self._shrink_seen: bytes | None = None  # the last shrink notice drained by
        # every live worker of the model knows held lists, as the last heartbeat read
        # (``heartbeat.Beat.held_aware``): none before the first
        self.peers_hold_aware = False
        # the policy the claimer has: a live change of ``model.policy`` (its forward
        # passes and published meta follow at once) reaches it at the next claim
        self._claimer_policy = model.policy

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``; after an error, the next call first returns what this
        worker still held to the queue's front.  One batch in flight at a time
        (``_serve_one``), or up to the policy's ``max_concurrent_batches``
        (``_serve_many``; read when the worker starts).  Batches are published in claim
        order either way: each ack trims the head of the in-flight list."""
        await self._return_unacked()
        self._unacked, self._held = True, None  # (what was held went back with the rest)
        self.claimer.stop = stop  # a window still filling at shutdown closes
        if self._limit > 1:
            await self._serve_many(stop)
        else:
            await self._serve_one(stop)
        self._unacked = False  # only after a clean stop: everything claimed was answered

    async def _serve_one(self, stop: asyncio.Event) -> None:
        """One batch at a time: claim -> decode (``_take``), forward -> encode
        (``_compute``), publish (``_publish_batch``).  While recent passes were short
        (under ``PREFETCH_MAX_MS``), the next batch is claimed and decoded during this
        pass, and this one is published during the next, so the model does not wait on
        Redis; a slow model claims only when it is free, so that an idle worker can take
        the next batch instead.  Batches are published in claim order (each ack trims
        the head of the in-flight list).  Items held over for the next batch (``hold``)
        run in one more batch at a stop."""
        claiming: asyncio.Task[Claimed | None] | None = None
        publishing: asyncio.Task[None] | None = None
        try:
            while claiming is not None or not stop.is_set() or self._held is not None:
                check_cancelled()
                if publishing is not None and publishing.done():
                    await _settle(publishing)  # its error, if any, now: not at the next batch
                    publishing = None
                prefetched = claiming is not None  # (claimed during the pass before)
                batch = await self._claimed(claiming or self._take(),
                                            publishing is None and self._held is None)
                early = self._claims_early()
                claiming = self._prefetch() if early and not stop.is_set() else None
                if claiming is not None and self._forwarder.inline:
                    await asyncio.sleep(0)  # the claim goes out before the pass holds us
                if batch is not None:
                    if prefetched:  # judged when claimed, a pass ago
                        self._recheck_deadlines(batch)
                    computed = await self._compute(batch)
                    await _settle(publishing)  # done by now, or waited for: claim order
                    publishing = asyncio.create_task(self._publish_batch(batch, computed))
                if not early and not stop.is_set():
                    claiming = self._prefetch()
            await _settle(publishing)
        finally:
            for task in (claiming, publishing):
                await _settle(task, abandon=True)

    async def _serve_many(self, stop: asyncio.Event) -> None:
        """Up to ``max_concurrent_batches`` batches between claim and publish: one loop
        claims and decodes (one claim at a time), each batch then runs in a task of its
        own (``_run_batch``): an async model's forward calls overlap on the loop, a
        sync model's pass overlaps the claims and replies of the others.  A batch
        holding suspects runs alone (the others drained first), so that a crash
        blames exactly the suspect it names."""
        slots = asyncio.Semaphore(self._limit)
        tasks: list[asyncio.Task[None]] = []
        try:
            while not stop.is_set():
                check_cancelled()
                await slots.acquire()
                tasks = _check_done(tasks)
                batch = None if stop.is_set() else await self._claimed(self._take(),
                                                                       not tasks)
                if batch is None:
                    slots.release()
                    continue
                tasks = await self._launch(batch, tasks, slots)
            await asyncio.gather(*tasks)  # a graceful stop: every batch finishes
        finally:
            for task in tasks:
                await _settle(task, abandon=True)

    async def _claimed(self, claim: Awaitable[T], idle: bool) -> T:
        """``claim``'s batch; ``idle``: this loop holds no batch meanwhile (a wait that
        ``stuck_claiming`` may end at a stop)."""
        self._idle_claim_since = time.monotonic() if idle else None
        try:
            return await claim
        finally:
            self._idle_claim_since = None

    def stuck_claiming(self, after_s: float, stopped_at: float) -> bool:
        """Whether the loop has waited on a claim with no batch of its own for longer
        than ``after_s`` since the stop came (``stopped_at``, monotonic): a stopping
        claim closes its window within its pop's timeout, so a stop may cancel it then
        (a stalled Redis held the pop; what the claim took is in this worker's
        in-flight list, which its leave, or a reaper once its lease expires, puts back
        in the queue).  A window open before the stop runs what it holds."""
        since = self._idle_claim_since
        return since is not None and time.monotonic() - max(since, stopped_at) > after_s

    async def _launch(self, batch: Claimed, tasks: list[asyncio.Task[None]],
                      slots: asyncio.Semaphore) -> list[asyncio.Task[None]]:
        """Start ``batch``'s task, published after the one before it; a batch with
        suspects waits until the others are done, and the next waits for it."""
        suspect = any(item.request.suspect for item in batch.decoded.items)
        if suspect:
            await asyncio.gather(*tasks)
            tasks = []
        task = asyncio.create_task(self._run_batch(batch, tasks[-1] if tasks else None,
                                                   slots))
        if suspect:
            await asyncio.gather(task)
            return []
        return [*tasks, task]

    async def _run_batch(self, batch: Claimed, previous: asyncio.Task[None] | None,
                         slots: asyncio.Semaphore) -> None:
        """Forward and encode ``batch`` on a free Forwarder, then publish it once the
        batch claimed before it was published (claim order: the ack trims the
        in-flight head); its slot frees once it is published, or failed."""
        self._in_flight += 1
        try:
            computed = await self._compute_one(batch)
            if previous is not None:
                await asyncio.wait([previous])  # (a cancel of this task leaves it be)
                previous.result()  # its error: this batch cannot be acked either
            await self._publish_batch(batch, computed)
        finally:
            self._in_flight -= 1
            slots.release()

    async def _return_unacked(self) -> None:
        """After a failure, requeue (in order) whatever this worker still holds."""
        if self._unacked and await self.reaper.reap(self._worker_id, force=True) == -2:
            raise LeaseLost("the in-flight list changed while it was being returned; "
                            "trying again")

    def _claims_early(self) -> bool:
        """Claim the next batch before this one's pass, or after its replies?  Before,
        beside a pass in the thread, or while the queue is busy (the last claim came
        back full).  An idle queue's claim ends in a blocking pop, which, beside an
        inline pass, would go out ahead of this batch's replies: then after them."""
        return not self._forwarder.inline or self._busy

    def _prefetch(self) -> asyncio.Task[Claimed | None] | None:
        longest = self._forwarder.pass_ms
        if longest is None or longest >= PREFETCH_MAX_MS:
            return None
        return asyncio.create_task(self._take())

    async def _take(self) -> Claimed | None:
        """Claim and decode the next batch (None on an idle timeout); the items the
        batch before held over join it, and it may hold some over in turn (``hold``)."""
        if self.model.policy is not self._claimer_policy:
            self._use_policy()
        if self.model.sub_queues != self.claimer.count:
            self._resize()
        held, self._held = self._held, None
        raws = await self._claim(held)
        self._busy = len(raws) >= self._claim_count
        steady, self._steady = min(len(raws), self._steady), len(raws)
        if not raws and held is None:
            return None
        batch = self._decoded(raws, held)
        await suspects.verify(self._redis, batch.source.tag,
                              (item.request for item in batch.decoded.items))
        if batch.source.cancels:  # callers went away: skip their requests
            await batch.source.drop_cancelled(batch.decoded)
        if raws:
            self._claim_count = self._next_claim_count(batch)
        self._schedule(batch)
        if len(raws) >= hold.STEADY_ENTRIES and (self._busy or steady >= hold.STEADY_ENTRIES):
            self._hold(batch, raws)  # (a lone request never: not even after packs)
        return batch

    async def _claim(self, held: Held | None) -> list[bytes]:
        """The next claim's entries.  While items are held, it claims from the
        sub-queue they came from (their held list and markers are in its slot), its wait
        for a first entry the batch window (they run then, with whatever came); none at
        a stop, nor while the claimer reads several sub-queues (a live change, or a
        reap that reopened one: the held items run alone first)."""
        if held is None:
            return await self.claimer.claim(self._claim_count)
        if self._stopping() or self.claimer.high != 1:
            return []
        source = held.source  # its window (and its wait) closes in time for them too
        source.held_deadline_ms = min(item.request.deadline_ms for item in held.items)
        urgent_s = (source.urgent_by(source.held_deadline_ms, self._claim_count)
                    - protocol.now_ms()) / 1000
        wait_s = min(max(self.model.policy.batch_wait_timeout_s, hold.MIN_WAIT_S),
                     max(urgent_s, 0.0))
        try:
            return await self.claimer.claim_from(source, self._claim_count, wait_s)
        finally:
            source.held_deadline_ms = None

    def _decoded(self, raws: list[bytes], held: Held | None) -> Claimed:
        """The claimed batch, decoded, with the items ``held`` over by the one before."""
        claimed_ms = protocol.now_ms()
        source = self.claimer.source if raws or held is None else held.source
        assert held is None or source is held.source, "held items cross sub-queues"
        by_entries = source.acks_by_entries and acks_by_entries(raws)
        digest = "" if by_entries else entries_digest(raws)
        decoded = decode_batch(raws, self.model, claimed_ms, self._same_slot, source.tag)
        batch = Claimed(len(raws), decoded, claimed_ms, digest, source,
                        raws=raws if by_entries else [])
        if held is not None:
            hold.merge(decoded, held, claimed_ms)
            batch.released = (len(held.raws), held.digest)
        return batch

    def _stopping(self) -> bool:
        return self.claimer.stop is not None and self.claimer.stop.is_set()

    def _may_hold(self) -> bool:
        """Holding applies to an ``auto_batch`` model with length buckets and
        ``hold_buckets`` on (live knobs), served one batch at a time from one sub-queue
        (no other one being drained), until the worker stops, while every live worker
        of the model knows held lists (``peers_hold_aware``)."""
        policy = self.model.policy
        return (policy.auto_batch and policy.hold_buckets and self._limit == 1
                and self.peers_hold_aware
                and self.model.length_spec is not None and self.claimer.high == 1
                and not self._stopping())

    def _hold(self, batch: Claimed, raws: list[bytes]) -> None:
        """Hold over the items of the batch's under-filled buckets that may wait a batch
        longer (``hold.pick``): out of this batch, into the next; its PUBLISH moves
        their entries to the held list."""
        if not self._may_hold():  # (most models: no pass-time estimate read)
            return
        pass_ms = self.stats.pass_times.estimate_ms(self.model.policy.max_batch_size)
        if pass_ms is None:
            return
        cap, fwd = self.model.policy.max_batch_size, self._forwarder
        groups = hold.groups(batch.decoded.items, fwd.bucket)
        levels = self.model.priority_levels > 1
        chosen = hold.pick(groups, lambda bucket: fwd.sizer.target(bucket, cap),
                           protocol.now_ms(), self._hold_slack_ms(groups, pass_ms),
                           self.model.default_priority if levels else 0)
        if chosen:
            hold.take_out(batch.decoded, chosen)
            batch.hold = [item.entry + 1 for item in chosen]
            self._held = Held(chosen, [raws[item.entry] for item in chosen], batch.source)

    def _hold_slack_ms(self, groups: hold.Groups, fallback_ms: float) -> float:
        """``hold.need_ms`` for a batch of ``groups``: each bucket's pass as the
        autosizer measured it at its target size (else ``fallback_ms``)."""
        policy, sizer = self.model.policy, self._forwarder.sizer
        passes = [hold.pass_ms(sizer, bucket, sizer.target(bucket, policy.max_batch_size),
                               fallback_ms) for bucket in groups]
        return hold.need_ms(passes, policy.batch_wait_timeout_s, policy.stride_s)

    def _tags(self) -> list[str]:
        """The sub-queues whose in-flight lists a reap reads: every one this worker
        has seen, and the count just applied (before its next claim resizes)."""
        return protocol.sub_queue_tags(self.model.name, max(self.claimer.seen,
                                                            self.model.sub_queues))

    def published(self) -> dict[str, Any]:
        """What this runner adds to the worker's published info: the sub-queues it may
        hold entries of, once more than one (another worker's reaper reads that many)."""
        seen = max(self.claimer.seen, self.model.sub_queues)
        return {protocol.F_SUB_QUEUES_SEEN: seen} if seen > 1 else {}

    def notice_shrink(self, notice: bytes | None) -> None:
        """Drain the sub-queues up to the S a shrink notice names, once per notice
        (``sub_queues_shrunk_key``: a producer may have pushed there while this worker
        never saw that S)."""
        if notice is None or notice == self._shrink_seen:
            return
        self._shrink_seen = notice
        with contextlib.suppress(ValueError):
            count = int(notice.split(b":")[0])
            if self.model.sub_queues < count <= protocol.MAX_SUB_QUEUES:
                self.claimer.reopen(count - 1)
                log.info("model=%s drains sub-queues up to %d (lowered from it lately)",
                         self.model.name, count)

    def _resize(self) -> None:
        """The model's ``sub_queues`` changed (live): claim over the new count."""
        before = self.claimer.describe()
        self.claimer.resize(self.model.sub_queues)
        log.info("model=%s sub-queues %s -> %s", self.model.name, before,
                 self.claimer.describe())

    def _use_policy(self) -> None:
        policy = self._claimer_policy = self.model.policy
        if not policy.auto_batch:  # off (or turned off live): status shows no sizes
            self.stats.sizer.forget()
        self.claimer.set_policy(policy)
        self.stats.max_batch_size = policy.max_batch_size
        self._claim_count = policy.max_batch_size
        self._rows_per_entry = 1.0

    def _schedule(self, batch: Claimed) -> None:
        """Earliest deadline first over the batch's passes; a request that cannot
        finish before its deadline, given the measured pass time, is answered now."""
        size = self.model.policy.max_batch_size
        order_by_deadline(batch.decoded, 1 if self._forwarder.several_passes else size)
        batch.late = self._drop_late(batch.decoded)

    def _recheck_deadlines(self, batch: Claimed) -> None:
        """Just before the pass, answer ``deadline_exceeded`` the requests that can no
        longer finish in time: a batch claimed during another's pass (or waiting for a
        free forwarder) was judged when claimed, a pass ago."""
        batch.late += self._drop_late(batch.decoded)

    def _drop_late(self, decoded: Decoded) -> int:
        """``drop_infeasible`` over the passes the forwarder would cut now (buckets,
        shapes, costs, learned sizes); skipped while even one pass per item would end
        in time (the usual case: no plan is made)."""
        items, now_ms = decoded.items, protocol.now_ms()
        worst_ms = self.stats.pass_times.estimate_ms(self.model.policy.max_batch_size)
        if not items or worst_ms is None or min(
                item.request.deadline_ms for item in items) >= now_ms + DROP_FACTOR * (
                worst_ms * len(items)) + REPLY_MARGIN_MS:
            return 0
        return drop_late(decoded, now_ms, self._plan, self.stats.pass_times.estimate_ms,
                         DROP_ROUNDS)

    def _plan(self, items: list[Item]) -> list[int | None]:
        """The pass of each item, as the forwarder would cut them now."""
        try:
            return self._forwarder.plan([item.value for item in items])
        except Exception:  # (the pass itself will say what is wrong)
            return fixed_plan(len(items), self.model.policy.max_batch_size)

    def _next_claim_count(self, batch: Claimed) -> int:
        """Entries to claim next so that about ``max_batch_size`` items come: fewer
        while the queue holds multi-row requests.  Rows per entry are smoothed, so
        that one batch of single requests between packs does not bring the next claim
        back to ``max_batch_size`` packs at once."""
        size = self.model.policy.max_batch_size
        rows = self._rows_per_entry + ROWS_SMOOTHING * (batch.size / batch.claimed
                                                        - self._rows_per_entry)
        self._rows_per_entry = rows if rows > 1.05 else 1.0  # back to single requests
        return max(1, min(size, int(size / self._rows_per_entry)))

    async def _compute_one(self, batch: Claimed) -> Computed:
        """``_compute`` on a free Forwarder, beside the other batches in flight; the
        deadlines are checked again first (a sync model's batch may have waited for
        the ones claimed before it)."""
        async with self._computing:
            self._recheck_deadlines(batch)
            forwarder = self._forwarders.pop()
            self._clock.start()
            try:
                computed = await self._compute(batch, forwarder)
            finally:
                computed_busy_s = self._clock.end()
                self._forwarders.append(forwarder)
            computed.busy_s = computed_busy_s
            return computed

    async def _compute(self, batch: Claimed, forwarder: Forwarder | None = None
                       ) -> Computed:
        """Forward (on ``forwarder``, by default the first) and encode: the replies of
        one batch."""
        fwd = forwarder or self._forwarder
        started = time.perf_counter()
        results = await self._forward(batch.decoded.items, fwd)
        fwd_ms = (time.perf_counter() - started) * 1000
        outs = self.encode(batch.decoded, results, batch.claimed_ms, fwd_ms, batch.source.tag)
        return Computed(outs, fwd_ms, time.perf_counter() - started,
                        sum(isinstance(r, RedbatchError) for r in results),
                        fwd.take_passes(), fwd.take_padding(), fwd.take_cpu_ms())

    async def _forward(self, items: list[Item], fwd: Forwarder) -> list[Any]:
        if not any(item.request.suspect for item in items):
            return await fwd.run_batches([item.value for item in items])
        return await self._forward_suspects(items, fwd)

    async def _forward_suspects(self, items: list[Item], fwd: Forwarder) -> list[Any]:
        """A batch holding entries of a batch that crashed a worker: each suspect entry
        (requeued at the queue's front: they come first) in passes of its own, named in
        this worker's crashing key while they run, so that a crash blames that entry
        alone (the reaper reads the key); then the others together."""
        groups: dict[int, list[int]] = {}  # suspect entry -> its items (a pack has several)
        for i, item in enumerate(items):
            if item.request.suspect:
                groups.setdefault(id(item.request), []).append(i)
        results: list[Any] = [None] * len(items)
        values = [item.value for item in items]
        for indices in groups.values():
            await self._redis.set(self._crashing, items[indices[0]].request.id,
                                  ex=protocol.CRASHING_TTL_S)
            try:
                await run_into(results, values, indices, fwd.run_batches)
            finally:
                await self._redis.delete(self._crashing)
        await run_into(results, values, [i for i, item in enumerate(items)
                                         if not item.request.suspect], fwd.run_batches)
        return results

    async def _publish_batch(self, batch: Claimed, computed: Computed) -> None:
        published = time.perf_counter()
        await self.publish(computed.outs, batch, batch.decoded.dead)
        reply_ms = (time.perf_counter() - published) * 1000
        self._log_batch(batch, computed, reply_ms)

    def encode(self, decoded: Decoded, results: list[Any], claimed_ms: int, fwd_ms: float,
               tag: str | None = None) -> list[Outgoing]:
        """The batch's replies; ``tag``: the sub-queue it came from (its markers')."""
        name, n = self.model.name, min(len(decoded.items), self.model.policy.max_batch_size)
        outs = [outgoing(name, req, error_reply(req, exc, self._timings(req, claimed_ms, 0, 0)),
                         fmt, tag) for req, fmt, exc in decoded.early]
        for item, result in zip(decoded.items, results, strict=True):
            if item.pack is not None:
                item.pack.outputs[item.row] = result
                continue
            timings = self._timings(item.request, claimed_ms, n, fwd_ms)
            reply = error_reply(item.request, result, timings) if isinstance(
                result, RedbatchError) else Reply(item.request.id, True, result, timings=timings)
            outs.append(outgoing(name, item.request, reply, item.fmt, tag))
        for pack in decoded.packs:
            reply = pack_reply(pack, self._timings(pack.request, claimed_ms, n, fwd_ms))
            outs.append(outgoing(name, pack.request, reply, pack.fmt, tag))
        return outs

    def _timings(self, request: Request, claimed_ms: int, n: int, fwd_ms: float) -> Timings:
        return Timings(protocol.queue_wait_ms(claimed_ms, request.enqueue_ms), n, fwd_ms,
                       self._worker_id)

    async def publish(self, outs: list[Outgoing], batch: Claimed, dead: list[bytes]) -> None:
        """Replies (each at most once), dead letters and the ack: one atomic script.
        Raises ``LeaseLost`` when the in-flight list no longer starts with this batch."""
        done = await self._script_publish(batch.source, outs, dead, batch.claimed,
                                          batch.ack_check, batch)
        if done[2:] and done[0]:  # refused replies of an acked batch (else the reaper
            await self._dead_letter_refused(batch.source, outs, done[2:])  # requeued them)
        if not done[0]:
            raise LeaseLost(f"model={self.model.name}: the in-flight list changed under "
                            "this worker (its lease lapsed and a reaper took it over); "
                            "returning what it still holds")

    async def _script_publish(self, source: Claimer, outs: list[Outgoing], dead: list[bytes],
                              ack: int, check: list[bytes | str],
                              batch: Claimed | None = None
                              ) -> list[Any]:
        """PUBLISH in the slot of ``source``, the sub-queue the batch came from; a
        ``batch`` that holds entries over, or runs those held before: PUBLISH_HOLD."""
        keys, argv = publish_args(outs, dead, self._dead_letters)
        if batch is not None and (batch.hold or batch.released[0]):
            return await self._script_publish_hold(batch, keys, argv)
        keys = [source.inflight, protocol.dead_letter_key(source.tag), *keys]
        return list(await self._link.script(lua.PUBLISH, keys,
                                            [ack, protocol.REPLY_TTL_S, *check, *argv]))

    async def _script_publish_hold(self, batch: Claimed, keys: list[Any], argv: list[Any]
                                   ) -> list[Any]:
        """PUBLISH_HOLD: the ack, the held list's trim and push, the replies: one step."""
        source, (released, released_digest) = batch.source, batch.released
        keys = [source.inflight, protocol.dead_letter_key(source.tag),
                protocol.held_key(source.tag, self._worker_id), *keys]
        argv = [batch.claimed, protocol.REPLY_TTL_S, batch.sha1, released, released_digest,
                protocol.INFLIGHT_TTL_S * 1000, len(batch.hold), *batch.hold, *argv]
        return list(await self._link.script(lua.PUBLISH_HOLD, keys, argv))

    async def _dead_letter_refused(self, source: Claimer, outs: list[Outgoing],
                                   refused: list[Any]) -> None:
        """Redis refused some replies (their reply_to or marker key holds another type
        of value): the rest of the batch went out and was acked; these requests cannot
        be answered, so they are dead-lettered, never retried."""
        for i in refused:
            out = outs[int(i) - 1]
            log.error("model=%s Redis refused the reply to request %s (its key %s or %s "
                      "holds a value of another type); dead-lettered it", self.model.name,
                      out.request.id, out.reply_to, out.marker)
        await self._script_publish(source, [], refused_entries(outs, refused), 0, [""])
        self.stats.dead_lettered(len(refused))

    def _log_batch(self, batch: Claimed, computed: Computed, reply_ms: float) -> None:
        decoded, passes, fwd_ms = batch.decoded, computed.passes, computed.fwd_ms
        waits = [protocol.queue_wait_ms(batch.claimed_ms, item.request.enqueue_ms)
                 for item in decoded.items if item.pack is None]  # a pack's rows share one
        waits += [protocol.queue_wait_ms(batch.claimed_ms, pack.request.enqueue_ms)
                  for pack in decoded.packs]
        self.stats.batch(decoded, entries=batch.claimed, size=batch.size, passes=passes,
                         waits_ms=waits, fwd_ms=fwd_ms, busy_s=computed.busy_s,
                         failed=computed.failed, padding=computed.padding,
                         fwd_cpu_ms=computed.fwd_cpu_ms)
        if batch.hold:
            self.stats.held(len(batch.hold))
        padded, real = computed.padding
        log.info("model=%s n=%d items=%d entries=%d passes=%d computed=%d failed=%d "
                 "rejected=%d late=%d wait_ms=%.1f fwd_ms=%.2f reply_ms=%.2f%s", self.model.name,
                 max(passes, default=0), sum(passes), batch.claimed, len(passes),
                 len(decoded.items) - computed.failed, computed.failed,
                 len(decoded.early) + decoded.invalid_rows - batch.late, batch.late,
                 max(waits, default=0), fwd_ms,
                 reply_ms, (f" pad={padded / real:.2f}" if real else "")
                 + (f" inflight={self._in_flight}" if self._limit > 1 else "")
                 + (f" held={len(batch.hold)}" if batch.hold else "")
                 + (f" released={batch.released[0]}" if batch.released[0] else "")
                 + (_levels_text(decoded, self.model.default_priority)
                    if self.model.priority_levels > 1 else ""))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("model=%s request_ids=%s", self.model.name, ",".join(
                r.trace_id or r.id for r in _requests(decoded)))


def entries_digest(raws: list[bytes]) -> str:
    """The SHA-1 (hex) of ``raws`` concatenated: what a digest-guarded script checks."""
    return hashlib.sha1(b"".join(raws), usedforsecurity=False).hexdigest()


def acks_by_entries(raws: list[bytes]) -> bool:
    """Whether a batch of ``raws`` is acked by its entries (a worker whose user may run
    LPOS): at most ``ACK_BY_ENTRIES_MAX`` of them, or at most
    ``ACK_BY_ENTRIES_MAX_LARGE`` of at least ``ACK_BY_ENTRIES_MIN_MEAN_BYTES`` each on
    average; ``ACK_BY_ENTRIES_MAX_BYTES`` in all."""
    n, size = len(raws), sum(map(len, raws))
    large = n <= protocol.ACK_BY_ENTRIES_MAX_LARGE and \
        size >= n * protocol.ACK_BY_ENTRIES_MIN_MEAN_BYTES
    return n > 0 and size <= protocol.ACK_BY_ENTRIES_MAX_BYTES and (
        n <= protocol.ACK_BY_ENTRIES_MAX or large)


def claimer_for(redis: aioredis.Redis, model: Model, worker_id: str, block_timeout_s: float,
                blocking: aioredis.Redis | None, *, tag: str | None = None,
                link: LeanLink | None = None) -> Claimer:
    """The claimer of ``model``'s sub-queue ``tag`` (its own queue by default), on
    ``link``: over its one queue, or over its priority levels."""
    claimer: Claimer
    if model.priority_levels > 1:
        claimer = LevelClaimer(redis, model.name, worker_id, model.policy, block_timeout_s,
                               blocking, tag, link, levels=model.priorities,
                               share=model.priority_share)
    else:
        claimer = Claimer(redis, model.name, worker_id, model.policy, block_timeout_s,
                          blocking, tag, link)
    claimer.live_policy = lambda: model.policy  # (``model.policy``: live)
    return claimer


def _levels_text(decoded: Decoded, default: int) -> str:
    """`` levels=1:3,2:1``: the batch's requests per priority level (a multi-level
    model's batch log line)."""
    counts = Counter(r.priority or default for r in _requests(decoded))
    return " levels=" + ",".join(f"{level}:{n}" for level, n in sorted(counts.items()))


def _check_done(tasks: list[asyncio.Task[None]]) -> list[asyncio.Task[None]]:
    """The tasks still running; a finished one's error is raised here."""
    for task in tasks:
        if task.done():
            task.result()
    return [task for task in tasks if not task.done()]


def _requests(decoded: Decoded) -> list[Request]:
    return [item.request for item in decoded.items] + [r for r, _f, _e in decoded.early]
