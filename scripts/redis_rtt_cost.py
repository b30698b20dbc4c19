"""scripts/redis_rtt_cost.py: what one round trip costs Redis on this machine, by load.

A private redis-server on a free port; for each command (``PING``, and the enqueue
script with one 2.2 KB entry, about a W2 entry of 8 rows), first pipelined (one
client, 200 commands per write), then from 1, 4, 16 and 64 concurrent clients that
each send one command and await its reply before the next, as redbatch's gateways
and workers do.  Per case: commands/s, Redis main-thread CPU per command (``INFO
cpu``), and how busy the main thread was.

The per-request figures of ``scripts/redis_cost_ab.py`` are round trips per request
times this cost, plus the commands' own work: read them against this table, taken in
the same conditions.  ``--pin-redis CPU`` runs the server on that CPU alone
(``taskset``), and ``--unix`` connects over a Unix socket instead of TCP.
Usage: ``python scripts/redis_rtt_cost.py [--seconds S] [--pin-redis CPU] [--unix]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from redbatch import lua

ENTRY = os.urandom(2200)
Send = Callable[[Any, int], Awaitable[Any]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(args: argparse.Namespace, port: int, sock: str) -> subprocess.Popen[bytes]:
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--unixsocket", sock, "--unixsocketperm", "700"]
    if args.pin_redis is not None:
        cmd = ["taskset", "-c", str(args.pin_redis), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc


def main_cpu_s(admin: redis.Redis) -> float:
    info: dict[str, Any] = admin.info("cpu")
    return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])


def senders(sha: str) -> dict[str, Send]:
    async def ping(conn: Any, _i: int) -> Any:
        return await conn.ping()

    async def enqueue(conn: Any, i: int) -> Any:
        marker = f"{{m}}:mk:{i}:{time.monotonic_ns()}"
        return await conn.evalsha(sha, 2, "{m}:queue", marker, 1_000_000, 60_000, 5_000,
                                  ENTRY)

    return {"PING": ping, "ENQUEUE": enqueue}


async def closed_loop(conns: list[Any], send: Send, seconds: float) -> int:
    done = 0
    stop = time.monotonic() + seconds

    async def one(conn: Any, k: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            await send(conn, k * 10_000_000 + done)
            done += 1

    await asyncio.gather(*(one(c, k) for k, c in enumerate(conns)))
    return done


async def pipelined(conn: Any, name: str, sha: str, seconds: float) -> int:
    done = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        pipe = conn.pipeline(transaction=False)
        for i in range(200):
            if name == "PING":
                pipe.ping()
            else:
                pipe.evalsha(sha, 2, "{m}:queue", f"{{m}}:mk:p{done + i}:{time.monotonic_ns()}",
                             1_000_000, 60_000, 5_000, ENTRY)
        await pipe.execute()
        done += 200
    return done


async def trimmer(url: str) -> None:
    """Keeps the queue short (a few commands a second), so that memory stays flat."""
    conn = aredis.Redis.from_url(url)
    try:
        while True:
            await conn.ltrim("{m}:queue", 0, 99)
            await asyncio.sleep(0.05)
    finally:
        await conn.aclose()


async def measure(admin: redis.Redis, url: str, label: str, run: Awaitable[int]) -> None:
    trim = asyncio.create_task(trimmer(url))
    cpu0, t0 = main_cpu_s(admin), time.monotonic()
    n = await run
    cpu, wall = main_cpu_s(admin) - cpu0, time.monotonic() - t0
    trim.cancel()
    admin.delete("{m}:queue")
    print(f"  {label:<22} {n / wall:9.0f} cmds/s  {cpu * 1e6 / max(n, 1):7.2f} us of Redis "
          f"CPU per command  main thread {cpu / wall * 100:5.1f} % busy", flush=True)


async def run_all(args: argparse.Namespace, url: str, admin: redis.Redis) -> None:
    sha = admin.script_load(lua.ENQUEUE)
    for name, send in senders(sha).items():
        print(name)
        conn = aredis.Redis.from_url(url)
        await measure(admin, url, "pipelined (200/write)", pipelined(conn, name, sha, args.seconds))
        await conn.aclose()
        for k in (1, 4, 16, 64):
            conns = [aredis.Redis.from_url(url) for _ in range(k)]
            await measure(admin, url, f"{k} client(s), 1 at a time",
                          closed_loop(conns, send, args.seconds))
            for c in conns:
                await c.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--pin-redis", type=int, default=None, metavar="CPU")
    parser.add_argument("--unix", action="store_true", help="connect over a Unix socket")
    args = parser.parse_args()
    port = free_port()
    sock = str(Path(tempfile.mkdtemp(prefix="rtt-")) / "redis.sock")
    proc = start_server(args, port, sock)
    url = f"unix://{sock}" if args.unix else f"redis://127.0.0.1:{port}"
    try:
        asyncio.run(run_all(args, url, redis.Redis(port=port)))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
