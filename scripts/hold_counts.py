"""Rows per pass per length bucket with and without holding (``worker/hold.py``), by
count: the W3 bodies' lengths, drawn with a fixed seed, pushed in claims of 12 to one
worker's runner (a real Redis, a model that only records its passes), the pass size of
each bucket fixed.  Deterministic: no timing enters the counts.

    PYTHONPATH=$PWD python scripts/hold_counts.py [--textcls] [redis-url]   (default:
    a fresh redis-server on a free port)

``--textcls``: the same claims through the real W3 model (``textcls``, one torch
thread) with the sizes learned (``auto_batch``), each arm warmed up first: real
tokens per CPU-second of the passes' threads (contended machines move wall time far
more than CPU time), with and without holding.

``--textcls --ab [ROUNDS] [--knob NAME]``: one runner, warmed up once, the boolean
knob ``NAME`` (default ``hold_buckets``; ``pad_to_longest`` too) switched live between
blocks of ``BLOCK`` claims in ABBA order (off, on, on, off, ...) for ROUNDS rounds
(default 6): both arms share the learned sizes, the process and the machine's load
over the run; per arm, real tokens per CPU-second, mean rows/pass and padding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from redbatch import TensorSpec, codec, protocol
from redbatch.bench.textcls import MAX_LEN, lengths
from redbatch.worker.autosize import AutoSizer
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.runner import BatchRunner
from redbatch.worker.stats import PASS_WARMUP

CLAIM, CLAIMS, SEED = 12, 400, 0
# the pass size of each bucket (what auto_batch learns for textcls on a CPU: the short
# buckets gain up to batch 32, the long ones lose from batching)
SIZES = {8: 32, 16: 32, 32: 32, 64: 32, 128: 16, 256: 4, 512: 1}


class FixedSizer(AutoSizer):
    def size(self, bucket: int | None, cap: int) -> int:
        return min(SIZES[bucket or 0], cap)

    def target(self, bucket: int | None, cap: int) -> int:
        return min(SIZES[bucket or 0], cap)


class Recorder:
    def __init__(self) -> None:
        self.passes: list[int] = []
        self.buckets: dict[int, list[int]] = defaultdict(list)

    def __call__(self, batch: list[Any]) -> list[int]:
        longest = max(len(x) for x in batch)
        bucket = next(b for b in sorted(SIZES) if b >= longest)
        self.buckets[bucket].append(len(batch))
        return [len(x) for x in batch]


async def run(url: str, holding: bool) -> Recorder:
    recorder = Recorder()
    spec = TensorSpec("int64", (None,), max_len=MAX_LEN)
    model = Model("w3", fn=recorder, spec=spec, inline=True, policy=BatchPolicy(
        max_batch_size=32, batch_wait_timeout_s=0.0, auto_batch=True))
    conn = aioredis.Redis.from_url(url)
    await conn.flushall()
    with ThreadPoolExecutor(1) as executor:
        runner = BatchRunner(conn, model, model.fn, "w1", executor, 0.01)
        runner._forwarder.sizer = FixedSizer()
        await claims(conn, prepared(runner, holding), random.Random(SEED), CLAIMS)
    await conn.aclose()
    return recorder


def prepared(runner: BatchRunner, holding: bool) -> BatchRunner:
    runner.peers_hold_aware = True  # no older worker (the heartbeat would say so)
    hold(runner, holding)
    for _ in range(PASS_WARMUP):
        runner.stats.pass_times.add([1], 1.0)
    return runner


def hold(runner: BatchRunner, on: bool, knob: str = "hold_buckets") -> None:
    """``knob`` (a boolean policy knob, ``hold_buckets`` by default) on or off, as a
    live change does (the next claim applies it)."""
    model = runner.model
    model.policy = dataclasses.replace(model.policy, **{knob: on})


async def claims(conn: aioredis.Redis, runner: BatchRunner, rng: random.Random, n: int,
                 passes: list[int] | None = None, padding: list[int] | None = None
                 ) -> tuple[int, float]:
    """``n`` claims of ``CLAIM`` W3 bodies; the real tokens computed and the passes'
    CPU ms (each pass's rows appended to ``passes``, the padded and real lengths added
    to ``padding``)."""
    pool, tokens, cpu_ms = lengths(), 0, 0.0
    name = runner.model.name
    for _ in range(n):
        now = protocol.now_ms()
        await conn.rpush(protocol.queue_key(name), *(codec.encode(protocol.Request(
            protocol.new_request_id(), name, now, now + 60_000,
            protocol.reply_key(name, "c"),
            np.arange(1, rng.choice(pool) + 1, dtype=np.int64) % 8192).to_wire())
            for _ in range(CLAIM)))
        batch = await runner._take()
        assert batch is not None
        tokens += sum(len(item.value) for item in batch.decoded.items)
        computed = await runner._compute(batch)
        cpu_ms += computed.fwd_cpu_ms
        if passes is not None:
            passes.extend(computed.passes)
        if padding is not None:
            padding[0] += computed.padding[0]
            padding[1] += computed.padding[1]
        await runner._publish_batch(batch, computed)
        await conn.delete(protocol.reply_key(name, "c"))
    return tokens, cpu_ms


def textcls_model() -> tuple[Model, Any]:
    """The W3 model (one torch thread) and its batch function."""
    import torch

    from redbatch.bench.textcls import build_served
    from redbatch.worker.torch_helpers import torch_model

    torch.set_num_threads(1)
    model = torch_model("textcls", build_served, TensorSpec("int64", (None,), max_len=MAX_LEN),
                        BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.0,
                                    auto_batch=True), input_name="input_ids")
    assert model.loader is not None
    return model, model.loader("cpu")


async def textcls_arm(url: str, holding: bool, warmup: int, n: int) -> tuple[float, dict[str, int]]:
    model, fn = textcls_model()
    conn = aioredis.Redis.from_url(url)
    await conn.flushall()
    with ThreadPoolExecutor(1) as executor:
        runner = prepared(BatchRunner(conn, model, fn, "w1", executor, 0.01), holding)
        rng = random.Random(SEED)
        await claims(conn, runner, rng, warmup)
        tokens, cpu_ms = await claims(conn, runner, rng, n)
        sizes = runner._forwarder.sizer.sizes()
    await conn.aclose()
    return tokens / (cpu_ms / 1000), sizes


async def textcls_main(url: str) -> None:
    for holding in (False, True, False, True):
        rate, sizes = await textcls_arm(url, holding, 100, 200)
        print(f"textcls {'with' if holding else 'without'} holding: {rate:,.0f} real "
              f"tokens per CPU-second of the passes; sizes learned {sizes}")


BLOCK = 25  # claims per block of the interleaved A/B
AB_ORDER = (False, True, True, False)  # one round: holding off, on, on, off


async def textcls_ab(url: str, rounds: int, knob: str = "hold_buckets", warmup: int = 100
                     ) -> None:
    model, fn = textcls_model()
    conn = aioredis.Redis.from_url(url)
    await conn.flushall()
    tokens_by = {False: 0, True: 0}
    cpu_ms_by = {False: 0.0, True: 0.0}
    padding_by = {False: [0, 0], True: [0, 0]}
    passes: dict[bool, list[int]] = {False: [], True: []}
    with ThreadPoolExecutor(1) as executor:
        runner = prepared(BatchRunner(conn, model, fn, "w1", executor, 0.01), True)
        rng = random.Random(SEED)
        await claims(conn, runner, rng, warmup)
        for _ in range(rounds):
            for on in AB_ORDER:
                hold(runner, on, knob)
                tokens, cpu_ms = await claims(conn, runner, rng, BLOCK, passes[on],
                                              padding_by[on])
                tokens_by[on] += tokens
                cpu_ms_by[on] += cpu_ms
        sizes = runner._forwarder.sizer.sizes()
    await conn.aclose()
    for on in (False, True):
        tokens, cpu_ms, rows = tokens_by[on], cpu_ms_by[on], passes[on]
        padded, real = padding_by[on]
        print(f"textcls, {knob} {'on' if on else 'off'} (interleaved, {rounds} rounds of "
              f"{BLOCK}-claim blocks): {tokens / (cpu_ms / 1000):,.0f} real tokens per "
              f"CPU-second of the passes; {len(rows)} passes, mean rows/pass "
              f"{sum(rows) / len(rows):.2f}, padding {padded / max(real, 1):.2f}x")
    print(f"sizes learned {sizes}")


def report(name: str, rec: Recorder) -> None:
    passes = [p for ps in rec.buckets.values() for p in ps]
    fill = [p / SIZES[b] for b, ps in rec.buckets.items() for p in ps]
    print(f"{name}: {len(passes)} passes, {sum(passes)} rows, mean rows/pass "
          f"{sum(passes) / len(passes):.2f}, mean fill (rows / bucket size) "
          f"{sum(fill) / len(fill):.2f}")
    for bucket in sorted(rec.buckets):
        ps = rec.buckets[bucket]
        print(f"  bucket {bucket:>3} (size {SIZES[bucket]:>2}): {len(ps):>4} passes, "
              f"mean rows/pass {sum(ps) / len(ps):5.2f}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(url: str) -> None:
    report("without holding", await run(url, holding=False))
    report("with holding", await run(url, holding=True))


def _entry(argv: list[str]) -> tuple[Any, list[str]]:
    """The function to run on a Redis URL, and the arguments left (the URL, if any)."""
    knob = "hold_buckets"
    if "--knob" in argv:
        knob = argv[argv.index("--knob") + 1]
        argv = [a for a in argv if a != knob]
    args = [a for a in argv if not a.startswith("--")]
    if "--ab" in argv:
        rounds = int(args.pop(0)) if args and args[0].isdigit() else 6
        return (lambda url: textcls_ab(url, rounds, knob)), args
    return (textcls_main if "--textcls" in argv else main), args


if __name__ == "__main__":
    entry, args = _entry(sys.argv[1:])
    if args:
        asyncio.run(entry(args[0]))
    else:
        port = _free_port()
        server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            asyncio.run(entry(f"redis://127.0.0.1:{port}"))
        finally:
            server.terminate()
            server.wait()
