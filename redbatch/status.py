"""``redbatch status``: what each model's queue and workers are doing, read straight
from Redis (the workers' heartbeats), no gateway needed.

Per model: queue depth, live workers and their devices, items/s (from the workers'
counters over the sampling interval), the batch-size distribution (items per forward
pass) and the queue entries per claimed batch, p50/p99 queue wait
and forward time (from the bucket counts each worker publishes with its heartbeat,
since the worker started), the pass size chosen per length bucket under
``auto_batch``, the dead letters waiting, and the workers needed (``redbatch.scaling``:
the arrival rate is the entries served plus the queue's growth over the interval).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import redis

from redbatch import knobs, metrics, protocol, scaling
from redbatch.levels import by_level, level_keys, meta_keys, queued_sub_queues_of
from redbatch.registry import live_workers_sync

log = logging.getLogger("redbatch.status")

HISTS: dict[str, tuple[float, ...]] = {"batch_size": metrics.BATCH_BUCKETS,
                                       "batch_entries": metrics.BATCH_BUCKETS,
                                       "queue_wait_s": metrics.LATENCY_BUCKETS_S,
                                       "forward_s": metrics.LATENCY_BUCKETS_S}


@dataclass
class ModelStatus:
    model: str
    queue_depth: int
    dead_letters: int
    workers: list[dict[str, Any]] = field(default_factory=list)
    items_per_s: float | None = None
    batches: int = 0
    items: int = 0
    passes: int = 0
    mean_batch: float = 0.0  # items per forward pass
    batch_size_p50: float | None = None
    batch_size_p99: float | None = None
    mean_entries: float = 0.0  # queue entries per claimed batch
    entries_p50: float | None = None
    entries_p99: float | None = None
    queue_wait_ms_p50: float | None = None
    queue_wait_ms_p99: float | None = None
    forward_ms_p50: float | None = None
    forward_ms_p99: float | None = None
    batch_sizes: dict[str, int] = field(default_factory=dict)
    knobs: dict[str, Any] = field(default_factory=dict)  # in effect (workers' meta)
    overrides: dict[str, Any] = field(default_factory=dict)  # stored live changes
    auto_sizes: dict[str, str] = field(default_factory=dict)  # bucket -> size ("4-8")
    queue_depths: dict[str, int] = field(default_factory=dict)  # per priority level
    workers_needed: int | None = None  # redbatch.scaling, over the sampling interval


def quantile(q: float, bounds: tuple[float, ...], counts: list[int], *,
             upper: bool = False) -> float | None:
    """The q-quantile from bucket counts, linear within a bucket (as PromQL's
    histogram_quantile), or with ``upper`` the bucket's upper bound (for whole numbers
    such as batch sizes); the +Inf bucket answers with the last finite bound."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, count in enumerate(counts):
        if seen + count >= rank and count:
            if i >= len(bounds):
                return bounds[-1]
            if upper:
                return bounds[i]
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / count
        seen += count
    return bounds[-1]


def _merged(workers: list[dict[str, Any]], name: str) -> list[int]:
    counts = [0] * (len(HISTS[name]) + 1)
    for info in workers:
        for i, c in enumerate(info.get("hist", {}).get(name, [])[:len(counts)]):
            counts[i] += int(c)
    return counts


def _read_meta(client: redis.Redis, model: str) -> tuple[Any, Any]:
    """``levels.read_meta``, on a synchronous client."""
    with client.pipeline(transaction=False) as pipe:
        for key in meta_keys(model):
            pipe.get(key)
        meta, draining = pipe.execute()
    return meta, draining


def read_model(client: redis.Redis, model: str) -> ModelStatus:
    """One model's status now (no rates: see ``sample``)."""
    workers = live_workers_sync(client, model)
    meta, draining = _read_meta(client, model)
    depths = [sum(int(client.llen(key)) for key in keys)
              for keys in level_keys(model, meta, draining)]
    dead = sum(int(client.llen(protocol.dead_letter_key(tag)))  # every sub-queue's
               for tag in protocol.sub_queue_tags(model, queued_sub_queues_of(meta, draining)))
    status = ModelStatus(model, sum(depths), dead, workers)
    if len(depths) > 1:
        status.queue_depths = by_level(depths)
    status.batches = sum(int(w.get("batches", 0)) for w in workers)
    status.items = sum(int(w.get("items", 0)) for w in workers)
    status.passes = sum(int(w.get("passes", 0)) for w in workers)
    pass_items = sum(int(w.get("pass_items", 0)) for w in workers)
    status.mean_batch = pass_items / status.passes if status.passes else 0.0
    entries = sum(int(w.get("entries", 0)) for w in workers)
    status.mean_entries = entries / status.batches if status.batches else 0.0
    _fill_quantiles(status, workers)
    _fill_knobs(status, client, meta)
    status.auto_sizes = auto_sizes(workers)
    return status


def auto_sizes(workers: list[dict[str, Any]]) -> dict[str, str]:
    """Bucket -> the pass size its workers chose (``auto_batch``): ``"16"``, or
    ``"8-16"`` when they differ; buckets in the workers' order."""
    seen: dict[str, list[int]] = {}
    for info in workers:
        for bucket, size in (info.get("auto_sizes") or {}).items():
            seen.setdefault(str(bucket), []).append(int(size))
    return {bucket: f"{min(s)}" if min(s) == max(s) else f"{min(s)}-{max(s)}"
            for bucket, s in seen.items()}


def _fill_knobs(status: ModelStatus, client: redis.Redis, meta: Any) -> None:
    """The knobs the workers publish in effect, and the stored overrides."""
    status.knobs = knobs.published(orjson.loads(meta)) if meta else {}
    raw: Any = client.hgetall(protocol.config_key(status.model))
    status.overrides = knobs.decode_stored(raw)[0]


def _fill_quantiles(status: ModelStatus, workers: list[dict[str, Any]]) -> None:
    sizes = _merged(workers, "batch_size")
    bounds = HISTS["batch_size"]
    status.batch_sizes = {f"<={b:g}": c for b, c in zip(bounds, sizes, strict=False) if c}
    status.batch_size_p50 = quantile(0.5, bounds, sizes, upper=True)
    status.batch_size_p99 = quantile(0.99, bounds, sizes, upper=True)
    entries = _merged(workers, "batch_entries")
    status.entries_p50 = quantile(0.5, bounds, entries, upper=True)
    status.entries_p99 = quantile(0.99, bounds, entries, upper=True)
    for name, attr in (("queue_wait_s", "queue_wait_ms"), ("forward_s", "forward_ms")):
        counts = _merged(workers, name)
        for q, suffix in ((0.5, "p50"), (0.99, "p99")):
            value = quantile(q, HISTS[name], counts)
            setattr(status, f"{attr}_{suffix}", None if value is None else value * 1000)


def model_names(client: redis.Redis) -> list[str]:
    raw: Any = client.zrange(protocol.MODELS_KEY, 0, -1)
    return sorted(name.decode(errors="replace") for name in raw)


def sample(client: redis.Redis, interval_s: float) -> dict[str, ModelStatus]:
    """Every model's status, with items/s measured over ``interval_s`` (workers publish
    their counters once a heartbeat, 1 s by default: sample 2 s or more for steady
    figures)."""
    before = _read_all(client, warn=False)  # (a model left out is named once, below)
    started = time.monotonic()
    time.sleep(interval_s)
    elapsed = time.monotonic() - started
    now = _read_all(client)
    for name, status in now.items():
        if name in before:
            try:
                status.items_per_s = _served(before[name].workers, status.workers) / elapsed
                status.workers_needed = _needed(before[name], status, elapsed)
            except (ValueError, TypeError) as exc:  # a worker's counter that is no number
                log.warning("model %r: its rates cannot be read (%s)", name, exc)
    return now


def _read_all(client: redis.Redis, *, warn: bool = True) -> dict[str, ModelStatus]:
    """Every model's status; a model whose keys in Redis cannot be read (a field that
    is no number, metadata that is no JSON object, a key of another type: written by
    something else) is left out, with a warning naming it (``warn``)."""
    statuses: dict[str, ModelStatus] = {}
    for model in model_names(client):
        try:
            statuses[model] = read_model(client, model)
        except (ValueError, TypeError, AttributeError, KeyError, redis.ResponseError) as exc:
            if warn:
                    log.warning("model %r left out: its keys in Redis cannot be read (%s: %s)",
                            model, type(exc).__name__, exc)
    return statuses


def _needed(before: ModelStatus, now: ModelStatus, elapsed: float) -> int:
    """``scaling.workers_needed`` from the entries served and the queue's growth
    between the two samples, and the capacities the workers publish."""
    served = _served(before.workers, now.workers, "entries") / elapsed
    arrival = scaling.arrival_rate(served, (now.queue_depth - before.queue_depth) / elapsed)
    per_worker = scaling.mean_capacity(
        [float(w.get(protocol.F_ITEMS_PER_S) or 0) for w in now.workers])
    return scaling.workers_needed(arrival, now.queue_depth, per_worker, len(now.workers))


def _served(before: list[dict[str, Any]], after: list[dict[str, Any]],
            counter: str = "items") -> int:
    """Items (or another counter) served between two samples, by workers present in
    both (a worker that joined, left or restarted in between would skew a plain
    difference of sums)."""
    then = {w.get("worker_id"): int(w.get(counter, 0)) for w in before}
    return sum(max(0, int(w.get(counter, 0)) - then[w.get("worker_id")])
               for w in after if w.get("worker_id") in then)


def as_json(statuses: dict[str, ModelStatus]) -> dict[str, Any]:
    return {"models": [asdict(s) for s in statuses.values()], "time_ms": protocol.now_ms()}
