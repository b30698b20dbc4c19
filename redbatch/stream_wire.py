"""A streaming model's messages on a reply list: numbered chunks, then one final
message (``last``) with the outcome and the timings (``docs/protocol.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redbatch import protocol
from redbatch.errors import InvalidPayload, RedbatchError, error_from_code


@dataclass(slots=True)
class StreamChunk:
    """One message of a stream: a chunk (``payload``), or the final message (``last``:
    ``ok``, else ``error_code`` and ``error_message``; ``timings``)."""

    id: str
    seq: int
    payload: Any = None
    last: bool = False
    ok: bool = True
    error_code: str = ""
    error_message: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    size: int = 0  # its bytes on the wire, as its caller read them (not sent)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {protocol.F_VERSION: protocol.PROTOCOL_VERSION,
                                protocol.F_ID: self.id, protocol.F_SEQ: self.seq}
        if not self.last:
            wire[protocol.F_PAYLOAD] = self.payload
            return wire
        wire[protocol.F_LAST] = True
        wire[protocol.F_OK] = self.ok
        if not self.ok:
            wire[protocol.F_ERROR] = {protocol.F_CODE: self.error_code,
                                      protocol.F_MESSAGE: self.error_message}
        wire[protocol.F_TIMINGS] = self.timings
        return wire

    def error(self) -> RedbatchError:
        """The typed error of a failed final message."""
        return error_from_code(self.error_code, self.error_message)


def chunk_from_wire(wire: dict[str, Any]) -> StreamChunk:
    """Validate a decoded stream message (``InvalidPayload`` if it is bad)."""
    seq, request_id = wire.get(protocol.F_SEQ), wire.get(protocol.F_ID)
    if type(seq) is not int or seq < 0 or not isinstance(request_id, str):
        raise InvalidPayload("a stream message needs an id and a seq >= 0")
    if wire.get(protocol.F_LAST) is not True:
        return StreamChunk(request_id, seq, wire.get(protocol.F_PAYLOAD))
    error = wire.get(protocol.F_ERROR) or {}
    timings = wire.get(protocol.F_TIMINGS)
    return StreamChunk(request_id, seq, last=True, ok=wire.get(protocol.F_OK) is True,
                       error_code=str(error.get(protocol.F_CODE, "internal")),
                       error_message=str(error.get(protocol.F_MESSAGE, "")),
                       timings=timings if isinstance(timings, dict) else {})
