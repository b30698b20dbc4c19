"""The priority overload scenario (``scripts/bench --priority``, about a minute).

A model of two priority levels whose pass takes a fixed ``PASS_S`` for up to
``MAX_BATCH`` items (so its capacity is known: ``MAX_BATCH / PASS_S`` items/s), one
worker replica, and the Python client as an open-loop load generator (no HTTP):

1. unloaded: only the top level (1), at ``TOP_SHARE`` of the overload rate;
2. overload: ``OVERLOAD`` x the capacity, ``TOP_SHARE`` of it at level 1 and the rest at
   the default level (2), whose own queue is capped at ``LOW_CAP`` (``priority_caps``).

Reported: level 1's p50/p99 in both phases (the target: the loaded p99 within 2x the
unloaded one), and the rest's share refused (``QueueFull``, the gateway's 503), how
fast the refusals come (their p99) and the p50/p99 of those served.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from redbatch import Client, DeadlineExceeded, Model, QueueFull
from redbatch.bench import producer
from redbatch.bench.servers import Procs
from redbatch.embedded import free_port
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import run_loop

MODEL = "prio_sleep"
PASS_S = 0.04  # a pass of up to MAX_BATCH items: capacity 200 items/s
MAX_BATCH = 8
CAPACITY = MAX_BATCH / PASS_S
OVERLOAD = 2.0
TOP_SHARE = 0.1
LOW_CAP = 40  # level 2's own queue cap: 0.2 s of the model's capacity
UNLOADED_S, LOADED_S = 8.0, 15.0
TIMEOUT_S = 5.0
TICK_S = 0.005
REDIS_START_S = 30.0  # how long the scenario waits for its redis-server to answer


def _sleep_pass(xs: list[Any]) -> list[Any]:
    time.sleep(PASS_S)
    return xs


models = [Model(MODEL, fn=_sleep_pass, policy=BatchPolicy(MAX_BATCH, 0.0),
                priority_levels=2, default_priority=2, priority_caps=[10_000, LOW_CAP],
                inline=False)]


@dataclass
class Outcomes:
    """Latencies (ms) by outcome of one stream of requests."""

    ok: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    late: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        sent = len(self.ok) + len(self.refused) + len(self.late)
        return {"sent": sent, "ok": len(self.ok), "refused": len(self.refused),
                "late": len(self.late), "refused_rate": len(self.refused) / max(sent, 1),
                "ok_p50_ms": _pct(self.ok, 50), "ok_p99_ms": _pct(self.ok, 99),
                "refused_p99_ms": _pct(self.refused, 99)}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _one(client: Client, priority: int | None, into: Outcomes) -> None:
    started = time.perf_counter()
    try:
        await client.predict(MODEL, 1, TIMEOUT_S, priority=priority)
        bucket = into.ok
    except QueueFull:
        bucket = into.refused
    except DeadlineExceeded:
        bucket = into.late
    bucket.append((time.perf_counter() - started) * 1000)


async def _open_loop(client: Client, rate: float, top_share: float, duration_s: float
                     ) -> tuple[Outcomes, Outcomes]:
    """Requests at ``rate``/s for ``duration_s`` (``top_share`` of them at level 1),
    sent on a fixed schedule whatever the answers: their outcomes, top and rest."""
    streams = ((1, top_share, Outcomes()), (None, 1 - top_share, Outcomes()))
    sent = [0, 0]
    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < duration_s:
        for index, (priority, share, into) in enumerate(streams):
            due = int(rate * share * elapsed) - sent[index]
            tasks += [asyncio.create_task(_one(client, priority, into)) for _ in range(due)]
            sent[index] += max(due, 0)
        await asyncio.sleep(TICK_S)
    await asyncio.gather(*tasks)
    return streams[0][2], streams[1][2]


async def _scenario(redis_url: str) -> dict[str, Any]:
    async with Client(redis_url) as client:
        await client.predict_many(MODEL, [1] * 64, priority=1)  # warm; measures capacity
        await asyncio.sleep(2.5)  # the worker's items_per_s reaches admission
        top_rate = OVERLOAD * CAPACITY * TOP_SHARE
        unloaded, _ = await _open_loop(client, top_rate, 1.0, UNLOADED_S)
        await asyncio.sleep(1.0)
        loaded, rest = await _open_loop(client, OVERLOAD * CAPACITY, TOP_SHARE, LOADED_S)
    return {"capacity_items_per_s": CAPACITY, "offered_per_s": OVERLOAD * CAPACITY,
            "top_share": TOP_SHARE, "low_cap": LOW_CAP, "pass_ms": PASS_S * 1000,
            "top_unloaded": unloaded.summary(), "top_loaded": loaded.summary(),
            "rest_loaded": rest.summary()}


def _wait_redis(url: str) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + REDIS_START_S
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        client.close()


def run(logdir: Path) -> dict[str, Any]:
    """Redis and one worker of the scenario's model as child processes, then the load."""
    procs = Procs(logdir)
    try:
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        procs.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"])
        procs.start("worker", [sys.executable, "-m", "redbatch", "worker",
                               "redbatch.bench.priority:models", "--redis-url", url,
                               "--device", "cpu"], {"REDBATCH_LOG_LEVEL": "WARNING"})
        _wait_redis(url)
        producer.wait_live_workers(url, MODEL, 1)
        return run_loop(_scenario(url))
    finally:
        procs.stop()


def report(res: dict[str, Any]) -> None:
    top_u, top_l, rest = res["top_unloaded"], res["top_loaded"], res["rest_loaded"]
    ratio = (top_l["ok_p99_ms"] or 0) / (top_u["ok_p99_ms"] or 1)
    print(f"priority overload: {res['offered_per_s']:.0f} req/s offered to a model of "
          f"{res['capacity_items_per_s']:.0f} items/s ({res['pass_ms']:.0f} ms passes of "
          f"{MAX_BATCH}), {res['top_share']:.0%} at priority 1")
    print(f"  priority 1 unloaded: p50 {top_u['ok_p50_ms']:.1f} ms, p99 "
          f"{top_u['ok_p99_ms']:.1f} ms ({top_u['ok']}/{top_u['sent']} ok)")
    print(f"  priority 1 loaded:   p50 {top_l['ok_p50_ms']:.1f} ms, p99 "
          f"{top_l['ok_p99_ms']:.1f} ms ({top_l['ok']}/{top_l['sent']} ok, "
          f"{top_l['refused']} refused, {top_l['late']} late): p99 x{ratio:.2f} unloaded")
    print(f"  priority 2 loaded:   {rest['refused_rate']:.0%} refused (503), refusals' p99 "
          f"{_ms(rest['refused_p99_ms'])}; served p50 {_ms(rest['ok_p50_ms'])}, p99 "
          f"{_ms(rest['ok_p99_ms'])} ({rest['ok']} ok, {rest['late']} late)")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"
