"""Holding an under-filled length bucket over to the next batch (``auto_batch`` models
with length buckets, one batch in flight, one sub-queue).

A claim of a dozen requests of spread-out lengths leaves each length bucket a pass of
a few items where its learned size (``autosize``) is 16 or 32.  While the model is busy
(the claim came back full, or this claim and the last both brought several entries),
such a bucket's items may wait for the next batch, whose items of the same bucket
join them in one pass.  An item is held once at most (the next batch runs it,
whatever that batch brings); never a row of a multi-row request or a suspect; and
only while its deadline leaves room (``need_ms``) for two passes per bucket of this
batch (the rest of this batch's passes, then the next batch's, ahead of its own at
worst) and one more, each bucket's pass as measured (``autosize``), the stride, two
batch windows and ``HOLD_MARGIN_MS`` more; never a request of a priority level more
urgent than the model's default.  A bucket whose items cannot all wait runs now, all
of them (the pass runs anyway).  Only while every live worker of the model knows held
lists, as the last heartbeat counted (``protocol.held_aware_key``): an older worker's
reaper or drainer would miss them.

The held entries never live only in memory: the PUBLISH of the batch that holds
them moves them from the in-flight list's head to the worker's held list
(``protocol.held_key``), and the next batch's PUBLISH trims them off its head, each
step guarded by a digest; a reap requeues the held list before the in-flight one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from redbatch.errors import DeadlineExceeded
from redbatch.worker.autosize import AutoSizer, slot
from redbatch.worker.claim import Claimer
from redbatch.worker.decode import Decoded, Item

HOLD_MARGIN_MS: Final = 50  # a held item's slack beyond the passes, stride and windows
MIN_WAIT_S: Final = 0.001  # the next claim's shortest wait while items are held
STEADY_ENTRIES: Final = 2  # claims of at least this many entries in a row: a busy model


@dataclass(slots=True)
class Held:
    """Items held over for the next batch, with their entries (in the held list's
    order) and the sub-queue they came from."""

    items: list[Item]
    raws: list[bytes]
    source: Claimer

    @property
    def digest(self) -> str:
        """The SHA-1 the next PUBLISH checks the held list's head against."""
        return hashlib.sha1(b"".join(self.raws), usedforsecurity=False).hexdigest()


Groups = dict[int | None, list[Item]]  # length bucket -> a batch's items in it


def need_ms(passes_ms: list[float], window_s: float, stride_s: float) -> float:
    """The slack (ms to its deadline) an item needs to be held one batch longer, for a
    batch whose buckets' passes take ``passes_ms``: two passes per bucket and the
    longest once more, the stride, two windows and ``HOLD_MARGIN_MS``."""
    return (2 * sum(passes_ms) + max(passes_ms, default=0.0) + 1000 * stride_s
            + 2000 * window_s + HOLD_MARGIN_MS)


def pass_ms(sizer: AutoSizer, bucket: int | None, size: int, fallback_ms: float) -> float:
    """A pass of ``size`` items of ``bucket``: the bucket's own measured time (its
    ``size`` slot's, else its slowest slot's), else ``fallback_ms``."""
    curve = sizer.curve(bucket)
    times = {} if curve is None else curve.ms
    if not times:
        return fallback_ms
    return times.get(slot(size), max(times.values()))


def groups(items: list[Item], bucket_of: Callable[[Any], int | None]) -> Groups:
    """``items`` by length bucket."""
    grouped: Groups = {}
    for item in items:
        grouped.setdefault(bucket_of(item.value), []).append(item)
    return grouped


def pick(groups: Groups, target: Callable[[int | None], int], now_ms: int,
         slack_ms: float, default_priority: int = 0) -> list[Item]:
    """The items to hold, in claim order: those of each bucket with fewer items than
    its ``target`` pass size, when every one of them may wait ``slack_ms`` and none
    is of a priority level more urgent than ``default_priority`` (0: one level)."""
    held = [item for bucket, group in groups.items()
            if len(group) < target(bucket) and
            all(_may_wait(item, now_ms, slack_ms, default_priority) for item in group)
            for item in group]
    return sorted(held, key=lambda item: item.entry)


def _may_wait(item: Item, now_ms: int, slack_ms: float, default_priority: int) -> bool:
    """A single-row request of this claim (a held one's ``entry`` is reset: never
    held twice), not a suspect, not more urgent than the default level, whose
    deadline leaves ``slack_ms``."""
    request = item.request
    return item.entry >= 0 and item.pack is None and not request.suspect \
        and (request.priority or default_priority) >= default_priority \
        and request.deadline_ms - now_ms >= slack_ms


def take_out(decoded: Decoded, held: list[Item]) -> None:
    """Remove the ``held`` items from this batch."""
    ids = {id(item) for item in held}
    decoded.items = [item for item in decoded.items if id(item) not in ids]


def merge(decoded: Decoded, held: Held, now_ms: int) -> None:
    """The held items join the next batch, ahead of its own (they are older); one whose
    deadline passed meanwhile is answered ``deadline_exceeded``."""
    live = []
    for item in held.items:
        item.entry = -1  # held once: never again
        if item.request.deadline_ms > now_ms:
            live.append(item)
            continue
        decoded.early.append((item.request, item.fmt, DeadlineExceeded(
            f"deadline passed {now_ms - item.request.deadline_ms} ms before its pass "
            "(held over for a fuller one)")))
    decoded.items = live + decoded.items
