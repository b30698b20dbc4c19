"""Keys, envelopes and their validation."""

from __future__ import annotations

import re

import pytest

from redbatch import codec, protocol
from redbatch.errors import InvalidPayload


def _tag(key: str) -> str:
    match = re.search(r"\{([^}]*)\}", key)
    assert match, key
    return match.group(1)


def test_all_keys_of_a_model_share_one_hash_tag() -> None:
    keys = [protocol.queue_key("m"), protocol.inflight_key("m", "w1"),
            protocol.workers_key("m"), protocol.worker_info_key("m"),
            protocol.meta_key("m"), protocol.dead_letter_key("m")]
    assert {_tag(k) for k in keys} == {"m"}
    assert protocol.REPLY_TO_RE.match(protocol.reply_key("abc"))


def _request(**changes: object) -> dict[str, object]:
    wire = protocol.Request("id1", "m", 1, 2, protocol.reply_key("c"), [1, 2]).to_wire()
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


def test_request_ids_are_unique_and_change_after_fork() -> None:
    import os

    ids = {protocol.new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(len(i) == 32 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child draws a new prefix: its ids cannot repeat the parent's
        os.write(write, protocol.new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child[:16] != protocol.new_request_id()[:16]


def test_queue_wait_is_clamped_to_zero_and_the_longest_deadline() -> None:
    assert protocol.queue_wait_ms(10_000, 9_000) == 1_000
    assert protocol.queue_wait_ms(10_000, 15_000) == 0  # a producer clock ahead of ours
    assert protocol.queue_wait_ms(10_000_000, 1) == protocol.MAX_TIMEOUT_S * 1000
    assert protocol.queue_wait_ms(10_000, 0) == 0  # unknown enqueue time
