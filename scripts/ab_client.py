"""scripts/ab-client: an interleaved same-run A/B of the Python client's hot path.

The client of the code at REV (A, a detached worktree) against the working tree's
(B), against one redis-server and one worker (the working tree's, serving
``redbatch.demo:adder``): each round runs A then B (then B then A), each in a
process of its own, and prints, per round and side:

* ``submit_us``: ``Client.submit``'s own cost, the median over 30 ticks of 1000
  submits each (no await suspends within a tick: CPU time alone);
* ``rps`` and ``cpu_us``: ``n`` requests answered at ``concurrency`` in flight
  (submit, then await the reply), and the client process's CPU time per request.

The medians per side come last.  Usage: ``scripts/ab-client [REV] [ROUNDS]`` (REV:
by default the merge base of HEAD and ``main``, the code before this branch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "adder"
FIELDS = ("submit_us", "rps", "cpu_us")
READY_S = 60.0  # redis-server and the worker (which imports torch) start within this


async def _submit_us(client: Any) -> float:
    per_tick = []
    for _ in range(30):
        started = time.perf_counter()
        futures = [await client.submit(MODEL, i) for i in range(1000)]
        per_tick.append((time.perf_counter() - started) * 1000)  # µs per submit
        await asyncio.gather(*futures)
    return statistics.median(per_tick)


async def _answered(client: Any, n: int, concurrency: int) -> tuple[float, float]:
    async def one(count: int) -> None:
        for i in range(count):
            await (await client.submit(MODEL, i))

    each = n // concurrency
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(each) for _ in range(concurrency)))
    done = each * concurrency
    return done / (time.perf_counter() - started), (time.process_time() - cpu) / done * 1e6


async def measure(url: str, n: int, concurrency: int) -> dict[str, float]:
    from redbatch import Client  # the side's own (PYTHONPATH)

    async with Client(url, pack_rows=1) as client:
        await _answered(client, 50 * concurrency, concurrency)  # warm-up
        submit_us = await _submit_us(client)
        rps, cpu_us = await _answered(client, n, concurrency)
    return {"submit_us": submit_us, "rps": rps, "cpu_us": cpu_us}


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate ``process``; killed if it has not exited 10 s later."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _until(ready: Callable[[], bool], what: str, process: subprocess.Popen[bytes]) -> None:
    """Poll ``ready`` until it holds; exit with a message if ``process`` (``what``)
    exits first, or after ``READY_S``."""
    deadline = time.monotonic() + READY_S
    while not ready():
        if process.poll() is not None:
            sys.exit(f"{what} exited ({process.returncode}) before it was ready")
        if time.monotonic() > deadline:
            sys.exit(f"{what} was not ready after {READY_S:.0f} s")
        time.sleep(0.1)


def _start(stack: contextlib.ExitStack, url: str, port: int) -> None:
    """redis-server on ``port`` and a worker of ``MODEL``, each stopped by ``stack``,
    once each is ready (redis answers PING, the worker holds a live lease)."""
    import redis

    from redbatch import protocol

    if shutil.which("redis-server") is None:
        sys.exit("redis-server is missing (apt-get install redis-server)")
    client = stack.enter_context(redis.Redis.from_url(url))

    def pings() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    def live() -> bool:
        return bool(client.zcount(protocol.workers_key(MODEL), protocol.now_ms(), "+inf"))

    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    stack.callback(_stop, server)
    _until(pings, "redis-server", server)
    worker = subprocess.Popen(
        [sys.executable, "-m", "redbatch", "worker", f"redbatch.demo:{MODEL}", "--device",
         "cpu", "--threads", "1", "--redis-url", url, "--log-level", "WARNING"],
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    stack.callback(_stop, worker)
    _until(live, "the worker", worker)


def _worktree(stack: contextlib.ExitStack, rev: str) -> Path:
    """A detached worktree of ``rev`` in a temp dir, removed (and pruned) by ``stack``."""
    tree = Path(tempfile.mkdtemp(prefix="redbatch-ab-client-"))
    stack.callback(shutil.rmtree, tree, True)
    stack.callback(subprocess.run, ["git", "worktree", "prune"], cwd=ROOT, check=False)
    stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(tree)],
                   cwd=ROOT, check=False)
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), rev], cwd=ROOT,
                   check=True)
    return tree


def _round(side: str, tree: Path, url: str, args: argparse.Namespace) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--measure", url, "--n", str(args.n),
                           "--concurrency", str(args.concurrency)],
                          env={**os.environ, "PYTHONPATH": str(tree)}, check=False,
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the client of {side} failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _compare(trees: dict[str, Path], url: str, args: argparse.Namespace) -> None:
    rows: dict[str, list[dict[str, float]]] = {side: [] for side in trees}
    order = list(trees)
    _round("B", trees["B"], url, args)  # the worker's warm-up
    for number in range(args.rounds):
        for side in order if number % 2 == 0 else order[::-1]:
            row = rows[side]
            row.append(_round(side, trees[side], url, args))
            print(f"round {number} {side} " + " ".join(
                f"{k}={row[-1][k]:.2f}" for k in FIELDS), flush=True)
    for side, results in rows.items():
        print(f"median {side} " + " ".join(
            f"{k}={statistics.median(r[k] for r in results):.2f}" for k in FIELDS))


def _merge_base() -> str:
    """The merge base of HEAD and ``main``: the code before this branch's changes."""
    found = subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=False,
                           capture_output=True, text=True)
    if found.returncode:
        sys.exit(f"no merge base of HEAD and main (give REV): {found.stderr.strip()}")
    return found.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", help="A (default: git merge-base HEAD main)")
    parser.add_argument("rounds", nargs="?", type=int, default=5)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--measure", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(asyncio.run(measure(args.measure, args.n, args.concurrency))))
        return
    from redbatch.embedded import free_port

    rev = args.rev or _merge_base()
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with contextlib.ExitStack() as stack:
        tree = _worktree(stack, rev)
        _start(stack, url, port)
        print(f"A = {rev}, B = the working tree", flush=True)
        _compare({"A": tree, "B": ROOT}, url, args)


if __name__ == "__main__":
    main()
