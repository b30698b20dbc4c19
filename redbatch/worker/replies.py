"""Encoded replies, each with the marker that makes it the only reply to its request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from redbatch import codec, protocol
from redbatch.codec import Format
from redbatch.errors import InvalidPayload, ModelError, RedbatchError
from redbatch.protocol import Reply, Request, Timings
from redbatch.worker.decode import Pack


@dataclass(slots=True)
class Outgoing:
    """One encoded reply, with the marker that makes it the only one."""

    reply_to: str
    marker: str
    marker_ttl_ms: int
    data: bytes


def outgoing(model: str, request: Request, reply: Reply, fmt: Format) -> Outgoing:
    ttl = protocol.marker_ttl_ms(request.deadline_ms, protocol.now_ms())
    return Outgoing(request.reply_to, protocol.request_key(model, request.id), ttl,
                    encode_reply(model, reply, fmt))


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


def publish_args(outs: list[Outgoing], dead: list[bytes]) -> tuple[list[str], list[Any]]:
    """KEYS and the tail of ARGV shared by the PUBLISH and REAP scripts."""
    keys: list[str] = []
    argv: list[Any] = [len(dead), *dead]
    for out in outs:
        keys += [out.marker, out.reply_to]
        argv += [out.marker_ttl_ms, out.data]
    return keys, argv
