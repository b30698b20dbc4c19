"""Packing: many inputs of one shape and dtype (or maps of named inputs of the same
names, shapes and dtypes) travel as one multi-row request (the ``rows`` field,
``docs/protocol.md`` §3.1), up to ``pack_rows`` rows and ``PACK_BYTES`` each.  The
client's requests of one flush (lone ``predict`` calls of one tick, and the inputs of
a ``submit_many``) are packed here, so that the queue's
per-entry costs (encoding, Redis, the worker's decode and encode) are paid once per
pack instead of once per request.

Each member keeps its own id and waiter: the listener splits the pack's reply back
row by row (``Listeners.route_pack``, with ``split_reply`` and ``row_reply``): a pack
is of one model, and so is its ``reply_to``, its members' (``protocol.reply_key``).
Only requests whose ids the client made up are packed (a caller's own id names a
marker that dedupes its retries), and only while every live worker of the model
takes multi-row requests.  Requests that carry a caller's ``trace_id`` travel alone,
so that the id the worker logs is theirs; so do the batches a caller sends whole
(``Request.rows`` set: ``slices`` cuts a tensor into them)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from redbatch import codec, protocol
from redbatch.codec import Format
from redbatch.errors import InvalidPayload, RedbatchError, error_from_code
from redbatch.protocol import Reply, Request

PACK_BYTES = 1 << 20  # input bytes per multi-row request: far below the entry limit
DEADLINE_SPAN_MS = 100  # members of one pack have deadlines within this of each other
# route_pack(model, pack id, member ids, deadline_ms): tell the model's reply listener
# how to split a reply
RoutePack = Callable[[str, str, list[str], int], None]
Member = tuple[int, Request]  # a request, and the index of the push that holds it
Failures = dict[int, list[tuple[str, Exception]]]  # push index -> (request id, error)


def pack_size(row_bytes: int, pack_rows: int) -> int:
    """Rows of ``row_bytes`` each in one multi-row request: at most ``pack_rows`` and
    ``PACK_BYTES`` (1: too big to pack)."""
    return max(1, min(pack_rows, PACK_BYTES // max(1, row_bytes)))


def slices(tensor: np.ndarray[Any, Any], pack_rows: int
           ) -> tuple[list[int], list[np.ndarray[Any, Any]]]:
    """A batch tensor cut along its first dimension into views of up to a pack's rows
    (never split into rows): each view's first row, and the views."""
    per = pack_size(tensor.nbytes // max(1, len(tensor)), pack_rows)
    starts = list(range(0, len(tensor), per))
    return starts, [tensor[start:start + per] for start in starts]


@dataclass(slots=True)
class Unit:
    """One queue entry of a flush, and the requests (with their pushes) it carries."""

    request: Request
    entry: bytes
    members: list[Member]


def plan(requests: list[list[Request]], entries: list[list[bytes] | None], fmt: Format,
         pack_rows: int, route_pack: RoutePack | None) -> tuple[list[Unit], Failures]:
    """The entries of one flush, given each push's requests (and entries, when the
    caller encoded them): packs of same-shape requests first (with ``route_pack`` and
    ``pack_rows`` > 1), then every other request in push order; and the requests that
    could not be encoded, by push."""
    units: list[Unit] = []
    failed: Failures = {}
    groups, alone = _grouped(requests, entries, route_pack is not None and pack_rows > 1)
    for members in groups.values():
        assert route_pack is not None
        units += _packs(members, fmt, pack_rows, route_pack, failed)
    for member, entry in alone:
        if entry is None:
            _add_alone(member, fmt, units, failed)
        else:
            units.append(Unit(member[1], entry, [member]))
    return units, failed


Keyed = tuple[Member, bytes | None, tuple[Any, ...] | None]  # a request, entry, pack key


def _grouped(requests: list[list[Request]], entries: list[list[bytes] | None], packing: bool
             ) -> tuple[dict[tuple[Any, ...], list[Member]], list[tuple[Member, bytes | None]]]:
    """The groups of two or more requests that may share packs, and the requests that
    travel alone (with their entries, if encoded), in push order."""
    keyed = _keyed(requests, entries, packing)
    counts = Counter(key for _m, _e, key in keyed if key is not None)
    groups: dict[tuple[Any, ...], list[Member]] = {}
    alone: list[tuple[Member, bytes | None]] = []
    for member, entry, key in keyed:
        if key is None or counts[key] < 2:
            alone.append((member, entry))
        else:
            groups.setdefault(key, []).append(member)
    return groups, alone


def _keyed(requests: list[list[Request]], entries: list[list[bytes] | None], packing: bool
           ) -> list[Keyed]:
    """Every request of the flush with its push, its entry (if encoded) and pack key."""
    keyed: list[Keyed] = []
    for index, reqs in enumerate(requests):
        encoded = entries[index]
        if encoded is not None:
            keyed += [((index, r), e, None) for r, e in zip(reqs, encoded, strict=True)]
        else:
            keyed += [((index, r), None, _pack_key(r) if packing else None) for r in reqs]
    return keyed


def _pack_key(request: Request) -> tuple[Any, ...] | None:
    """What a request must share with others to travel in one pack, if it may."""
    payload = request.payload
    if type(payload) is not np.ndarray:
        return _named_key(request) if type(payload) is dict else None
    if request.rows or request.trace_id or pack_size(payload.nbytes, 2) < 2:
        return None
    return payload.shape, payload.dtype.str


def _named_key(request: Request) -> tuple[Any, ...] | None:
    """The pack key of a map of named inputs, all of them arrays (or numpy scalars):
    their names, shapes and dtypes, in order."""
    payload: dict[Any, Any] = request.payload
    if request.rows or request.trace_id or not payload or not all(
            type(value) is np.ndarray or isinstance(value, np.generic)
            for value in payload.values()) or pack_size(_nbytes(payload), 2) < 2:
        return None
    return ("named", *((name, v.shape, v.dtype.str) for name, v in payload.items()))


def _nbytes(payload: Any) -> int:
    """A packable payload's bytes: an array's, or a map of named arrays' together."""
    if isinstance(payload, dict):
        return sum(value.nbytes for value in payload.values())
    return int(payload.nbytes)


def _packs(members: list[Member], fmt: Format, pack_rows: int, route_pack: RoutePack,
           failed: Failures) -> list[Unit]:
    size = pack_size(_nbytes(members[0][1].payload), pack_rows)
    units: list[Unit] = []
    for chunk in _chunks(members, size):
        if len(chunk) == 1:  # a lone leftover travels as itself
            _add_alone(chunk[0], fmt, units, failed)
            continue
        pack = _pack_request([r for _i, r in chunk])
        try:
            entry = codec.encode(pack.to_wire(), fmt)
        except Exception:  # e.g. a dtype the wire lacks: each member fails on its own
            for member in chunk:
                _add_alone(member, fmt, units, failed)
            continue
        route_pack(pack.model, pack.id, [r.id for _i, r in chunk],
                   max(r.deadline_ms for _i, r in chunk))
        units.append(Unit(pack, entry, chunk))
    return units


def _chunks(members: list[Member], size: int) -> list[list[Member]]:
    """Members in packs of at most ``size``, each spanning at most ``DEADLINE_SPAN_MS``
    of deadlines (a pack expires at its earliest member's); in order otherwise."""
    chunks: list[list[Member]] = []
    first_ms = 0
    for member in sorted(members, key=lambda m: m[1].deadline_ms):
        deadline_ms = member[1].deadline_ms
        if not chunks or len(chunks[-1]) == size or deadline_ms - first_ms > DEADLINE_SPAN_MS:
            chunks.append([])
            first_ms = deadline_ms
        chunks[-1].append(member)
    return chunks


def _pack_request(members: list[Request]) -> Request:
    """One request for ``members`` (of one priority level: a flush packs each level's
    apart): the earliest enqueue time and deadline among them."""
    first = members[0]
    return Request(id=protocol.new_request_id(), model=first.model,
                   enqueue_ms=min(m.enqueue_ms for m in members),
                   deadline_ms=min(m.deadline_ms for m in members), reply_to=first.reply_to,
                   payload=_stacked([m.payload for m in members]), rows=len(members),
                   priority=first.priority)


def _stacked(payloads: list[Any]) -> Any:
    """The members' payloads as one multi-row payload: arrays stacked, or a map of
    named arrays stacked input by input."""
    if isinstance(payloads[0], dict):
        return {name: np.stack([p[name] for p in payloads]) for name in payloads[0]}
    return np.stack(payloads)


def _add_alone(member: Member, fmt: Format, units: list[Unit], failed: Failures) -> None:
    request = member[1]
    try:
        entry = codec.encode(request.to_wire(), fmt)
    except Exception as exc:  # an input that cannot travel fails its own request only
        failed.setdefault(member[0], []).append((request.id, exc))
        return
    units.append(Unit(request, entry, [member]))


# --- replies -------------------------------------------------------------------
def row_reply(reply: Reply, row_id: str, outcome: Any) -> Reply:
    """A row's own ``Reply`` (id ``row_id``, the request's timings) from its outcome."""
    if isinstance(outcome, RedbatchError):
        return Reply(row_id, False, error_code=outcome.code, error_message=str(outcome),
                     timings=reply.timings)
    return Reply(row_id, True, outcome, timings=reply.timings)


def split_reply(reply: Reply, n: int) -> list[Any]:
    """Each row's output, or its error."""
    if not reply.ok:
        return [error_from_code(reply.error_code, reply.error_message) for _ in range(n)]
    payload = reply.payload
    if not isinstance(payload, np.ndarray | list) or (
            isinstance(payload, np.ndarray) and payload.ndim == 0) or len(payload) != n:
        exc: RedbatchError = InvalidPayload(
            f"a reply to {n} rows did not hold {n} outputs (a worker without multi-row "
            "support?)")
        return [exc] * n
    # as a lone request's output decodes: Python numbers for scalar rows
    outcomes = payload.tolist() if isinstance(payload, np.ndarray) and payload.ndim == 1 \
        else list(payload)
    for row, (code, message) in reply.row_errors.items():
        if 0 <= row < n:
            outcomes[row] = error_from_code(code, message)
    return outcomes
