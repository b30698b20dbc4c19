"""scripts/autosize_sim.py: how often ``auto_batch``'s learner picks a pass size that
does worse than 95 % of the better of batch 1 and batch 32 (the W3 per-bucket target),
on simulated passes: no model runs, so the figure does not move with the machine.

Each bucket's pass time follows W3's anchors (``../shared/anchors``: tokens/s of the
bare model at batch 1 and 32 per length): ``a + b n`` ms for ``n`` items where batching
pays, ``t1 n^p`` where it does not (256 tokens).  Each round, a claim brings the bucket
4 to 12 items (W3's 64 bodies over two workers: 7 to 15 bodies per bucket), the learner
cuts them into passes, each pass's time is multiplied by a log-normal noise of spread
``sigma``; after 50 rounds, every round's chosen size (the exploration aside) counts.
Prints the share of rounds with a miss, per noise level, and per bucket at 20 %.

Usage: ``python scripts/autosize_sim.py [--recent N] [--tie SHARE] [--seeds K]``
(``--recent``/``--tie`` override ``autosize.RECENT``/``TIE_SHARE``, to compare).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable

from redbatch.worker import autosize
from redbatch.worker.autosize import AutoSizer

ANCHORS = {16: (62102, 246223), 32: (95832, 219958), 64: (127900, 194137),
           128: (132626, 137176), 256: (91856, 53301)}  # length: tokens/s at batch 1, 32
ROUNDS, SETTLE, CAP = 400, 50, 32


def pass_ms(length: int) -> Callable[[int], float]:
    """The bucket's pass time by items, through its anchors' batch 1 and batch 32."""
    r1, r32 = ANCHORS[length]
    t1, t32 = 1000 * length / r1, 1000 * 32 * length / r32
    b = (t32 - t1) / 31
    if t1 - b < 0:
        p = math.log(t32 / t1) / math.log(32)
        return lambda n: t1 * n ** p
    return lambda n: t1 - b + b * n


def misses(length: int, sigma: float, seed: int) -> tuple[int, int]:
    """(rounds whose chosen size missed the target, rounds counted) for one bucket."""
    ms, rng, sizer = pass_ms(length), random.Random(seed), AutoSizer(seed=seed)
    rate = lambda n: n / ms(n)  # noqa: E731
    floor, missed = 0.95 * max(rate(1), rate(CAP)), 0
    for r in range(ROUNDS):
        items, size = rng.randint(4, 12), sizer.size(length, CAP)
        for start in range(0, items, size):
            n = min(size, items - start)
            sizer.observe(length, n, ms(n) * math.exp(rng.gauss(0.0, sigma)))
        missed += r >= SETTLE and rate(sizer.target(length, CAP)) < floor
    return missed, ROUNDS - SETTLE


def share(sigma: float, seeds: int, lengths: tuple[int, ...] = tuple(ANCHORS)) -> float:
    counts = [misses(length, sigma, seed) for length in lengths for seed in range(seeds)]
    return sum(m for m, _ in counts) / sum(n for _, n in counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recent", type=int, default=autosize.RECENT)
    parser.add_argument("--tie", type=float, default=autosize.TIE_SHARE)
    parser.add_argument("--seeds", type=int, default=6)
    args = parser.parse_args()
    autosize.RECENT, autosize.TIE_SHARE = args.recent, args.tie
    print(f"RECENT={args.recent} TIE_SHARE={args.tie}, {args.seeds} seeds per bucket")
    for sigma in (0.1, 0.2, 0.3):
        print(f"  noise {sigma:.0%}: {share(sigma, args.seeds):.1%} of rounds miss")
    print("  at 20 %, per bucket: " + ", ".join(
        f"{length}: {share(0.2, args.seeds, (length,)):.1%}" for length in ANCHORS))


if __name__ == "__main__":
    main()
