"""A "foreign" client, written only from ``docs/protocol.md``, talks to a real worker.

The client side uses nothing but raw Redis commands (``redis.asyncio``), ``msgpack``,
``json``, ``base64`` and ``numpy`` for checking tensor bytes: no redbatch producer,
codec or protocol module.  Key names, fields, TTLs and the ENQUEUE script are
hard-coded exactly as the document gives them, so these tests fail if the document
and the worker drift apart.  Only the *server side* (the models a worker serves, run
by the ``start_worker`` fixture) uses redbatch.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis.asyncio as aioredis

from redbatch.spec import TensorSpec
from redbatch.worker.model import batch  # server side only

WAIT_S = 10  # every BLPOP waits at most this long (server-side timeout)

# --- the client: nothing below comes from redbatch -------------------------------

# Verbatim from docs/protocol.md, section 9 ("Recommended way: the ENQUEUE script").
# KEYS[1]=queue  KEYS[1+i]=marker of entry i
# ARGV[1]=cap  ARGV[2]=queue ttl ms  ARGV[2+i]=marker ttl ms of entry i  ARGV[2+n+i]=entry i
ENQUEUE = """
local n = #KEYS - 1
local depth = redis.call('LLEN', KEYS[1])
local room = tonumber(ARGV[1]) - depth
local accepted, pushed = 0, 0
for i = 1, n do
  if redis.call('SET', KEYS[1 + i], 'q', 'NX', 'PX', ARGV[2 + i]) then
    if room <= 0 then
      redis.call('DEL', KEYS[1 + i])
      break
    end
    redis.call('RPUSH', KEYS[1], ARGV[2 + n + i])
    room = room - 1
    pushed = pushed + 1
  end
  accepted = accepted + 1
end
if pushed > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {accepted, depth + pushed}
"""
QUEUE_TTL_MS = 3_600_000
QUEUE_CAP = 10_000
MARKER_GRACE_MS = 5_000  # a marker outlives its request's deadline by this much
REPLY_TTL_S = 120

MODEL = "fc-double"  # TensorSpec float32 (4,), stacked: returns 2 * x
LOOSE = "fc-echo"  # no spec: returns each payload unchanged
QUEUE = "rb:{fc-double}:queue"
DEAD = "rb:{fc-double}:dead"
META = "rb:{fc-double}:meta"
WORKERS = "rb:{fc-double}:workers"
WORKER_INFO = "rb:{fc-double}:worker_info"
MODELS = "rb:models"

Item = tuple[dict[str, Any], bytes]  # a request envelope and its encoded entry


def epoch_ms() -> int:
    return time.time_ns() // 1_000_000


def queue_key(model: str) -> str:
    return "rb:{" + model + "}:queue"


def marker_key(model: str, request_id: str) -> str:
    return "rb:{" + model + "}:req:" + request_id


def marker_ttl_ms(request: dict[str, Any], now: int) -> int:
    return max(request["deadline_ms"] - now, 0) + MARKER_GRACE_MS


def new_reply_to(model: str) -> str:
    """A reply list in the model's slot: ``rb:reply:{<model>}:<id>``."""
    return "rb:reply:{" + model + "}:fc-" + uuid.uuid4().hex


def envelope(model: str, reply_to: str, payload: Any, *, timeout_ms: int = 10_000,
             request_id: str | None = None) -> dict[str, Any]:
    now = epoch_ms()
    return {"v": 1, "id": request_id or uuid.uuid4().hex, "model": model, "enqueue_ms": now,
            "deadline_ms": now + timeout_ms, "reply_to": reply_to, "attempt": 0,
            "payload": payload}


def msgpack_tensor(arr: np.ndarray[Any, Any]) -> dict[str, Any]:
    little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {"__tensor__": {"dtype": arr.dtype.name, "shape": list(arr.shape),
                           "data": little.tobytes()}}


def json_tensor(arr: np.ndarray[Any, Any]) -> dict[str, Any]:
    fields = msgpack_tensor(arr)["__tensor__"]
    return {"__tensor__": {**fields, "data": base64.b64encode(fields["data"]).decode()}}


def tensor_from_reply(value: Any) -> np.ndarray[Any, Any]:
    assert isinstance(value, dict) and set(value) == {"__tensor__"}, value
    fields = value["__tensor__"]
    data = fields["data"]
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return np.frombuffer(raw, dtype=np.dtype(fields["dtype"]).newbyteorder("<")).reshape(
        fields["shape"])


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def mp(request: dict[str, Any]) -> Item:
    return request, pack(request)


def js(request: dict[str, Any]) -> Item:
    return request, json.dumps(request, separators=(",", ":")).encode()


def decode_reply(raw: bytes) -> dict[str, Any]:
    reply = json.loads(raw) if raw[:1] == b"{" else msgpack.unpackb(raw, raw=False)
    assert isinstance(reply, dict)
    return reply


def enqueue_args(model: str, items: tuple[Item, ...], cap: int) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one ENQUEUE call, as the document lays them out."""
    now = epoch_ms()
    keys = [queue_key(model), *(marker_key(model, request["id"]) for request, _ in items)]
    args: list[Any] = [cap, QUEUE_TTL_MS, *(marker_ttl_ms(request, now) for request, _ in items),
                       *(entry for _, entry in items)]
    return keys, args


async def enqueue(rc: aioredis.Redis, model: str, *items: Item,
                  cap: int = QUEUE_CAP) -> tuple[int, int]:
    """Run ENQUEUE; return (accepted, queue length after)."""
    keys, args = enqueue_args(model, items, cap)
    result: Any = await rc.eval(ENQUEUE, len(keys), *keys, *args)
    accepted, depth = result
    return int(accepted), int(depth)


async def push_plain(rc: aioredis.Redis, queue: str, *entries: bytes) -> None:
    """The simplest valid enqueue: RPUSH at the tail, then refresh the queue's TTL."""
    async with rc.pipeline(transaction=True) as pipe:
        pipe.rpush(queue, *entries)
        pipe.pexpire(queue, QUEUE_TTL_MS)
        await pipe.execute()


async def next_reply(rc: aioredis.Redis, reply_to: str) -> tuple[bytes, dict[str, Any]]:
    got = await rc.blpop([reply_to], timeout=WAIT_S)
    assert got is not None, f"no reply on {reply_to} within {WAIT_S} s"
    key, raw = got
    assert key.decode() == reply_to
    return raw, decode_reply(raw)


async def replies_by_id(rc: aioredis.Redis, reply_to: str, n: int) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for _ in range(n):
        _raw, reply = await next_reply(rc, reply_to)
        assert reply["id"] not in found, f"a second reply to {reply['id']}"
        found[reply["id"]] = reply
    return found


async def replies_until(rc: aioredis.Redis, reply_to: str, last_id: str
                        ) -> list[dict[str, Any]]:
    """Every reply up to and including the one to ``last_id`` (each pop is bounded)."""
    seen: list[dict[str, Any]] = []
    while not seen or seen[-1]["id"] != last_id:
        assert len(seen) < 50, "runaway replies"
        seen.append((await next_reply(rc, reply_to))[1])
    return seen


def assert_timings(reply: dict[str, Any], worker_id: str) -> None:
    timings = reply["timings"]
    assert set(timings) == {"queue_wait_ms", "batch_size", "forward_ms", "worker_id"}
    assert isinstance(timings["queue_wait_ms"], int | float)
    assert isinstance(timings["batch_size"], int)
    assert isinstance(timings["forward_ms"], int | float)
    assert timings["worker_id"] == worker_id


def assert_error(reply: dict[str, Any], request_id: str, code: str) -> None:
    assert reply["v"] == 1
    assert reply["id"] == request_id
    assert reply["ok"] is False
    assert "payload" not in reply
    assert reply["error"]["code"] == code, reply
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]


# --- the server side: models served by an in-process worker ------------------------

def double_model(calls: list[int] | None = None) -> Any:
    def fn(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if calls is not None:
            calls.append(len(x))
        return x * 2

    return batch(name=MODEL, max_batch_size=8, batch_wait_timeout_s=0.01,
                 spec=TensorSpec("float32", (4,)), stack=True, input_name="x",
                 output_name="y")(fn)


def echo_model(calls: list[list[Any]] | None = None) -> Any:
    def fn(inputs: list[Any]) -> list[Any]:
        if calls is not None:
            calls.append(list(inputs))
        return list(inputs)

    return batch(name=LOOSE, max_batch_size=8, batch_wait_timeout_s=0.0)(fn)


@pytest.fixture
async def rc(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)  # no socket timeout: BLPOP has its own
    yield client
    await client.aclose()


async def wait_for_key(rc: aioredis.Redis, key: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await rc.exists(key):
        assert time.monotonic() < deadline, f"{key} never appeared"
        await asyncio.sleep(0.02)


# --- tests -------------------------------------------------------------------------

async def test_msgpack_tensor_via_enqueue_script(rc: aioredis.Redis,
                                                 start_worker: Callable[..., Any]) -> None:
    worker = start_worker([double_model()])
    reply_to = new_reply_to(MODEL)
    x = np.array([1.5, -2.0, 0.25, 1e6], dtype=np.float32)
    request = envelope(MODEL, reply_to, msgpack_tensor(x))
    accepted, depth = await enqueue(rc, MODEL, mp(request))
    assert accepted == 1 and depth in (0, 1)  # a worker may have claimed it already

    await wait_for_key(rc, reply_to)  # created by the worker's RPUSH, with a TTL
    assert 0 < await rc.ttl(reply_to) <= REPLY_TTL_S
    raw, reply = await next_reply(rc, reply_to)
    assert raw[:1] != b"{"  # msgpack in, msgpack out
    assert reply["v"] == 1 and reply["id"] == request["id"] and reply["ok"] is True
    assert "error" not in reply
    assert reply["payload"]["__tensor__"]["dtype"] == "float32"
    assert reply["payload"]["__tensor__"]["shape"] == [4]
    assert isinstance(reply["payload"]["__tensor__"]["data"], bytes)
    np.testing.assert_array_equal(tensor_from_reply(reply["payload"]), x * 2)
    assert_timings(reply, worker.worker_id)
    assert reply["timings"]["batch_size"] == 1

    # The marker turned from 'q' (queued) to 'd' (answered), and lives until the
    # deadline plus the grace.
    marker = marker_key(MODEL, request["id"])
    assert await rc.get(marker) == b"d"
    assert 0 < await rc.pttl(marker) <= marker_ttl_ms(request, epoch_ms()) + 50

    # The registry the document describes: meta, live workers, worker info, models.
    await wait_for_key(rc, META)
    meta = json.loads(await rc.get(META))
    assert meta["name"] == MODEL
    assert (meta["input_name"], meta["output_name"]) == ("x", "y")
    assert meta["spec"] == {"dtype": "float32", "shape": [4]}
    assert meta["policy"]["max_batch_size"] == 8
    assert 0 < await rc.ttl(META) <= 24 * 3600
    live = await rc.zrangebyscore(WORKERS, epoch_ms(), "+inf")
    assert live == [worker.worker_id.encode()]
    assert 0 < await rc.ttl(WORKERS) <= 24 * 3600
    info = json.loads(await rc.hget(WORKER_INFO, worker.worker_id))
    assert {"worker_id", "device", "pid", "host", "started_ms", "items_per_s"} <= set(info)
    assert info["worker_id"] == worker.worker_id and info["device"] == "cpu"
    assert isinstance(info["items_per_s"], int | float) and info["items_per_s"] >= 0
    assert await rc.zscore(MODELS, MODEL) is not None


async def test_enqueue_many_in_one_call_replies_matched_by_id(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    reply_to = new_reply_to(MODEL)
    inputs = [np.full(4, i, dtype=np.float32) for i in range(5)]
    requests = [envelope(MODEL, reply_to, msgpack_tensor(x)) for x in inputs]
    # Queued before any worker runs: the queue, its TTL and the markers exist on their own.
    assert await enqueue(rc, MODEL, *map(mp, requests)) == (5, 5)
    assert 0 < await rc.pttl(QUEUE) <= QUEUE_TTL_MS
    for request in requests:
        assert await rc.get(marker_key(MODEL, request["id"])) == b"q"
    worker = start_worker([double_model()])

    replies = await replies_by_id(rc, reply_to, 5)
    assert set(replies) == {r["id"] for r in requests}
    for request, x in zip(requests, inputs, strict=True):
        reply = replies[request["id"]]
        assert reply["ok"] is True
        np.testing.assert_array_equal(tensor_from_reply(reply["payload"]), x * 2)
        assert_timings(reply, worker.worker_id)
        assert 1 <= reply["timings"]["batch_size"] <= 5


async def test_enqueue_returns_accepted_and_depth_and_enforces_the_cap(
        rc: aioredis.Redis) -> None:
    a, b, c = (mp(envelope(MODEL, new_reply_to(MODEL), [0, 0, 0, i])) for i in range(3))
    assert await enqueue(rc, MODEL, a, b, c, cap=2) == (2, 2)  # a prefix fits, in order
    assert await rc.lrange(QUEUE, 0, -1) == [a[1], b[1]]
    assert 0 < await rc.pttl(QUEUE) <= QUEUE_TTL_MS
    marker_a, marker_c = marker_key(MODEL, a[0]["id"]), marker_key(MODEL, c[0]["id"])
    assert await rc.get(marker_a) == b"q"
    assert 0 < await rc.pttl(marker_a) <= 10_000 + MARKER_GRACE_MS
    assert not await rc.exists(marker_c)  # a refused entry leaves no marker behind

    assert await enqueue(rc, MODEL, c, cap=2) == (0, 2)  # full: nothing pushed
    assert not await rc.exists(marker_c)
    # Already queued counts as accepted even when the queue is full; the refusal of c
    # after it shows the split.
    assert await enqueue(rc, MODEL, a, c, cap=2) == (1, 2)
    assert await enqueue(rc, MODEL, cap=2) == (0, 2)  # no entries: a depth probe

    keys, args = enqueue_args(MODEL, (c,), 3)
    sha = await rc.script_load(ENQUEUE)  # EVALSHA works the same way
    assert await rc.evalsha(sha, len(keys), *keys, *args) == [1, 3]
    assert await rc.lrange(QUEUE, 0, -1) == [a[1], b[1], c[1]]
    assert await rc.get(marker_c) == b"q"


async def test_retried_enqueue_of_one_id_is_queued_and_answered_once(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    calls: list[list[Any]] = []
    reply_to = new_reply_to(LOOSE)
    request = envelope(LOOSE, reply_to, "once")
    # The push is retried after a (pretend) connection error: the same call again.
    assert await enqueue(rc, LOOSE, js(request)) == (1, 1)
    assert await enqueue(rc, LOOSE, js(request)) == (1, 1)  # accepted, not pushed again
    assert await enqueue(rc, LOOSE, mp(request)) == (1, 1)  # dedupe is by id, not bytes
    sentinel = envelope(LOOSE, reply_to, "sentinel")
    assert await enqueue(rc, LOOSE, js(request), mp(sentinel)) == (2, 2)
    start_worker([echo_model(calls)])

    replies = await replies_until(rc, reply_to, sentinel["id"])
    assert [r["id"] for r in replies] == [request["id"], sentinel["id"]]
    assert replies[0]["ok"] is True and replies[0]["payload"] == "once"
    assert [x for batch_ in calls for x in batch_] == ["once", "sentinel"]  # computed once
    assert await rc.llen(reply_to) == 0
    assert await rc.get(marker_key(LOOSE, request["id"])) == b"d"

    # Reusing an answered id for a new request is a client bug: it is "accepted" but
    # never queued, so it is never answered.
    reused = envelope(LOOSE, reply_to, "new work", request_id=request["id"])
    assert await enqueue(rc, LOOSE, js(reused)) == (1, 0)
    assert await rc.blpop([reply_to], timeout=0.5) is None


@pytest.mark.parametrize("queued_before_worker", [True, False],
                         ids=["same-batch", "later-batch"])
async def test_plain_rpush_twice_is_answered_once(rc: aioredis.Redis,
                                                  start_worker: Callable[..., Any],
                                                  queued_before_worker: bool) -> None:
    calls: list[list[Any]] = []
    reply_to = new_reply_to(LOOSE)
    request = envelope(LOOSE, reply_to, "twice")
    entry = json.dumps(request).encode()
    sentinel = envelope(LOOSE, reply_to, "sentinel")
    if queued_before_worker:  # both copies (no marker: both queued) land in one batch
        await push_plain(rc, queue_key(LOOSE), entry, entry, pack(sentinel))
        assert await rc.llen(queue_key(LOOSE)) == 3
        start_worker([echo_model(calls)])
    else:  # the copy comes after the first reply
        start_worker([echo_model(calls)])
        await push_plain(rc, queue_key(LOOSE), entry)
        _raw, first = await next_reply(rc, reply_to)
        assert first["id"] == request["id"] and first["payload"] == "twice"
        await push_plain(rc, queue_key(LOOSE), entry, pack(sentinel))

    # FIFO with one worker: once the sentinel is answered, both copies were handled.
    replies = await replies_until(rc, reply_to, sentinel["id"])
    ids = [r["id"] for r in replies]
    assert ids == ([request["id"], sentinel["id"]] if queued_before_worker
                   else [sentinel["id"]])
    assert [x for batch_ in calls for x in batch_] == ["twice", "twice", "sentinel"]
    assert await rc.llen(reply_to) == 0  # the second copy's reply was dropped
    assert await rc.get(marker_key(LOOSE, request["id"])) == b"d"


@pytest.mark.parametrize("tensor", [True, False], ids=["base64-tensor", "plain-list"])
async def test_json_request_with_plain_rpush(rc: aioredis.Redis,
                                             start_worker: Callable[..., Any],
                                             tensor: bool) -> None:
    worker = start_worker([double_model()])
    reply_to = new_reply_to(MODEL)
    x = np.array([1, 2, 3, 4.5], dtype=np.float32)
    payload = json_tensor(x) if tensor else x.tolist()
    request = envelope(MODEL, reply_to, payload)
    entry = json.dumps(request, separators=(",", ":")).encode()
    assert entry[:1] == b"{"
    await push_plain(rc, QUEUE, entry)

    raw, reply = await next_reply(rc, reply_to)
    assert raw[:1] == b"{"  # JSON in, JSON out
    assert reply["id"] == request["id"] and reply["ok"] is True
    assert isinstance(reply["payload"]["__tensor__"]["data"], str)  # base64 text
    np.testing.assert_array_equal(tensor_from_reply(reply["payload"]), x * 2)
    assert_timings(reply, worker.worker_id)
    assert await rc.get(marker_key(MODEL, request["id"])) == b"d"  # made by the reply


async def test_json_reply_without_tensors_is_plain_json(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    start_worker([echo_model()])
    reply_to = new_reply_to(LOOSE)
    payload = {"text": "héllo", "n": [1, 2.5, None, True]}
    request = envelope(LOOSE, reply_to, payload)
    await push_plain(rc, queue_key(LOOSE), json.dumps(request).encode())
    raw, reply = await next_reply(rc, reply_to)
    assert raw[:1] == b"{"
    assert reply["ok"] is True and reply["payload"] == payload


async def test_expired_deadline_is_answered_without_computing(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    calls: list[int] = []
    start_worker([double_model(calls)])
    reply_to = new_reply_to(MODEL)
    late = envelope(MODEL, reply_to, [1, 2, 3, 4], timeout_ms=-1)
    assert late["deadline_ms"] < epoch_ms()
    json_late = envelope(MODEL, reply_to, [1, 2, 3, 4], timeout_ms=-50)
    assert marker_ttl_ms(late, epoch_ms()) == MARKER_GRACE_MS  # never below the grace
    assert (await enqueue(rc, MODEL, mp(late), js(json_late)))[0] == 2

    replies = await replies_by_id(rc, reply_to, 2)
    assert_error(replies[late["id"]], late["id"], "deadline_exceeded")
    assert_error(replies[json_late["id"]], json_late["id"], "deadline_exceeded")
    assert replies[late["id"]]["timings"]["batch_size"] == 0
    assert calls == []  # never reached the model
    assert await rc.llen(DEAD) == 0  # expired is not malformed


async def test_malformed_entries_are_dead_lettered_and_answered_when_readable(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    worker = start_worker([double_model()])
    reply_to = new_reply_to(MODEL)
    garbage = b"\xc1\xff\x00 not msgpack"
    broken_json = b"{not json at all"
    wrong_type = envelope(MODEL, reply_to, [1, 2, 3, 4])
    wrong_type["enqueue_ms"] = "yesterday"
    wrong_version = envelope(MODEL, reply_to, [1, 2, 3, 4])
    wrong_version["v"] = 2
    wrong_model = envelope("other-model", reply_to, [1, 2, 3, 4])
    bad_tensor = envelope(MODEL, reply_to, {"__tensor__": {
        "dtype": "float32", "shape": [4], "data": b"\x00" * 15}})  # 15 bytes, needs 16
    bad_shape = envelope(MODEL, reply_to, [1, 2, 3])  # valid envelope, payload off spec
    good = envelope(MODEL, reply_to, [1, 2, 3, 4])
    dead = [garbage, broken_json, pack(wrong_type), json.dumps(wrong_version).encode(),
            pack(wrong_model), pack(bad_tensor)]
    await push_plain(rc, QUEUE, *dead, pack(bad_shape))
    await push_plain(rc, QUEUE, pack(good))  # FIFO: answered after all of the above

    replies = await replies_by_id(rc, reply_to, 6)
    for bad in (wrong_type, wrong_version, wrong_model, bad_tensor, bad_shape):
        assert_error(replies[bad["id"]], bad["id"], "invalid_payload")
    assert replies[good["id"]]["ok"] is True
    assert_timings(replies[good["id"]], worker.worker_id)
    np.testing.assert_array_equal(tensor_from_reply(replies[good["id"]]["payload"]),
                                  [2, 4, 6, 8])
    # Dead letters are written in the same script as the replies of their batch.
    assert await rc.lrange(DEAD, 0, -1) == dead  # off-spec payloads are not dead letters
    assert 0 < await rc.ttl(DEAD) <= 7 * 24 * 3600
    assert await rc.llen(reply_to) == 0  # the unreadable ones (no id) got no reply


class _Mkdir:
    """A pickle that would create ``path`` when unpickled (the hostile part)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


async def test_pickled_entries_are_never_unpickled(rc: aioredis.Redis,
                                                   start_worker: Callable[..., Any],
                                                   tmp_path: Path) -> None:
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(_Mkdir(control)))  # proves the payload is live
    assert control.exists()

    marker = tmp_path / "pwned-marker"
    hostile = [pickle.dumps(_Mkdir(marker), protocol=p) for p in (0, 2, 5)]
    start_worker([double_model()])
    reply_to = new_reply_to(MODEL)
    wrapped = envelope(MODEL, reply_to, hostile[-1])  # pickle bytes as a msgpack bin payload
    good = envelope(MODEL, reply_to, [0, 0, 0, 1])
    await push_plain(rc, QUEUE, *hostile, pack(wrapped), pack(good))

    replies = await replies_by_id(rc, reply_to, 2)
    assert_error(replies[wrapped["id"]], wrapped["id"], "invalid_payload")
    assert replies[good["id"]]["ok"] is True
    assert not marker.exists()
    assert await rc.lrange(DEAD, 0, -1) == hostile


def as_json(request: dict[str, Any]) -> bytes:
    return json.dumps(request, separators=(",", ":")).encode()


@pytest.mark.parametrize("encode", [pack, as_json], ids=["msgpack", "json"])
async def test_out_of_range_deadlines_and_attempts_are_refused_at_once(
        rc: aioredis.Redis, start_worker: Callable[..., Any],
        encode: Callable[[dict[str, Any]], bytes]) -> None:
    """A foreign "no deadline" (Long.MAX_VALUE, or 2**64-1 as an unsigned int), a
    deadline past the 600 s maximum (+60 s of clock skew), and an attempt outside
    0..1000 are answered invalid_payload and dead-lettered; the model goes on serving."""
    start_worker([double_model()])
    reply_to = new_reply_to(MODEL)
    bad = []
    for name, value in (("deadline_ms", 2**64 - 1), ("deadline_ms", 2**63 - 1),
                        ("deadline_ms", epoch_ms() + 700_000), ("deadline_ms", -1),
                        ("enqueue_ms", 2**63 - 1), ("attempt", -2**62), ("attempt", 1001)):
        request = envelope(MODEL, reply_to, [1, 2, 3, 4])
        request[name] = value
        bad.append(request)
    skewed = envelope(MODEL, reply_to, [1, 2, 3, 4], timeout_ms=600_000 + 30_000)
    good = envelope(MODEL, reply_to, [1, 2, 3, 4])
    await push_plain(rc, QUEUE, *map(encode, bad), encode(skewed), encode(good))

    replies = await replies_by_id(rc, reply_to, len(bad) + 2)
    for request in bad:
        assert_error(replies[request["id"]], request["id"], "invalid_payload")
    assert replies[skewed["id"]]["ok"] is True  # within the clock-skew slack
    assert replies[good["id"]]["ok"] is True
    assert await rc.lrange(DEAD, 0, -1) == [encode(r) for r in bad]
    later = envelope(MODEL, reply_to, [0, 0, 0, 1])  # and the worker is not wedged
    await push_plain(rc, QUEUE, encode(later))
    _raw, reply = await next_reply(rc, reply_to)
    assert reply["id"] == later["id"] and reply["ok"] is True


async def test_undecodable_payload_is_answered_when_id_and_reply_to_are_readable(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    """The envelope is read without its payload, so a payload the worker cannot decode
    still gets its caller an invalid_payload reply, in the caller's format."""
    start_worker([echo_model()])
    reply_to = new_reply_to(LOOSE)
    base64_in_msgpack = envelope(LOOSE, reply_to, {"__tensor__": {  # JSON's spelling
        "dtype": "float32", "shape": [1], "data": "AACAPw=="}})
    bad_base64_json = envelope(LOOSE, reply_to, {"__tensor__": {
        "dtype": "float32", "shape": [1], "data": "not base64!"}})
    bad_utf8 = envelope(LOOSE, reply_to, None)
    bad_utf8["payload"] = b"\xff\xfe"  # a msgpack str (old spec) that is not UTF-8
    good = envelope(LOOSE, reply_to, "fine")
    entries = [pack(base64_in_msgpack), as_json(bad_base64_json),
               msgpack.packb(bad_utf8, use_bin_type=False)]
    await push_plain(rc, queue_key(LOOSE), *entries, pack(good))

    raws: dict[str, bytes] = {}
    for _ in range(4):
        raw, reply = await next_reply(rc, reply_to)
        raws[reply["id"]] = raw
    for request in (base64_in_msgpack, bad_base64_json, bad_utf8):
        assert_error(decode_reply(raws[request["id"]]), request["id"], "invalid_payload")
    assert raws[bad_base64_json["id"]][:1] == b"{"  # JSON in, JSON out
    assert raws[base64_in_msgpack["id"]][:1] != b"{"
    assert decode_reply(raws[good["id"]])["payload"] == "fine"
    assert await rc.lrange("rb:{fc-echo}:dead", 0, -1) == entries


@pytest.mark.parametrize("trace_id", ["has space", "x" * 129, 12345, None, ""],
                         ids=["space", "129-chars", "int", "null", "empty"])
async def test_a_bad_trace_id_is_dropped_not_held_against_the_request(
        rc: aioredis.Redis, start_worker: Callable[..., Any], trace_id: Any) -> None:
    start_worker([echo_model()])
    reply_to = new_reply_to(LOOSE)
    request = envelope(LOOSE, reply_to, "traced")
    request["trace_id"] = trace_id
    await push_plain(rc, queue_key(LOOSE), as_json(request))
    _raw, reply = await next_reply(rc, reply_to)
    assert reply["id"] == request["id"] and reply["ok"] is True, reply
    assert reply["payload"] == "traced"
    assert await rc.llen("rb:{fc-echo}:dead") == 0


@pytest.mark.parametrize("encode", [pack, as_json], ids=["msgpack", "json"])
async def test_multi_row_request_takes_a_nested_list(
        rc: aioredis.Redis, start_worker: Callable[..., Any],
        encode: Callable[[dict[str, Any]], bytes]) -> None:
    start_worker([double_model(), echo_model()])
    reply_to = new_reply_to(MODEL)
    rows = [[1, 2, 3, 4], [5, 6, 7, 8.5], [0, 0, 0, 0]]
    spec_rows = {**envelope(MODEL, reply_to, rows), "rows": 3}
    loose_rows = {**envelope(LOOSE, reply_to, [[1, 2], [3, 4]]), "rows": 2}
    ragged = {**envelope(MODEL, reply_to, [[1, 2, 3, 4], [5, 6, 7]]), "rows": 2}
    text = {**envelope(MODEL, reply_to, [["a", "b", "c", "d"]]), "rows": 1}
    wrong_count = {**envelope(MODEL, reply_to, rows), "rows": 2}
    await push_plain(rc, QUEUE, *map(encode, (spec_rows, ragged, text, wrong_count)))
    await push_plain(rc, queue_key(LOOSE), encode(loose_rows))

    replies = await replies_by_id(rc, reply_to, 5)
    doubled = tensor_from_reply(replies[spec_rows["id"]]["payload"])
    np.testing.assert_array_equal(doubled, np.array(rows, dtype=np.float32) * 2)
    assert "row_errors" not in replies[spec_rows["id"]]
    echoed = tensor_from_reply(replies[loose_rows["id"]]["payload"])
    np.testing.assert_array_equal(echoed, [[1, 2], [3, 4]])
    for request in (ragged, text, wrong_count):
        assert_error(replies[request["id"]], request["id"], "invalid_payload")


async def test_tensor_tagged_top_level_entry_is_dead_lettered(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    reply_to = new_reply_to(MODEL)
    hostile = pack({"__tensor__": {"dtype": "uint8", "shape": [1], "data": b"\x00"}})
    good = envelope(MODEL, reply_to, [1, 1, 1, 1])
    await push_plain(rc, QUEUE, hostile, pack(good))  # one batch: queued before the worker
    start_worker([double_model()])
    got = await rc.blpop([reply_to], timeout=3)
    assert got is not None, "the good request sharing the batch was never answered"
    assert await rc.lrange(DEAD, 0, -1) == [hostile]


async def test_unstackable_batch_is_answered(rc: aioredis.Redis,
                                             start_worker: Callable[..., Any]) -> None:
    model = batch(name="fc-ragged", max_batch_size=8, batch_wait_timeout_s=0.0, stack=True,
                  spec=TensorSpec("float32", (None,)))(lambda x: x * 2)
    reply_to = new_reply_to("fc-ragged")
    short = envelope("fc-ragged", reply_to, [1, 2])
    long = envelope("fc-ragged", reply_to, [1, 2, 3])
    assert await enqueue(rc, "fc-ragged", mp(short), mp(long)) == (2, 2)  # one batch
    start_worker([model])
    got = await rc.blpop([reply_to], timeout=3)
    assert got is not None, "neither request of the unstackable batch was answered"


async def test_future_enqueue_ms_does_not_hold_the_batch(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    start_worker([double_model()])
    reply_to = new_reply_to(MODEL)
    skewed = envelope(MODEL, reply_to, [1, 2, 3, 4], timeout_ms=20_000)
    skewed["enqueue_ms"] += 5_000  # the producer's clock runs 5 s ahead
    await enqueue(rc, MODEL, mp(skewed))
    got = await rc.blpop([reply_to], timeout=2)  # the model's window is 10 ms
    assert got is not None, "a 10 ms batch window was held open by a future enqueue_ms"
    assert decode_reply(got[1])["timings"]["queue_wait_ms"] == 0  # not negative


async def test_queue_waits_are_clamped_to_the_longest_deadline(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    reply_to = new_reply_to(MODEL)
    slow_clock = envelope(MODEL, reply_to, [1, 2, 3, 4], timeout_ms=20_000)
    slow_clock["enqueue_ms"] -= 3_600_000  # the producer's clock runs an hour behind
    await enqueue(rc, MODEL, mp(slow_clock))
    start_worker([double_model()])
    _raw, reply = await next_reply(rc, reply_to)
    assert reply["ok"] and reply["timings"]["queue_wait_ms"] == 600_000  # MAX_TIMEOUT_S


async def test_dead_workers_entries_are_requeued_in_front_or_dead_lettered(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    """A worker ("ghost") died holding three claimed requests; a live worker reaps it."""
    calls: list[list[Any]] = []
    reply_to = new_reply_to(LOOSE)
    first = envelope(LOOSE, reply_to, "first")  # never crashed a worker before
    crashed = envelope(LOOSE, reply_to, "crashed")
    crashed["attempt"] = 2  # this is its third crash: max_attempts (3) reached
    second = envelope(LOOSE, reply_to, "second")
    second["attempt"] = 1
    later = envelope(LOOSE, reply_to, "later")
    items = (js(first), mp(crashed), js(second))
    assert await enqueue(rc, LOOSE, *items) == (3, 3)
    ghost_inflight = "rb:{fc-echo}:inflight:ghost"
    for _ in items:  # the ghost claimed them: queue head -> its in-flight tail
        await rc.lmove(queue_key(LOOSE), ghost_inflight, "LEFT", "RIGHT")
    await rc.zadd("rb:{fc-echo}:workers", {"ghost": epoch_ms() - 1})  # lease expired
    await rc.hset("rb:{fc-echo}:worker_info", "ghost", json.dumps({"worker_id": "ghost"}))
    assert await enqueue(rc, LOOSE, mp(later)) == (1, 1)
    start_worker([echo_model(calls)])

    replies = await replies_by_id(rc, reply_to, 4)
    assert_error(replies[crashed["id"]], crashed["id"], "worker_crashed")
    assert replies[crashed["id"]]["timings"]["batch_size"] == 0
    for request in (first, second, later):
        assert replies[request["id"]]["ok"] is True
        assert replies[request["id"]]["payload"] == request["payload"]
    # Requeued at the queue's front, in their order, before what was queued already.
    assert [x for batch_ in calls for x in batch_] == ["first", "second", "later"]
    assert await rc.lrange("rb:{fc-echo}:dead", 0, -1) == [items[1][1]]  # the bytes as sent
    assert await rc.get(marker_key(LOOSE, crashed["id"])) == b"d"
    assert not await rc.exists(ghost_inflight)
    assert await rc.zscore("rb:{fc-echo}:workers", "ghost") is None
    assert await rc.hget("rb:{fc-echo}:worker_info", "ghost") is None
    assert await rc.llen(reply_to) == 0


def test_document_matches_the_code() -> None:
    """The hard-coded client above and docs/protocol.md agree with redbatch's source."""
    from redbatch import defaults, errors, lua, protocol
    from redbatch.config import WorkerConfig

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    block = doc.split("```lua\n", 1)[1].split("```", 1)[0]
    script = "\n".join(line for line in block.splitlines() if not line.startswith("--"))
    assert script.strip() == lua.ENQUEUE.strip() == ENQUEUE.strip()
    assert (protocol.queue_key(MODEL), protocol.dead_letter_key(MODEL), protocol.meta_key(MODEL),
            protocol.workers_key(MODEL), protocol.worker_info_key(MODEL),
            protocol.MODELS_KEY) == (QUEUE, DEAD, META, WORKERS, WORKER_INFO, MODELS)
    assert protocol.queue_key(LOOSE) == queue_key(LOOSE)
    assert protocol.request_key(MODEL, "r1") == marker_key(MODEL, "r1") == "rb:{fc-double}:req:r1"
    assert protocol.inflight_key(MODEL, "w1") == "rb:{fc-double}:inflight:w1"
    assert protocol.reply_key(MODEL, "c1") == "rb:reply:{fc-double}:c1"
    assert protocol.legacy_reply_key("c1") == "rb:reply:{c1}"
    assert protocol.QUEUE_TTL_S * 1000 == QUEUE_TTL_MS
    assert protocol.REPLY_TTL_S == REPLY_TTL_S
    assert protocol.MARKER_GRACE_MS == MARKER_GRACE_MS
    now = epoch_ms()
    for deadline in (now - 10_000, now, now + 7_000):
        assert protocol.marker_ttl_ms(deadline, now) == marker_ttl_ms(
            {"deadline_ms": deadline}, now)
    assert defaults.MAX_ATTEMPTS == WorkerConfig().max_attempts == 3
    for text in (protocol.MODEL_NAME_RE.pattern, protocol.REPLY_TO_RE.pattern):
        assert f"`{text}`" in doc
    for seconds in (protocol.QUEUE_TTL_S, protocol.REPLY_TTL_S, protocol.META_TTL_S,
                    protocol.WORKERS_TTL_S, protocol.INFLIGHT_TTL_S):
        assert f"{seconds} s" in doc
    for name in ("QUEUE_TTL_S", "INFLIGHT_TTL_S", "WORKERS_TTL_S", "META_TTL_S",
                 "REPLY_TTL_S", "DEAD_LETTER_TTL_S", "MARKER_GRACE_MS",
                 "defaults.MAX_ATTEMPTS"):
        assert f"`{name}`" in doc
    assert f"{protocol.MARKER_GRACE_MS} ms" in doc
    assert f"{protocol.DEAD_LETTER_MAX:,}".replace(",", " ") in doc
    assert f"{protocol.MAX_ENTRY_BYTES:,}".replace(",", " ") in doc
    codes = {cls.code for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.RedbatchError)}
    assert {"no_workers", "worker_crashed", "queue_full"} <= codes
    for code in codes:
        assert f"`{code}`" in doc, code
    assert "`items_per_s`" in doc
    assert protocol.PROTOCOL_VERSION == 1
    # The bounds a worker enforces on entries, and what workers publish as meta.
    assert f"0-{protocol.MAX_ATTEMPT} (`MAX_ATTEMPT`)" in doc
    skew_s = protocol.CLOCK_SKEW_MS // 1000
    assert f"{skew_s} s (`CLOCK_SKEW_MS`)" in doc
    assert f"{protocol.MAX_TIMEOUT_S + skew_s:g} s" in doc
    assert "`redbatch worker redbatch.demo:models`" in doc
    meta_example = json.loads(doc.split("## 8.", 1)[1].split("```json\n", 1)[1].split("```")[0])
    published = double_model().meta()
    assert set(meta_example) == set(published)
    assert set(meta_example["policy"]) == set(published["policy"])
    assert set(meta_example["limits"]) == set(published["limits"])


# --- named inputs and outputs --------------------------------------------------------

PAIR = "fc-pair"  # inputs x float32 (4,) and scale float32 (); outputs y = x*scale, norm


def pair_model() -> Any:
    def fn(batch: dict[str, Any]) -> dict[str, Any]:
        y = batch["x"] * batch["scale"][:, None]
        return {"y": y, "norm": np.linalg.norm(y, axis=1)}

    return batch(name=PAIR, max_batch_size=8, batch_wait_timeout_s=0.01, stack=True,
                 inputs={"x": TensorSpec("float32", (4,)), "scale": TensorSpec("float32", ())},
                 outputs={"y": TensorSpec("float32", (4,)),
                          "norm": TensorSpec("float32", ())})(fn)


async def test_two_named_inputs_in_and_two_named_outputs_out(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    """The payload of a model with named inputs is a map input name -> value; its
    reply's payload a map output name -> value (docs/protocol.md, "Payload")."""
    start_worker([pair_model()])
    reply_to = new_reply_to(PAIR)
    x = np.array([3.0, 0.0, 4.0, 0.0], dtype=np.float32)
    good = envelope(PAIR, reply_to, {"x": msgpack_tensor(x),
                                     "scale": msgpack_tensor(np.float32(2.0).reshape(()))})
    listed = envelope(PAIR, reply_to, {"x": [1, 1, 1, 1], "scale": 0.5})
    bad = envelope(PAIR, reply_to, {"x": [1, 2, 3], "scale": 1})  # x has 3 values
    assert (await enqueue(rc, PAIR, mp(good), mp(listed), mp(bad)))[0] == 3
    replies = await replies_by_id(rc, reply_to, 3)

    reply = replies[good["id"]]
    assert reply["ok"] is True and set(reply["payload"]) == {"y", "norm"}
    np.testing.assert_array_equal(tensor_from_reply(reply["payload"]["y"]), x * 2)
    assert reply["payload"]["norm"] == pytest.approx(10.0)
    y = replies[listed["id"]]["payload"]["y"]
    np.testing.assert_array_equal(tensor_from_reply(y), np.full(4, 0.5, np.float32))
    assert_error(replies[bad["id"]], bad["id"], "invalid_payload")
    assert "'x'" in replies[bad["id"]]["error"]["message"]

    meta = json.loads(await rc.get("rb:{" + PAIR + "}:meta"))
    assert meta["inputs"] == {"x": {"dtype": "float32", "shape": [4]},
                              "scale": {"dtype": "float32", "shape": []}}
    assert list(meta["outputs"]) == ["y", "norm"]


async def test_a_multi_row_request_of_named_inputs_fails_a_bad_row_alone(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    """``rows: n`` with a map input name -> n rows: one reply, one output map per row;
    a bad row is null in the payload and named in row_errors."""
    start_worker([pair_model()])
    reply_to = new_reply_to(PAIR)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    scale = np.array([1.0, np.nan, 2.0], dtype=np.float32)  # row 1: NaN
    request = {**envelope(PAIR, reply_to, {"x": msgpack_tensor(x), "scale": [1, 2, 3]}),
               "rows": 3}
    request["payload"]["scale"] = msgpack_tensor(scale)
    await enqueue(rc, PAIR, mp(request))
    _raw, reply = await next_reply(rc, reply_to)
    assert reply["ok"] is True and len(reply["payload"]) == 3
    first, bad, last = reply["payload"]
    assert bad is None
    np.testing.assert_array_equal(tensor_from_reply(first["y"]), x[0])
    np.testing.assert_array_equal(tensor_from_reply(last["y"]), x[2] * 2)
    (row_error,) = reply["row_errors"]
    assert row_error["row"] == 1 and row_error["code"] == "invalid_payload"
    assert "'scale'" in row_error["message"]
    short = {**envelope(PAIR, reply_to, {"x": [[1, 2, 3, 4]], "scale": [1, 2]}), "rows": 2}
    await enqueue(rc, PAIR, mp(short))
    _raw, reply = await next_reply(rc, reply_to)
    assert_error(reply, short["id"], "invalid_payload")
    assert "'x'" in reply["error"]["message"]


# --- priority levels and variable lengths (docs/protocol.md §9.1, §8) ----------------

LEVELS = "fc-levels"  # two levels, default 2, no share kept for level 2: strict order
BELL = "rb:{fc-levels}:bell"

# A push to one level's queue that rings the bell, as §9.1 asks ("in the same script
# or MULTI as the push"): KEYS[1]=the level's queue  KEYS[2]=the bell
# ARGV[1]=queue ttl ms  ARGV[2..]=entries
PUSH_AND_RING = """
redis.call('RPUSH', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('RPUSH', KEYS[2], 1) end
redis.call('PEXPIRE', KEYS[2], 3600000)
"""


def levels_model(calls: list[Any], release: Any) -> Any:
    def fn(inputs: list[Any]) -> list[Any]:
        calls.extend(inputs)
        if inputs == ["first"]:
            release.wait(WAIT_S)  # holds the worker while the other levels fill
        return list(inputs)

    return batch(name=LEVELS, max_batch_size=1, batch_wait_timeout_s=0.0, priority_levels=2,
                 default_priority=2, priority_share=0.0)(fn)


async def test_a_foreign_producer_enqueues_by_level_and_rings_the_bell(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    """Level 1's queue is ``rb:{<model>}:queue:p1``, the default level's the plain
    queue; the meta's ``priority`` section says so, and the more urgent level is
    claimed first (the model keeps no share for level 2 here)."""
    calls: list[Any] = []
    release = threading.Event()
    start_worker([levels_model(calls, release)])
    await wait_for_key(rc, "rb:{" + LEVELS + "}:meta")
    meta = json.loads(await rc.get("rb:{" + LEVELS + "}:meta"))
    assert meta["priority"] == {"levels": 2, "default": 2, "caps": None}
    reply_to = new_reply_to(LEVELS)
    first = envelope(LEVELS, reply_to, "first")
    assert (await enqueue(rc, LEVELS, mp(first)))[0] == 1  # the default level: plain
    deadline = time.monotonic() + WAIT_S
    while calls != ["first"]:
        assert time.monotonic() < deadline, calls
        await asyncio.sleep(0.02)
    later = [envelope(LEVELS, reply_to, n) for n in (10, 11)]
    urgent = [{**envelope(LEVELS, reply_to, n), "priority": 1} for n in (20, 21)]
    await enqueue(rc, LEVELS, *(mp(r) for r in later))
    await rc.eval(PUSH_AND_RING, 2, queue_key(LEVELS) + ":p1", BELL, QUEUE_TTL_MS,
                  *(pack(r) for r in urgent))
    release.set()
    replies = await replies_by_id(rc, reply_to, 5)
    assert all(reply["ok"] for reply in replies.values())
    assert calls == ["first", 20, 21, 10, 11]


async def test_a_variable_length_meta_lists_its_buckets_and_mask(
        rc: aioredis.Redis, start_worker: Callable[..., Any]) -> None:
    """§8: a variable-length spec publishes ``max_len``, ``pad_value``, ``buckets``
    and, when callers may send one, the ``mask`` field's name; the queue takes the
    input unpadded, any length from 1 to ``max_len``."""
    name = "fc-tokens"

    def fn(batch: Any) -> list[int]:
        _padded, lengths = batch
        return [int(n) for n in lengths]

    model = batch(name=name, max_batch_size=8, batch_wait_timeout_s=0.01, stack=True,
                  spec=TensorSpec("int64", (None,), max_len=16, mask="attention_mask"))(fn)
    start_worker([model])
    await wait_for_key(rc, "rb:{" + name + "}:meta")
    meta = json.loads(await rc.get("rb:{" + name + "}:meta"))
    assert meta["spec"] == {"dtype": "int64", "shape": [-1], "max_len": 16, "pad_value": 0,
                            "buckets": [1, 2, 4, 8, 16], "mask": "attention_mask"}
    reply_to = new_reply_to(name)
    requests = [envelope(name, reply_to, list(range(n))) for n in (3, 9, 16, 17)]
    await enqueue(rc, name, *(mp(r) for r in requests))
    replies = await replies_by_id(rc, reply_to, 4)
    assert [replies[r["id"]].get("payload") for r in requests[:3]] == [3, 9, 16]
    assert_error(replies[requests[3]["id"]], requests[3]["id"], "invalid_payload")
