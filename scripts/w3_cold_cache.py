"""scripts/w3_cold_cache.py: what evicted caches cost W3's passes.  The forward that
``textcls`` serves, one torch thread, each pass timed in thread CPU time (as a worker
times its passes) with its caches warm (passes back to back, as the bench's bare sweep
runs them) and cold (64 MiB read between passes, as the gateway, Redis and the load
generator do on a worker's cores between its passes), taking turns, 2 s each, 3 rounds.

Usage: ``.venv/bin/python scripts/w3_cold_cache.py`` (about 2 minutes).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from redbatch.bench import textcls, w3
from redbatch.worker.ragged import pad_batch

CASES = ((256, 1), (256, 4), (512, 1), (64, 32), (128, 32))  # (bucket, pass size)
JUNK = np.ones(64 * 2**20 // 8)


def rate(model: torch.nn.Module, rows: list[list[int]], n: int, cold: bool,
         duration_s: float = 2.0) -> float:
    """Real tokens per CPU-second of passes of ``n`` rows, each padded to its longest."""
    done, cpu_s, i = 0, 0.0, 0
    end = time.perf_counter() + duration_s
    with torch.inference_mode():
        while time.perf_counter() < end:
            chunk = [np.asarray(rows[(i + k) % len(rows)], dtype=np.int64) for k in range(n)]
            if cold:
                JUNK.sum()
            padded, lens = pad_batch(chunk, max(map(len, chunk)), 0)
            started = time.thread_time()
            model(torch.from_numpy(padded), torch.from_numpy(lens)).numpy()
            cpu_s, done, i = cpu_s + time.thread_time() - started, done + int(lens.sum()), i + 1
    return done / cpu_s


def main() -> None:
    torch.set_num_threads(1)
    model, buckets = textcls.build_served(), w3.buckets()
    for r in range(3):
        for length, n in CASES:
            warm, cold = rate(model, buckets[length], n, False), rate(model, buckets[length],
                                                                      n, True)
            print(f"round {r} bucket {length} x{n}: warm {warm:.0f} cold {cold:.0f} "
                  f"tokens/CPU-s, cold/warm {cold / warm:.2f}", flush=True)


if __name__ == "__main__":
    main()
