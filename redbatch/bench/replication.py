"""The cost of the WAIT after each enqueue (``REDBATCH_WAIT_REPLICAS``): W2's
producer path (``bench/producer.py``'s ``predict`` way, 64 tasks, then one) against a primary
with one replica on this machine and one worker replica, with the WAIT off and on
(one replica, the default timeout), in alternating rounds after an untimed one; then
once more with the WAIT on and the replica paused (SIGSTOP: every WAIT times out).
``redbatch bench --replica-wait``."""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from redbatch import defaults
from redbatch.bench import producer, servers
from redbatch.bench.servers import Procs
from redbatch.config import ReplicaWait

SETTINGS = {"off": ReplicaWait(), "on": ReplicaWait(1, defaults.WAIT_TIMEOUT_MS)}
TASKS = (producer.PREDICT_TASKS, 1)  # concurrent callers: loaded, then a lone caller
LINK_TIMEOUT_S = 30.0  # how long the replica may take to link to the primary
WARM_S = 2.0  # an untimed run first


def run(logdir: Path, duration_s: float, rounds: int) -> dict[str, Any]:
    """Each setting's figures per round, and their medians."""
    procs = Procs(logdir)
    try:
        url = start_pair(procs)
        servers.start_worker(procs, url, "worker")
        producer.wait_live_workers(url, "mlp", 1)
        producer.enqueue_latency(url, WARM_S, SETTINGS["on"])  # warm: worker, replica link
        runs: dict[str, list[dict[str, float]]] = {}
        for _ in range(rounds):
            for tasks in TASKS:
                for name, setting in SETTINGS.items():
                    runs.setdefault(f"{name} x{tasks}", []).append(
                        producer.enqueue_latency(url, duration_s, setting, tasks))
        runs.update(_paused(procs, url, duration_s))
    finally:
        procs.stop()
    return {"rounds": runs, "median": {name: _median(got) for name, got in runs.items()}}


def _paused(procs: Procs, url: str, duration_s: float) -> dict[str, list[dict[str, float]]]:
    """The WAIT on while the replica is paused: each enqueue waits its whole timeout."""
    pid = procs.pids("replica")[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        return {f"on x{tasks}, replica paused": [
            producer.enqueue_latency(url, duration_s, SETTINGS["on"], tasks)] for tasks in TASKS}
    finally:
        os.kill(pid, signal.SIGCONT)


def start_pair(procs: Procs) -> str:
    """A primary and a replica of it, once linked: the primary's URL."""
    port = servers.start_redis(procs, "redis")
    replica_port = servers.start_redis(procs, "replica", "--replicaof", "127.0.0.1", str(port))
    client = redis.Redis(port=replica_port, socket_timeout=2)
    deadline = time.monotonic() + LINK_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            try:
                if client.info("replication").get("master_link_status") == "up":
                    return f"redis://127.0.0.1:{port}/0"
            except redis.ConnectionError:
                pass
            time.sleep(0.1)
    finally:
        client.close()
    raise SystemExit("bench: the replica never linked to the primary")


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def report(res: dict[str, Any]) -> None:
    print("W2 producer path (predict, callers x N), primary + 1 replica: WAIT after each "
          "enqueue off and on (medians of the rounds)")
    print(f"  {'':24} {'items/s':>9} {'enqueue p50 ms':>15} {'enqueue p99 ms':>15}")
    for name, figures in res["median"].items():
        print(f"  {name:24} {figures['items_per_s']:9.0f} {figures['enqueue_p50_ms']:15.2f} "
              f"{figures['enqueue_p99_ms']:15.2f}")
    for tasks in TASKS:
        off, on = res["median"][f"off x{tasks}"], res["median"][f"on x{tasks}"]
        print(f"  x{tasks} on/off: throughput x{on['items_per_s'] / off['items_per_s']:.2f}, "
              f"enqueue p50 {on['enqueue_p50_ms'] - off['enqueue_p50_ms']:+.2f} ms")
