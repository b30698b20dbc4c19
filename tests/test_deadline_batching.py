"""Deadline-aware batch formation, with a real Redis and an in-process worker: requests
that cannot finish in time are answered uncomputed, earliest deadlines run first, and
a deadline closes the batch window (also with ``allow_small_batch=False``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from redbatch import DeadlineExceeded, TensorSpec, protocol
from redbatch.config import RedisSettings
from redbatch.producer import Client
from redbatch.worker.deadlines import (
    drop_infeasible,
    drop_late,
    fixed_plan,
    order_by_deadline,
)
from redbatch.worker.decode import Decoded, Item, Pack
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.stats import PASS_WARMUP, PassTimes

from .conftest import FAST_WORKER, wait_live


def recording(name: str, calls: list[list[Any]], sleep_s: float = 0.0, **policy: Any
              ) -> Model:
    """A model that records each pass's inputs (and sleeps ``sleep_s`` per pass)."""

    def fn(xs: list[Any]) -> list[Any]:
        calls.append([_plain(x) for x in xs])
        time.sleep(sleep_s)
        return list(xs)

    return Model(name=name, fn=fn, policy=BatchPolicy(**policy), inline=False)


def _plain(x: Any) -> Any:
    return int(x[0]) if isinstance(x, np.ndarray) else x


async def served(start_worker: Callable[..., Worker], url: str, name: str,
                 sleep_s: float = 0.0, **policy: Any) -> tuple[Worker, list[list[Any]]]:
    """A live worker of a ``recording`` model, and the model's calls."""
    calls: list[list[Any]] = []
    worker = start_worker([recording(name, calls, sleep_s, **policy)])
    await wait_live(url, name)
    return worker, calls


def expired_count(worker: Worker) -> float:
    return float(worker.runners[0].stats.outcomes["expired"]._value.get())


async def test_a_request_that_cannot_make_its_deadline_is_not_computed(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    worker, calls = await served(start_worker, redis_url, "slow", 0.2, max_batch_size=8,
                                 batch_wait_timeout_s=0.0)
    async with Client(redis_url) as client:
        for i in range(PASS_WARMUP):  # the worker measures ~200 ms a pass
            assert await client.predict("slow", i, timeout_s=10) == i
        calls.clear()
        before = expired_count(worker)
        with pytest.raises(DeadlineExceeded):
            await client.predict("slow", 100, timeout_s=0.05)
        assert await client.predict("slow", 200, timeout_s=2) == 200
    assert calls == [[200]]  # 100 never reached the model
    assert expired_count(worker) == before + 1


async def test_passes_cut_by_cost_decide_which_requests_are_computed(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """8 requests that cost a whole budget each run in 8 passes of ~200 ms, not one of
    ``max_batch_size``: those whose pass cannot end by their deadline (450 ms away)
    are answered ``deadline_exceeded`` uncomputed."""
    seen: list[int] = []

    def fn(arg: tuple[Any, Any]) -> Any:
        padded, lengths = arg
        time.sleep(0.2)
        seen.extend(lengths.tolist())
        return padded

    worker = start_worker([Model(
        "costly", fn=fn, stack=True, inline=False,
        spec=TensorSpec("int64", (None,), max_len=64),
        output_spec=TensorSpec("int64", (None,)),
        policy=BatchPolicy(max_batch_size=8, batch_wait_timeout_s=0.05, max_batch_cost=8))])
    await wait_live(redis_url, "costly")
    async with Client(redis_url) as client:
        for _ in range(PASS_WARMUP):  # the worker measures ~200 ms a pass
            await client.predict("costly", [1, 2], timeout_s=5)
        seen.clear()
        before = expired_count(worker)
        replies = await asyncio.gather(*(client.predict("costly", [5] * 7, timeout_s=0.45)
                                         for _ in range(8)), return_exceptions=True)
        await asyncio.sleep(0.5)  # (passes under way end)
    assert all(isinstance(r, DeadlineExceeded) or r == [5] * 7 for r in replies), replies
    assert expired_count(worker) - before >= 3  # passes 5 to 8 by the estimate, or more
    assert len(seen) <= 5, seen  # before: all 8 computed, every caller gone


async def test_a_request_claimed_during_a_long_pass_is_judged_again_before_its_own(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """Short passes make the worker claim the next batch during the current pass; a
    request claimed so, whose deadline passes while a long pass runs, is answered
    ``deadline_exceeded`` without being computed once that pass ends."""
    calls: list[list[Any]] = []

    def fn(xs: list[Any]) -> list[Any]:
        calls.append(list(xs))
        time.sleep(1.0 if 1000 in xs else 0.005)
        return list(xs)

    worker = start_worker([Model(name="prefetch", fn=fn, inline=False, policy=BatchPolicy(
        max_batch_size=8, batch_wait_timeout_s=0.0))])
    await wait_live(redis_url, "prefetch")
    async with Client(redis_url) as client:
        for i in range(PASS_WARMUP + 2):  # short passes: the next claim goes out early
            assert await client.predict("prefetch", i, timeout_s=10) == i
        calls.clear()
        before = expired_count(worker)
        slow = await client.submit("prefetch", 1000, timeout_s=10)
        await asyncio.sleep(0.1)  # the long pass has begun; the next claim waits
        with pytest.raises(DeadlineExceeded):
            await client.predict("prefetch", 7, timeout_s=0.3)  # claimed at once
        assert await slow == 1000
        assert await client.predict("prefetch", 8, timeout_s=5) == 8
    assert calls == [[1000], [8]]  # 7 never reached the model
    assert expired_count(worker) == before + 1


async def test_a_cold_worker_drops_nothing(start_worker: Callable[..., Worker],
                                           redis_url: str) -> None:
    _, calls = await served(start_worker, redis_url, "cold", 0.2, max_batch_size=8,
                            batch_wait_timeout_s=0.0)
    async with Client(redis_url) as client:
        with pytest.raises(DeadlineExceeded):  # 50 ms: too short for a 200 ms pass
            await client.predict("cold", 7, timeout_s=0.05)
    for _ in range(100):
        if calls:
            break
        await asyncio.sleep(0.02)
    assert calls == [[7]]  # no estimate yet: computed anyway


async def test_earliest_deadlines_run_in_the_first_pass(start_worker: Callable[..., Worker],
                                                        redis_url: str) -> None:
    calls: list[list[Any]] = []
    model = recording("edf", calls, max_batch_size=4, batch_wait_timeout_s=0.0)
    async with Client(redis_url, require_workers=False) as client:
        pack = await client.submit_many("edf", [np.arange(4).reshape(4, 1)], timeout_s=30,
                                        batched=True)  # 4 rows, queued first
        singles = [await client.submit("edf", np.array([100 + i]), timeout_s=5)
                   for i in range(3)]
        queue = redis.Redis.from_url(redis_url)
        for _ in range(200):
            if queue.llen(protocol.queue_key("edf")) == 4:
                break
            await asyncio.sleep(0.01)
        queue.close()
        start_worker([model])  # one claim: 4 entries, 7 items, two passes of up to 4
        rows, *outs = await asyncio.gather(*pack, *singles)
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3]  # each result to its caller
    assert [int(out[0]) for out in outs] == [100, 101, 102]
    assert [len(c) for c in calls] == [4, 3]
    assert {100, 101, 102} <= set(calls[0])  # not FIFO's [0, 1, 2, 3] first


async def test_no_small_batch_waits_for_a_full_batch(start_worker: Callable[..., Worker],
                                                     redis_url: str) -> None:
    _, calls = await served(start_worker, redis_url, "full", max_batch_size=8,
                            batch_wait_timeout_s=0.05, allow_small_batch=False)
    async with Client(redis_url) as client:
        first = [await client.submit("full", i, timeout_s=10) for i in range(3)]
        await asyncio.sleep(0.5)  # ten times batch_wait_timeout_s
        assert calls == []
        rest = [await client.submit("full", i, timeout_s=10) for i in range(3, 8)]
        assert await asyncio.gather(*first, *rest) == list(range(8))
        assert calls == [list(range(8))]
        started = time.monotonic()
        urgent = [await client.submit("full", i, timeout_s=1.5) for i in range(3)]
        assert await asyncio.gather(*urgent) == [0, 1, 2]  # forced by the deadline, in time
    assert calls[1:] == [[0, 1, 2]]
    assert time.monotonic() - started > 0.5  # it did wait for more, while it could


async def test_no_small_batch_counts_the_rows_of_multi_row_requests(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """A multi-row request of ``max_batch_size`` rows is a full batch: it runs at once,
    not at its deadline; and single requests after packs still fill a batch of
    ``max_batch_size`` items, not one of as many entries as the packs had."""
    _, calls = await served(start_worker, redis_url, "rows", max_batch_size=8,
                            batch_wait_timeout_s=0.01, allow_small_batch=False)
    rows = np.arange(8, dtype=np.int64).reshape(8, 1)
    async with Client(redis_url) as client:
        for _ in range(3):
            started = time.monotonic()
            (packed,) = await client.submit_many("rows", [rows], batched=True, timeout_s=10)
            assert [_plain(x) for x in await packed] == list(range(8))
            assert time.monotonic() - started < 5, "a full batch waited for its deadline"
        singles = [await client.submit("rows", i, timeout_s=10) for i in range(8)]
        assert await asyncio.gather(*singles) == list(range(8))
    assert calls[3:] == [list(range(8))]


async def test_a_stopping_worker_runs_the_small_batch_it_holds(redis_url: str) -> None:
    calls: list[list[Any]] = []
    model = recording("held", calls, max_batch_size=8, allow_small_batch=False)
    worker, stop = Worker([model], RedisSettings(redis_url), FAST_WORKER), asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    await wait_live(redis_url, "held")
    async with Client(redis_url) as client:
        held = [await client.submit("held", i, timeout_s=30) for i in range(3)]
        await asyncio.sleep(0.3)
        assert calls == []  # waiting for a full batch
        stop.set()
        assert await asyncio.wait_for(asyncio.gather(*held), 5) == [0, 1, 2]
    await asyncio.wait_for(running, 10)
    assert calls == [[0, 1, 2]]


async def test_a_deadline_closes_the_window_early(start_worker: Callable[..., Worker],
                                                  redis_url: str) -> None:
    _, calls = await served(start_worker, redis_url, "window", max_batch_size=8,
                            batch_wait_timeout_s=2.0, adaptive=False)
    async with Client(redis_url) as client:
        started = time.monotonic()
        assert await client.predict("window", 5, timeout_s=0.5) == 5  # not held 2 s
        assert time.monotonic() - started < 1.0
    assert calls == [[5]]


def test_pass_times_need_a_warmup_and_bucket_by_size() -> None:
    times = PassTimes()
    for _ in range(PASS_WARMUP - 1):
        times.add([8], 100.0)
    assert times.estimate_ms(8) is None  # cold
    times.add([8, 8], 200.0)  # 100 ms a pass
    assert times.estimate_ms(8) == pytest.approx(100.0)
    assert times.estimate_ms(5) == pytest.approx(100.0)  # the same bucket (8)
    assert times.estimate_ms(64) == pytest.approx(100.0)  # a lower bound from below
    assert times.estimate_ms(2) == pytest.approx(100.0)  # nothing below: the next above
    times.add([1], 10.0)
    assert times.estimate_ms(1) == pytest.approx(10.0)
    assert times.estimate_ms(8) == pytest.approx(100.0)


def _request(rid: str, deadline_ms: int, rows: int = 0) -> protocol.Request:
    return protocol.Request(rid, "m", 0, deadline_ms, protocol.reply_key("m", "c"), None,
                            rows=rows)


def test_a_late_multi_row_request_is_answered_whole() -> None:
    packed = _request("p", 1_100, rows=2)
    pack = Pack(packed, "msgpack", [None, None], {})
    decoded = Decoded(items=[Item(_request("a", 5_000), "msgpack", 1),
                             Item(packed, "msgpack", 2, pack, 0),
                             Item(packed, "msgpack", 3, pack, 1)], packs=[pack])
    order_by_deadline(decoded, size=2)  # three items, two passes: the pack first
    assert [item.request.id for item in decoded.items] == ["p", "p", "a"]
    assert drop_infeasible(decoded, 1_000, fixed_plan(3, 2), lambda n: 300.0) == 1  # 100 < 155
    assert [item.request.id for item in decoded.items] == ["a"]
    assert decoded.packs == []
    assert [(r.id, type(e)) for r, _f, e in decoded.early] == [("p", DeadlineExceeded)]
    assert drop_infeasible(decoded, 1_000, fixed_plan(1, 2), lambda n: None) == 0  # cold


def test_the_pass_a_request_joins_decides() -> None:
    items = [Item(_request(f"r{i}", 1_000 + 400), "msgpack", i) for i in range(4)]
    decoded = Decoded(items=items)
    # 100 ms a pass, halved: the first pass ends by 1_055, the second by 1_105 ... < 1_400
    assert drop_infeasible(decoded, 1_000, fixed_plan(4, 2), lambda n: 100.0) == 0
    decoded.items[3].request.deadline_ms = 1_080  # in the second pass: 1_105 > 1_080
    assert drop_infeasible(decoded, 1_000, fixed_plan(4, 2), lambda n: 100.0) == 1
    assert [item.request.id for item in decoded.items] == ["r0", "r1", "r2"]


def test_the_forwarders_own_passes_decide() -> None:
    """Passes cut by buckets or costs, not by ``max_batch_size``: 8 items, one pass each
    (a cost of a whole budget each), 100 ms a pass: the later passes cannot end by a
    deadline 250 ms away, though 8 items fit one pass of ``max_batch_size``."""
    items = [Item(_request(f"r{i}", 1_000 + 250), "msgpack", i) for i in range(8)]
    decoded = Decoded(items=items)
    assert drop_infeasible(decoded, 1_000, fixed_plan(8, 8), lambda n: 100.0) == 0
    one_each = lambda items: list(range(len(items)))  # noqa: E731
    assert drop_late(decoded, 1_000, one_each, lambda n: 100.0, rounds=8) == 4
    assert [item.request.id for item in decoded.items] == ["r0", "r1", "r2", "r3"]


def test_a_pass_of_dropped_requests_takes_no_time() -> None:
    """The first pass holds only a request already late: it does not run, so the next
    pass's request still makes it."""
    decoded = Decoded(items=[Item(_request("late", 1_010), "msgpack", 0),
                             Item(_request("next", 1_100), "msgpack", 1)])
    # pass 0 ends by 1_055 (late: 1_010); pass 1 by 1_055 too, as pass 0 never runs
    assert drop_late(decoded, 1_000, lambda items: list(range(len(items))),
                     lambda n: 100.0, rounds=8) == 1
    assert [item.request.id for item in decoded.items] == ["next"]


def test_a_dropped_request_frees_its_place() -> None:
    """Passes of 2: once the late one is gone, the other two share the first pass,
    which ends in time for both (dropped requests do not keep their places)."""
    decoded = Decoded(items=[Item(_request("late", 1_010), "msgpack", 0),
                             Item(_request("a", 1_100), "msgpack", 1),
                             Item(_request("b", 1_100), "msgpack", 2)])
    assert drop_late(decoded, 1_000, lambda items: fixed_plan(len(items), 2),
                     lambda n: 100.0, rounds=8) == 1
    assert [item.request.id for item in decoded.items] == ["a", "b"]
