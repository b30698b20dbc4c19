"""One runner's statistics, fed once per served batch (``WorkerStats.batch``).

Everything a worker reports of its throughput is derived from it: the Prometheus
metrics (names in ``redbatch.metrics``), the totals and bucket counts its heartbeat
publishes in ``worker_info`` (read by ``redbatch status``, the v2 statistics and the
benchmark) and the measured capacity, ``items_per_s``, that admission reads."""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Any

from redbatch import defaults, metrics, protocol
from redbatch.errors import DeadlineExceeded
from redbatch.worker.autosize import AutoSizer
from redbatch.worker.decode import Decoded

CAPACITY_SMOOTHING = 0.5  # weight of the last heartbeat interval in ``items_per_s``
PASS_SMOOTHING = 0.3  # weight of the last batch in a pass size's forward time
PASS_WARMUP = 3  # batches measured before the pass times are trusted


class Buckets:
    """Counts per histogram bucket (upper bounds, then +Inf), for ``redbatch status``:
    published with the heartbeat, so that it needs no Prometheus."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1


class Capacity:
    """Queue entries served per busy second (idle time excluded), smoothed over
    heartbeats: the queue's own unit (a multi-row request is one entry), which
    admission compares with the queue's length."""

    def __init__(self) -> None:
        self.items_per_s = 0.0
        self._entries = 0  # totals at the last sample
        self._busy_s = 0.0

    def sample(self, entries: int, busy_s: float) -> float:
        """The estimate after this interval (``entries``, ``busy_s``: totals so far);
        an idle interval keeps the last one."""
        served, busy = entries - self._entries, busy_s - self._busy_s
        self._entries, self._busy_s = entries, busy_s
        if busy > 0 and served > 0:
            rate = served / busy
            self.items_per_s = rate if not self.items_per_s else (
                self.items_per_s + CAPACITY_SMOOTHING * (rate - self.items_per_s))
        return self.items_per_s


class ServedRate:
    """Queue entries served per second of wall time over the last ``window_s`` or so
    (idle time included, unlike ``Capacity``): what the fleet takes off the queue, for
    the autoscaling signals (``redbatch.scaling``); exactly 0 after a quiet window."""

    def __init__(self, window_s: float = defaults.SERVED_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic s, entries total)

    def sample(self, entries: int, now: float | None = None) -> float:
        """The rate now (``entries``: the total so far); call once per heartbeat."""
        now = time.monotonic() if now is None else now
        self._samples.append((now, entries))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        then, before = self._samples[0]
        return (entries - before) / (now - then) if now > then else 0.0


class PassTimes:
    """Forward time of one pass (ms), smoothed per pass size rounded up to a power of
    two; ``estimate_ms`` is None until ``PASS_WARMUP`` batches were measured."""

    def __init__(self) -> None:
        self.ms: dict[int, float] = {}  # pass-size bucket -> smoothed ms per pass
        self.batches = 0

    @staticmethod
    def bucket(size: int) -> int:
        return 1 << max(0, size - 1).bit_length()

    def add(self, passes: list[int], fwd_ms: float) -> None:
        """One batch's passes and their forward time in all (shared out evenly)."""
        if not passes:
            return
        self.batches += 1
        key, per_pass = self.bucket(max(passes)), fwd_ms / len(passes)
        last = self.ms.get(key)
        self.ms[key] = per_pass if last is None else last + PASS_SMOOTHING * (per_pass - last)

    def estimate_ms(self, size: int) -> float | None:
        """A pass of ``size`` items: its bucket's time, else the nearest smaller
        bucket's (a lower bound), else the smallest larger one's."""
        if self.batches < PASS_WARMUP or not self.ms:
            return None
        key = self.bucket(size)
        below = [k for k in self.ms if k <= key]
        return self.ms[max(below)] if below else self.ms[min(self.ms)]


class WorkerStats:
    """The statistics of one model in one worker."""

    def __init__(self, model: str, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.batches = 0
        self.passes = 0  # forward passes (a batch larger than max_batch_size takes several)
        self.pass_items = 0  # items that went through a forward pass
        self.entries = 0  # queue entries answered (a multi-row request is one)
        self.items = 0  # requests answered, each row of a multi-row request counting
        self.busy_s = 0.0  # time spent serving claimed batches (not waiting for them)
        self.forward_ms = 0.0  # total forward time
        self.forward_cpu_ms = 0.0  # CPU time of the threads that ran the sync passes
        self.queue_wait_ms = 0.0  # total queue wait of answered entries (one per pack)
        self.holds = 0  # items held over to the next batch (``hold``)
        self.padded = 0  # padded passes of a variable-length model: lengths padded to,
        self.real = 0  # and the items' own lengths (``padding_waste``: their ratio)
        self.capacity = Capacity()
        self.served = ServedRate()
        self.pass_times = PassTimes()  # read by the batch window and the deadline check
        self.sizer = AutoSizer()  # ``auto_batch``: pass sizes learned per length bucket
        self._model = model
        self._gauged: set[str] = set()  # buckets with a redbatch_auto_batch_size series
        self.hist = {"batch_size": Buckets(metrics.BATCH_BUCKETS),
                     "batch_entries": Buckets(metrics.BATCH_BUCKETS),
                     "queue_wait_s": Buckets(metrics.LATENCY_BUCKETS_S),
                     "forward_s": Buckets(metrics.LATENCY_BUCKETS_S)}
        self._prometheus(model)

    def _prometheus(self, model: str) -> None:
        self.queue_wait = metrics.QUEUE_WAIT.labels(model)
        self.forward = metrics.FORWARD.labels(model)
        self.batch_size = metrics.BATCH_SIZE.labels(model)
        self.batch_entries = metrics.BATCH_ENTRIES.labels(model)
        self.fill = metrics.BATCH_FILL.labels(model)
        self.waste = metrics.PADDING_WASTE.labels(model)
        self.outcomes = {o: metrics.WORKER_ITEMS.labels(model, o)
                         for o in ("computed", "expired", "invalid", "error")}
        self.dead_letters = metrics.DEAD_LETTERS.labels(model)
        self.retries = metrics.RETRIES.labels(model)
        self.held_items = metrics.HELD_ITEMS.labels(model)

    def batch(self, decoded: Decoded, *, entries: int, size: int, passes: list[int],
              waits_ms: list[int], fwd_ms: float, busy_s: float, failed: int,
              padding: tuple[int, int] = (0, 0), fwd_cpu_ms: float = 0.0) -> None:
        """One served batch: ``entries`` queue entries of ``size`` items in all, the
        items of each forward pass, the entries' queue waits (clamped by
        ``protocol.queue_wait_ms``), the forward and busy time, the items that failed,
        the (padded, real) lengths of its padded passes and the passes' CPU time."""
        self.batches += 1
        self.entries += entries
        self.items += size
        self.busy_s += busy_s
        self.batch_entries.observe(entries)
        self.hist["batch_entries"].add(entries)
        self._passes(passes)
        self._waits(waits_ms)
        if decoded.items:
            self.forward.observe(fwd_ms / 1000)
            self.hist["forward_s"].add(fwd_ms / 1000)
        self.forward_ms += fwd_ms
        self.forward_cpu_ms += fwd_cpu_ms
        self._outcomes(decoded, failed)
        if not failed:  # a failed pass is bisected: its time is no pass's
            self.pass_times.add(passes, fwd_ms)
        self._padding(*padding)

    def _padding(self, padded: int, real: int) -> None:
        if real:
            self.padded += padded
            self.real += real
            self.waste.observe(padded / real)

    @property
    def padding_waste(self) -> float | None:
        """Padded over real elements since start (None before a padded pass)."""
        return self.padded / self.real if self.real else None

    def _passes(self, passes: list[int]) -> None:
        self.passes += len(passes)
        self.pass_items += sum(passes)
        for size in passes:
            self.batch_size.observe(size)
            self.hist["batch_size"].add(size)
            self.fill.observe(min(1.0, size / self.max_batch_size))

    def _waits(self, waits_ms: list[int]) -> None:
        self.queue_wait_ms += sum(waits_ms)
        for wait_ms in waits_ms:
            self.queue_wait.observe(wait_ms / 1000)
            self.hist["queue_wait_s"].add(wait_ms / 1000)

    def _outcomes(self, decoded: Decoded, failed: int) -> None:
        expired = sum(isinstance(exc, DeadlineExceeded) for _r, _f, exc in decoded.early)
        self.outcomes["computed"].inc(len(decoded.items) - failed)
        self.outcomes["error"].inc(failed)
        self.outcomes["expired"].inc(expired)
        self.outcomes["invalid"].inc(len(decoded.early) - expired + decoded.invalid_rows)
        self.dead_letters.inc(len(decoded.dead))

    def held(self, count: int) -> None:
        """Items a batch held over to the next one (``hold``)."""
        self.holds += count
        self.held_items.inc(count)

    def dead_lettered(self, count: int) -> None:
        """Entries dead-lettered outside a served batch (refused replies, reaps)."""
        self.dead_letters.inc(count)

    def retried(self, count: int) -> None:
        """Requests of a dead worker put back in the queue."""
        self.retries.inc(count)

    def sample_capacity(self) -> float:
        """``items_per_s`` now: call once per heartbeat (it measures since the last)."""
        return self.capacity.sample(self.entries, self.busy_s)

    def sample_served(self) -> float:
        """``served_per_s`` now: call once per heartbeat."""
        return self.served.sample(self.entries)

    def counters(self) -> dict[str, Any]:
        """Totals since start and the bucket counts, as ``worker_info`` publishes them
        with each heartbeat (with ``items_per_s``, the last sampled capacity)."""
        return {protocol.F_ITEMS_PER_S: self.capacity.items_per_s,
                "batches": self.batches, "items": self.items, "entries": self.entries,
                "passes": self.passes, "pass_items": self.pass_items,
                "forward_ms": round(self.forward_ms, 3),
                "forward_cpu_ms": round(self.forward_cpu_ms, 3),
                "queue_wait_ms": round(self.queue_wait_ms, 3),
                "padded": self.padded, "real": self.real, "held": self.holds,
                "hist": {name: list(b.counts) for name, b in self.hist.items()},
                **self._auto_sizes()}

    def _auto_sizes(self) -> dict[str, Any]:
        """``auto_sizes`` (bucket -> chosen pass size) while ``auto_batch`` chooses
        them, nothing otherwise; the gauge follows."""
        sizes = self.sizer.sizes()
        for bucket in self._gauged - set(sizes):
            metrics.AUTO_BATCH_SIZE.remove(self._model, bucket)
        for bucket, size in sizes.items():
            metrics.AUTO_BATCH_SIZE.labels(self._model, bucket).set(size)
        self._gauged = set(sizes)
        return {"auto_sizes": sizes} if sizes else {}
