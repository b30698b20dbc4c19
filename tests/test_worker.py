"""The worker against a real Redis: the model contract, expiry, validation, reply+ack."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis

from redbatch import DeadlineExceeded, InvalidPayload, ModelError, RedisSettings, lua, protocol
from redbatch.lean import LeanLink
from redbatch.producer import Client
from redbatch.spec import TensorSpec
from redbatch.worker import process
from redbatch.worker.model import Model, batch
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.runner import acks_by_entries
from redbatch.worker.torch_helpers import torch_model
from tests.conftest import FAST_WORKER, wait_live


@batch(name="double", max_batch_size=8, batch_wait_timeout_s=0.05)
def double(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


@batch(name="short", max_batch_size=8, batch_wait_timeout_s=0.05)
def short(xs: list[int]) -> list[int]:
    return xs[:-1]


@batch(name="raiser", max_batch_size=8, batch_wait_timeout_s=0.0)
def raiser(xs: list[int]) -> list[int]:
    raise RuntimeError("model exploded")


@batch(name="lengths", max_batch_size=16, batch_wait_timeout_s=0.0)
def lengths(xs: list[str]) -> list[int]:
    return [len(x) for x in xs]


async def test_batch_results_in_order(start_worker: Callable[..., Worker], redis_url: str
                                      ) -> None:
    start_worker([double])
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many("double", list(range(20))) == [
            2 * i for i in range(20)]


async def test_length_mismatch_fails_every_caller(start_worker: Callable[..., Worker],
                                                  redis_url: str) -> None:
    start_worker([short])
    async with Client(redis_url, require_workers=False) as client:
        results = await client.predict_many("short", [1, 2, 3], return_exceptions=True)
    assert all(isinstance(r, ModelError) for r in results)
    assert "returned 2 outputs for a batch of 3" in str(results[0])


async def test_model_exception_reaches_callers_typed(start_worker: Callable[..., Worker],
                                                     redis_url: str) -> None:
    start_worker([raiser])
    async with Client(redis_url, require_workers=False) as client:
        with pytest.raises(ModelError, match="RuntimeError: model exploded"):
            await client.predict("raiser", 1)
        with pytest.raises(ModelError):  # the worker survived and still answers
            await client.predict("raiser", 2)


async def test_expired_requests_are_not_computed(start_worker: Callable[..., Worker],
                                                 redis_url: str) -> None:
    seen: list[int] = []

    @batch(name="counted", batch_wait_timeout_s=0)
    def counted(xs: list[int]) -> list[int]:
        seen.extend(xs)
        return xs

    async with Client(redis_url, require_workers=False) as client:
        with pytest.raises(DeadlineExceeded):
            await client.predict("counted", 1, timeout_s=0.0)
        start_worker([counted])
        assert await client.predict("counted", 2) == 2
    assert seen == [2]


async def test_bad_input_fails_only_its_own_request(start_worker: Callable[..., Worker],
                                                    redis_url: str) -> None:
    spec_model = Model("vec", fn=lambda xs: [float(np.sum(x)) for x in xs],
                       spec=TensorSpec("float32", (2,)))
    start_worker([spec_model])
    async with Client(redis_url, require_workers=False) as client:
        out = await client.predict_many("vec", [[1, 2], [1, 2, 3], [3, 4], [1, float("nan")]],
                                        return_exceptions=True)
    assert out[0] == 3.0 and out[2] == 7.0
    assert isinstance(out[1], InvalidPayload) and "shape (3,)" in str(out[1])
    assert isinstance(out[3], InvalidPayload) and "NaN" in str(out[3])


def gated(name: str) -> tuple[Model, threading.Event, threading.Event]:
    """A model that signals ``entered`` and blocks in its forward until ``release``."""
    entered, release = threading.Event(), threading.Event()

    def forward(xs: list[int]) -> list[int]:
        entered.set()
        release.wait(10)
        return xs

    return Model(name, fn=forward, policy=BatchPolicy(batch_wait_timeout_s=0)), entered, release


@pytest.fixture
def ack_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(entries acked, ARGV[3]: ``=`` or a SHA-1's hex) of every PUBLISH."""
    checks: list[tuple[int, str]] = []
    script = LeanLink.script

    async def record(self: LeanLink, source: str, keys: list[Any], args: list[Any]) -> Any:
        if source == lua.PUBLISH:
            checks.append((int(args[0]), str(args[2])))
        return await script(self, source, keys, args)

    monkeypatch.setattr(LeanLink, "script", record)
    return checks


async def test_a_small_batch_is_acked_by_its_entries(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis,
        ack_checks: list[tuple[int, str]]) -> None:
    """By its entries (Redis runs one LPOS each) while a batch holds at most
    ``ACK_BY_ENTRIES_MAX`` entries and ``ACK_BY_ENTRIES_MAX_BYTES``; else by its SHA-1:
    9 entries (queued before the worker starts: its first claim takes them all), or one
    entry over the byte cap."""
    async with Client(redis_url, require_workers=False) as client:
        nine = [await client.submit("lengths", "x") for _ in range(9)]
        start_worker([lengths])
        assert [await future for future in nine] == [1] * 9
        raw_redis.config_resetstat()
        assert await client.predict("lengths", "y") == 1
        lpos = raw_redis.info("commandstats")["cmdstat_lpos"]["calls"]
        big = "z" * protocol.ACK_BY_ENTRIES_MAX_BYTES
        assert await client.predict("lengths", big) == len(big)
    sha1 = re.compile("[0-9a-f]{40}")
    assert [(n, check if check == "=" else bool(sha1.fullmatch(check)))
            for n, check in ack_checks] == [(9, True), (1, "="), (1, True)], ack_checks
    assert lpos == 1


async def test_a_batch_of_large_entries_is_acked_by_them_however_many(
        start_worker: Callable[..., Worker], redis_url: str,
        ack_checks: list[tuple[int, str]]) -> None:
    """Past ``ACK_BY_ENTRIES_MAX`` entries, a batch whose entries hold at least
    ``ACK_BY_ENTRIES_MIN_MEAN_BYTES`` each on average is still acked by them (LPOS in
    place beats hashing a copy of large entries): 12 of them queued before the worker
    starts, so that its first claim takes them all."""
    size = protocol.ACK_BY_ENTRIES_MIN_MEAN_BYTES
    async with Client(redis_url, require_workers=False) as client:
        queued = [await client.submit("lengths", "a" * size) for _ in range(12)]
        start_worker([lengths])
        assert [await future for future in queued] == [size] * 12
    assert ack_checks == [(12, "=")]


def test_which_batches_are_acked_by_their_entries() -> None:
    mean, most = protocol.ACK_BY_ENTRIES_MIN_MEAN_BYTES, protocol.ACK_BY_ENTRIES_MAX
    assert acks_by_entries([b"x"] * most)  # a few, however small
    assert not acks_by_entries([b"x" * (mean - 1)] * (most + 1))  # many small: by SHA-1
    assert acks_by_entries([b"x" * mean] * (most + 1))
    assert acks_by_entries([b"x" * (mean * (most + 1) - most)] + [b"x"] * most)  # the mean
    over = protocol.ACK_BY_ENTRIES_MAX_BYTES // mean + 1
    assert not acks_by_entries([b"x" * mean] * over)  # over the byte cap
    most_large = protocol.ACK_BY_ENTRIES_MAX_LARGE
    assert acks_by_entries([b"x" * mean] * most_large)
    assert not acks_by_entries([b"x" * mean] * (most_large + 1))  # n(n+1)/2 scans: by SHA-1
    assert not acks_by_entries([])


async def test_claimed_items_sit_in_flight_until_acked(start_worker: Callable[..., Worker],
                                                       redis_url: str,
                                                       raw_redis: redis.Redis) -> None:
    model, entered, release = gated("gated")
    worker = start_worker([model])
    async with Client(redis_url, require_workers=False) as client:
        future = await client.submit("gated", 5)
        assert await asyncio.to_thread(entered.wait, 10)
        inflight = protocol.inflight_key("gated", worker.worker_id)
        assert raw_redis.llen(inflight) == 1
        assert raw_redis.llen(protocol.queue_key("gated")) == 0
        release.set()
        assert await future == 5
    assert raw_redis.llen(inflight) == 0


async def test_heartbeat_ticks_during_a_long_forward(start_worker: Callable[..., Worker],
                                                     redis_url: str,
                                                     raw_redis: redis.Redis) -> None:
    model, entered, release = gated("slow")
    worker = start_worker([model])
    async with Client(redis_url, require_workers=False) as client:
        future = await client.submit("slow", 1)
        assert await asyncio.to_thread(entered.wait, 10)
        first = raw_redis.zscore(protocol.workers_key("slow"), worker.worker_id)
        await asyncio.sleep(0.6)  # three heartbeat intervals while the forward blocks
        second = raw_redis.zscore(protocol.workers_key("slow"), worker.worker_id)
        release.set()
        assert await future == 1
    assert first is not None and second is not None and second > first


async def test_torch_model_stacks_and_splits(start_worker: Callable[..., Worker],
                                             redis_url: str) -> None:
    import torch

    def build() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Linear(3, 2)

    start_worker([torch_model("lin", build, TensorSpec("float32", (3,)))])
    xs = np.arange(12, dtype=np.float32).reshape(4, 3)
    async with Client(redis_url, require_workers=False) as client:
        out = await client.predict_many("lin", list(xs))
    expected = build()(torch.from_numpy(xs)).detach().numpy()
    np.testing.assert_allclose(np.stack(out), expected, rtol=1e-5, atol=1e-6)


async def test_stacked_and_async_batch_functions(start_worker: Callable[..., Worker],
                                                 redis_url: str) -> None:
    shapes: list[tuple[int, ...]] = []

    def stacked(arr: np.ndarray) -> np.ndarray:
        shapes.append(arr.shape)
        return arr.sum(axis=1)

    async def asum(xs: list[int]) -> list[int]:
        await asyncio.sleep(0)
        return [x + 100 for x in xs]

    start_worker([Model("st", fn=stacked, spec=TensorSpec("int64", (2,)), stack=True),
                  Model("as", fn=asum)])
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict_many("st", [[1, 2], [3, 4]]) == [3, 7]
        assert await client.predict("as", 1) == 101
    assert all(len(s) == 2 and s[1] == 2 for s in shapes)


async def test_inline_models_run_on_the_event_loop(start_worker: Callable[..., Worker],
                                                   redis_url: str) -> None:
    threads: set[str] = set()

    def record(xs: list[int]) -> list[int]:
        threads.add(threading.current_thread().name)
        return xs

    start_worker([Model("on-loop", fn=record, inline=True),
                  Model("in-thread", fn=record)])
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict("on-loop", 1) == 1
        on_loop = set(threads)
        assert await client.predict("in-thread", 2) == 2
    assert on_loop == {threading.current_thread().name}
    assert any(name.startswith("redbatch-forward") for name in threads - on_loop)


async def test_a_loop_whose_step_swallowed_its_cancel_still_ends() -> None:
    """A step that swallows the cancel (as Python 3.11's ``asyncio.wait_for`` can, inside
    redis-py, when the cancel lands just as a write completes) returns normally; the
    loop sees the pending cancel at its next turn and ends instead of going on."""
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)

    loop = asyncio.create_task(process._keep_going("step", step, asyncio.Event()))
    await asyncio.sleep(0.05)
    loop.cancel()
    done, _pending = await asyncio.wait([loop], timeout=5)
    assert done and loop.cancelled() and calls == 1


async def test_a_cancelled_worker_leaves_no_task_or_connection_behind(
        redis_url: str, raw_redis: redis.Redis) -> None:
    """A worker's run cancelled (not stopped) ends its batch loops, heartbeat and
    pipeline duty with it: one that went on would take connections of the closed
    pools again, left open."""
    ours = {c["id"] for c in raw_redis.client_list()}
    worker = Worker([Model("idle", fn=lambda xs: xs)], RedisSettings(redis_url), FAST_WORKER)
    run = asyncio.create_task(worker.run(asyncio.Event()))
    await wait_live(redis_url, "idle")
    before = set(asyncio.all_tasks())
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await asyncio.sleep(2 * FAST_WORKER.heartbeat_interval_s)  # a beat that went on
    assert not [t for t in before if not t.done() and t is not asyncio.current_task()]
    assert {c["id"] for c in raw_redis.client_list()} == ours
