"""Batch size by measurement (``BatchPolicy.auto_batch``): per length bucket, the pass
size that gives the most items per second, learned from the passes as they run.

Batching does not always pay: on a CPU a transformer's short inputs gain many times
from batch 32 over batch 1, its long ones lose.  So, per bucket (a fixed-shape model
has one, ``"all"``), the worker keeps the time and item count of its last ``RECENT``
passes by size, the size rounded up to a power of two (a pass of 3 items counts for
size 4, with its 3 items), and reads their medians: a pass that another process slowed
down (it took the core) moves nothing.  25 passes, not fewer: with pass times spread
by 20 % (a shared CPU), medians of 9 picked a size below 95 % of the bucket's best
about twice as often (``scripts/autosize_sim.py``).  The size it cuts a bucket's
passes at is the largest one whose passes gave the most items/s, ``items / pass time``, or within
``TIE_SHARE`` of it (a flat curve's sizes differ by less than their noise: the larger
runs fuller passes), among those measured ``SLOT_PASSES`` times whose pass took at
most ``MAX_PASS_MS`` (size 1 is always allowed); never above ``max_batch_size``, a
cap.  Sizes above the largest measured are not ruled out while that one is the best:
the cut grows up to the budget, and the passes that a cut that large lets run
measure it.

* Before ``WARMUP_PASSES`` passes of a bucket were measured, its passes are cut at
  ``max_batch_size``, as without ``auto_batch``.
* Exploration: one choice in ``EXPLORE_EVERY`` (a seeded RNG) tries a neighbour of the
  best size instead, half or double (one not measured yet first), so that the curve
  is learned beyond the sizes that happen to run.
* A pass that failed (bisected) is not measured.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from statistics import median

WARMUP_PASSES = 4  # passes of a bucket measured before its size is chosen by them
EXPLORE_EVERY = 16  # one choice in this many tries a neighbouring size
RECENT = 25  # passes per size slot whose medians make its figures (scripts/autosize_sim.py)
MAX_PASS_MS = 100.0  # the latency budget of one pass (size 1 is always allowed)
FIXED = "all"  # the bucket label of a fixed-shape model
TIE_SHARE = 0.05  # items/s within this share of the best: a tie, the larger size wins
SLOT_PASSES = 3  # passes of a size before its figures count (``Curve.measured``)


def slot(size: int) -> int:
    """The power of two a pass of ``size`` items counts for (rounded up)."""
    return 1 << max(0, size - 1).bit_length()


def label(bucket: int | None) -> str:
    """A bucket as the counters and metrics name it: its length, or ``all``."""
    return FIXED if bucket is None else str(bucket)


@dataclass
class Curve:
    """One bucket's passes: per size slot, the items and time (ms) of its last
    ``RECENT`` passes, whose medians are the slot's figures (a pass slowed by another
    process taking the core moves no median)."""

    recent: dict[int, deque[tuple[float, float]]] = field(default_factory=dict)
    passes: int = 0

    def add(self, items: int, ms: float) -> None:
        self.passes += 1
        self.recent.setdefault(slot(items), deque(maxlen=RECENT)).append((float(items), ms))

    @property
    def ms(self) -> dict[int, float]:
        """Per slot, the median pass time."""
        return {k: median(ms for _items, ms in passes) for k, passes in self.recent.items()}

    @property
    def items(self) -> dict[int, float]:
        """Per slot, the median items per pass."""
        return {k: median(n for n, _ms in passes) for k, passes in self.recent.items()}

    @property
    def measured(self) -> list[int]:
        """The slots with ``SLOT_PASSES`` passes at least (all, while none has): a size
        that ran once or twice (a pass that allocated for a new shape, a rare claim)
        neither wins nor stops the cut from growing past it."""
        enough = [k for k, passes in self.recent.items() if len(passes) >= SLOT_PASSES]
        return enough or list(self.recent)

    def best(self, cap: int, budget_ms: float) -> int:
        """The largest slot of the most items/s, ties within ``TIE_SHARE`` included,
        among the measured ones within the budget and the cap (the quickest when none
        is within the budget); past the largest measured when that one is the best."""
        measured, ms = self.measured, self.ms
        keys = [k for k in measured if k <= slot(cap)] or [min(measured)]
        fits = [k for k in keys if ms[k] <= budget_ms] or [min(keys, key=ms.__getitem__)]
        rates = {k: self.rate(k) for k in fits}
        floor = (1 - TIE_SHARE) * max(rates.values())
        top = max(k for k, rate in rates.items() if rate >= floor)
        return self._extended(top, cap, budget_ms) if top == max(measured) else top

    def rate(self, key: int) -> float:
        """Items per ms of the passes of slot ``key`` (the median of theirs)."""
        return median(n / max(ms, 1e-6) for n, ms in self.recent[key])

    def _extended(self, top: int, cap: int, budget_ms: float) -> int:
        """The largest power of two up to the cap's slot whose pass, at ``top``'s time
        per item, fits the budget (``top`` itself if none above does)."""
        size, per_item_ms = top, self.ms[top] / max(self.items[top], 1.0)
        while size < slot(cap) and 2 * size * per_item_ms <= budget_ms:
            size *= 2
        return size


class AutoSizer:
    """The learned pass sizes of one model in one worker (shared by its Forwarders)."""

    def __init__(self, seed: int | None = None, explore_every: int = EXPLORE_EVERY,
                 budget_ms: float = MAX_PASS_MS) -> None:
        self._curves: dict[int | None, Curve] = {}
        self.chosen: dict[int | None, int] = {}  # bucket -> the size chosen last
        self._rng = random.Random(seed)
        self.explore_every = explore_every
        self.budget_ms = budget_ms

    def size(self, bucket: int | None, cap: int) -> int:
        """The size to cut ``bucket``'s passes at now (at most ``cap``)."""
        curve = self._curves.get(bucket)
        if curve is None or curve.passes < WARMUP_PASSES:
            self.chosen[bucket] = cap
            return cap
        best = min(curve.best(cap, self.budget_ms), cap)
        self.chosen[bucket] = best
        if self.explore_every and self._rng.random() * self.explore_every < 1:
            return self._neighbour(curve, best, cap)
        return best

    def target(self, bucket: int | None, cap: int) -> int:
        """The size ``size`` would choose for ``bucket`` now, exploration aside and
        nothing recorded: what a claim must bring of the bucket to fill its pass."""
        curve = self._curves.get(bucket)
        if curve is None or curve.passes < WARMUP_PASSES:
            return cap
        return min(curve.best(cap, self.budget_ms), cap)

    def _neighbour(self, curve: Curve, best: int, cap: int) -> int:
        """Half or double ``best`` (within 1..cap), one not measured yet first."""
        sides = sorted({max(1, best // 2), min(cap, best * 2)} - {best})
        if not sides:
            return best
        fresh = [s for s in sides if slot(s) not in curve.recent]
        return self._rng.choice(fresh or sides)

    def observe(self, bucket: int | None, items: int, ms: float) -> None:
        """One pass of ``items`` items in ``bucket`` took ``ms``."""
        curve = self._curves.get(bucket)
        if curve is None:
            curve = self._curves[bucket] = Curve()
        curve.add(items, ms)

    def forget(self) -> None:
        """``auto_batch`` was turned off: no size is chosen any more (what was
        measured stays, for when it is turned on again)."""
        self.chosen.clear()

    def sizes(self) -> dict[str, int]:
        """Each bucket's chosen size (the exploration aside), shortest bucket first."""
        ordered = sorted(self.chosen.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        return {label(bucket): size for bucket, size in ordered}

    def curve(self, bucket: int | None) -> Curve | None:
        return self._curves.get(bucket)
