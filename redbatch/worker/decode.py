"""The decode step: raw queue entries -> requests to compute, and replies already known.

A malformed entry is dead-lettered (and answered with ``invalid_payload`` if its id
and reply_to can still be read); an expired request is answered with
``deadline_exceeded``; an input that does not match the model's spec is answered
with ``invalid_payload``.  None of them reaches the model.

A multi-row request (``rows``) becomes one item per row, gathered back into one
reply by its ``Pack``; a row that does not match the spec fails alone.  A model
with named inputs (``Signature``) takes a map input name -> value per request,
every field checked (a multi-row request: a map input name -> rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import orjson

from redbatch import codec, protocol
from redbatch.codec import Format
from redbatch.errors import DeadlineExceeded, InvalidPayload, RedbatchError
from redbatch.protocol import Request
from redbatch.spec import row_count
from redbatch.worker.model import Model

log = logging.getLogger("redbatch.worker")


@dataclass(slots=True)
class Pack:
    """A multi-row request: its rows' outputs and errors, gathered for its one reply."""

    request: Request
    fmt: Format
    outputs: list[Any]
    errors: dict[int, RedbatchError]  # rows refused by the spec


@dataclass(slots=True)
class Item:
    request: Request
    fmt: Format
    value: Any
    pack: Pack | None = None  # set for a row of a multi-row request
    row: int = 0
    entry: int = -1  # its entry's place in the claimed batch (a single-row request)


@dataclass
class Decoded:
    items: list[Item] = field(default_factory=list)
    early: list[tuple[Request, Format, RedbatchError]] = field(default_factory=list)
    dead: list[bytes] = field(default_factory=list)
    packs: list[Pack] = field(default_factory=list)

    @property
    def invalid_rows(self) -> int:
        """Rows of multi-row requests refused by the spec."""
        return sum(len(pack.errors) for pack in self.packs)


def loose_reply_target(raw: bytes) -> tuple[str, str, Format] | None:
    """Find (id, reply_to) in an entry that failed validation, to tell its sender.  They
    are read from the envelope alone, so a payload that cannot be decoded (a bad
    tensor, an ext type) does not hide them."""
    fmt = codec.sniff_format(raw)
    try:
        fields = _loose_json(raw) if fmt == "json" else _loose_msgpack(raw)
    except Exception:  # any shape of garbage: there is simply no one to tell
        return None
    request_id, reply_to = fields.get(protocol.F_ID), fields.get(protocol.F_REPLY_TO)
    if isinstance(request_id, str) and isinstance(reply_to, str) and \
            protocol.REPLY_TO_RE.fullmatch(reply_to) and 0 < len(request_id) <= 128:
        return request_id, reply_to, fmt
    return None


_TARGET_FIELDS = (protocol.F_ID, protocol.F_REPLY_TO)


def _loose_json(raw: bytes) -> dict[Any, Any]:
    wire = orjson.loads(raw)  # tensors stay plain maps: nothing checks them here
    return wire if isinstance(wire, dict) else {}


def _loose_msgpack(raw: bytes) -> dict[Any, Any]:
    """The top-level id and reply_to of a msgpack map; every other value is skipped
    without being built, so its tensors, ext types or odd keys do not matter."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    found = {}
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key in _TARGET_FIELDS:
            found[key] = unpacker.unpack()
        else:
            unpacker.skip()
    return found


def parse_entry(raw: bytes, model: str, same_slot: bool = False, tag: str | None = None
                ) -> Request:
    """Decode and validate one queue entry of ``model``'s queue (its sub-queue ``tag``,
    by default its own).  ``same_slot`` (on Redis Cluster): a reply list outside the
    sub-queue's slot cannot be answered in the reply script, so such an entry is
    invalid."""
    request = protocol.request_from_wire(codec.decode(raw, budget=True))
    if request.model != model:
        raise InvalidPayload(f"entry for model {request.model!r} in the queue of {model!r}")
    tag = tag or model
    if same_slot and not protocol.reply_in_model_slot(tag, request.reply_to):
        raise InvalidPayload(f"reply_to {request.reply_to!r} is not in the slot of model "
                             f"{model!r}'s queue {tag!r}: on Redis Cluster it must be "
                             f"rb:reply:{{{tag}}}:<client_id>")
    return request


def decode_batch(raws: list[bytes], model: Model, now_ms: int, same_slot: bool = False,
                 tag: str | None = None) -> Decoded:
    """Decode a batch claimed from ``model``'s sub-queue ``tag`` (its own by default)."""
    out = Decoded()
    for entry, raw in enumerate(raws):
        before = len(out.items)
        _decode_one(raw, model, now_ms, out, (same_slot, tag or model.name))
        if len(out.items) == before + 1 and out.items[-1].pack is None:
            out.items[-1].entry = entry
    return out


def _decode_one(raw: bytes, model: Model, now_ms: int, out: Decoded,
                slot: tuple[bool, str]) -> None:
    fmt = codec.sniff_format(raw)
    try:
        request = parse_entry(raw, model.name, *slot)
    except InvalidPayload as exc:
        _reject(raw, exc, model.name, out, slot)
        return
    if request.deadline_ms <= now_ms:
        late_ms = now_ms - request.deadline_ms
        out.early.append((request, fmt, DeadlineExceeded(
            f"deadline passed {late_ms} ms before a worker took the request")))
        return
    if request.rows:
        _decode_rows(request, fmt, model, out)
        return
    try:
        value = model.spec.check(request.payload, model.input_name) if model.spec \
            else model.signature.check(request.payload) if model.signature \
            else request.payload
    except InvalidPayload as exc:
        out.early.append((request, fmt, exc))
        return
    out.items.append(Item(request, fmt, value))


def _decode_rows(request: Request, fmt: Format, model: Model, out: Decoded) -> None:
    """One item per row of a multi-row request; rows that fail the spec fail alone."""
    rows = request.rows
    if model.signature is not None:
        _decode_named_rows(request, fmt, model, out)
        return
    payload = _rows_of(request.payload, rows, model.spec is None)
    if payload is None:
        out.early.append((request, fmt, InvalidPayload(
            f"a request of {rows} rows needs a tensor (or a rectangular nested list of "
            f"numbers) whose first dimension is {rows}" + (
                f", or a map name -> {rows} rows" if model.spec is None else ""))))
        return
    pack = Pack(request, fmt, [None] * rows, {})
    out.packs.append(pack)
    out.items.extend(Item(request, fmt, value, pack, row)
                     for row, value in _checked_rows(payload, model, pack))


def _decode_named_rows(request: Request, fmt: Format, model: Model, out: Decoded) -> None:
    """A multi-row request of a model with named inputs: a map input name -> rows, one
    item per row (each checked on its own, failing alone)."""
    assert model.signature is not None
    try:
        values = model.signature.split_rows(request.payload, request.rows)
    except InvalidPayload as exc:
        out.early.append((request, fmt, exc))
        return
    pack = Pack(request, fmt, [None] * request.rows, {})
    out.packs.append(pack)
    for row, value in enumerate(values):
        try:
            out.items.append(Item(request, fmt, model.signature.check(value), pack, row))
        except InvalidPayload as exc:
            pack.errors[row] = exc


def _rows_of(payload: Any, rows: int, plain: bool) -> Any:
    """A multi-row payload's ``rows`` rows: an array (``_rows_array``), or for a
    ``plain`` model (no spec) a list of ``rows`` values (a pipeline's previous stage
    answers rows of maps so), or a map name -> ``rows`` rows as one map per row (a
    pipeline's merge stage gets its branches' outputs so); None if it is neither."""
    array = _rows_array(payload)
    if array is not None and array.ndim and array.shape[0] == rows:
        return array
    if plain and isinstance(payload, list) and len(payload) == rows:
        return payload
    if not plain or not isinstance(payload, dict) or \
            not 0 < len(payload) <= protocol.MAX_ROW_MAP_NAMES:
        return None
    if any(row_count(value) != rows for value in payload.values()):
        return None
    return [{name: value[row] for name, value in payload.items()} for row in range(rows)]


def _rows_array(payload: Any) -> np.ndarray[Any, Any] | None:
    """A multi-row payload as an array: a tensor as it is, a nested list of numbers
    converted (as a tensor of a wire dtype would be); anything else ``None``."""
    if isinstance(payload, np.ndarray):
        return payload
    if not isinstance(payload, list):
        return None
    try:
        arr = np.asarray(payload)
    except (ValueError, TypeError, OverflowError):  # ragged, or not numbers
        return None
    return arr if arr.dtype.name in codec.DTYPES else None


def _checked_rows(payload: Any, model: Model, pack: Pack
                  ) -> list[tuple[int, Any]]:
    """The rows, checked against the spec in one go; if that fails, row by row (the
    failures go to ``pack.errors``)."""
    spec = model.spec
    if spec is None:
        return list(enumerate(payload))
    try:
        return list(enumerate(spec.check_rows(payload, model.input_name)))
    except InvalidPayload:
        pass
    rows = []
    for row, value in enumerate(payload):
        try:
            rows.append((row, spec.check(value, model.input_name)))
        except InvalidPayload as exc:
            pack.errors[row] = exc
    return rows


def drop_requests(decoded: Decoded, ids: set[str]) -> int:
    """Remove the requests ``ids`` (single or multi-row) from the batch, uncomputed and
    unanswered; return how many entries went."""
    before = len(decoded.packs) + sum(item.pack is None for item in decoded.items)
    decoded.items = [item for item in decoded.items if item.request.id not in ids]
    decoded.packs = [p for p in decoded.packs if p.request.id not in ids]
    return before - len(decoded.packs) - sum(item.pack is None for item in decoded.items)


def _reject(raw: bytes, exc: InvalidPayload, model: str, out: Decoded,
            slot: tuple[bool, str]) -> None:
    log.warning("model=%s dead-lettered a malformed entry (%d bytes): %s", model, len(raw), exc)
    out.dead.append(raw)
    addressed = addressable(raw, model, *slot)
    if addressed is not None:
        out.early.append((*addressed, exc))


def addressable(raw: bytes, model: str, same_slot: bool = False, tag: str | None = None
                ) -> tuple[Request, Format] | None:
    """A malformed entry's sender, as a request to answer (no payload), if its id and
    reply_to can be read (``loose_reply_target``), and with ``same_slot`` (Redis
    Cluster) if its reply list is in the model's slot."""
    target = loose_reply_target(raw)
    if target is None:
        return None
    request_id, reply_to, fmt = target
    if same_slot and not protocol.reply_in_model_slot(tag or model, reply_to):
        return None
    deadline = protocol.now_ms() + protocol.MARKER_GRACE_MS
    return Request(request_id, model, 0, deadline, reply_to, None), fmt
