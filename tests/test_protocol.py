"""Keys, envelopes and their validation."""

from __future__ import annotations

import itertools
import re

import pytest
from redis.crc import key_slot

from redbatch import codec, protocol
from redbatch.errors import InvalidPayload


def _tag(key: str) -> str:
    match = re.search(r"\{([^}]*)\}", key)
    assert match, key
    return match.group(1)


def test_all_keys_of_a_model_share_one_hash_tag() -> None:
    keys = [protocol.queue_key("m"), protocol.inflight_key("m", "w1"),
            protocol.workers_key("m"), protocol.worker_info_key("m"),
            protocol.worker_capacity_key("m"), protocol.meta_key("m"),
            protocol.dead_letter_key("m"), protocol.reply_key("m", "c1")]
    assert {_tag(k) for k in keys} == {"m"}
    assert protocol.REPLY_TO_RE.match(protocol.reply_key("m", "abc"))


@pytest.mark.parametrize(("reply_to", "in_slot"), [
    (protocol.reply_key("m", "c1"), True), (protocol.legacy_reply_key("c1"), False),
    (protocol.reply_key("m2", "c1"), False), ("rb:reply:{m}", True),
    ("rb:reply:{}:m", False), ("rb:reply:c1", False), ("rb:reply:{m:c1", False),
])
def test_reply_in_model_slot(reply_to: str, in_slot: bool) -> None:
    assert protocol.REPLY_TO_RE.fullmatch(reply_to)  # the worker takes every one of them
    assert protocol.reply_in_model_slot("m", reply_to) is in_slot
    assert (key_slot(reply_to.encode()) == key_slot(b"{m}")) is in_slot


def _request(**changes: object) -> dict[str, object]:
    wire = protocol.Request("id1", "m", 1, 2, protocol.reply_key("m", "c"), [1, 2]).to_wire()
    wire.update(changes)
    return wire


def test_request_round_trip() -> None:
    req = protocol.request_from_wire(codec.decode(codec.encode(_request())))
    assert (req.id, req.model, req.enqueue_ms, req.deadline_ms, req.attempt, req.payload) == (
        "id1", "m", 1, 2, 0, [1, 2])


@pytest.mark.parametrize("changes", [
    {"v": 2}, {"id": ""}, {"id": 5}, {"model": "bad name"}, {"model": "a{b}"},
    {"deadline_ms": "soon"}, {"enqueue_ms": True}, {"reply_to": "rb:{m}:queue"},
    {"reply_to": "victim-key"}, {"attempt": None},
])
def test_bad_requests_are_invalid_payload(changes: dict[str, object]) -> None:
    with pytest.raises(InvalidPayload):
        protocol.request_from_wire(_request(**changes))


def test_missing_payload_is_invalid() -> None:
    wire = _request()
    del wire["payload"]
    with pytest.raises(InvalidPayload, match="payload"):
        protocol.request_from_wire(wire)


def test_reply_round_trip_ok_and_error() -> None:
    ok = protocol.Reply("r", True, payload=3, timings=protocol.Timings(1.0, 4, 2.0, "w"))
    back = protocol.reply_from_wire(codec.decode(codec.encode(ok.to_wire())))
    assert back.ok and back.payload == 3 and back.timings.batch_size == 4
    err = protocol.Reply("r", False, error_code="model_error", error_message="boom")
    back = protocol.reply_from_wire(codec.decode(codec.encode(err.to_wire(), "json")))
    assert not back.ok and back.error_code == "model_error" and back.error_message == "boom"


def test_request_ids_are_random_128_bit_hex_and_differ_after_fork() -> None:
    import os

    ids = [protocol.new_request_id() for _ in range(10_000)]
    assert len(set(ids)) == 10_000
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    # No shared prefix and no counter: the next id cannot be told from the last ones.
    assert len({i[:16] for i in ids}) == 10_000
    assert len({i[16:] for i in ids}) == 10_000
    steps = {int(b[16:], 16) - int(a[16:], 16) for a, b in itertools.pairwise(ids)}
    assert len(steps) > 9_000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's ids are its own, not a continuation of the parent's
        os.write(write, "".join(protocol.new_request_id() for _ in range(4)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 256).decode()
    os.close(read)
    os.close(write)
    parent = "".join(protocol.new_request_id() for _ in range(4))
    assert len(child) == 128 and child != parent
    assert {child[k:k + 32] for k in range(0, 128, 32)}.isdisjoint(ids)


@pytest.mark.parametrize("changes", [
    {"deadline_ms": 2**64 - 1}, {"deadline_ms": 2**63 - 1}, {"deadline_ms": -1},
    {"enqueue_ms": 2**63 - 1}, {"enqueue_ms": -5},
    {"attempt": -2**62}, {"attempt": -1}, {"attempt": protocol.MAX_ATTEMPT + 1},
])
def test_out_of_range_times_and_attempts_are_invalid_payload(
        changes: dict[str, object]) -> None:
    for wire in (_request(**changes), codec.decode(codec.encode(_request(**changes)))):
        with pytest.raises(InvalidPayload, match=next(iter(changes))):
            protocol.request_from_wire(wire)


def test_deadline_bound_is_the_longest_timeout_plus_clock_skew() -> None:
    now = protocol.now_ms()
    latest = protocol.latest_ms(now)
    assert latest == now + int(protocol.MAX_TIMEOUT_S * 1000) + protocol.CLOCK_SKEW_MS
    req = protocol.request_from_wire(_request(deadline_ms=latest, enqueue_ms=latest,
                                              attempt=protocol.MAX_ATTEMPT))
    assert (req.deadline_ms, req.attempt) == (latest, protocol.MAX_ATTEMPT)
    far = latest + 10_000  # well past the bound, even if the clock ticks meanwhile
    with pytest.raises(InvalidPayload, match="deadline_ms"):
        protocol.request_from_wire(_request(deadline_ms=far))


@pytest.mark.parametrize("trace_id", ["has space", "x" * 129, "", 7, ["a"], None])
def test_a_bad_or_null_trace_id_is_dropped(trace_id: object) -> None:
    assert protocol.request_from_wire(_request(trace_id=trace_id)).trace_id == ""


def test_a_good_trace_id_is_kept() -> None:
    good = "a" * 128
    assert protocol.request_from_wire(_request(trace_id=good)).trace_id == good


def test_max_attempts_cannot_pass_the_attempt_bound() -> None:
    from redbatch.config import WorkerConfig
    from redbatch.errors import ConfigError

    assert WorkerConfig(max_attempts=protocol.MAX_ATTEMPT).max_attempts == protocol.MAX_ATTEMPT
    with pytest.raises(ConfigError, match="max_attempts"):
        WorkerConfig(max_attempts=protocol.MAX_ATTEMPT + 1)


def test_queue_wait_is_clamped_to_zero_and_the_longest_deadline() -> None:
    assert protocol.queue_wait_ms(10_000, 9_000) == 1_000
    assert protocol.queue_wait_ms(10_000, 15_000) == 0  # a producer clock ahead of ours
    assert protocol.queue_wait_ms(10_000_000, 1) == protocol.MAX_TIMEOUT_S * 1000
    assert protocol.queue_wait_ms(10_000, 0) == 0  # unknown enqueue time
