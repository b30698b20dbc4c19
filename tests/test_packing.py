"""Packing: ``submit_many`` and lone ``predict`` calls of one tick send same-shape arrays
as one queue entry per ``pack_rows`` rows (while the workers take multi-row requests);
the worker computes each row as its own item (in passes of at most ``max_batch_size``),
a row that is bad or fails the model fails alone, and the listener splits each reply
back to the members' own waiters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import redis

from redbatch import Client, codec, protocol
from redbatch.errors import InvalidPayload, ModelError
from redbatch.producer import packing
from redbatch.producer.listener import ReplyListener
from redbatch.protocol import Reply, Request
from redbatch.spec import TensorSpec
from redbatch.worker.decode import decode_batch
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker
from redbatch.worker.replies import encode_reply
from redbatch.worker.runner import BatchRunner, Claimed
from tests.conftest import until

SPEC = TensorSpec("float32", (4,))


def doubler(name: str, max_batch_size: int = 32, seen: list[int] | None = None) -> Model:
    """Doubles each row; records each pass's size in ``seen``; fails on a row of -1s."""

    def forward(batch: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if seen is not None:
            seen.append(len(batch))
        if (batch == -1).all(axis=1).any():
            raise ValueError("-1 is unlucky")
        return batch * 2

    return Model(name, fn=forward, spec=SPEC, stack=True,
                 policy=BatchPolicy(max_batch_size=max_batch_size, batch_wait_timeout_s=0.002))


def inputs(n: int) -> list[np.ndarray[Any, Any]]:
    return [np.full(4, i, dtype=np.float32) for i in range(n)]


async def rows_taken(client: Client, model: str) -> None:
    """Wait until the client sees that the model's live workers take multi-row requests."""
    while not await client._admission.takes_rows(model):
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_submit_many_sends_packs_and_returns_one_output_per_input(
        start_worker: Callable[..., Worker], redis_url: str, fmt: str) -> None:
    worker = start_worker([doubler("double")])
    async with Client(redis_url, require_workers=False, fmt=fmt, pack_rows=32) as client:  # type: ignore[arg-type]
        await rows_taken(client, "double")
        runner = worker.runners[0]
        before = (runner.stats.entries, runner.stats.items)
        futures = await client.submit_many("double", inputs(100), timeout_s=10)
        outputs = await asyncio.gather(*futures)
        while runner.stats.items - before[1] < 100:  # counted once the replies are out
            await asyncio.sleep(0.02)
        assert runner.stats.entries - before[0] == 4  # ceil(100 / 32) queue entries
        replies = await client.predict_many("double", inputs(3), timeout_s=10, reply=True)
    assert [o.tolist() for o in outputs] == [[2.0 * i] * 4 for i in range(100)]
    assert [r.payload.tolist() for r in replies] == [[2.0 * i] * 4 for i in range(3)]
    assert all(r.ok and r.timings.batch_size >= 1 for r in replies)  # a pack's timings


async def test_no_packs_until_every_live_worker_takes_rows(redis_url: str,
                                                           raw_redis: redis.Redis) -> None:
    async with Client(redis_url, require_workers=False, pack_rows=32) as client:
        futures = await client.submit_many("nobody-yet", inputs(5), timeout_s=5)
        entries = raw_redis.lrange(protocol.queue_key("nobody-yet"), 0, -1)
        for future in futures:
            future.cancel()
    assert [protocol.F_ROWS in codec.decode(e) for e in entries] == [False] * 5


async def test_a_batch_sent_whole_is_one_entry_and_one_reply(
        start_worker: Callable[..., Worker], redis_url: str, raw_redis: redis.Redis) -> None:
    tensor = np.stack(inputs(10))
    tensor[4] = -1  # fails the model: its row alone
    starts, parts = packing.slices(tensor, 4)
    assert starts == [0, 4, 8] and [len(p) for p in parts] == [4, 4, 2]
    assert all(p.base is tensor for p in parts)  # views: never split into rows
    async with Client(redis_url, require_workers=False) as client:
        futures = await client.submit_many("double", parts, timeout_s=10, batched=True,
                                           reply=True)
        entries = raw_redis.lrange(protocol.queue_key("double"), 0, -1)
        start_worker([doubler("double")])
        replies = await asyncio.gather(*futures)
        outputs = await (await client.submit_many("double", parts[:1], timeout_s=10,
                                                   batched=True))[0]
        with pytest.raises(InvalidPayload, match="1 to 4096 rows"):
            await client.submit_many("double", [np.float32(1)], batched=True)
    assert [codec.decode(e)[protocol.F_ROWS] for e in entries] == [4, 4, 2]
    assert [r.ok for r in replies] == [True] * 3 and replies[1].row_errors.keys() == {0}
    assert replies[2].payload.tolist() == [[16.0] * 4, [18.0] * 4]
    assert [o.tolist() for o in outputs] == [[2.0 * i] * 4 for i in range(4)]


async def test_a_row_that_is_invalid_or_fails_the_model_fails_alone(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    start_worker([doubler("double")])
    xs = inputs(10)
    xs[3] = np.full(4, np.nan, dtype=np.float32)  # refused by the spec
    xs[7] = np.full(4, -1, dtype=np.float32)  # raises in the model
    async with Client(redis_url, require_workers=False) as client:
        out = await client.predict_many("double", xs, timeout_s=10, return_exceptions=True)
    assert isinstance(out[3], InvalidPayload) and "NaN" in str(out[3])
    assert isinstance(out[7], ModelError) and "unlucky" in str(out[7])
    assert [o.tolist() for i, o in enumerate(out) if i not in (3, 7)] == [
        [2.0 * i] * 4 for i in range(10) if i not in (3, 7)]


async def test_rows_beyond_max_batch_size_run_in_passes_of_that_size(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    seen: list[int] = []
    start_worker([doubler("double8", max_batch_size=8, seen=seen)])
    async with Client(redis_url, require_workers=False, pack_rows=20) as client:
        outputs = await client.predict_many("double8", inputs(60), timeout_s=10)
    assert [o[0] for o in outputs] == [2.0 * i for i in range(60)]
    assert sum(seen) == 60 and max(seen) == 8


async def test_inputs_of_mixed_shapes_go_one_entry_each(redis_url: str,
                                                        raw_redis: redis.Redis) -> None:
    mixed = [np.zeros(4, dtype=np.float32), np.zeros(5, dtype=np.float32)]
    async with Client(redis_url, require_workers=False) as client:
        futures = await client.submit_many("double", mixed, timeout_s=5)
        entries = raw_redis.lrange(protocol.queue_key("double"), 0, -1)
        for future in futures:
            future.cancel()
    assert [protocol.F_ROWS in codec.decode(e) for e in entries] == [False, False]


def test_only_arrays_of_one_shape_and_dtype_share_a_pack() -> None:
    now = protocol.now_ms()
    one_push = [[_lone(x, now + 5000)[0] for x in [
        np.zeros(4, np.float32), np.zeros(4, np.float64), np.zeros(4, np.float32),
        np.zeros(5, np.float32)]] + [Request("l1", "double", now, now + 5000,
                                              protocol.reply_key("double", "c1"), [0.0] * 4)]]
    units, failed = packing.plan(one_push, [None], "msgpack", 32, lambda *route: None)
    assert not failed
    assert [u.request.rows for u in units] == [2, 0, 0, 0]
    assert [r.id for _i, r in units[0].members] == [
        one_push[0][0].id, one_push[0][2].id]
    again, _ = packing.plan(one_push, [None], "msgpack", 1, lambda *route: None)
    assert [u.request.rows for u in again] == [0] * 5  # pack_rows=1: no packs


def test_packs_stay_far_below_the_entry_limit() -> None:
    assert packing.pack_size(3 * 256 * 256 * 4, 32) == 1  # 768 KiB a row: one each
    assert packing.pack_size(64 * 1024, 32) == packing.PACK_BYTES // (64 * 1024) == 16
    assert packing.pack_size(16, 32) == 32


def test_a_reply_over_the_entry_limit_is_sent_as_an_error() -> None:
    huge = Reply("r1", True, payload=np.zeros(protocol.MAX_ENTRY_BYTES // 4 + 1, np.float32))
    sent = protocol.reply_from_wire(codec.decode(encode_reply("double", huge, "msgpack")))
    assert not sent.ok and sent.error_code == "model_error" and "limit" in sent.error_message


async def test_a_pack_reply_that_cannot_be_split_still_settles_every_member() -> None:
    client = redis.asyncio.Redis()  # never connects: only the routing is tested
    listener = ReplyListener(client, protocol.reply_key("double", "c1"), 1.0)
    deadline_ms = protocol.now_ms() + 10_000
    futures = [listener.expect(rid, deadline_ms, False) for rid in ("m1", "m2")]
    listener.route_pack("p1", ["m1", "m2"], deadline_ms)
    listener.dispatch(codec.encode(Reply("p1", True, payload=np.float32(1.0)).to_wire()))
    done = await asyncio.gather(*futures, return_exceptions=True)
    assert all(isinstance(o, InvalidPayload) for o in done) and listener.waiting == 0
    await listener.stop()
    await client.aclose()


def _entry(payload: Any, count: Any) -> bytes:
    wire = protocol.Request("r1", "double", protocol.now_ms(), protocol.now_ms() + 10_000,
                            protocol.reply_key("double", "c1"), payload).to_wire()
    wire[protocol.F_ROWS] = count
    return codec.encode(wire)


def test_a_rows_field_that_does_not_match_the_payload_is_refused() -> None:
    model = doubler("double")
    now = protocol.now_ms()
    mismatched = decode_batch([_entry(np.zeros((2, 4), np.float32), 3)], model, now)
    assert not mismatched.items and "first dimension is 3" in str(mismatched.early[0][2])
    for bad in (0, protocol.MAX_ROWS + 1, True, "3"):
        decoded = decode_batch([_entry(np.zeros((2, 4), np.float32), bad)], model, now)
        assert decoded.dead and "field 'rows'" in str(decoded.early[0][2])


def test_a_reply_that_does_not_hold_one_output_per_row_fails_each_row() -> None:
    """A worker without multi-row support would answer with one output for the lot."""
    outcomes = packing.split_reply(Reply("r1", True, payload=[1.0, 2.0]), 3)
    assert all(isinstance(o, InvalidPayload) for o in outcomes)
    failed = packing.split_reply(Reply("r1", False, error_code="deadline_exceeded",
                                  error_message="late"), 2)
    assert [type(o).__name__ for o in failed] == ["DeadlineExceeded"] * 2
    partly = packing.split_reply(Reply("r1", True, payload=[1.0, None], row_errors={
        1: ("model_error", "boom")}), 2)
    assert partly[0] == 1.0 and isinstance(partly[1], ModelError)


def test_reply_row_errors_round_trip() -> None:
    reply = Reply("r1", True, payload=[1, None], row_errors={1: ("invalid_payload", "bad")})
    again = protocol.reply_from_wire(codec.decode(codec.encode(reply.to_wire())))
    assert again.row_errors == {1: ("invalid_payload", "bad")} and again.payload == [1, None]
    with pytest.raises(InvalidPayload, match="row_errors"):
        protocol.reply_from_wire({**reply.to_wire(), protocol.F_ROW_ERRORS: [{"row": "1"}]})


async def test_claims_shrink_to_about_max_batch_size_rows() -> None:
    model = doubler("double", max_batch_size=32)
    client = redis.asyncio.Redis()  # never connects: only the arithmetic is tested
    with ThreadPoolExecutor(1) as executor:
        runner = BatchRunner(client, model, model.fn, "w1", executor, 0.2)
    await client.aclose()
    now = protocol.now_ms()

    def claimed(entries: list[bytes]) -> Claimed:
        return Claimed(len(entries), decode_batch(entries, model, now), now, "",
                       runner.claimer.source)

    packs = claimed([_entry(np.zeros((16, 4), np.float32), 16)] * 4)
    assert packs.size == 64
    counts = [runner._next_claim_count(packs) for _ in range(6)]
    assert counts[0] < 32 and counts[-1] == 2  # 2 packs of 16 rows: 32 rows a claim
    singles = claimed([codec.encode(protocol.Request(
        "s1", "double", now, now + 10_000, protocol.reply_key("double", "c1"),
        np.zeros(4, np.float32)).to_wire())] * 3)
    assert singles.size == 3
    counts = [runner._next_claim_count(singles) for _ in range(12)]
    assert counts[0] < 8 and counts == sorted(counts) and counts[-1] == 32  # grows back


def owners(unit: packing.Unit) -> list[int]:
    return [index for index, _request in unit.members]


def _lone(x: np.ndarray[Any, Any], deadline_ms: int, trace_id: str = "") -> list[Request]:
    return [Request(protocol.new_request_id(), "double", protocol.now_ms(), deadline_ms,
                    protocol.reply_key("double", "c1"), x, trace_id=trace_id)]


def test_a_flush_packs_lone_requests_of_one_shape_and_close_deadlines() -> None:
    now = protocol.now_ms()
    routes: list[tuple[str, str, list[str], int]] = []
    requests = [_lone(x, now + 5000) for x in inputs(5)]
    requests += [_lone(x, now + 9000) for x in inputs(2)]  # a later deadline: a pack apart
    requests += [_lone(np.zeros(3, np.float32), now + 5000)]  # another shape: alone
    requests += [_lone(np.zeros(4, np.float32), now + 5000, trace_id="caller-1")]  # alone
    units, failed = packing.plan(requests, [None] * len(requests), "msgpack", 32,
                                 lambda *route: routes.append(route))
    assert not failed
    assert [u.request.rows for u in units] == [5, 2, 0, 0]
    assert [owners(u) for u in units] == [[0, 1, 2, 3, 4], [5, 6], [7], [8]]
    assert [(model, len(members)) for model, _id, members, _ms in routes] == [
        ("double", 5), ("double", 2)]  # routed to the model's listener
    assert units[0].request.deadline_ms == now + 5000 and routes[1][3] == now + 9000
    assert {u.request.reply_to for u in units} == {protocol.reply_key("double", "c1")}
    again, _ = packing.plan(requests, [None] * len(requests), "msgpack", 1, None)
    assert all(u.request.rows == 0 for u in again)  # pack_rows=1, or no route: no packs


def test_a_pack_that_cannot_be_encoded_fails_its_members_alone() -> None:
    now = protocol.now_ms()
    requests = [_lone(np.zeros(4, np.uint16), now + 5000) for _ in range(3)]
    requests += [_lone(x, now + 5000) for x in inputs(2)]
    routes: list[Any] = []
    units, failed = packing.plan(requests, [None] * 5, "msgpack", 32,
                                 lambda *route: routes.append(route))
    assert sorted(failed) == [0, 1, 2] and all(
        [rid for rid, _e in failed[i]] == [requests[i][0].id] and
        isinstance(failed[i][0][1], InvalidPayload) for i in range(3))
    assert [owners(u) for u in units] == [[3, 4]] and len(routes) == 1


async def test_lone_requests_of_one_tick_travel_as_one_entry(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    worker = start_worker([doubler("double")])
    xs = inputs(10)
    xs[4] = np.full(4, np.inf, dtype=np.float32)
    async with Client(redis_url, require_workers=False) as client:
        assert await client.predict("double", xs[0], timeout_s=10) is not None  # warm up
        # the worker counts a batch after its replies are out: wait for the warm-up's
        while not await client._admission.takes_rows("double") or \
                worker.runners[0].stats.items < 1:
            await asyncio.sleep(0.05)
        before = (worker.runners[0].stats.entries, worker.runners[0].stats.items)
        out = await asyncio.gather(*(client.predict("double", x, timeout_s=10) for x in xs),
                                   return_exceptions=True)
        reply = await client.predict("double", xs[1], 10, reply=True, trace_id="caller-1")
        stats = worker.runners[0].stats  # counted once a batch's replies are out
        await until(lambda: stats.items - before[1] >= 11, "the batches counted")
        entries, items = stats.entries - before[0], stats.items - before[1]
    assert items == 11 and entries <= 3  # one or two packs, and the traced one alone
    assert isinstance(out[4], InvalidPayload)
    assert [o.tolist() for i, o in enumerate(out) if i != 4] == [
        [2.0 * i] * 4 for i in range(10) if i != 4]
    assert reply.ok and reply.payload.tolist() == [2.0] * 4


async def test_a_member_that_gives_up_leaves_the_others_their_answers(
        start_worker: Callable[..., Worker], redis_url: str) -> None:
    seen: list[int] = []
    start_worker([doubler("double", seen=seen)])
    async with Client(redis_url, require_workers=False) as client:
        await client.predict("double", inputs(1)[0], timeout_s=10)
        while not await client._admission.takes_rows("double"):
            await asyncio.sleep(0.05)
        calls = [asyncio.create_task(client.predict("double", x, timeout_s=10))
                 for x in inputs(5)]
        await asyncio.sleep(0)  # pushed; the flush runs on the next tick
        calls[2].cancel()
        out = await asyncio.gather(*calls, return_exceptions=True)
        assert client.waiting == 0
    assert isinstance(out[2], asyncio.CancelledError)
    assert [o[0] for i, o in enumerate(out) if i != 2] == [0.0, 2.0, 6.0, 8.0]
    assert 5 in seen  # the five went through the model as one pass
