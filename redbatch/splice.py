"""Set a few top-level fields of an encoded envelope, keeping every other value's bytes.

A reaper that requeues a request changes only its ``attempt`` and ``suspect``.
Decoding and re-encoding the whole entry would not give the same bytes back: JSON
``1e5`` comes back as ``100000.0`` and a msgpack float32 as a float64, so a request
near the entry limit could grow past it, and unknown fields would be lost.  Splicing
keeps the payload (and every field it does not set) exactly as the producer wrote it.

Only an entry that already decoded as an envelope is spliced; anything this module
cannot read raises ``ValueError`` and the caller re-encodes instead.
"""

from __future__ import annotations

import json
import re
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

import msgpack
import orjson

from redbatch import codec
from redbatch.codec import Format
from redbatch.errors import InvalidPayload
from redbatch.protocol import F_ATTEMPT, F_SUSPECT, MAX_ENTRY_BYTES, Request

_SPACE = re.compile(r"[ \t\n\r]*")
_JSON = json.JSONDecoder()


def requeue_entry(raw: bytes, request: Request, fmt: Format) -> bytes | None:
    """The entry that puts ``request`` (decoded from ``raw``) back in its queue: ``raw``
    with its ``attempt`` and ``suspect`` set, re-encoded only if it cannot be spliced;
    None when that is over the entry limit or cannot be encoded."""
    fields: dict[str, Any] = {F_ATTEMPT: request.attempt}
    if request.suspect:
        fields[F_SUSPECT] = True
    try:
        entry = splice(raw, fields, fmt)
    except (ValueError, TypeError):  # (orjson's encode error is a TypeError)
        try:
            entry = codec.encode(request.to_wire(), fmt)
        except InvalidPayload:
            return None
    return entry if len(entry) <= MAX_ENTRY_BYTES else None


def splice(raw: bytes, fields: dict[str, Any], fmt: Format) -> bytes:
    """``raw`` (a map, in ``fmt``) with ``fields`` set: each replaces the member of its
    name in place, or is appended.  Raises ``ValueError`` if ``raw`` is not a map."""
    if fmt == "json":
        return _splice_json(raw, fields)
    return _splice_msgpack(raw, fields)


def _splice_msgpack(raw: bytes, fields: dict[str, Any]) -> bytes:
    members = _msgpack_members(raw)
    for name, value in fields.items():
        members[msgpack.packb(name, use_bin_type=True)] = msgpack.packb(value, use_bin_type=True)
    packer = msgpack.Packer(use_bin_type=True)
    return packer.pack_map_header(len(members)) + b"".join(
        key + value for key, value in members.items())


def _msgpack_members(raw: bytes) -> dict[bytes, bytes]:
    """Each member's encoded name -> its encoded value (the last of a repeated name)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(raw))
    unpacker.feed(raw)
    try:
        count = unpacker.read_map_header()
        members: dict[bytes, bytes] = {}
        for _ in range(count):
            name = unpacker.unpack()
            start = unpacker.tell()
            unpacker.skip()
            members[msgpack.packb(name, use_bin_type=True)] = raw[start:unpacker.tell()]
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"not a msgpack map: {exc}") from exc
    if unpacker.tell() != len(raw):
        raise ValueError("bytes after the msgpack map")
    return members


def _splice_json(raw: bytes, fields: dict[str, Any]) -> bytes:
    members = _json_members(raw.decode("utf-8"))
    for name, value in fields.items():
        members[name] = orjson.dumps(value).decode("utf-8")
    body = ",".join(orjson.dumps(name).decode("utf-8") + ":" + value
                    for name, value in members.items())
    return ("{" + body + "}").encode("utf-8")


def _json_members(text: str) -> dict[str, str]:
    """Each member's name -> its value's text (the last of a repeated name)."""
    members: dict[str, str] = {}
    at = _expect(text, _skip(text, 0), "{")
    if text[at:at + 1] == "}":
        return _end(text, at, members)
    while True:
        if text[at:at + 1] != '"':
            raise ValueError(f"expected a member name at {at} of a JSON object")
        try:
            name, at = scanstring(text, at + 1)
            start = _skip(text, _expect(text, _skip(text, at), ":"))
            end = _JSON.raw_decode(text, start)[1]
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object: {exc}") from exc
        members[name] = text[start:end]
        at = _skip(text, end)
        if text[at:at + 1] == "}":
            return _end(text, at, members)
        at = _expect(text, at, ",")


def _skip(text: str, at: int) -> int:
    match = _SPACE.match(text, at)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _expect(text: str, at: int, char: str) -> int:
    """The index past ``char`` (and the white space after it) at ``at``."""
    if text[at:at + 1] != char:
        raise ValueError(f"expected {char!r} at {at} of a JSON object")
    return _skip(text, at + 1)


def _end(text: str, at: int, members: dict[str, str]) -> dict[str, str]:
    if _skip(text, at + 1) != len(text):
        raise ValueError("text after the JSON object")
    return members
