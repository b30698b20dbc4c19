"""scripts/redis_cost_ab.py: Redis's cost per request of W2 (the demo ``mlp`` over HTTP
at 64 connections), the code at REV (A, a detached worktree) against the working tree (B).

Each side runs its own redis-server, one worker (``redbatch.demo:models``, one torch
thread) and the gateway (``--workers`` processes); an aiohttp load of ``connections``
closed-loop callers takes turns on A and B, ``rounds`` rounds of ``seconds`` each.
Around every round: one ``INFO cpu commandstats``.  Per side, summed over its rounds and
divided by the requests served, it prints the calls and usec per request of every
command, and the main thread's CPU per request.  After the rounds, a ``SLOWLOG`` of
every command for ``monitor_s`` seconds per side splits ``evalsha`` by script (named
from the tree's ``lua.py``).

``--w3``: W3 instead (the demo ``textcls``, its 64 bodies of 8 to 458 token ids in
turn, entries of about 1 KB).

On a shared machine, the call counts and commandstats usec are the figures to trust
(usec is wall time inside a command: a busy machine inflates both sides alike).
Usage: ``python scripts/redis_cost_ab.py --rev REV [--rounds N] [--seconds S]``
(REV, required: the code to compare with, e.g. ``main`` or the commit before a change;
the working tree, uncommitted edits included, is B).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import redis

ROOT = Path(__file__).resolve().parent.parent
BODY = {"x": [i / 64 for i in range(64)]}
BODIES: list[dict[str, Any]] = [BODY]  # sent in turn (``--w3``: W3's 64 bodies)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Side:
    """One stack: redis-server, worker, gateway, from the tree at ``tree``."""

    def __init__(self, name: str, tree: Path, gateways: int, model: str) -> None:
        self.name, self.tree, self.model = name, tree, model
        self.redis_port, self.http_port = free_port(), free_port()
        self.url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.procs: list[subprocess.Popen[bytes]] = []
        self._spawn(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                     "--save", "", "--appendonly", "no"])
        time.sleep(0.5)
        self._spawn([sys.executable, "-m", "redbatch", "worker", "redbatch.demo:models",
                     "--redis-url", self.url, "--threads", "1", "--device", "cpu"])
        self._spawn([sys.executable, "-m", "redbatch", "gateway", "--host", "127.0.0.1",
                     "--port", str(self.http_port), "--workers", str(gateways)],
                    {"REDIS_URL": self.url})
        self.totals: Counter[str] = Counter()
        self.requests = 0

    def _spawn(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full = {**os.environ, "PYTHONPATH": str(self.tree), "REDBATCH_LOG_LEVEL": "WARNING",
                **(env or {})}
        self.procs.append(subprocess.Popen(args, cwd=self.tree, env=full,
                                           stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/models/{self.model}/predict"

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def snapshot(url: str) -> Counter[str]:
    info: dict[str, Any] = redis.Redis.from_url(url).info("cpu", "commandstats")
    out: Counter[str] = Counter()
    out["cpu_s"] = float(info["used_cpu_user_main_thread"]) + float(
        info["used_cpu_sys_main_thread"])
    for key, value in info.items():
        if key.startswith("cmdstat_"):
            name = key.removeprefix("cmdstat_")
            out["calls:" + name] = value["calls"]
            out["usec:" + name] = value["usec"]
    return out


async def wait_ready(side: Side, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.post(side.endpoint, json=BODIES[0]) as resp:
                    if resp.status == 200:
                        await asyncio.sleep(2)  # the first heartbeats and summaries
                        return
            await asyncio.sleep(0.5)
    raise SystemExit(f"{side.name}: never answered 200")


async def load(endpoint: str, connections: int, seconds: float) -> tuple[int, int]:
    """Closed-loop callers for ``seconds``: (requests answered 200, others)."""
    ok = bad = 0
    stop = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def caller(i: int) -> None:
            nonlocal ok, bad
            while time.monotonic() < stop:
                i += 1
                async with session.post(endpoint, json=BODIES[i % len(BODIES)]) as resp:
                    await resp.read()
                    if resp.status == 200:
                        ok += 1
                    else:
                        bad += 1
        await asyncio.gather(*(caller(i) for i in range(connections)))
    return ok, bad


async def measured_round(side: Side, args: argparse.Namespace) -> None:
    before = snapshot(side.url)
    ok, bad = await load(side.endpoint, args.connections, args.seconds)
    after = snapshot(side.url)
    after.subtract(before)
    side.totals.update(after)
    side.requests += ok
    cpu = after["cpu_s"] * 1e6 / max(ok, 1)
    print(f"  {side.name}: {ok / args.seconds:7.0f} req/s  errors {bad}  "
          f"redis cpu {cpu:5.1f} us/req  evalsha {after['usec:evalsha'] / max(ok, 1):5.2f} us/req",
          flush=True)


def report(side: Side) -> None:
    n = max(side.requests, 1)
    print(f"\n{side.name} ({side.tree}): {side.requests} requests")
    print(f"  main-thread CPU: {side.totals['cpu_s'] * 1e6 / n:.2f} us/request")
    names = sorted({k.split(":", 1)[1] for k in side.totals if k.startswith("calls:")},
                   key=lambda c: -side.totals["usec:" + c])
    for name in names:
        calls, usec = side.totals["calls:" + name], side.totals["usec:" + name]
        if calls:
            print(f"  {name:<22} {calls / n:7.3f} calls/req  {usec / n:6.2f} us/req  "
                  f"{usec / max(calls, 1):6.2f} us/call")


def script_names(tree: Path) -> dict[str, str]:
    """sha1 -> name of every script string in the tree's lua modules."""
    code = ("import json, redbatch.lua as a\n"
            "try:\n    import redbatch.lua_stream as b\nexcept ImportError:\n    b = a\n"
            "print(json.dumps({f'{m.__name__}.{k}': v for m in (a, b) for k, v in "
            "vars(m).items() if isinstance(v, str) and 'redis.call' in v}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    scripts: dict[str, str] = json.loads(out.stdout)
    return {hashlib.sha1(v.encode()).hexdigest(): k for k, v in scripts.items()}


async def monitored(side: Side, args: argparse.Namespace) -> None:
    """``SLOWLOG`` of every command while the load runs ``monitor_s``: calls and usec
    per request of each command, ``evalsha`` split by script."""
    names = script_names(side.tree)
    client = redis.Redis.from_url(side.url)
    client.config_set("slowlog-max-len", 1_000_000)
    client.slowlog_reset()
    client.config_set("slowlog-log-slower-than", 0)
    ok, _ = await load(side.endpoint, args.connections, args.monitor_s)
    client.config_set("slowlog-log-slower-than", 10000)
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for entry in client.slowlog_get(1_000_000):
        cmd = entry["command"].split()
        op = cmd[0].decode().upper() if cmd else "?"
        if op == "EVALSHA":
            op += " " + names.get(cmd[1].decode(), cmd[1].decode()[:8])
        calls[op] += 1
        usec[op] += entry["duration"]
    client.slowlog_reset()
    n = max(ok, 1)
    print(f"\n{side.name} SLOWLOG ({ok} requests): calls/req, usec/req, usec/call")
    for op in sorted(calls, key=lambda o: -usec[o]):
        print(f"  {op:<36} {calls[op] / n:7.3f} {usec[op] / n:7.2f} {usec[op] / calls[op]:7.2f}")


async def main_async(args: argparse.Namespace, base: Path) -> None:
    sides = [Side("A", base, args.gateways, args.model), Side("B", ROOT, args.gateways, args.model)]
    try:
        await asyncio.gather(*(wait_ready(s) for s in sides))
        for side in sides:  # warm-up
            await load(side.endpoint, args.connections, 2)
        for r in range(args.rounds):
            print(f"round {r + 1}", flush=True)
            for side in (sides if r % 2 == 0 else sides[::-1]):
                await measured_round(side, args)
        for side in sides:
            report(side)
        if args.monitor_s:
            for side in sides:
                await monitored(side, args)
    finally:
        for side in sides:
            side.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", required=True,
                        help="the code to compare with (A): a branch, tag or commit")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--w3", action="store_true",
                        help="W3: the model textcls and its 64 bodies, in turn")
    parser.add_argument("--monitor-s", type=float, default=2.0,
                        help="seconds of SLOWLOG per side after the rounds (0: none)")
    args = parser.parse_args()
    if args.w3:
        from redbatch.bench import textcls

        BODIES[:] = textcls.bodies()
        args.model = "textcls"
    base = Path(tempfile.mkdtemp(prefix="redis-base-"))
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.rev],
                   cwd=ROOT, check=True)
    try:
        asyncio.run(main_async(args, base))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       check=False)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
