"""A requeued entry keeps the producer's bytes: only ``attempt`` and ``suspect`` change."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import redis

from redbatch import codec, protocol
from redbatch.protocol import MAX_ENTRY_BYTES
from redbatch.splice import requeue_entry, splice


def envelope(payload_text: str, extra: str = "") -> bytes:
    now = protocol.now_ms()
    return (f'{{ "v":1, "id":"r1","model":"m","enqueue_ms":{now},'
            f' "deadline_ms":{now + 30000},"reply_to":"rb:reply:{{m}}:c",'
            f'"attempt":0{extra},\n"payload": {payload_text} }}').encode()


def test_json_keeps_the_payload_text_and_unknown_fields() -> None:
    raw = envelope("[1e5, 2.50, 1E-3]", ', "custom": {"k": [1, 2]}')
    out = splice(raw, {"attempt": 1, "suspect": True}, "json")
    assert b"[1e5, 2.50, 1E-3]" in out
    assert codec.decode(out) == {**codec.decode(raw), "attempt": 1, "suspect": True}
    assert out.index(b'"attempt"') < out.index(b'"payload"')  # replaced in place


def test_json_repeated_name_keeps_the_last_value_as_decoding_does() -> None:
    raw = b'{"a": 1, "b": "x", "a": 2}'
    out = splice(raw, {"c": None}, "json")
    assert codec.decode(out) == {**codec.decode(raw), "c": None} == {"a": 2, "b": "x", "c": None}


def test_json_names_with_escapes_and_white_space() -> None:
    raw = b'{ "a\\"b" :\t"\\u00e9" , " k ":[ ] }'
    out = splice(raw, {"attempt": 3}, "json")
    assert codec.decode(out) == {'a"b': "é", " k ": [], "attempt": 3}


@pytest.mark.parametrize("raw", [b"[1, 2]", b'{"a": 1', b'{"a": 1} x', b'{"a" 1}',
                                 b'{"a": 1,}', b"{a: 1}", b'{"a": 1 "b": 2}'])
def test_json_that_is_not_one_object_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        splice(raw, {"attempt": 1}, "json")


def test_msgpack_keeps_float32_values() -> None:
    fields = {"v": 1, "id": "r1", "attempt": 0, "payload": [0.5, 1.25] * 1000, "x": b"\0"}
    raw = msgpack.packb(fields, use_bin_type=True, use_single_float=True)
    out = splice(raw, {"attempt": 2, "suspect": True}, "msgpack")
    assert raw[raw.index(b"payload"):] in out  # the payload's float32 bytes as they were
    assert len(out) < len(raw) + 20
    assert codec.decode(out) == {**fields, "attempt": 2, "suspect": True}
    reencoded = codec.encode(codec.decode(raw))
    assert len(reencoded) > len(raw) + 7000  # what decoding and re-encoding would do


def test_msgpack_tensor_payload_round_trips() -> None:
    arr = np.arange(12, dtype=np.float16).reshape(3, 4)
    raw = codec.encode({"v": 1, "payload": arr})
    got = codec.decode(splice(raw, {"attempt": 1}, "msgpack"))
    assert got["attempt"] == 1 and np.array_equal(got["payload"], arr)


@pytest.mark.parametrize("raw", [msgpack.packb([1, 2]), msgpack.packb({"a": 1}) + b"\x01",
                                 msgpack.packb({"a": 1})[:-1], b"\xc1"])
def test_msgpack_that_is_not_one_map_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        splice(raw, {"attempt": 1}, "msgpack")


def request_near_the_limit(fmt: codec.Format) -> tuple[protocol.Request, bytes]:
    """A request whose payload of numbers fills the entry limit but for about 64 bytes."""
    now = protocol.now_ms()
    request = protocol.Request("r1", "m", now, now + 30000, "rb:reply:{m}:c", None)
    head = codec.encode(request.to_wire(), fmt)
    count = (MAX_ENTRY_BYTES - len(head) - 64) // (4 if fmt == "json" else 5)
    if fmt == "json":  # 1e5 is 3 characters and a separator; re-encoded, 100000.0
        payload = b"[" + b",".join([b"1e5"] * count) + b"]"
        raw = head.replace(b'"payload":null', b'"payload":' + payload)
    else:  # float32 is 5 bytes; re-encoded, a float64 of 9
        numbers = msgpack.packb([1.5] * count, use_single_float=True)
        raw = head.replace(msgpack.packb("payload") + b"\xc0", msgpack.packb("payload") + numbers)
    assert len(raw) <= MAX_ENTRY_BYTES
    return protocol.request_from_wire(codec.decode(raw)), raw


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_an_entry_near_the_limit_is_requeued_within_it(fmt: codec.Format) -> None:
    request, raw = request_near_the_limit(fmt)
    request.attempt, request.suspect = 1, True
    assert len(codec.encode(request.to_wire(), fmt)) > MAX_ENTRY_BYTES  # the old way
    entry = requeue_entry(raw, request, fmt)
    assert entry is not None and len(entry) <= MAX_ENTRY_BYTES
    again = protocol.request_from_wire(codec.decode(entry))
    assert (again.id, again.attempt, again.suspect) == ("r1", 1, True)


def test_an_entry_that_cannot_stay_within_the_limit_is_not_requeued() -> None:
    request, raw = request_near_the_limit("json")
    padded = raw.replace(b'"payload":', b'"pad":"' + b"x" * 50 + b'","payload":')
    assert len(padded) <= MAX_ENTRY_BYTES
    request.attempt, request.suspect = 1, True
    assert requeue_entry(padded, request, "json") is None


async def test_reaper_requeues_the_producers_bytes(redis_url: str,
                                                   raw_redis: redis.Redis) -> None:
    """A dead worker's JSON entry goes back to the queue with its payload text intact."""
    import redis.asyncio as aioredis

    from redbatch.worker.reaper import Reaper

    raw = envelope("[1e5, 7]", ', "custom": 1').replace(b'"m"', b'"spl"').replace(
        b"{m}", b"{spl}")
    raw_redis.rpush(protocol.inflight_key("spl", "zombie"), raw)
    raw_redis.zadd(protocol.workers_key("spl"), {"zombie": protocol.now_ms() - 1})
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await Reaper(client, "spl", 3).reap("zombie") == 1
    finally:
        await client.aclose()
    (entry,) = raw_redis.lrange(protocol.queue_key("spl"), 0, -1)
    assert b"[1e5, 7]" in entry and b'"custom":1' in entry
    assert codec.decode(entry) == {**codec.decode(raw), "attempt": 1, "suspect": True}
