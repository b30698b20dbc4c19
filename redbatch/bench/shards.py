"""The shard curve (``python -m redbatch.bench --shards``, about 2 minutes).

Three Redis Clusters side by side on 127.0.0.1, of 1, 2 and 3 primaries (no
replicas), each with one worker process serving ``MODELS``: six no-op models, their
slots spread evenly over the primaries with ``redbatch.placement`` (one model lives in
one slot, so several models are what spreads the load).  The Python client (no HTTP)
drives them: ``TASKS_PER_MODEL`` tasks per model, each awaiting one ``predict`` after
another, in rounds that take the clusters in turn; then once, on the 3-primary
cluster, one caller per model sending 128 items per ``predict_many`` (multi-row
requests).

Reported per cluster: items/s, and per primary the items its models served, its
main-thread CPU per item, commands per item and how busy it was (``INFO`` before and
after, as ``redis_cost``).  Then, on the 3-primary cluster: what Redis spends per
second with no client (the cluster bus), with an idle worker (6 models) and with an
idle gateway beside it, and one gateway process under wrk (W1's body, 64
connections): its CPU per request and Redis's.

Everything shares this machine's cores: the client, the worker and the gateway
compete with Redis for them, so the curve says little about Redis's own ceiling.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from redbatch import Client
from redbatch.bench import cluster, redis_cost
from redbatch.bench.servers import Procs, cpu_seconds, wait_ok, wrk
from redbatch.config import RedisSettings
from redbatch.embedded import free_port
from redbatch.placement import place
from redbatch.spec import TensorSpec
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import run_loop

MODELS = [f"noop{n}" for n in range(6)]
SHARDS = (1, 2, 3)
TASKS_PER_MODEL = 8
MANY_PER_CALL = 128  # then: multi-row requests of up to 32 rows
X_LIST = [i / 16 for i in range(16)]  # W1's body
X = np.asarray(X_LIST, dtype=np.float32)  # same-shape arrays: multi-row requests
IDLE_S = 4.0
CALLS = redis_cost.CALLS
WARM_TIMEOUT_S = 60.0
HOST = "127.0.0.1"


def _noop(items: list[Any]) -> list[Any]:
    return items


models = [Model(name, fn=_noop, policy=BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.0),
                spec=TensorSpec("float32", (len(X_LIST),)), input_name="x", output_name="y",
                inline=True) for name in MODELS]


@dataclass(frozen=True)
class Shards:
    """One cluster of the curve: its primaries' ports, URL, and each model's primary."""

    count: int
    ports: tuple[int, ...]
    url: str
    owner: dict[str, int]

    def node_url(self, port: int) -> str:
        return f"redis://{HOST}:{port}/0"


def start(procs: Procs, count: int, tags: list[str] = MODELS) -> Shards:
    """``count`` primaries, the slots of ``tags`` (models, or a model's sub-queues)
    spread over them (no worker yet)."""
    ports = tuple(free_port() for _ in range(count))
    for index, port in enumerate(ports):
        procs.start(f"redis-{count}-{index}",
                    cluster.node_args(HOST, port, procs.logdir, bus_port=free_port()))
    addresses = [f"{HOST}:{port}" for port in ports]
    cluster.create(addresses)
    url = cluster.url(addresses)
    rows = place(RedisSettings(url), tags, apply=True).rows
    cluster.wait_ok(addresses)
    return Shards(count, ports, url, {m: planned.port for m, _s, _o, planned in rows})


def spawn_worker(procs: Procs, name: str, target: str, url: str) -> None:
    """A worker process (``name``) serving ``target`` (``MODULE:OBJECT``) on the CPU."""
    procs.start(name, [sys.executable, "-m", "redbatch", "worker", target, "--redis-url",
                       url, "--device", "cpu", "--threads", "1"],
                {"REDBATCH_LOG_LEVEL": "WARNING"})


def start_worker(procs: Procs, shards: Shards) -> None:
    """One worker process serving ``MODELS``; returns once every model answers."""
    spawn_worker(procs, f"worker-{shards.count}", "redbatch.bench.shards:models", shards.url)
    run_loop(warm(shards.url, MODELS))


async def warm(url: str, names: list[str]) -> None:
    """Until every model of ``names`` answers (its worker is up)."""
    deadline = time.monotonic() + WARM_TIMEOUT_S
    async with Client(url, require_workers=False) as client:
        for model in names:
            await client.predict(model, X, timeout_s=max(deadline - time.monotonic(), 0.1))


async def _load(url: str, duration_s: float, per_call: int = 1
                ) -> tuple[dict[str, int], float]:
    """Items served per model by ``TASKS_PER_MODEL`` callers per model, and the time;
    with ``per_call`` over 1, one caller per model sending that many items per
    ``predict_many`` (multi-row requests)."""
    counts = dict.fromkeys(MODELS, 0)
    callers = TASKS_PER_MODEL if per_call == 1 else 1
    async with Client(url) as client:
        await client.predict_many(MODELS[0], [X] * 8)  # connections up
        stop_at = time.monotonic() + duration_s

        async def caller(model: str) -> None:
            while time.monotonic() < stop_at:
                if per_call == 1:
                    await client.predict(model, X)
                else:
                    await client.predict_many(model, [X] * per_call)
                counts[model] += per_call

        started = time.monotonic()
        await asyncio.gather(*(caller(m) for m in MODELS for _ in range(callers)))
        return counts, time.monotonic() - started


def snapshots(shards: Shards) -> dict[int, dict[str, float]]:
    return {port: redis_cost.snapshot(shards.node_url(port)) for port in shards.ports}


def spent(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]
          ) -> dict[int, dict[str, float]]:
    return {port: redis_cost.spent(before[port], after[port]) for port in before}


def measure(shards: Shards, duration_s: float, per_call: int = 1) -> dict[str, Any]:
    """One round: items per model, elapsed seconds and what each primary spent."""
    before = snapshots(shards)
    counts, elapsed_s = run_loop(_load(shards.url, duration_s, per_call))
    return {"counts": counts, "elapsed_s": elapsed_s, "spent": spent(before, snapshots(shards))}


def _node(shards: Shards, port: int, rounds: list[dict[str, Any]], elapsed_s: float
          ) -> dict[str, Any]:
    """One primary over the rounds: its models, items, CPU and commands per item, and
    the share of the time its main thread was busy."""
    mine = [m for m, p in shards.owner.items() if p == port]
    served = max(sum(r["counts"][m] for r in rounds for m in mine), 1)
    cpu_s = sum(r["spent"][port].get(redis_cost.CPU_S, 0.0) for r in rounds)
    calls = sum(r["spent"][port].get(CALLS, 0.0) for r in rounds)
    return {"models": mine, "items": served, "cpu_us_per_item": cpu_s * 1e6 / served,
            "commands_per_item": calls / served, "busy": cpu_s / elapsed_s}


def summary(shards: Shards, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one cluster as one figure: items/s over all of them, each round's
    items/s, Redis CPU per item (all primaries) and each primary's figures."""
    elapsed_s = sum(r["elapsed_s"] for r in rounds)
    items = sum(sum(r["counts"].values()) for r in rounds)
    nodes = {str(port): _node(shards, port, rounds, elapsed_s) for port in shards.ports}
    cpu_s = sum(r["spent"][port].get(redis_cost.CPU_S, 0.0) for r in rounds
                for port in shards.ports)
    return {"shards": shards.count, "items_per_s": items / elapsed_s,
            "rounds_items_per_s": [round(sum(r["counts"].values()) / r["elapsed_s"], 1)
                                   for r in rounds],
            "redis_cpu_us_per_item": cpu_s * 1e6 / max(items, 1), "nodes": nodes}


def idle_cost(shards: Shards, idle_s: float = IDLE_S) -> dict[str, float]:
    """Redis's CPU (µs per second, all primaries together) and commands per second
    while nothing is sent."""
    before = snapshots(shards)
    time.sleep(idle_s)
    used = spent(before, snapshots(shards)).values()
    return {"cpu_us_per_s": sum(s.get(redis_cost.CPU_S, 0.0) for s in used) * 1e6 / idle_s,
            "commands_per_s": sum(s.get(CALLS, 0.0) for s in used) / idle_s,
            **held(shards)}


def held(shards: Shards) -> dict[str, float]:
    """What the primaries hold now, all together: client connections (this one's
    own left out), keys and memory."""
    totals = {"clients": 0.0, "keys": 0.0, "used_memory": 0.0}
    for port in shards.ports:
        with redis.Redis.from_url(shards.node_url(port)) as client:
            info: dict[str, Any] = client.info("clients", "memory")
            totals["keys"] += float(client.dbsize())
        totals["clients"] += float(info["connected_clients"]) - 1
        totals["used_memory"] += float(info["used_memory"])
    return totals


def gateway_cost(procs: Procs, shards: Shards, duration_s: float) -> dict[str, Any]:
    """A gateway process (one) beside the worker: what it costs Redis idle (after one
    request, so with one reply listener), then under wrk at 64 connections (W1's body
    to one model): its own CPU per request, and Redis's CPU and commands per request."""

    port = free_port()
    procs.start("gateway", [sys.executable, "-m", "redbatch", "gateway", "--host", HOST,
                            "--port", str(port), "--workers", "1"],
                {"REDBATCH_LOG_LEVEL": "WARNING", "REDIS_URL": shards.url})
    url = f"http://{HOST}:{port}/v1/models/{MODELS[0]}/predict"
    wait_ok(url, {"x": X_LIST})
    idle = idle_cost(shards)
    wrk(url, "w1.lua", 64, 1.0)  # warm-up
    pids, before = procs.pids("gateway"), snapshots(shards)
    cpu_before = cpu_seconds(pids)
    result = wrk(url, "w1.lua", 64, duration_s)
    cpu_s = cpu_seconds(pids) - cpu_before
    used = spent(before, snapshots(shards)).values()
    requests = max(result["requests"], 1)
    return {"idle_with_gateway": idle, "rps": result["rps"], "errors": result["errors"],
            "wrk": result, "lat_p99_ms": result["lat_p99_us"] / 1000,
            "gateway_cpu_us_per_request": cpu_s * 1e6 / requests,
            "redis_cpu_us_per_request": sum(s.get(redis_cost.CPU_S, 0.0) for s in used)
            * 1e6 / requests,
            "redis_commands_per_request": sum(s.get(CALLS, 0.0) for s in used) / requests}


def run(logdir: Path, duration_s: float, rounds: int) -> dict[str, Any]:
    """The curve (``rounds`` rounds taking the clusters in turn, ``duration_s`` each),
    the idle cluster's and the idle worker's cost, then the gateway's (on the 3-primary cluster)."""
    procs = Procs(logdir)
    try:
        clusters = [start(procs, count) for count in SHARDS]
        res: dict[str, Any] = {"started": time.strftime("%FT%TZ"), "models": MODELS,
                               "tasks_per_model": TASKS_PER_MODEL, "duration_s": duration_s,
                               "rounds": rounds, "idle_cluster": idle_cost(clusters[-1])}
        for shards in clusters:
            start_worker(procs, shards)
        res["idle_worker"] = idle_cost(clusters[-1])
        runs: dict[int, list[dict[str, Any]]] = {s.count: [] for s in clusters}
        for _ in range(rounds):
            for shards in clusters:
                runs[shards.count].append(measure(shards, duration_s))
        res["curve"] = [{**summary(s, runs[s.count]), "after": held(s)} for s in clusters]
        res["many"] = summary(clusters[-1], [measure(clusters[-1], duration_s, MANY_PER_CALL)])
        res["gateway"] = gateway_cost(procs, clusters[-1], duration_s)
        return res
    finally:  # the clients of Redis first
        for name in ("gateway", *(f"worker-{count}" for count in SHARDS)):
            if procs.pids(name):
                procs.stop_one(name)
        procs.stop()


def report(res: dict[str, Any]) -> None:
    print("\nshards  items/s   (rounds)                Redis CPU/item   per primary: "
          "models, share of items, CPU/item, commands/item, busy")
    for fig in res["curve"]:
        total = sum(n["items"] for n in fig["nodes"].values())
        nodes = "; ".join(f"{len(n['models'])}m {n['items'] / total:.0%} "
                          f"{n['cpu_us_per_item']:.1f}µs {n['commands_per_item']:.2f}c "
                          f"{n['busy']:.0%}" for n in fig["nodes"].values())
        print(f"  {fig['shards']}    {fig['items_per_s']:>8.0f}   {fig['rounds_items_per_s']!s:<24}"
              f" {fig['redis_cpu_us_per_item']:>6.1f} µs       {nodes}")
    idle, gw = res["idle_worker"], res["gateway"]
    print(f"  idle {len(SHARDS)}-primary cluster, no client: "
          f"{res['idle_cluster']['cpu_us_per_s']:.0f} µs of Redis CPU per s, "
          f"{res['idle_cluster']['commands_per_s']:.1f} commands/s")
    for name in ("idle_cluster", "idle_worker"):
        print(f"  {name}: {res[name]['clients']:.0f} client connections, "
              f"{res[name]['keys']:.0f} keys, {res[name]['used_memory'] / 2**20:.1f} MiB")
    print(f"  with the gateway: {gw['idle_with_gateway']['clients']:.0f} client connections")
    for fig in res["curve"]:
        after = fig["after"]
        print(f"  after the rounds, {fig['shards']} primaries: {after['keys']:.0f} keys, "
              f"{after['used_memory'] / 2**20:.1f} MiB")
    print(f"  idle, one worker of {len(MODELS)} models: {idle['cpu_us_per_s']:.0f} µs of Redis "
          f"CPU per s, {idle['commands_per_s']:.1f} commands/s")
    print(f"  idle, plus one gateway: {gw['idle_with_gateway']['cpu_us_per_s']:.0f} µs/s, "
          f"{gw['idle_with_gateway']['commands_per_s']:.1f} commands/s")
    many = res["many"]
    print(f"  predict_many x{MANY_PER_CALL}, one caller per model, {many['shards']} primaries: "
          f"{many['items_per_s']:.0f} items/s, Redis {many['redis_cpu_us_per_item']:.1f} µs "
          f"per item")
    print(f"  one gateway process under wrk -c64: {gw['rps']:.0f} req/s, its CPU "
          f"{gw['gateway_cpu_us_per_request']:.0f} µs/request, Redis "
          f"{gw['redis_cpu_us_per_request']:.1f} µs and {gw['redis_commands_per_request']:.2f} "
          f"commands per request, p99 {gw['lat_p99_ms']:.1f} ms, errors {gw['errors']}")


def plot(res: dict[str, Any], path: Path) -> bool:
    """Items/s against primaries (each round a dot), and each primary's Redis CPU per
    item."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    counts = [f["shards"] for f in res["curve"]]
    left.plot(counts, [f["items_per_s"] for f in res["curve"]], marker="o", label="all rounds")
    for f in res["curve"]:
        left.scatter([f["shards"]] * len(f["rounds_items_per_s"]), f["rounds_items_per_s"],
                     color="gray", s=12)
        right.scatter([f["shards"]] * len(f["nodes"]),
                      [n["cpu_us_per_item"] for n in f["nodes"].values()], marker="s")
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    _labels(left, "items/s (6 no-op models, Python client)", counts)
    _labels(right, "Redis CPU per item (µs), each primary", counts)
    fig.suptitle("Redis Cluster primaries (shards), one 2-core machine shared by all")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _labels(ax: Any, ylabel: str, counts: list[int]) -> None:
    ax.set_xticks(counts)
    ax.set_xlabel("primaries")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
