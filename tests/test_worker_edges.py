"""The worker at its edges: an async model's own CancelledError, knobs that are not
numbers, stale overrides, per-token outputs as lists, deadlines across length buckets,
and draining, against a real Redis."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from redbatch import Client, protocol
from redbatch.errors import InvalidKnob, ModelError
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from tests.conftest import wait_live

pytestmark = pytest.mark.timeout(30)


async def test_an_async_models_own_cancelled_error_fails_its_request_alone(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """Awaiting a future cancelled under it is the model's error: the batch loop goes
    on (it ended silently, and the model's requests waited to their deadlines)."""
    async def fn(xs: list[int]) -> list[int]:
        if 13 in xs:
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future
        return xs

    start_worker([Model("ac", fn=fn, policy=BatchPolicy(max_batch_size=4,
                                                         batch_wait_timeout_s=0.05))])
    await wait_live(redis_url, "ac")
    async with Client(redis_url) as client:
        results = await client.predict_many("ac", [1, 13, 2], timeout_s=10,
                                            return_exceptions=True)
        assert results[0] == 1 and results[2] == 2
        assert isinstance(results[1], ModelError) and "CancelledError" in str(results[1])
        assert await client.predict("ac", 5, timeout_s=10) == 5


async def test_a_knob_that_is_not_a_finite_number_is_refused(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """NaN passes every range check, and JSON would store NaN and inf as null."""
    start_worker([Model("kn", fn=lambda xs: xs)])
    await wait_live(redis_url, "kn")
    async with Client(redis_url) as client:
        for knob in ({"batch_wait_timeout_s": math.nan}, {"max_batch_cost": math.inf}):
            with pytest.raises(InvalidKnob, match="finite"):
                await client.configure("kn", **knob)
        done = await client.configure("kn", max_batch_cost=4.0)
        assert done["effective"]["max_batch_cost"] == 4.0


def test_a_stale_override_is_ignored_alone(caplog: pytest.LogCaptureFixture) -> None:
    """A stored ``priority_caps`` for three levels, read by a model of one (redeployed):
    that override alone is dropped; ``max_batch_size`` still applies."""
    from redbatch.worker.live import LiveKnobs

    model = Model("stale", fn=lambda xs: xs)

    class Runner:
        pass

    runner = Runner()
    runner.model = model  # type: ignore[attr-defined]
    LiveKnobs(runner).update({b"max_batch_size": b"4",  # type: ignore[arg-type]
                              b"priority_caps": b"[10, 10, 10]"})
    assert model.policy.max_batch_size == 4
    assert "priority_caps=[10, 10, 10]" in caplog.text


async def test_per_token_outputs_may_be_lists() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from redbatch import TensorSpec
    from redbatch.worker.forward import Forwarder

    def doubled(arg: tuple[np.ndarray, np.ndarray]) -> list[list[int]]:
        padded, _lengths = arg
        return [[int(v) * 2 for v in row] for row in padded]

    model = Model("pt", fn=doubled, inline=True, stack=True,
                  spec=TensorSpec("int64", (None,), max_len=8),
                  output_spec=TensorSpec("int64", (None,)))
    with ThreadPoolExecutor(1) as pool:
        out = await Forwarder(model, doubled, pool).run_batches(
            [np.array([1, 2, 3]), np.array([4, 5])])
    assert [list(o) for o in out] == [[2, 4, 6], [8, 10]]


async def test_the_bucket_of_the_most_urgent_request_runs_first() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from redbatch import TensorSpec
    from redbatch.worker.forward import Forwarder

    seen: list[list[int]] = []

    def lengths(items: list[Any]) -> list[int]:
        seen.append([len(x) for x in items])
        return [len(x) for x in items]

    model = Model("edf", fn=lengths, inline=True, policy=BatchPolicy(max_batch_size=2),
                  spec=TensorSpec("int64", (None,), max_len=64))
    inputs = [np.zeros(n, np.int64) for n in (60, 50, 3, 2, 3, 1)]  # earliest first
    with ThreadPoolExecutor(1) as pool:
        await Forwarder(model, lengths, pool).run_batches(inputs)
    assert seen[0] == [60, 50]  # (the shortest bucket ran first, urgent or not)


async def test_draining_reads_the_sub_queues_in_effect_and_any_worker_id(
        redis_url: str, raw_redis: Any) -> None:
    """A version grown to 3 sub-queues live has each of them closed, and a peer id
    that is not UTF-8 stops nothing."""
    import redis.asyncio as aioredis

    from redbatch.worker import drain

    model = Model("dr", fn=lambda xs: xs, version="2")
    model.sub_queues = 3  # (as a live knob sets it on the runner's model)
    raw_redis.zadd(protocol.workers_key(model.name), {b"\xff\xfe": protocol.now_ms() + 10_000})
    client = aioredis.Redis.from_url(redis_url, encoding_errors="surrogateescape")  # (as workers)
    try:
        assert await drain.close(client, model, "me") is True
    finally:
        await client.aclose()
    for tag in protocol.sub_queue_tags(model.name, 3):
        assert raw_redis.exists(protocol.closed_key(tag))
    states = [model]
    assert drain.Drain(lambda: states, "me")._models == [model]


async def test_a_live_change_reaches_a_batch_window_already_open(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """``allow_small_batch=false`` holds a lone request to its deadline; turning it on
    (live) sends the batch now, not at the deadline."""
    import time

    start_worker([Model("win", fn=lambda xs: xs, policy=BatchPolicy(
        max_batch_size=8, allow_small_batch=False))])
    await wait_live(redis_url, "win")
    async with Client(redis_url) as client:
        started = time.monotonic()
        future = await client.submit("win", 7, timeout_s=15)
        await asyncio.sleep(0.5)
        await client.configure("win", allow_small_batch=True)
        assert await future == 7
        assert time.monotonic() - started < 5  # (without: about 15 s less the margins)


async def test_a_model_of_two_sub_queues_keeps_its_stride_and_its_window(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """A batch stolen from the other sub-queue waits out the stride and fills through
    the window as a claim of the home's does: ``allow_small_batch=False`` holds a
    small batch until its deadline forces it, and passes keep ``stride_s`` apart."""
    import time

    passes: list[float] = []

    def timed(xs: list[int]) -> list[int]:
        passes.append(time.monotonic())
        return xs

    start_worker([Model("held2", fn=lambda xs: xs, sub_queues=2, policy=BatchPolicy(
        max_batch_size=8, allow_small_batch=False)),
        Model("strided2", fn=timed, sub_queues=2, inline=True, policy=BatchPolicy(
            max_batch_size=1, batch_wait_timeout_s=0.0, stride_s=0.3))])
    await wait_live(redis_url, "held2")
    await wait_live(redis_url, "strided2")
    async with Client(redis_url) as client:
        started = time.monotonic()
        assert await client.predict_many("held2", [1, 2, 3], timeout_s=2) == [1, 2, 3]
        assert time.monotonic() - started > 1.0  # held for its deadline, not sent at once
        assert await client.predict_many("strided2", list(range(6)), timeout_s=10) == \
            list(range(6))
    gaps = [b - a for a, b in itertools.pairwise(passes)]
    assert len(gaps) == 5 and min(gaps) > 0.25, gaps


def test_a_bool_input_takes_0_and_1_but_no_other_integer() -> None:
    """-1 or 70000 became true without a word."""
    from redbatch import TensorSpec
    from redbatch.errors import InvalidPayload

    spec = TensorSpec("bool", (2,))
    assert spec.check([0, 1]).tolist() == [False, True]
    assert spec.check([True, False]).tolist() == [True, False]
    for bad in ([-1, 1], [70000, 0]):
        with pytest.raises(InvalidPayload, match="true or false"):
            spec.check(bad)


async def test_a_larger_pass_after_short_ones_leaves_the_event_loop_to_the_heartbeat(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: Any) -> None:
    """Auto-inline runs a model's passes on the loop while its recent ones were short;
    a pass larger than those (here 3 s long) runs in the thread: the lease stays live
    (it lapsed, and a peer reaped a healthy worker and ran its batch again)."""
    import time

    def slow_when_many(xs: list[int]) -> list[int]:
        if len(xs) >= 4:
            time.sleep(3)
        return xs

    worker = start_worker([Model("grow", fn=slow_when_many, policy=BatchPolicy(
        max_batch_size=16, batch_wait_timeout_s=0.05))])
    await wait_live(redis_url, "grow")
    async with Client(redis_url) as client:
        for x in range(10):
            assert await client.predict("grow", x, timeout_s=10) == x
        futures = await client.submit_many("grow", list(range(8)), timeout_s=15)
        lowest = math.inf
        while not all(f.done() for f in futures):
            lease = raw_redis.zscore(protocol.workers_key("grow"), worker.worker_id)
            lowest = min(lowest, (lease or 0) - protocol.now_ms())
            await asyncio.sleep(0.1)
        assert [await f for f in futures] == list(range(8))
    assert lowest > 500, lowest  # (2 s leases, renewed every 0.2 s)


async def test_a_dead_worker_that_cannot_be_reaped_holds_up_no_other(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: Any) -> None:
    """``d0``'s in-flight key holds a string: its reap fails every time; ``d1`` behind it
    is still reaped (its junk entry dead-lettered), and the worker serves."""
    start_worker([Model("m8", fn=lambda xs: xs)])
    await wait_live(redis_url, "m8")
    past = protocol.now_ms() - 60_000
    raw_redis.set(protocol.inflight_key("m8", "d0"), "not a list")
    raw_redis.rpush(protocol.inflight_key("m8", "d1"), b"junk-entry")
    raw_redis.zadd(protocol.workers_key("m8"), {"d0": past, "d1": past + 1})
    for _ in range(100):
        if raw_redis.llen(protocol.dead_letter_key("m8")):
            break
        await asyncio.sleep(0.05)
    assert raw_redis.llen(protocol.dead_letter_key("m8")) == 1
    assert raw_redis.llen(protocol.inflight_key("m8", "d1")) == 0
    async with Client(redis_url) as client:
        assert await client.predict("m8", 3, timeout_s=5) == 3


async def test_the_demo_adder_answers_each_request_by_its_own_input(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """A float or an int past int64 batched with an int made one array of the batch:
    ``3`` beside ``1.5`` was answered ``4.0``, and ``2**64 - 1`` was answered 0."""
    from redbatch import demo
    from redbatch.errors import InvalidPayload

    start_worker([demo.adder])
    await wait_live(redis_url, "adder")
    async with Client(redis_url) as client:
        futures = await client.submit_many("adder", [3, 1.5, 2**64 - 1, 41], timeout_s=10)
        results = await asyncio.gather(*futures, return_exceptions=True)
    assert results[0] == 4 and type(results[0]) is int and results[3] == 42
    assert all(isinstance(r, InvalidPayload) for r in results[1:3]), results


async def test_a_reply_of_many_lists_reaches_its_caller(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """The budget of lists and maps holds for a producer's entries, not for replies: a
    reply of 600,000 pairs is decoded by its caller (it was dropped, the caller waiting
    to its deadline)."""
    pairs = 600_000
    start_worker([Model("boxes", fn=lambda xs: [[[0, 1]] * pairs for _ in xs])])
    await wait_live(redis_url, "boxes")
    async with Client(redis_url) as client:
        assert len(await client.predict("boxes", 1, timeout_s=20)) == pairs


async def test_entries_pushed_while_s_was_raised_and_lowered_unseen_are_drained(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """``sub_queues`` raised and lowered between two heartbeats (here with no worker
    running): producers may have pushed to sub-queues no worker ever claimed from.  The
    lowering leaves a notice; a worker drains up to it and answers them (before: they
    waited to their deadlines, uncounted)."""
    import redis as redis_sync
    import redis.asyncio as aioredis

    from redbatch import codec, knobs
    from redbatch.worker.model import Model

    model = Model("flip", fn=lambda xs: [x * 2 for x in xs], policy=BatchPolicy(
        max_batch_size=8, batch_wait_timeout_s=0.0))
    raw = redis_sync.Redis.from_url(redis_url)
    raw.set(protocol.meta_key("flip"), orjson.dumps(model.meta()))  # registered once
    client = aioredis.Redis.from_url(redis_url)
    try:
        await knobs.configure(client, "flip", {"sub_queues": 4})
        replies = []
        for index in (1, 2, 3):  # as a producer that read S = 4
            tag = protocol.sub_queue_tag("flip", index)
            reply_to = protocol.reply_key(tag, "t")
            now = protocol.now_ms()
            request = protocol.Request(f"r{index}", "flip", now, now + 20_000, reply_to,
                                       index)
            raw.rpush(protocol.queue_key(tag), codec.encode(request.to_wire()))
            replies.append(reply_to)
        await knobs.configure(client, "flip", {"sub_queues": 1})
    finally:
        await client.aclose()
    start_worker([model])  # it starts at S = 1, and never saw 4
    for index, reply_to in zip((1, 2, 3), replies, strict=True):
        got = await asyncio.to_thread(raw.blpop, [reply_to], 10)
        assert got is not None, f"sub-queue {index} was never drained"
        assert codec.decode(got[1])[protocol.F_PAYLOAD] == 2 * index
    raw.close()


async def test_cancelled_requests_in_a_stolen_batch_are_skipped(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    """A steal from another sub-queue found its cancelled set, then the window's claim
    reset the flag: the cancelled requests were computed and answered."""
    import redis as redis_sync

    from redbatch import codec
    from redbatch.worker.model import Model

    computed: list[int] = []

    def double(xs: list[int]) -> list[int]:
        computed.extend(xs)
        return [2 * x for x in xs]

    worker = start_worker([Model("cx", fn=double, sub_queues=2, policy=BatchPolicy(
        max_batch_size=8, batch_wait_timeout_s=0.0))])
    await wait_live(redis_url, "cx")
    await asyncio.sleep(0.5)  # ranked: its home sub-queue known
    tag = protocol.sub_queue_tag("cx", (worker.runners[0].claimer.home + 1) % 2)
    raw = redis_sync.Redis.from_url(redis_url)
    now = protocol.now_ms()
    raw.zadd(protocol.cancelled_key(tag), {f"c{i}": now + 60_000 for i in range(4)})
    raw.rpush(protocol.queue_key(tag), *[codec.encode(protocol.Request(
        f"c{i}", "cx", now, now + 30_000, protocol.reply_key(tag, "t"), i).to_wire())
        for i in range(4)])
    for _ in range(100):
        if raw.llen(protocol.queue_key(tag)) == 0 and not raw.keys(
                protocol.inflight_key(tag, "*")):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert computed == [] and raw.llen(protocol.reply_key(tag, "t")) == 0
    raw.close()


async def test_a_batch_returned_above_the_count_leaves_a_notice_for_every_worker(
        redis_url: str) -> None:
    """A worker stopping while it drained a sub-queue above a lowered count returns its
    batch there: it drains that sub-queue again itself (``reopen``), but it is leaving,
    and the others had finished draining: a shrink notice makes them drain it too
    (before: the entries waited to their deadlines)."""
    import redis as redis_sync
    import redis.asyncio as aioredis

    from redbatch import codec
    from redbatch.worker.reaper import Reaper

    tags = protocol.sub_queue_tags("shr", 3)
    now = protocol.now_ms()
    raw = redis_sync.Redis.from_url(redis_url)
    raw.rpush(protocol.inflight_key(tags[2], "wA"), codec.encode(protocol.Request(
        "r1", "shr", now, now + 30_000, protocol.reply_key(tags[2], "t"), 1).to_wire()))
    client = aioredis.Redis.from_url(redis_url)
    try:
        reaper = Reaper(client, "shr", 3)
        reaper.tags = lambda: tags  # this worker's view: it drained three
        reaper.sub_queue_count = lambda: 1  # the count now
        assert await reaper.reap("wA", force=True) == 1
    finally:
        await client.aclose()
    assert raw.llen(protocol.queue_key(tags[2])) == 1
    notice = raw.get(protocol.sub_queues_shrunk_key("shr"))
    assert notice is not None and notice.startswith(b"3:")
    raw.close()


def test_a_pool_checks_its_target_without_calling_a_factory() -> None:
    """The pool's process called the factory (it may load weights or set up a GPU)
    before each replica called it again; the loader's doc says only workers do."""
    from redbatch.errors import ConfigError
    from redbatch.worker.loader import check_target, load_target
    from tests import models_for_tests

    before = len(models_for_tests.FACTORY_CALLS)
    check_target("tests.models_for_tests:counted_factory")
    assert len(models_for_tests.FACTORY_CALLS) == before
    assert [m.name for m in load_target("tests.models_for_tests:counted_factory")[0]] == [
        "adder"]
    assert len(models_for_tests.FACTORY_CALLS) == before + 1
    check_target("tests.models_for_tests:adder")
    for bad, match in (("tests.models_for_tests:not_models", "is not a Model"),
                       ("tests.models_for_tests:nothing", "no attribute"),
                       ("tests.nowhere:x", "cannot import")):
        with pytest.raises(ConfigError, match=match):
            check_target(bad)


def test_a_target_whose_module_fails_is_one_config_error_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own code raising at import, or a syntax error: a 30-line traceback, exit 1."""
    from redbatch.errors import ConfigError
    from redbatch.worker.loader import check_target

    (tmp_path / "raising_mod.py").write_text('raise RuntimeError("no weights at /x")\n')
    (tmp_path / "broken_mod.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="RuntimeError: no weights at /x"):
        check_target("raising_mod:models")
    with pytest.raises(ConfigError, match=r"SyntaxError: .*broken_mod\.py, line 1"):
        check_target("broken_mod:models")


async def test_a_stop_during_an_open_window_runs_what_it_holds(redis_url: str) -> None:
    """A claim whose window opened over ``block_timeout_s`` + 1 s before the stop was
    taken for one stalled at the stop ("Redis stalled?"): cancelled, its batch went
    back to the queue, and its callers waited for another worker, past their
    deadline when none came in time."""
    from redbatch import Client, batch
    from redbatch.config import RedisSettings, WorkerConfig

    computed: list[list[int]] = []

    @batch(name="held_open", max_batch_size=8, allow_small_batch=False,
           batch_wait_timeout_s=0.0)
    def held_open(xs: list[int]) -> list[int]:
        computed.append(list(xs))
        return [x * 10 for x in xs]

    config = WorkerConfig(block_timeout_s=1.0, heartbeat_interval_s=0.2, lease_ttl_s=2.0,
                          grace_s=30.0)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker([held_open], RedisSettings(redis_url), config).run(stop))
    await wait_live(redis_url, "held_open")
    async with Client(redis_url) as client:
        calls = [asyncio.ensure_future(client.predict("held_open", i, timeout_s=25))
                 for i in range(3)]
        await asyncio.sleep(2.5)  # the window open (not full: it waits for more)
        stop.set()
        await asyncio.wait_for(task, 10)
        assert sorted(x for batch_ in computed for x in batch_) == [0, 1, 2]
        assert await asyncio.wait_for(asyncio.gather(*calls), 5) == [0, 10, 20]
