"""A worker's Prometheus metrics for one model (names in ``redbatch.metrics``)."""

from __future__ import annotations

import bisect

from redbatch import metrics
from redbatch.errors import DeadlineExceeded
from redbatch.worker.decode import Decoded


class Buckets:
    """Counts per histogram bucket (upper bounds, then +Inf), for ``redbatch status``:
    published with the heartbeat, so that it needs no Prometheus."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1


class WorkerMeters:
    def __init__(self, model: str, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.hist = {"batch_size": Buckets(metrics.BATCH_BUCKETS),
                     "batch_entries": Buckets(metrics.BATCH_BUCKETS),
                     "queue_wait_s": Buckets(metrics.LATENCY_BUCKETS_S),
                     "forward_s": Buckets(metrics.LATENCY_BUCKETS_S)}
        self.queue_wait = metrics.QUEUE_WAIT.labels(model)
        self.forward = metrics.FORWARD.labels(model)
        self.batch_size = metrics.BATCH_SIZE.labels(model)
        self.batch_entries = metrics.BATCH_ENTRIES.labels(model)
        self.fill = metrics.BATCH_FILL.labels(model)
        self.items = {o: metrics.WORKER_ITEMS.labels(model, o)
                      for o in ("computed", "expired", "invalid", "error")}
        self.dead_letters = metrics.DEAD_LETTERS.labels(model)
        self.retries = metrics.RETRIES.labels(model)

    def batch(self, decoded: Decoded, passes: list[int], entries: int, waits_ms: list[int],
              fwd_ms: float, failed: int) -> None:
        """One served batch: the items of each of its forward passes, its queue entries,
        forward time, queue waits and outcomes."""
        for size in passes:
            self.batch_size.observe(size)
            self.hist["batch_size"].add(size)
            self.fill.observe(min(1.0, size / self.max_batch_size))
        self.batch_entries.observe(entries)
        self.hist["batch_entries"].add(entries)
        if decoded.items:
            self.forward.observe(fwd_ms / 1000)
            self.hist["forward_s"].add(fwd_ms / 1000)
        for wait_ms in waits_ms:  # clamped by protocol.queue_wait_ms
            wait_s = wait_ms / 1000
            self.queue_wait.observe(wait_s)
            self.hist["queue_wait_s"].add(wait_s)
        expired = sum(isinstance(exc, DeadlineExceeded) for _r, _f, exc in decoded.early)
        self.items["computed"].inc(len(decoded.items) - failed)
        self.items["error"].inc(failed)
        self.items["expired"].inc(expired)
        self.items["invalid"].inc(len(decoded.early) - expired + decoded.invalid_rows)
        self.dead_letters.inc(len(decoded.dead))

    def snapshot(self) -> dict[str, list[int]]:
        return {name: list(b.counts) for name, b in self.hist.items()}
