"""Who to tell about an entry the worker cannot take: its id and reply_to are read from
the envelope alone, whatever its payload holds."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from redbatch import codec, protocol
from redbatch.errors import InvalidPayload
from redbatch.worker.decode import loose_reply_target

REPLY_TO = "rb:reply:{m}:c1"  # protocol.reply_key("m", "c1")
LEGACY_REPLY_TO = "rb:reply:{c1}"  # a producer of protocol 1.0


def _wire(payload: Any, **changes: Any) -> dict[str, Any]:
    wire = {"v": 1, "id": "r1", "model": "m", "enqueue_ms": 1, "deadline_ms": 2,
            "reply_to": REPLY_TO, "attempt": 0, "payload": payload}
    return {**wire, **changes}


JSON_TENSOR = {"__tensor__": {"dtype": "float32", "shape": [1], "data": "AACAPw=="}}
SHORT_TENSOR = {"__tensor__": {"dtype": "float32", "shape": [2], "data": b"\x00" * 4}}

UNDECODABLE = {
    "msgpack-base64-tensor": msgpack.packb(_wire(JSON_TENSOR)),
    "msgpack-short-tensor": msgpack.packb(_wire([1, {"deep": SHORT_TENSOR}])),
    "msgpack-bad-utf8": msgpack.packb(_wire(b"\xff\xfe"), use_bin_type=False),
    "msgpack-int-map-key": msgpack.packb(_wire({1: "a"}), strict_types=False),
    "json-bad-base64": json.dumps(_wire({"__tensor__": {
        "dtype": "float32", "shape": [1], "data": "not base64!"}})).encode(),
    "oversized": msgpack.packb(_wire(b"\x00" * protocol.MAX_ENTRY_BYTES)),
}


@pytest.mark.parametrize("raw", UNDECODABLE.values(), ids=UNDECODABLE.keys())
def test_undecodable_payload_still_names_its_sender(raw: bytes) -> None:
    with pytest.raises(InvalidPayload):
        codec.decode(raw)
    assert loose_reply_target(raw) == ("r1", REPLY_TO, codec.sniff_format(raw))


@pytest.mark.parametrize("reply_to", [REPLY_TO, LEGACY_REPLY_TO])
def test_both_reply_forms_name_the_sender(reply_to: str) -> None:
    raw = msgpack.packb(_wire(JSON_TENSOR, reply_to=reply_to))
    assert loose_reply_target(raw) == ("r1", reply_to, "msgpack")
    assert protocol.request_from_wire(_wire(1, reply_to=reply_to)).reply_to == reply_to


@pytest.mark.parametrize("raw", [
    b"\xc1 garbage", b"{not json", msgpack.packb([1, 2]), b"[1]",
    msgpack.packb(_wire(1, id=7)), msgpack.packb(_wire(1, id="")),
    msgpack.packb(_wire(1, id="x" * 129)), msgpack.packb(_wire(1, reply_to="victim")),
    msgpack.packb(_wire(1, id=b"r1")),  # bin, not str
    json.dumps(_wire(1, reply_to=None)).encode(),
], ids=["garbage", "bad-json", "msgpack-list", "json-list", "int-id", "empty-id",
        "long-id", "bad-reply-to", "bin-id", "null-reply-to"])
def test_no_target_when_id_or_reply_to_is_unreadable(raw: bytes) -> None:
    assert loose_reply_target(raw) is None
