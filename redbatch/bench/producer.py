"""The producer path of a bench run: W2 through the Python client, no HTTP.

Two ways in, each measured with the run's one worker replica and again with a second
replica started for it (the layout for 2 cores: the client and Redis leave most of a
core free):

* ``predict``: 64 tasks, each awaiting one ``Client.predict`` after another (one
  queue entry per item);
* ``predict_many``: 8 tasks, each sending 128 inputs per ``Client.predict_many``
  (same-shape arrays travel as multi-row requests of 32 rows: one entry per 32 items).

``enqueue_latency`` runs the ``predict`` way with each enqueue timed apart from its
reply, under a given ``ReplicaWait`` (``bench/replication.py``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import redis

from redbatch import Client
from redbatch.bench import redis_cost, servers
from redbatch.bench.servers import W2_X, Procs
from redbatch.config import ReplicaWait
from redbatch.registry import live_workers_sync
from redbatch.worker.process import run_loop

PREDICT_TASKS = 64
MANY_TASKS, MANY_PER_CALL = 8, 128


async def _closed_loop(redis_url: str, duration_s: float, tasks: int, per_call: int,
                       call: Callable[[Client, np.ndarray[Any, Any], int], Awaitable[Any]],
                       replica_wait: ReplicaWait | None = None) -> tuple[float, dict[str, Any]]:
    """Items/s of ``tasks`` callers, each sending ``per_call`` items per call, and what
    Redis spent per item meanwhile (``redis_cost``)."""
    x = np.asarray(W2_X, dtype=np.float32)
    async with Client(redis_url, replica_wait=replica_wait) as client:
        await client.predict_many("mlp", [x] * 64)  # warm: connections, auto-inline
        cost_before = redis_cost.snapshot(redis_url)  # (blocks the idle loop briefly)
        done = 0
        stop_at = time.monotonic() + duration_s

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                await call(client, x, per_call)
                done += per_call

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(tasks)))
        rate = done / (time.monotonic() - started)
        spent = redis_cost.spent(cost_before, redis_cost.snapshot(redis_url))
        return rate, redis_cost.per_request(spent, done, "item")


async def _one(client: Client, x: np.ndarray[Any, Any], _n: int) -> Any:
    return await client.predict("mlp", x)


async def _many(client: Client, x: np.ndarray[Any, Any], n: int) -> Any:
    return await client.predict_many("mlp", [x] * n)


async def _timed_one(latencies_s: list[float], client: Client, x: np.ndarray[Any, Any],
                     _n: int) -> Any:
    """``predict`` in its two steps: the enqueue, timed (``submit_many`` returns once
    the push is done, its WAIT included), then the reply."""
    started = time.perf_counter()
    futures = await client.submit_many("mlp", [x])
    latencies_s.append(time.perf_counter() - started)
    return await futures[0]


def enqueue_latency(redis_url: str, duration_s: float, replica_wait: ReplicaWait,
                    tasks: int = PREDICT_TASKS) -> dict[str, float]:
    """The ``predict`` way in (64 tasks; or ``tasks``) under ``replica_wait``: items/s
    and the enqueue's p50 and p99 in ms (on uvloop)."""
    latencies_s: list[float] = []
    rate, _cost = run_loop(_closed_loop(redis_url, duration_s, tasks, 1,
                                        functools.partial(_timed_one, latencies_s),
                                        replica_wait))
    p50, p99 = np.percentile(np.asarray(latencies_s) * 1000, [50, 99])
    return {"items_per_s": rate, "enqueue_p50_ms": float(p50), "enqueue_p99_ms": float(p99)}


Ways = dict[str, tuple[float, dict[str, Any]]]  # way in -> items/s, Redis cost per item


def both(redis_url: str, duration_s: float) -> Ways:
    """Items/s through ``predict`` and through ``predict_many`` (on uvloop)."""
    return {
        "predict": run_loop(_closed_loop(redis_url, duration_s, PREDICT_TASKS, 1, _one)),
        "predict_many": run_loop(_closed_loop(redis_url, duration_s, MANY_TASKS,
                                              MANY_PER_CALL, _many)),
    }


def measure(procs: Procs, redis_url: str, duration_s: float
            ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """``both`` with the run's worker, then with a second replica beside it: the items/s
    and, apart, the Redis cost per item, each by layout and way in."""
    ways = {"1 replica": both(redis_url, duration_s)}
    servers.start_worker(procs, redis_url, "worker-extra")
    try:
        wait_live_workers(redis_url, "mlp", 2)
        ways["2 replicas"] = both(redis_url, duration_s)
    finally:
        procs.stop_one("worker-extra")
    return ({layout: {way: rate for way, (rate, _) in got.items()} for layout, got in ways.items()},
            {layout: {way: cost for way, (_, cost) in got.items()} for layout, got in ways.items()})


def wait_live_workers(redis_url: str, model: str, count: int, timeout_s: float = 60) -> None:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if len(live_workers_sync(client, model)) >= count:
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise SystemExit(f"bench: {count} workers of {model!r} never came up")
