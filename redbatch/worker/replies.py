"""Encoded replies, each with the marker that makes it the only reply to its request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from redbatch import codec, defaults, protocol
from redbatch.codec import Format
from redbatch.errors import InvalidPayload, ModelError, RedbatchError
from redbatch.protocol import Reply, Request, Timings
from redbatch.worker.decode import Pack


@dataclass(slots=True)
class Outgoing:
    """One encoded reply, with the marker that makes it the only one (and its request,
    to dead-letter if Redis refuses the reply)."""

    reply_to: str
    marker: str
    marker_ttl_ms: int
    data: bytes
    request: Request
    fmt: Format


def outgoing(model: str, request: Request, reply: Reply, fmt: Format, tag: str | None = None
             ) -> Outgoing:
    """The reply to ``request``, with its marker in sub-queue ``tag`` (the model's own
    queue by default): the slot its entry was queued in."""
    ttl = protocol.marker_ttl_ms(request.deadline_ms, protocol.now_ms())
    return Outgoing(request.reply_to, protocol.request_key(tag or model, request.id), ttl,
                    encode_reply(model, reply, fmt), request, fmt)


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """How dead letters are kept: the first ``max_bytes`` of each entry, for ``ttl_s``
    (refreshed by every dead letter), the newest ``DEAD_LETTER_MAX`` of them."""

    ttl_s: int = defaults.DEAD_LETTER_TTL_S
    max_bytes: int = defaults.DEAD_LETTER_MAX_BYTES

    def args(self, dead: list[bytes]) -> list[Any]:
        """The scripts' dead-letter ARGV: ttl, count, then the (truncated) entries."""
        return [self.ttl_s, len(dead), *(raw[:self.max_bytes] for raw in dead)]


DEFAULT_DEAD_LETTERS: Final = DeadLetters()


def refused_entries(outs: list[Outgoing], refused: list[Any]) -> list[bytes]:
    """The requests whose replies Redis refused (1-based indices into ``outs``), encoded
    again for the dead-letter list (without the payload, if that no longer encodes)."""
    return [_entry(outs[int(i) - 1]) for i in refused]


def _entry(out: Outgoing) -> bytes:
    wire = out.request.to_wire()
    try:
        return codec.encode(wire, out.fmt)
    except InvalidPayload:
        return codec.encode({**wire, protocol.F_PAYLOAD: None}, out.fmt)


def encode_reply(model: str, reply: Reply, fmt: Format) -> bytes:
    try:
        data = codec.encode(reply.to_wire(), fmt)
    except InvalidPayload as exc:
        return _failed(reply, fmt, f"model {model!r} returned an output that cannot be "
                                   f"encoded: {exc}")
    if len(data) > protocol.MAX_ENTRY_BYTES:  # no reader would take it: say so instead
        return _failed(reply, fmt, f"the reply of model {model!r} takes {len(data)} bytes, "
                                   f"over the {protocol.MAX_ENTRY_BYTES}-byte limit "
                                   "(send fewer rows per request)")
    return data


def _failed(reply: Reply, fmt: Format, message: str) -> bytes:
    failed = Reply(reply.id, False, error_code=ModelError.code, error_message=message,
                   timings=reply.timings)
    return codec.encode(failed.to_wire(), fmt)


def error_reply(request: Request, exc: RedbatchError, timings: Timings) -> Reply:
    return Reply(request.id, False, error_code=exc.code, error_message=str(exc),
                 timings=timings)


def pack_reply(pack: Pack, timings: Timings) -> Reply:
    """The one reply to a multi-row request: its rows' outputs (stacked into one tensor
    when they all succeeded and stack), and the rows that failed."""
    failed = {**pack.errors, **{row: out for row, out in enumerate(pack.outputs)
                                 if isinstance(out, RedbatchError)}}
    if not failed:
        return Reply(pack.request.id, True, _stacked(pack.outputs), timings=timings)
    outputs = [None if row in failed else out for row, out in enumerate(pack.outputs)]
    errors = {row: (exc.code, str(exc)) for row, exc in sorted(failed.items())}
    return Reply(pack.request.id, True, outputs, timings=timings, row_errors=errors)


def _stacked(outputs: list[Any]) -> Any:
    first = outputs[0] if outputs else None
    if not isinstance(first, np.ndarray) or not all(
            isinstance(o, np.ndarray) and o.shape == first.shape and o.dtype == first.dtype
            for o in outputs):
        return outputs
    return np.stack(outputs)


def publish_args(outs: list[Outgoing], dead: list[bytes], policy: DeadLetters | None = None
                 ) -> tuple[list[str], list[Any]]:
    """KEYS and the tail of ARGV shared by the PUBLISH and REAP scripts."""
    keys: list[str] = []
    argv: list[Any] = (policy or DEFAULT_DEAD_LETTERS).args(dead)
    for out in outs:
        keys += [out.marker, out.reply_to]
        argv += [out.marker_ttl_ms, out.data]
    return keys, argv
