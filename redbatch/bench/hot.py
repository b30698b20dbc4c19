"""One hot model over sub-queues (``python -m redbatch.bench --hot``, about a minute).

One Redis Cluster of 3 primaries (no replicas) on 127.0.0.1; one no-op model
(``float32`` arrays of 16, batched at most 32) whose three sub-queue tags
(``protocol.sub_queue_tags``) are placed one per primary; ``WORKERS`` worker
processes serve it.  The Python client (no HTTP), ``CALLERS`` tasks each awaiting one
``predict`` after another, drives it in rounds that alternate ``sub_queues`` = 1 and 3,
set live (``Client.configure``) and given ``SETTLE_S`` to reach every process.

Reported per setting: items/s (each round), Redis CPU per item over the primaries,
commands per item, and how busy each primary's main thread was (``redis_cost``).
Everything shares this machine's cores, so the figure shows how the load spreads, not
a ceiling.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from redbatch import Client, protocol
from redbatch.bench import redis_cost
from redbatch.bench.servers import Procs
from redbatch.bench.shards import Shards, X, snapshots, spawn_worker, spent, start, warm
from redbatch.spec import TensorSpec
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import run_loop

HOT = "hotnoop"
SETTINGS = (1, 3)  # sub_queues, alternating
PRIMARIES = 3
WORKERS = 3
CALLERS = 48
SETTLE_S = 2.5  # a live change reaches producers within 1 s, workers within 2 s


def _noop(items: list[Any]) -> list[Any]:
    return items


models = [Model(HOT, fn=_noop, policy=BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.0),
                spec=TensorSpec("float32", (16,)), input_name="x", output_name="y",
                inline=True)]


def start_workers(procs: Procs, shards: Shards) -> None:
    """``WORKERS`` worker processes of the hot model; returns once it answers."""
    for index in range(WORKERS):
        spawn_worker(procs, f"worker-{index}", "redbatch.bench.hot:models", shards.url)
    run_loop(warm(shards.url, [HOT]))


async def _load(url: str, count: int, duration_s: float) -> tuple[int, float]:
    """Set ``sub_queues`` to ``count``, let it settle, then items served by
    ``CALLERS`` callers in ``duration_s``, and the time."""
    async with Client(url) as client:
        await client.configure(HOT, sub_queues=count)
        await asyncio.sleep(SETTLE_S)
        served = 0
        stop_at = time.monotonic() + duration_s

        async def caller() -> None:
            nonlocal served
            while time.monotonic() < stop_at:
                await client.predict(HOT, X)
                served += 1

        started = time.monotonic()
        await asyncio.gather(*(caller() for _ in range(CALLERS)))
        return served, time.monotonic() - started


def measure(shards: Shards, count: int, duration_s: float) -> dict[str, Any]:
    """One round at ``count`` sub-queues: items, seconds, what each primary spent."""
    before = snapshots(shards)
    items, elapsed_s = run_loop(_load(shards.url, count, duration_s))
    return {"items": items, "elapsed_s": elapsed_s, "spent": spent(before, snapshots(shards))}


def summary(count: int, rounds: list[dict[str, Any]], ports: tuple[int, ...]
            ) -> dict[str, Any]:
    elapsed_s = sum(r["elapsed_s"] for r in rounds)
    items = max(sum(r["items"] for r in rounds), 1)

    def total(port: int, name: str) -> float:
        return float(sum(r["spent"][port].get(name, 0.0) for r in rounds))

    cpu_s = sum(total(port, redis_cost.CPU_S) for port in ports)
    return {"sub_queues": count, "items_per_s": items / elapsed_s,
            "rounds_items_per_s": [round(r["items"] / r["elapsed_s"]) for r in rounds],
            "redis_cpu_us_per_item": cpu_s * 1e6 / items,
            "commands_per_item": sum(total(port, redis_cost.CALLS) for port in ports) / items,
            "busy": [total(port, redis_cost.CPU_S) / elapsed_s for port in ports]}


def run(logdir: Path, duration_s: float, rounds: int) -> dict[str, Any]:
    procs = Procs(logdir)
    try:
        shards = start(procs, PRIMARIES, protocol.sub_queue_tags(HOT, max(SETTINGS)))
        start_workers(procs, shards)
        runs: dict[int, list[dict[str, Any]]] = {count: [] for count in SETTINGS}
        for _ in range(rounds):
            for count in SETTINGS:
                runs[count].append(measure(shards, count, duration_s))
        return {"started": time.strftime("%FT%TZ"), "model": HOT, "primaries": PRIMARIES,
                "workers": WORKERS, "callers": CALLERS, "duration_s": duration_s,
                "figures": [summary(c, runs[c], shards.ports) for c in SETTINGS]}
    finally:  # the clients of Redis first
        for index in range(WORKERS):
            if procs.pids(f"worker-{index}"):
                procs.stop_one(f"worker-{index}")
        procs.stop()


def report(res: dict[str, Any]) -> None:
    print(f"\none hot model, {res['primaries']} primaries, {res['workers']} workers, "
          f"{res['callers']} callers")
    print("sub_queues  items/s  (rounds)                Redis CPU/item  commands/item  "
          "primaries busy")
    for fig in res["figures"]:
        busy = " ".join(f"{b:.0%}" for b in fig["busy"])
        print(f"  {fig['sub_queues']}       {fig['items_per_s']:>8.0f}  "
              f"{fig['rounds_items_per_s']!s:<24} {fig['redis_cpu_us_per_item']:>6.1f} µs"
              f"      {fig['commands_per_item']:>5.2f}        {busy}")
