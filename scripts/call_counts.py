"""Python calls per W1 request in the gateway process, by count (cProfile): no timing
enters the figures, so two trees compare on a shared, noisy machine.

A private redis-server and one worker (``redbatch.demo:models``, its own process)
serve ``echo``; the gateway app (``create_app``) runs in this process and is called
as an ASGI app directly (no HTTP server, no client library), with the W1 body
(``{"x": [16 floats]}``, wrk's headers).  After a warm-up, N requests run under
cProfile, one at a time (``--concurrency 1``: the same work each time), from C
concurrent callers (closer to wrk's 64 connections; the batches then vary from run
to run, and so do the event loop's calls), or in waves of C at once (``--waves``: each
wave enqueued in one tick, the batches much alike from run to run).

    PYTHONPATH=$TREE python scripts/call_counts.py [-n N] [-c C] [--waves] [--top K]

Prints the calls per request (all, and Python functions alone: builtins left out),
by package, and the top K functions by calls per request.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import redis

BODY = ('{"x": [' + ", ".join(f"{i / 16:.6f}" for i in range(16)) + "]}").encode()
PATH = "/v1/models/echo/predict"
HEADERS = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
           (b"content-length", str(len(BODY)).encode())]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_stack(tree: Path, workdir: str) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """A redis-server and a worker of the demo models (its own process)."""
    port = free_port()
    binary = shutil.which("redis-server") or "redis-server"
    procs = [subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                               "", "--appendonly", "no", "--dir", workdir],
                              stdout=subprocess.DEVNULL)]
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    env = {**os.environ, "PYTHONPATH": str(tree), "REDBATCH_LOG_LEVEL": "WARNING"}
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "redbatch", "worker", "redbatch.demo:models", "--redis-url",
         url, "--threads", "1", "--device", "cpu"], cwd=tree, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return url, procs


async def call(app: Any) -> int:
    """One W1 request through the ASGI app: its status."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": PATH, "raw_path": PATH.encode(),
             "query_string": b"", "root_path": "", "headers": HEADERS,
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # no disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def run(app: Any, count: int, concurrency: int, waves: bool = False) -> list[int]:
    if waves:  # C requests at once, all answered before the next C: the same work each wave
        statuses: list[int] = []
        for start in range(0, count, concurrency):
            statuses += await asyncio.gather(*(call(app) for _ in range(
                min(concurrency, count - start))))
        return statuses

    async def loop(share: int) -> list[int]:
        return [await call(app) for _ in range(share)]

    shares = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]
    results = await asyncio.gather(*(loop(s) for s in shares))
    return [status for part in results for status in part]


def _group(filename: str) -> str:
    if filename == "~":
        return "(builtins)"
    for name in ("redbatch", "starlette", "redis", "asyncio", "prometheus_client", "numpy"):
        if f"/{name}/" in filename:
            return name
    return "(other python)"


def report(profile: cProfile.Profile, count: int, top: int) -> None:
    stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = python = 0
    groups: dict[str, int] = defaultdict(int)
    rows = []
    for (filename, line, name), (_prim, calls, _tt, _ct, _callers) in stats.items():
        total += calls
        groups[_group(filename)] += calls
        if filename != "~":
            python += calls
        where = filename.split("/site-packages/")[-1].split("/redbatch/")[-1]
        rows.append((calls, f"{where}:{line}({name})" if filename != "~" else name))
    print(f"requests: {count}")
    print(f"calls/request, all: {total / count:.1f}   python functions: {python / count:.1f}")
    for group, calls in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:20s} {calls / count:8.1f}")
    print(f"top {top} by calls/request:")
    for calls, label in sorted(rows, reverse=True)[:top]:
        print(f"  {calls / count:7.2f}  {label}")


async def main(args: argparse.Namespace, tree: Path, workdir: str) -> None:
    from redbatch.api.app import create_app
    from redbatch.config import GatewayConfig, RedisSettings

    url, procs = start_stack(tree, workdir)
    try:
        app = create_app(GatewayConfig(), RedisSettings(url))
        async with app.router.lifespan_context(app):
            deadline = time.monotonic() + 120
            while await call(app) != 200:
                assert time.monotonic() < deadline, "echo never answered"
                await asyncio.sleep(0.2)
            await run(app, args.warmup, args.concurrency, args.waves)
            profile = cProfile.Profile()
            profile.enable()
            statuses = await run(app, args.requests, args.concurrency, args.waves)
            profile.disable()
        assert set(statuses) == {200}, sorted(set(statuses))
        print(f"tree: {tree}  concurrency: {args.concurrency}"
              f"{' (in waves)' if args.waves else ''}")
        report(profile, args.requests, args.top)
        if args.dump:
            profile.dump_stats(args.dump)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(15)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--requests", type=int, default=2000)
    parser.add_argument("-c", "--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--waves", action="store_true",
                        help="C requests at once, each wave answered before the next")
    parser.add_argument("--dump", help="also write the profile here (pstats)")
    parser.add_argument("--top", type=int, default=40)
    asyncio.run(main(parser.parse_args(),
                     Path(__import__("redbatch").__file__).resolve().parent.parent,
                     tempfile.mkdtemp(prefix="rb-calls-")))
