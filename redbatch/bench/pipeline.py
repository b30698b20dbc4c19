"""The pipeline overhead benchmark (``scripts/bench --pipeline``, about a minute).

The demo pipeline ``classify_text`` (the ``tok`` tokenizer stage, then the ``textcls``
classifier, both on one CPU worker process with one torch thread) against the same two
stages called one after the other by the Python client (``predict("tok", text)``, then
``predict("textcls", ids)``), in the same run, on the same workers, taking turns:

1. one request at a time (latency p50/p99: the pipeline's hand-off against the client's
   round trip between the stages);
2. ``CONCURRENCY`` requests in flight (texts/s, and the worker process's CPU time per
   text: the pipeline's hand-offs run in the stages' worker processes).

The texts are ``TEXTS`` deterministic ones of 8 to 64 words.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from redbatch import Client
from redbatch.embedded import start_embedded
from redbatch.worker.process import run_loop

TEXTS, CONCURRENCY, ROUNDS = 64, 32, 3
SEQUENTIAL, LOADED = 200, 1000  # requests per measurement


def texts() -> list[str]:
    rng = np.random.Generator(np.random.PCG64(7))
    words = [f"w{i}" for i in range(500)]
    return [" ".join(rng.choice(words, int(rng.integers(8, 65)))) for _ in range(TEXTS)]


async def pipeline_call(client: Client, text: str) -> Any:
    return await client.predict("classify_text", text, timeout_s=30)


async def chained_call(client: Client, text: str) -> Any:
    ids = await client.predict("tok", text, timeout_s=30)
    return await client.predict("textcls", ids, timeout_s=30)


async def _latencies(client: Client, call: Any, bodies: list[str]) -> list[float]:
    out = []
    for i in range(SEQUENTIAL):
        started = time.perf_counter()
        await call(client, bodies[i % len(bodies)])
        out.append((time.perf_counter() - started) * 1000)
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) that process ``pid`` and its children (the worker
    replicas) used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return own + sum(cpu_s(int(child)) for child in children)


async def _rate(client: Client, call: Any, bodies: list[str]) -> float:
    queue = list(range(LOADED))

    async def lane() -> None:
        while queue:
            await call(client, bodies[queue.pop() % len(bodies)])

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
    return LOADED / (time.perf_counter() - started)


async def _measure(url: str, pid: int) -> dict[str, Any]:
    bodies = texts()
    calls = {"pipeline": pipeline_call, "chained": chained_call}
    res: dict[str, Any] = {name: {"ms": [], "rates": [], "worker_cpu_ms": []}
                           for name in calls}
    async with Client(url) as client:
        for call in calls.values():  # warm-up, and the two agree
            await asyncio.gather(*(call(client, b) for b in bodies))
        one = await pipeline_call(client, bodies[0])
        np.testing.assert_allclose(one, await chained_call(client, bodies[0]), atol=1e-5)
        for _ in range(ROUNDS):
            for name, call in calls.items():
                res[name]["ms"] += await _latencies(client, call, bodies)
                before = cpu_s(pid)
                res[name]["rates"].append(await _rate(client, call, bodies))
                res[name]["worker_cpu_ms"].append((cpu_s(pid) - before) * 1000 / LOADED)
    return res


def run(logdir: Path) -> dict[str, Any]:
    """Start Redis and one worker process of the demo models, measure, stop."""
    embedded = start_embedded()
    logdir.mkdir(parents=True, exist_ok=True)
    log = (logdir / "pipeline-worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "redbatch", "worker", "redbatch.bench.pipeline:models",
         "--redis-url", embedded.url, "--threads", "1", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        run_loop(_wait_live(embedded.url))
        return run_loop(_measure(embedded.url, worker.pid))
    finally:
        worker.terminate()
        worker.wait(30)
        log.close()
        embedded.stop()


async def _wait_live(url: str) -> None:
    async with Client(url) as client:
        for _ in range(600):
            if await client.live_workers("classify_text") and await client.live_workers(
                    "textcls"):
                return
            await asyncio.sleep(0.1)
    raise RuntimeError("the pipeline's worker did not start")


def models() -> list[Any]:
    """The worker's models: the demo's ``tok`` and ``textcls``, and the pipeline."""
    from redbatch import demo

    return [m for m in demo.models() if m.name in ("tok", "textcls", "classify_text")]


def report(res: dict[str, Any]) -> None:
    print(f"pipeline overhead, {SEQUENTIAL * ROUNDS} sequential requests and "
          f"{LOADED * ROUNDS} at {CONCURRENCY} in flight per way (os.cpu_count="
          f"{os.cpu_count()}):")
    for name in ("pipeline", "chained"):
        ms = np.asarray(res[name]["ms"])
        rates = res[name]["rates"]
        print(f"  {name:9s} one at a time p50 {np.percentile(ms, 50):6.2f} ms  p99 "
              f"{np.percentile(ms, 99):6.2f} ms   {CONCURRENCY} in flight "
              f"{np.median(rates):7.1f} texts/s (rounds: "
              f"{', '.join(f'{r:.0f}' for r in rates)}), worker CPU "
              f"{np.median(res[name]['worker_cpu_ms']):.2f} ms/text")
