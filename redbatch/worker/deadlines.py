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


def fixed_plan(count: int, size: int) -> list[int | None]:
    """The pass of each of ``count`` items run in order, ``size`` a pass."""
    return [i // size for i in range(count)]


def drop_infeasible(decoded: Decoded, now_ms: int, plan: list[int | None],
                    estimate_ms: Callable[[int], float | None]) -> int:
    """Answer ``deadline_exceeded`` the requests (single or multi-row) that cannot
    finish before their deadline, judged at their first item's pass; return how many.
    ``plan``: the pass of each of ``decoded.items`` (0 runs first; None: none), as the
    forwarder cuts them (length buckets, shapes, costs, learned sizes).  Only the
    requests of the first pass that holds late ones are answered: every pass ahead of
    it runs, so they are late for sure; the passes after it are cut again without
    them, so the caller plans again and calls again (``drop_late``)."""
    passes: dict[int, list[Item]] = {}
    for item, index in zip(decoded.items, plan, strict=True):
        if index is not None:
            passes.setdefault(index, []).append(item)
    times = [estimate_ms(len(passes[index])) for index in sorted(passes)]
    if not passes or None in times:  # a cold worker drops nothing
        return 0
    late = _first_late(passes, [DROP_FACTOR * ms for ms in times if ms is not None], now_ms)
    if late:
        _answer_late(decoded, late, now_ms)
    return len(late)


def drop_late(decoded: Decoded, now_ms: int, plan: Callable[[list[Item]], list[int | None]],
              estimate_ms: Callable[[int], float | None], rounds: int) -> int:
    """``drop_infeasible`` again on a new plan of the items left, until nothing more is
    late (at most ``rounds`` times: past them, a late request is computed anyway)."""
    dropped = 0
    for _ in range(rounds):
        found = drop_infeasible(decoded, now_ms, plan(decoded.items), estimate_ms)
        if not found:
            break
        dropped += found
    return dropped


def _first_late(passes: dict[int, list[Item]], budgets: list[float], now_ms: int
                ) -> dict[int, Item]:
    """id(request) -> its first item, for the late requests of the first pass that
    holds any (judged at their first item's pass)."""
    seen: set[int] = set()
    spent = 0.0  # the passes ahead, all of which run
    for index, budget in zip(sorted(passes), budgets, strict=True):
        finish_ms = now_ms + spent + budget + REPLY_MARGIN_MS
        late: dict[int, Item] = {}
        for item in passes[index]:
            key = id(item.request)
            if key not in seen:
                seen.add(key)
                if item.request.deadline_ms < finish_ms:
                    late[key] = item
        if late:
            return late
        spent += budget
    return {}


def _answer_late(decoded: Decoded, late: dict[int, Item], now_ms: int) -> None:
    decoded.items = [item for item in decoded.items if id(item.request) not in late]
    decoded.packs = [pack for pack in decoded.packs if id(pack.request) not in late]
    for item in late.values():
        left_ms = item.request.deadline_ms - now_ms
        decoded.early.append((item.request, item.fmt, DeadlineExceeded(
            f"deadline {left_ms} ms away before its pass, shorter than the measured pass")))
        log.debug("model=%s request %s answered deadline_exceeded uncomputed: %d ms "
                  "left", item.request.model, item.request.id, left_ms)
