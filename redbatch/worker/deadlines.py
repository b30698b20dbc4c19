"""Deadlines within a claimed batch: earliest deadline first, and requests that cannot
finish in time answered ``deadline_exceeded`` without being computed.

Both read the measured pass time (``stats.PassTimes``); without an estimate (a cold
worker) nothing is dropped.  The check is deliberately lenient: a request is dropped
only when even ``DROP_FACTOR`` of the estimated time to the end of its pass, plus
``REPLY_MARGIN_MS``, does not fit before its deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from redbatch.errors import DeadlineExceeded
from redbatch.worker.decode import Decoded, Item

log = logging.getLogger("redbatch.worker")

DROP_FACTOR = 0.5  # a pass twice as fast as measured would still miss the deadline
REPLY_MARGIN_MS = 5  # encode and publish, after the pass


def order_by_deadline(decoded: Decoded, size: int) -> None:
    """Earliest deadline first when the batch takes several passes of ``size`` (a
    stable sort: FIFO among equal deadlines).  Results follow ``decoded.items``."""
    if len(decoded.items) > size:
        decoded.items.sort(key=lambda item: item.request.deadline_ms)


def drop_infeasible(decoded: Decoded, now_ms: int, size: int,
                    estimate_ms: Callable[[int], float | None]) -> int:
    """Answer ``deadline_exceeded`` the requests (single or multi-row) that cannot
    finish before their deadline, judged at their first item's pass (in the order of
    ``decoded.items``); return how many."""
    pass_ms = estimate_ms(min(size, len(decoded.items))) if decoded.items else None
    if pass_ms is None or _all_in_time(decoded.items, now_ms, size, pass_ms):
        return 0
    decided: dict[int, bool] = {}  # id(request) -> late
    late: dict[int, Item] = {}
    kept = 0  # items kept ahead of this one: its pass is kept // size
    for item in decoded.items:
        key = id(item.request)
        if key not in decided:
            finish_ms = now_ms + DROP_FACTOR * pass_ms * (kept // size + 1) + REPLY_MARGIN_MS
            decided[key] = item.request.deadline_ms < finish_ms
            if decided[key]:
                late[key] = item
        kept += not decided[key]
    if late:
        _answer_late(decoded, late, now_ms)
    return len(late)


def _all_in_time(items: list[Item], now_ms: int, size: int, pass_ms: float) -> bool:
    """Whether even the earliest deadline leaves time for every pass (the usual case:
    one ``min`` instead of the per-request walk)."""
    passes = -(-len(items) // size)
    earliest = min(item.request.deadline_ms for item in items)
    return earliest >= now_ms + DROP_FACTOR * pass_ms * passes + REPLY_MARGIN_MS


def _answer_late(decoded: Decoded, late: dict[int, Item], now_ms: int) -> None:
    decoded.items = [item for item in decoded.items if id(item.request) not in late]
    decoded.packs = [pack for pack in decoded.packs if id(pack.request) not in late]
    for item in late.values():
        left_ms = item.request.deadline_ms - now_ms
        decoded.early.append((item.request, item.fmt, DeadlineExceeded(
            f"deadline {left_ms} ms away before its pass, shorter than the measured pass")))
        log.debug("model=%s request %s answered deadline_exceeded uncomputed: %d ms "
                  "left", item.request.model, item.request.id, left_ms)
