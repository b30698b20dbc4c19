"""Coalescing: the single requests of one flush whose inputs are arrays of one shape
and dtype travel as multi-row requests (``rows``, ``docs/protocol.md`` §3.1), up to
``pack_rows`` rows and ``rows.PACK_BYTES`` each.  A busy gateway or a client with many
concurrent ``predict`` calls then pays the queue's per-entry costs (encoding, Redis,
the worker's decode and encode) once per pack instead of once per request.

Each member keeps its own id and waiter: the listener splits the pack's reply back
(``ReplyListener.route_pack``).  Only requests whose ids the client made up are packed
(a caller's own id names a marker that dedupes its retries), and only while every live
worker of the model takes multi-row requests.  Requests that carry a caller's
``trace_id`` travel alone, so that the id the worker logs is theirs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from redbatch import codec, protocol
from redbatch.codec import Format
from redbatch.producer.rows import pack_size
from redbatch.protocol import Request

# route_pack(pack id, member ids, deadline_ms): tell the listener how to split a reply
RoutePack = Callable[[str, list[str], int], None]
DEADLINE_SPAN_MS = 100  # members of one pack have deadlines within this of each other


@dataclass(slots=True)
class Unit:
    """One queue entry of a flush, and the pushes (by index) whose requests it carries."""

    request: Request
    entry: bytes
    owners: list[int]


def plan(requests: list[list[Request]], entries: list[list[bytes] | None], fmt: Format,
         pack_rows: int, route_pack: RoutePack | None
         ) -> tuple[list[Unit], dict[int, Exception]]:
    """The entries of one flush: packs of lone same-shape requests first (with
    ``route_pack`` and ``pack_rows`` > 1), then every other request in push order; and
    the pushes whose requests could not be encoded."""
    units: list[Unit] = []
    failed: dict[int, Exception] = {}
    groups: dict[tuple[Any, ...], list[int]] = {}
    if route_pack is not None and pack_rows > 1:
        for index, reqs in enumerate(requests):
            key = _pack_key(reqs) if entries[index] is None else None
            if key is not None:
                groups.setdefault(key, []).append(index)
    packed = {i for members in groups.values() if len(members) > 1 for i in members}
    for members in groups.values():
        if len(members) > 1:
            assert route_pack is not None
            units += _packs(members, requests, fmt, pack_rows, route_pack, failed)
    for index, reqs in enumerate(requests):
        if index not in packed:
            _add_alone(index, reqs, entries[index], fmt, units, failed)
    return units, failed


def _pack_key(reqs: list[Request]) -> tuple[Any, ...] | None:
    """What a lone request must share with others to travel in one pack, if it may."""
    if len(reqs) != 1:
        return None
    request = reqs[0]
    payload = request.payload
    if type(payload) is not np.ndarray or request.rows or request.trace_id or \
            pack_size(payload.nbytes, 2) < 2:
        return None
    return payload.shape, payload.dtype.str


def _packs(members: list[int], requests: list[list[Request]], fmt: Format, pack_rows: int,
           route_pack: RoutePack, failed: dict[int, Exception]) -> list[Unit]:
    size = pack_size(requests[members[0]][0].payload.nbytes, pack_rows)
    units: list[Unit] = []
    for chunk in _chunks(members, requests, size):
        if len(chunk) == 1:  # a lone leftover travels as itself
            _add_alone(chunk[0], requests[chunk[0]], None, fmt, units, failed)
            continue
        pack = _pack_request([requests[i][0] for i in chunk])
        try:
            entry = codec.encode(pack.to_wire(), fmt)
        except Exception:  # e.g. a dtype the wire lacks: each member fails on its own
            for index in chunk:
                _add_alone(index, requests[index], None, fmt, units, failed)
            continue
        route_pack(pack.id, [requests[i][0].id for i in chunk],
                   max(requests[i][0].deadline_ms for i in chunk))
        units.append(Unit(pack, entry, chunk))
    return units


def _chunks(members: list[int], requests: list[list[Request]], size: int
            ) -> list[list[int]]:
    """Members in packs of at most ``size``, each spanning at most ``DEADLINE_SPAN_MS``
    of deadlines (a pack expires at its earliest member's)."""
    chunks: list[list[int]] = []
    first_ms = 0
    for index in sorted(members, key=lambda i: requests[i][0].deadline_ms):
        deadline_ms = requests[index][0].deadline_ms
        if not chunks or len(chunks[-1]) == size or deadline_ms - first_ms > DEADLINE_SPAN_MS:
            chunks.append([])
            first_ms = deadline_ms
        chunks[-1].append(index)
    return chunks


def _pack_request(members: list[Request]) -> Request:
    """One request for ``members``: the earliest enqueue time and deadline among them."""
    first = members[0]
    return Request(id=protocol.new_request_id(), model=first.model,
                   enqueue_ms=min(m.enqueue_ms for m in members),
                   deadline_ms=min(m.deadline_ms for m in members), reply_to=first.reply_to,
                   payload=np.stack([m.payload for m in members]), rows=len(members))


def _add_alone(index: int, reqs: list[Request], encoded: list[bytes] | None, fmt: Format,
               units: list[Unit], failed: dict[int, Exception]) -> None:
    try:
        entries = encoded if encoded is not None else [codec.encode(r.to_wire(), fmt)
                                                       for r in reqs]
    except Exception as exc:  # an input that cannot travel fails its own push only
        failed[index] = exc
        return
    units += [Unit(r, e, [index]) for r, e in zip(reqs, entries, strict=True)]
