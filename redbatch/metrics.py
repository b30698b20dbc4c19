"""Prometheus metrics: every name redbatch exports, in one place.

The gateway serves them at ``GET /metrics`` on its HTTP port; each worker replica on
its own port (``--metrics-port P``: replica *i* on ``P + i``).  All carry a ``model``
label.  Several gateway processes on one port (``redbatch gateway --workers N``) run in
prometheus_client's multiprocess mode, set up by ``redbatch.gateway_procs``: a scrape,
whichever process answers it, sums every process's counters and histograms; the
in-flight gauge sums the live processes, and the gauges read from Redis at scrape time
show the latest reading.  Under ``uvicorn --workers N`` by hand, set
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory for the same.

Labels come from model names that a worker registered; the gateway files requests for
names it does not know under ``model="_unknown"`` so that URLs cannot blow up the
number of series.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Final

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
)

UNKNOWN_MODEL: Final = "_unknown"
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                            0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a request's (a stream's runs to its deadline, at most MAX_TIMEOUT_S): up to 10 minutes
REQUEST_BUCKETS_S: Final = (*LATENCY_BUCKETS_S, 120.0, 300.0, 600.0)
BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
FILL_BUCKETS: Final = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
WASTE_BUCKETS: Final = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0)

# --- gateway ------------------------------------------------------------------------
REQUESTS: Final = Counter(
    "redbatch_requests", "Predict requests answered by the gateway, by outcome: ok, "
    "expired (504), rejected (503: queue full, no workers), invalid (4xx), cancelled "
    "(the client went away first), error (5xx, and Redis unavailable)",
    ["model", "outcome"])
REQUEST_DURATION: Final = Histogram(
    "redbatch_request_duration_seconds", "End-to-end latency of predict requests at the "
    "gateway (a streamed answer's: to its last chunk)", ["model"], buckets=REQUEST_BUCKETS_S)
STREAM_FIRST_CHUNK: Final = Histogram(
    "redbatch_stream_first_chunk_seconds", "Time from arrival to the first chunk of a "
    "streamed answer at the gateway (its request duration runs to the last chunk)",
    ["model"], buckets=REQUEST_BUCKETS_S)
INFLIGHT: Final = Gauge(
    "redbatch_inflight_requests", "Predict requests this gateway is serving now",
    ["model"], multiprocess_mode="livesum")
QUEUE_DEPTH: Final = Gauge(
    "redbatch_queue_depth", "Entries in the model's queue (read from Redis at scrape time)",
    ["model"], multiprocess_mode="livemostrecent")
QUEUE_DEPTH_LEVEL: Final = Gauge(
    "redbatch_queue_depth_level", "Entries in each priority level's queue of a model of "
    "several levels (read from Redis at scrape time)",
    ["model", "level"], multiprocess_mode="livemostrecent")
LIVE_WORKERS: Final = Gauge(
    "redbatch_live_workers", "Workers of the model holding a live lease (at scrape time)",
    ["model"], multiprocess_mode="livemostrecent")
# Autoscaling signals (redbatch.scaling: the formulas), read from Redis at scrape time.
CAPACITY: Final = Gauge(
    "redbatch_capacity_items_per_second", "Measured capacity of the model's live workers "
    "summed: queue entries per busy second (at scrape time)",
    ["model"], multiprocess_mode="livemostrecent")
WORKER_CAPACITY: Final = Gauge(
    "redbatch_worker_capacity_items_per_second", "Measured capacity of one live worker: "
    "the mean over those that measured one (0: none did; at scrape time)",
    ["model"], multiprocess_mode="livemostrecent")
ARRIVAL_RATE: Final = Gauge(
    "redbatch_arrival_items_per_second", "Queue entries arriving per second, fleet-wide: "
    "served by every live worker plus the queue's growth (at scrape time)",
    ["model"], multiprocess_mode="livemostrecent")
WORKERS_NEEDED_NAME: Final = "redbatch_workers_needed"  # deploy/k8s: the HPA's metric
WORKERS_NEEDED: Final = Gauge(
    WORKERS_NEEDED_NAME, "Workers that serve the arrival rate and drain the queue "
    "within SCALE_DRAIN_S: ceil((arrival + queue / drain_s) / per-worker capacity)",
    ["model"], multiprocess_mode="livemostrecent")
SCALING_METRICS: Final = ("redbatch_capacity_items_per_second",
                          "redbatch_worker_capacity_items_per_second",
                          "redbatch_arrival_items_per_second", WORKERS_NEEDED_NAME)

# --- worker -------------------------------------------------------------------------
QUEUE_WAIT: Final = Histogram(
    "redbatch_queue_wait_seconds", "Time from enqueue to claim, per computed request",
    ["model"], buckets=LATENCY_BUCKETS_S)
FORWARD: Final = Histogram(
    "redbatch_forward_seconds", "Forward pass time per batch", ["model"],
    buckets=LATENCY_BUCKETS_S)
BATCH_SIZE: Final = Histogram(
    "redbatch_batch_size", "Items per forward pass (each row of a multi-row request "
    "counts; a claimed batch over max_batch_size items takes several passes)", ["model"],
    buckets=BATCH_BUCKETS)
BATCH_ENTRIES: Final = Histogram(
    "redbatch_batch_entries", "Queue entries claimed per batch (a multi-row request is "
    "one)", ["model"], buckets=BATCH_BUCKETS)
BATCH_FILL: Final = Histogram(
    "redbatch_batch_fill_ratio", "Items per forward pass over max_batch_size", ["model"],
    buckets=FILL_BUCKETS)
PADDING_WASTE: Final = Histogram(
    "redbatch_padding_waste_ratio", "Padded elements over real elements per batch of a "
    "variable-length model (1.0: no padding)", ["model"], buckets=WASTE_BUCKETS)
AUTO_BATCH_SIZE: Final = Gauge(
    "redbatch_auto_batch_size", "Pass size chosen by measurement per length bucket "
    "(auto_batch; bucket \"all\" for a fixed-shape model)", ["model", "bucket"],
    multiprocess_mode="livemostrecent")
WORKER_ITEMS: Final = Counter(
    "redbatch_worker_items", "Claimed entries by outcome: computed (reached the model), "
    "expired, invalid (bad entry or input), error (the model failed on it)",
    ["model", "outcome"])
RETRIES: Final = Counter(
    "redbatch_retries", "Requests put back in the queue after their worker died",
    ["model"])
HELD_ITEMS: Final = Counter(
    "redbatch_held_items", "Items of an under-filled length bucket held over to the next "
    "batch (hold_buckets; each runs in the next batch, or alone if none comes)", ["model"])
DEAD_LETTERS: Final = Counter(
    "redbatch_dead_letters", "Entries moved to the dead-letter list (malformed, or "
    "crashed max_attempts workers, or whose reply Redis refused)", ["model"])

GATEWAY_METRICS: Final = ("redbatch_requests_total", "redbatch_request_duration_seconds",
                          "redbatch_stream_first_chunk_seconds",
                          "redbatch_inflight_requests", "redbatch_queue_depth",
                          "redbatch_queue_depth_level", "redbatch_live_workers",
                          *SCALING_METRICS)
WORKER_METRICS: Final = ("redbatch_queue_wait_seconds", "redbatch_forward_seconds",
                         "redbatch_batch_size", "redbatch_batch_entries",
                         "redbatch_batch_fill_ratio", "redbatch_worker_items_total",
                         "redbatch_retries_total", "redbatch_dead_letters_total",
                         "redbatch_padding_waste_ratio", "redbatch_auto_batch_size",
                         "redbatch_held_items_total")
HISTOGRAMS: Final = frozenset({"redbatch_request_duration_seconds",
                               "redbatch_stream_first_chunk_seconds",
                               "redbatch_queue_wait_seconds", "redbatch_forward_seconds",
                               "redbatch_batch_size", "redbatch_batch_entries",
                               "redbatch_batch_fill_ratio", "redbatch_padding_waste_ratio"})


def series_names(names: Iterable[str] = GATEWAY_METRICS + WORKER_METRICS) -> set[str]:
    """Every series name a scrape can show (histograms as _bucket, _sum, _count)."""
    out: set[str] = set()
    for name in names:
        out |= {f"{name}{s}" for s in ("_bucket", "_sum", "_count")} if name in HISTOGRAMS \
            else {name}
    return out


def exposition() -> bytes:
    """The text exposition of this process (or, in multiprocess mode, of all)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest(DEFAULT_REGISTRY)


def serve(port: int, host: str = "0.0.0.0") -> None:  # scraped from outside
    """Serve ``/metrics`` of this process on ``port`` from a daemon thread."""
    start_http_server(port, addr=host)


class GatewayMeters:
    """The gateway's per-model metric children, looked up once per model."""

    def __init__(self) -> None:
        self._children: dict[str, tuple[Histogram, Gauge, dict[str, Counter]]] = {}
        self._first_chunks: dict[str, Histogram] = {}

    def get(self, model: str) -> tuple[Histogram, Gauge, dict[str, Counter]]:
        found = self._children.get(model)
        if found is None:
            outcomes = {o: REQUESTS.labels(model, o)
                        for o in OUTCOMES}
            found = (REQUEST_DURATION.labels(model), INFLIGHT.labels(model), outcomes)
            self._children[model] = found
        return found

    def first_chunk(self, model: str) -> Histogram:
        """``STREAM_FIRST_CHUNK``'s child of ``model``, made at its first stream (a model
        that never streams exports no such series)."""
        found = self._first_chunks.get(model)
        if found is None:
            found = self._first_chunks[model] = STREAM_FIRST_CHUNK.labels(model)
        return found


OUTCOMES: Final = ("ok", "expired", "rejected", "invalid", "cancelled", "error")
OUTCOME_OF_CODE: Final = {"redis_unavailable": "error", "client_disconnected": "cancelled"}


def outcome_of(status: int, code: str | None = None) -> str:
    """The ``outcome`` label of a predict response: by its error ``code`` where the
    status alone misleads (Redis away is no back-pressure; a client gone sent nothing
    invalid), else by its HTTP status."""
    if code in OUTCOME_OF_CODE:
        return OUTCOME_OF_CODE[code]
    if status == 200:
        return "ok"
    if status == 504:
        return "expired"
    if status == 503:
        return "rejected"
    return "invalid" if 400 <= status < 500 else "error"
