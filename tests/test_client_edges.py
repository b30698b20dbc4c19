"""The Python client at its edges: waiters never outlive a failed call, the waiter cap
holds under concurrent callers, a flush's requests are admitted each on its own terms,
and closing (async or sync) leaves nothing running, against a real Redis."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import redis

from redbatch import Client, SyncClient, protocol
from redbatch.errors import InvalidPayload, QueueFull, RedbatchError
from redbatch.pipelines import Pipeline
from redbatch.producer.admission import Admission
from redbatch.worker.model import Model
from redbatch.worker.process import Worker
from tests.conftest import wait_live

pytestmark = pytest.mark.timeout(30)


async def test_submit_many_with_ids_and_an_input_it_cannot_encode_leaves_no_waiter(
        redis_url: str) -> None:
    async with Client(redis_url, require_workers=False, max_waiters=2) as client:
        with pytest.raises(InvalidPayload, match="cannot encode"):
            await client.submit_many("m", [1, object()], 10, request_ids=["a", "b"])
        assert client.waiting == 0
        futures = await client.submit_many("m", [1, 2], 10, request_ids=["a", "b"])
        assert client.waiting == 2
        for future in futures:
            future.cancel()


async def test_the_waiter_cap_holds_for_callers_that_checked_it_side_by_side(
        redis_url: str) -> None:
    async with Client(redis_url, require_workers=False, max_waiters=5) as client:
        for model in ("m1", "m2"):  # (m2: a model the client meets for the first time)
            results = await asyncio.gather(*(client.submit(model, i, 10) for i in range(50)),
                                           return_exceptions=True)
            accepted = [r for r in results if not isinstance(r, BaseException)]
            assert len(accepted) == 5 and client.waiting == 5
            assert all(isinstance(r, QueueFull) for r in results if r not in accepted)
            for future in accepted:
                future.cancel()
            await asyncio.sleep(0)
            assert client.waiting == 0


async def test_a_short_deadline_or_a_low_cap_in_the_same_tick_refuses_only_its_own(
        redis_url: str, raw_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    async def capacity(self: Admission, model: str) -> float:
        return 1000.0  # as if workers published that they drain 1000 items/s

    monkeypatch.setattr(Admission, "capacity", capacity)
    queue = protocol.queue_key("m")
    async with Client(redis_url, require_workers=False, pack_rows=1) as client:
        for other, depth in (({"timeout_s": 0.05}, 100), ({"max_queue_len": 3}, 5)):
            raw_redis.delete(queue)
            raw_redis.rpush(queue, *[b"x"] * depth)
            long, short = await asyncio.gather(client.submit("m", 1, 10),
                                               client.submit("m", 2, **{"timeout_s": 10,
                                                                        **other}))
            with pytest.raises(QueueFull):
                await short
            assert not long.done()  # queued: no worker answers it
            assert raw_redis.llen(queue) == depth + 1
            long.cancel()


async def test_close_right_after_submit_sends_the_push_and_leaves_nothing_running(
        redis_url: str, raw_redis: redis.Redis) -> None:
    client = Client(redis_url, require_workers=False)
    await client.submit("late", 0, 5)  # (warm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        future = await client.submit("late", 1, 5)
        await client.close()
        assert future.done()
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert raw_redis.llen(protocol.queue_key("late")) == 2


async def test_close_while_a_request_starts_the_client_closes_what_it_started(
        redis_url: str) -> None:
    client = Client(redis_url, require_workers=False)
    call = asyncio.create_task(client.predict("m", 1, 5))
    await asyncio.sleep(0)
    await client.close()
    assert client._redis is None and client._listeners is None
    with pytest.raises(RedbatchError):
        await call
    await client.close()


async def test_requests_racing_close_fail_typed_and_the_closed_client_stays_closed(
        redis_url: str) -> None:
    """The model's first look-up, cancelled by the close, ended each caller with a
    ``CancelledError`` nobody asked for; a request after the close opened a new
    connection pool that nobody closed."""
    client = Client(redis_url, default_timeout_s=5)
    await client.start()
    calls = [asyncio.create_task(client.predict("nobody", i)) for i in range(5)]
    await asyncio.sleep(0)  # (each one in its look-up of the model's workers)
    await client.close()
    for call in calls:
        with pytest.raises(RedbatchError, match="closed"):
            await call
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        for again in (client.predict("nobody", 1), client.live_workers("nobody"),
                      client.configure("nobody")):
            with pytest.raises(RedbatchError, match="client is closed"):
                await again
        assert client._redis is None
        await client.start()  # (started again on purpose: it works, and closes)
        assert await client.live_workers("nobody") == 0
        await client.close()


def test_a_sync_clients_close_right_after_its_submits_fails_each_typed(
        redis_url: str) -> None:
    """Calls still in their look-ups when the loop's tasks were cancelled ended with
    ``concurrent.futures.CancelledError``."""
    client = SyncClient(redis_url, require_workers=False)
    futures = [client.submit("m", i, 5) for i in range(20)]
    client.close()
    for future in futures:
        with pytest.raises(RedbatchError, match="closed"):
            future.result(5)


@pytest.mark.parametrize(("call", "match"), [
    ({"request_id": 5}, "request_id must be a str"),
    ({"request_id": "x" * 129}, "request_id must be a str of 1-128"),
    ({"request_id": ""}, "request_id must be a str of 1-128"),
    ({"request_id": "a\ud800"}, "encode as UTF-8"),
    ({"timeout_s": float("nan")}, "timeout_s must be a number"),
    ({"timeout_s": "1"}, "timeout_s must be a number"),
    ({"deadline_ms": "soon"}, "deadline_ms must be"),
    ({"model": None}, "invalid model name"),
    ({"max_queue_len": "5"}, "max_queue_len must be"),
    ({"max_queue_len": 0}, "max_queue_len must be"),
])
@pytest.mark.parametrize("sub_queues", [1, 3])
async def test_a_calls_bad_argument_is_invalid_payload_before_anything_is_queued(
        redis_url: str, raw_redis: redis.Redis, call: dict[str, Any], match: str,
        sub_queues: int) -> None:
    """A bad id was queued and dead-lettered by the worker (its caller waited out its
    deadline), or raised a raw ``AttributeError`` / ``UnicodeEncodeError`` on a model
    of several sub-queues; a NaN timeout or a ``None`` model a raw ``ValueError`` or
    ``TypeError``."""
    raw_redis.set(protocol.meta_key("m"), b'{"name":"m","defaults":{"sub_queues":1}}')
    raw_redis.hset(protocol.config_key("m"), "sub_queues", sub_queues)
    args = {"model": "m", **call}
    async with Client(redis_url, require_workers=False) as client:
        with pytest.raises(InvalidPayload, match=match):
            await client.submit(args.pop("model"), 1, **args)
        if "request_id" in call:
            with pytest.raises(InvalidPayload, match=match):
                await client.submit_many("m", [1, 2], request_ids=["ok", call["request_id"]])
        assert client.waiting == 0
    assert not [k for k in raw_redis.scan_iter("rb:{m*") if b"queue" in k]


async def test_a_streams_bad_cap_is_invalid_payload(redis_url: str) -> None:
    """``max_queue_len="5"`` raised a raw ``TypeError``; 0 a ``QueueFull``."""
    async with Client(redis_url, require_workers=False) as client:
        for cap in ("5", 0):
            with pytest.raises(InvalidPayload, match="max_queue_len must be"):
                client.stream("m", 1, max_queue_len=cap)  # type: ignore[arg-type]


async def test_predict_many_refuses_what_is_not_a_list_of_inputs(redis_url: str) -> None:
    async with Client(redis_url, require_workers=False) as client:
        for bad in ({"a": 1}, (x for x in range(3)), "abc"):
            with pytest.raises(InvalidPayload, match="inputs must be a list"):
                await client.predict_many("m", bad)  # type: ignore[arg-type]
        assert await client.predict_many("m", ()) == []


@pytest.mark.parametrize("bad", [{"block_timeout_s": -1}, {"block_timeout_s": float("nan")},
                                 {"block_timeout_s": 0}, {"listener_idle_s": 0},
                                 {"max_queue_len": -5}, {"max_queue_len": "5"},
                                 {"max_waiters": 0}])
def test_a_clients_bad_limit_is_a_config_error(redis_url: str, bad: dict[str, Any]) -> None:
    """A negative block timeout made every request wait out its deadline (the reply
    listener's pop refused, retried forever); 0 made that pop wait forever."""
    from redbatch.errors import ConfigError

    with pytest.raises(ConfigError, match=next(iter(bad))):
        Client(redis_url, **bad)


async def test_a_cancelled_pipeline_call_frees_its_waiter(
        redis_url: str, start_worker: Callable[..., Worker]) -> None:
    gate = threading.Event()

    def slow(xs: list[Any]) -> list[Any]:
        gate.wait(5)
        return xs

    start_worker([Model("slowstage", fn=slow)], pipelines=[Pipeline("slowpipe",
                                                                    ["slowstage"])])
    await wait_live(redis_url, "slowpipe")
    async with Client(redis_url, max_waiters=3) as client:
        for _ in range(4):
            call = asyncio.create_task(client.predict("slowpipe", 1, 20))
            await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        assert client.waiting == 0
        gate.set()


def test_a_sync_client_closed_under_another_threads_calls_settles_every_one(
        redis_url: str) -> None:
    client = SyncClient(redis_url, require_workers=False)
    futures: list[concurrent.futures.Future[Any]] = []
    refused: list[BaseException] = []

    def submitting() -> None:
        for _ in range(100_000):  # until the client is closed
            try:
                futures.append(client.submit("m", 1, 2))
            except RedbatchError as exc:
                refused.append(exc)
                return

    thread = threading.Thread(target=submitting)
    thread.start()
    while len(futures) < 50:
        time.sleep(0.001)
    client.close()
    thread.join(5)
    for future in futures:  # (never a cancellation nobody asked for)
        with pytest.raises(RedbatchError):
            future.result(5)
    assert refused and "closed" in str(refused[0])
    with pytest.raises(RedbatchError, match="closed"):
        client.predict("m", 1, 1)


def test_a_client_started_on_one_loop_says_so_on_another(redis_url: str) -> None:
    """It failed each call with 'Event loop is closed', or hung to the deadline."""
    client = Client(redis_url, require_workers=False)

    async def once() -> None:
        future = await client.submit("m", 1, 5)
        future.cancel()

    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(once())
        with pytest.raises(RedbatchError, match="another event loop"):
            asyncio.run(once())
    finally:
        first.run_until_complete(client.close())  # (on its own loop: nothing left open)
        first.close()


async def test_bad_arguments_are_refused_at_once(redis_url: str) -> None:
    from redbatch import BatchPolicy, TensorSpec
    from redbatch.errors import ConfigError

    with pytest.raises(ConfigError, match="fmt"):
        Client(redis_url, fmt="JSON")  # type: ignore[arg-type]
    for bad in ({"max_batch_size": 8.0}, {"max_batch_size": "8"}):
        with pytest.raises(ConfigError, match="max_batch_size"):
            BatchPolicy(**bad)  # type: ignore[arg-type]
    for shape in (4, (-1,), ("4",)):
        with pytest.raises(ConfigError, match="shape"):
            TensorSpec("float32", shape)  # type: ignore[arg-type]
    assert TensorSpec("float32", [3]).shape == (3,)
    async with Client(redis_url, require_workers=False) as client:
        for ids in (["a1", "a2"], ["b1", "b2", "b3", "b4"]):
            with pytest.raises(InvalidPayload, match="request ids for 3 inputs"):
                await client.submit_many("m", [1, 2, 3], 5, request_ids=ids)
        assert client.waiting == 0


def test_a_sync_client_waits_for_the_deadline_it_was_given(redis_url: str) -> None:
    """Given ``deadline_ms``, it gave up after its default timeout + 5 s all the same."""
    from redbatch.producer.sync import MARGIN_S

    client = SyncClient(redis_url, require_workers=False, default_timeout_s=1)
    try:
        budget = client._budget(None, protocol.now_ms() + 12_000)
        assert 12 + MARGIN_S - 1 < budget <= 12 + MARGIN_S
        assert client._budget(None) == 1 + MARGIN_S
    finally:
        client.close()
