"""The streaming benchmark: time to first token and tokens/s of the ``generate`` demo
model at 1, 16 and 64 concurrent streams, in one run, for

* ``continuous``: redbatch, continuous batching (requests join the running batch);
* ``completion``: redbatch, run-to-completion batches (``continuous=False``);
* ``naive``: a server that generates one request at a time (the same model, batch 1,
  in this process, behind an asyncio queue).

Each stream asks for a seeded random number of tokens (8 to 64), so that a batch's
members end at different steps.  ``--step-ms`` adds a fixed time to every step (in
each server alike), standing for an accelerator's pass, whose time hardly depends on
the batch's size: the tiny model's own step costs less than the messages around it.
The redbatch workers are separate processes (``redbatch worker``), on a private Redis
unless ``--redis-url`` is given.  Each server first serves a few unmeasured warm-up
streams (the model's first calls, the connections); each concurrency level measures at
least ``MIN_SAMPLES`` requests (a caller streams more of them in turn at low
concurrency), so that its p95 is not just the slowest of a handful.
``python -m redbatch.bench --stream`` (``scripts/bench --stream``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from redbatch import defaults
from redbatch.embedded import start_embedded
from redbatch.generate import CharGRU, generate_model, generator_fn
from redbatch.producer.client import Client
from redbatch.registry import live_workers
from redbatch.worker.model import Model
from redbatch.worker.stream_batch import STOP, StreamBatch

CONCURRENCY = (1, 16, 64)
MIN_SAMPLES = 20  # requests measured per concurrency level, at least
WARM_UP_STREAMS = 4  # unmeasured streams before the first level
MIN_TOKENS, MAX_TOKENS = 8, 64
MODEL = "generate"


STEP_ENV = "REDBATCH_BENCH_STEP_MS"  # the workers' step_ms, from the bench


def continuous() -> list[Model]:
    return [generate_model(MODEL, max_batch_size=64,
                           step_ms=float(os.environ.get(STEP_ENV, "0")))]


def completion() -> list[Model]:
    return [generate_model(MODEL, max_batch_size=64, continuous=False,
                           step_ms=float(os.environ.get(STEP_ENV, "0")))]


@dataclass
class Result:
    server: str
    step_ms: float
    streams: int
    requests: int
    tokens: int
    wall_s: float
    ttft_ms: list[float]

    def row(self) -> dict[str, Any]:
        ttft = sorted(self.ttft_ms)
        return {"server": self.server, "step_ms": self.step_ms, "streams": self.streams,
                "requests": self.requests,
                "tokens_per_s": round(self.tokens / self.wall_s, 1),
                "ttft_p50_ms": round(statistics.median(ttft), 1),
                "ttft_p95_ms": round(ttft[math.ceil(0.95 * len(ttft)) - 1], 1)}


Open = Callable[[str, int], AsyncIterator[Any]]  # prompt, tokens -> the chunks


async def _drive(open_stream: Open, streams: int, per_stream: int, seed: int
                 ) -> tuple[int, float, list[float]]:
    """``streams`` concurrent callers, each streaming ``per_stream`` requests in turn:
    the tokens, the wall time and each request's time to first token."""
    rng = random.Random(seed)
    plans = [[rng.randint(MIN_TOKENS, MAX_TOKENS) for _ in range(per_stream)]
             for _ in range(streams)]
    ttft: list[float] = []
    tokens = 0

    async def caller(plan: list[int]) -> None:
        nonlocal tokens
        for n in plan:
            started = time.perf_counter()
            first = True
            async for _chunk in open_stream(f"prompt {n}", n):
                if first:
                    ttft.append((time.perf_counter() - started) * 1000)
                    first = False
                tokens += 1

    started = time.perf_counter()
    await asyncio.gather(*(caller(plan) for plan in plans))
    return tokens, time.perf_counter() - started, ttft


class NaiveServer:
    """One request at a time: a queue, one task, the model at batch 1 in a thread."""

    def __init__(self, step_ms: float) -> None:
        self.gen = generator_fn(CharGRU(), step_ms / 1000)
        self.queue: asyncio.Queue[tuple[dict[str, Any], asyncio.Queue[Any]]] = asyncio.Queue()

    async def serve(self) -> None:
        while True:
            value, out = await self.queue.get()
            batch = StreamBatch()
            batch.add("0", value)
            steps = self.gen(batch)
            while (items := await asyncio.to_thread(next, steps)) and items[0] is not STOP:
                out.put_nowait(items[0])
            out.put_nowait(STOP)

    async def stream(self, prompt: str, tokens: int) -> AsyncIterator[Any]:
        out: asyncio.Queue[Any] = asyncio.Queue()
        self.queue.put_nowait(({"prompt": prompt, "max_tokens": tokens}, out))
        while (chunk := await asyncio.wait_for(out.get(), 600)) is not STOP:
            yield chunk


def _start_worker(url: str, target: str, step_ms: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "redbatch", "worker", target,
                             "--redis-url", url], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, STEP_ENV: str(step_ms)})


async def _wait_live(client: Client,
                     timeout_s: float = defaults.BENCH_LIVE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await live_workers(client.redis, MODEL):
        if time.monotonic() > deadline:
            raise RuntimeError("the bench worker did not start")
        await asyncio.sleep(0.1)


async def _redbatch(url: str, server: str, step_ms: float, per_stream: int) -> list[Result]:
    proc = _start_worker(url, f"redbatch.bench.stream:{server}", step_ms)
    try:
        async with Client(url, require_workers=False, max_timeout_s=600) as client:
            await _wait_live(client)

            def open_stream(prompt: str, tokens: int) -> AsyncIterator[Any]:
                return client.stream(MODEL, {"prompt": prompt, "max_tokens": tokens}, 600)

            return await _levels(open_stream, server, step_ms, per_stream)
    finally:
        proc.terminate()
        proc.wait(30)


async def _naive(step_ms: float, per_stream: int) -> list[Result]:
    server = NaiveServer(step_ms)
    task = asyncio.create_task(server.serve())
    try:
        return await _levels(server.stream, "naive", step_ms, per_stream)
    finally:
        task.cancel()


async def _levels(open_stream: Open, server: str, step_ms: float, per_stream: int
                  ) -> list[Result]:
    """A warm-up, then each concurrency level (at least ``MIN_SAMPLES`` requests)."""
    await _drive(open_stream, WARM_UP_STREAMS, 1, seed=0)
    results = []
    for n in CONCURRENCY:
        each = max(per_stream, math.ceil(MIN_SAMPLES / n))
        results.append(Result(server, step_ms, n, n * each,
                              *await _drive(open_stream, n, each, seed=n)))
    return results


async def run(url: str, per_stream: int, steps_ms: list[float]) -> list[dict[str, Any]]:
    results: list[Result] = []
    for step_ms in steps_ms:
        results += await _redbatch(url, "continuous", step_ms, per_stream)
        results += await _redbatch(url, "completion", step_ms, per_stream)
        results += await _naive(step_ms, per_stream)
    return [r.row() for r in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="redbatch bench --stream", description=__doc__)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--per-stream", type=int, default=4,
                        help="requests each concurrent caller streams in turn (4; more "
                             f"at low concurrency: at least {MIN_SAMPLES} per level)")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 5.0],
                        help="time added to every step, as an accelerator's pass: one "
                             "run each (0 5)")
    parser.add_argument("--out", help="write the rows as JSON here too")
    args = parser.parse_args(argv)
    embedded = None if args.redis_url else start_embedded()
    try:
        url = args.redis_url or embedded.url  # type: ignore[union-attr]
        rows = asyncio.run(run(url, args.per_stream, args.step_ms))
    finally:
        if embedded is not None:
            embedded.stop()
    for row in rows:
        print(orjson.dumps(row).decode())
    if args.out:
        with open(args.out, "wb") as out:
            out.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 0
