"""scripts/chaos: the delivery promise under fire, with a ledger at the end.

Starts its own redis-server (AOF on, as in production), a gateway, and a pool of
two worker replicas serving scripts/chaos_models.py.  While a bounded HTTP load
runs, it kill -9s a replica mid-batch (the pool restarts it), SIGSTOPs the other
past its lease and wakes it, restarts Redis, and injects poison: garbage queue
entries pushed straight into Redis and requests whose input makes the model raise.
Every request must end in exactly one answer: lost and duplicated must be 0.

``--scenario stall`` instead SIGSTOPs the redis-server for ``--stall-s`` seconds under
open-loop arrivals (a fixed rate, whatever the answers do), then SIGCONTs it: every
request must be answered by its deadline plus a margin, and none with a 200 after it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redbatch import protocol  # noqa: E402
from redbatch.embedded import free_port  # noqa: E402

LEASE = {"REDBATCH_HEARTBEAT_INTERVAL_S": "0.3", "REDBATCH_LEASE_TTL_S": "1.5"}
REFUSED = {"queue_full", "no_workers", "redis_unavailable"}  # 503 before acceptance


@dataclass
class Ledger:
    sent: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: int = 0
    wrong: int = 0
    latencies: list[float] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


class Stack:
    """redis-server + gateway + worker pool, as child processes of this script."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.redis_port = free_port()
        self.http_port = free_port()
        self.url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=ROOT, env={**os.environ, **(env or {})})

    def start_redis(self) -> None:
        self._spawn("redis", ["redis-server", "--port", str(self.redis_port), "--bind",
                              "127.0.0.1", "--dir", str(self.workdir), "--appendonly", "yes",
                              "--appendfsync", "always", "--save", ""])
        wait(lambda: _ping(self.url), 10, "redis")

    def start(self) -> None:
        self.start_redis()
        env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'scripts'}", **LEASE}
        self._spawn("workers", [sys.executable, "-m", "redbatch", "worker",
                                "chaos_models:chaos", "--replicas", "2", "--redis-url",
                                self.url], env)
        self._spawn("gateway", [sys.executable, "-m", "redbatch", "gateway", "--redis-url",
                                self.url, "--port", str(self.http_port),
                                "--default-timeout-s", "8"], env)
        wait(lambda: _ready(f"http://127.0.0.1:{self.http_port}/readyz"), 60, "gateway")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()


def _ping(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.2).ping())
    except redis.RedisError:
        return False


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"chaos: timed out waiting for {what}")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_pids(raw: redis.Redis) -> list[int]:
    """Live replicas (a killed one's info stays in Redis until it is reaped)."""
    pids = (json.loads(v)["pid"] for v in raw.hvals(protocol.worker_info_key("chaos")))
    return sorted(pid for pid in pids if alive(pid))


def busy_worker(raw: redis.Redis) -> int | None:
    for key in raw.scan_iter(protocol.inflight_key("chaos", "*")):
        if raw.llen(key):
            wid = key.decode().rsplit(":", 1)[1]
            info = raw.hget(protocol.worker_info_key("chaos"), wid)
            if info and alive(pid := int(json.loads(info)["pid"])):
                return pid
    return None


async def client_loop(http: httpx.AsyncClient, ledger: Ledger, stop: asyncio.Event,
                      seed: int) -> None:
    i = seed
    while not stop.is_set():
        i += 1000
        value = -13 if i % 97 == 0 else i
        ledger.sent += 1
        started = time.monotonic()
        try:
            resp = await http.post("/v1/models/chaos/predict", json={"inputs": value})
        except httpx.HTTPError:
            ledger.lost += 1
            continue
        ledger.latencies.append(time.monotonic() - started)
        body = resp.json()
        code = "ok" if resp.status_code == 200 else body["error"]["code"]
        ledger.codes[code] += 1
        if code == "ok" and body["outputs"] != value * 2:
            ledger.wrong += 1
        if code in REFUSED:
            await asyncio.sleep(0.05)


async def chaos_events(stack: Stack, ledger: Ledger, duration_s: float) -> None:
    raw = redis.Redis.from_url(stack.url, socket_timeout=5)
    step = duration_s / 6
    await asyncio.sleep(step)
    pid = await asyncio.to_thread(_wait_busy, raw)
    os.kill(pid, signal.SIGKILL)
    ledger.events.append(f"kill -9 replica pid {pid} mid-batch")
    await asyncio.sleep(step)
    pid = await asyncio.to_thread(_wait_busy, raw)
    os.kill(pid, signal.SIGSTOP)
    ledger.events.append(f"SIGSTOP replica pid {pid} for 3 s (lease 1.5 s)")
    await asyncio.sleep(3.0)
    os.kill(pid, signal.SIGCONT)
    await asyncio.sleep(step)
    await asyncio.to_thread(_restart_redis, stack)
    ledger.events.append("restarted redis-server (SIGTERM, AOF, same port)")
    await asyncio.sleep(step)
    raw = redis.Redis.from_url(stack.url, socket_timeout=5)
    poison = [b"\xc1garbage", b'{"v": 1, "id": 5}', b"\x81\xa1v\x02", b"{" * 100]
    raw.rpush(protocol.queue_key("chaos"), *poison)
    ledger.events.append(f"pushed {len(poison)} malformed entries into the queue")


def _wait_busy(raw: redis.Redis) -> int:
    """A live replica with a batch in flight (or, failing that, any live replica)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pid = busy_worker(raw)
        if pid:
            return pid
        time.sleep(0.005)
    pids = worker_pids(raw)
    if not pids:
        raise SystemExit("chaos: no live worker replica to disturb")
    return pids[0]


def _restart_redis(stack: Stack) -> None:
    proc = stack.procs["redis"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    stack.start_redis()


async def run(stack: Stack, duration_s: float, concurrency: int) -> Ledger:
    ledger = Ledger()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{stack.http_port}", timeout=30,
                                 limits=limits) as http:
        clients = [asyncio.create_task(client_loop(http, ledger, stop, i))
                   for i in range(concurrency)]
        try:
            await chaos_events(stack, ledger, duration_s)
            await asyncio.sleep(max(0.0, duration_s / 6))
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 60)
        stats = (await http.get("/v1/stats")).json()
    ledger.codes["duplicates_seen_by_gateway"] = stats["duplicates"]
    ledger.codes["late_replies_seen_by_gateway"] = stats["late"]
    return ledger


def report(ledger: Ledger, raw: redis.Redis) -> int:
    refused = sum(ledger.codes[c] for c in REFUSED)
    answered = sum(v for k, v in ledger.codes.items() if not k.endswith("_by_gateway"))
    accepted = ledger.sent - refused
    duplicated = ledger.codes["duplicates_seen_by_gateway"]
    leftover = sum(raw.llen(k) for pattern in (protocol.inflight_key("chaos", "*"),
                                               protocol.held_key("chaos", "*"))
                   for k in raw.scan_iter(pattern))  # claimed, or held over, never answered
    dead = raw.llen(protocol.dead_letter_key("chaos"))
    print("\nchaos events:")
    for event in ledger.events:
        print(f"  - {event}")
    print("\nledger:")
    print(f"  sent                    {ledger.sent}")
    print(f"  refused (503, never accepted) {refused}")
    print(f"  accepted                {accepted}")
    print(f"  replied ok              {ledger.codes['ok']} (wrong values: {ledger.wrong})")
    for code, n in sorted(ledger.codes.items()):
        if code != "ok" and code not in REFUSED and not code.endswith("_by_gateway"):
            print(f"  replied error {code:<22} {n}")
    print(f"  lost                    {ledger.lost + (ledger.sent - answered - ledger.lost)}")
    print(f"  duplicated              {duplicated}")
    print(f"  late replies dropped    {ledger.codes['late_replies_seen_by_gateway']}")
    print(f"  left in flight or held  {leftover}")
    print(f"  dead letters            {dead}")
    lat = sorted(ledger.latencies)
    if lat:
        print(f"  latency p50/p99/max     {lat[len(lat) // 2]:.3f} / "
              f"{lat[int(len(lat) * 0.99)]:.3f} / {lat[-1]:.3f} s")
    bad = ledger.lost + duplicated + ledger.wrong + leftover + (ledger.sent - answered -
                                                                ledger.lost)
    print("\nRESULT:", "PASS (nothing lost, nothing duplicated)" if bad == 0 else "FAIL")
    return 0 if bad == 0 else 1


STALL_TIMEOUT_MS = 1000
STALL_MARGIN_S = 0.5  # answers count as on time up to the deadline plus this


@dataclass
class StallLedger:
    sent: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    unanswered: int = 0  # nothing within the deadline plus STALL_MARGIN_S
    late: int = 0  # answered after the deadline plus the margin
    late_ok: int = 0  # of those, 200s
    misses: list[str] = field(default_factory=list)  # when each miss was sent, and what
    stall_at: float = 0.0  # monotonic time of the SIGSTOP


async def stall_request(http: httpx.AsyncClient, ledger: StallLedger, value: int) -> None:
    ledger.sent += 1
    started = time.monotonic()
    try:
        resp = await http.post("/v1/models/chaos/predict", json={"inputs": value},
                               headers={"x-redbatch-timeout-ms": str(STALL_TIMEOUT_MS)})
    except httpx.HTTPError as exc:
        ledger.unanswered += 1
        ledger.misses.append(_miss(ledger, started, type(exc).__name__))
        return
    code = "ok" if resp.status_code == 200 else resp.json()["error"]["code"]
    ledger.codes[code] += 1
    if time.monotonic() - started > STALL_TIMEOUT_MS / 1000 + STALL_MARGIN_S:
        ledger.late += 1
        ledger.late_ok += code == "ok"
        ledger.misses.append(_miss(ledger, started, f"late {code}"))


def _miss(ledger: StallLedger, started: float, what: str) -> str:
    """One line on a request that missed: when it was sent, against the SIGSTOP."""
    sent = started - ledger.stall_at if ledger.stall_at else float("nan")
    took = time.monotonic() - started
    return f"sent at stall{sent:+.3f} s, after {took:.3f} s: {what}"


async def run_stall(stack: Stack, duration_s: float, stall_s: float, rate: float
                    ) -> StallLedger:
    """Open-loop arrivals at ``rate`` per second; Redis SIGSTOPped for ``stall_s``."""
    ledger, tasks = StallLedger(), []
    limits = httpx.Limits(max_connections=None)
    timeout = STALL_TIMEOUT_MS / 1000 + STALL_MARGIN_S
    redis_pid = stack.procs["redis"].pid
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{stack.http_port}",
                                 timeout=timeout, limits=limits) as http:
        started, stopped = time.monotonic(), False
        for i in range(int(duration_s * rate)):
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            elapsed = time.monotonic() - started
            if not stopped and elapsed >= duration_s / 3:
                os.kill(redis_pid, signal.SIGSTOP)
                stopped, ledger.stall_at = True, time.monotonic()
            if stopped and elapsed >= duration_s / 3 + stall_s:
                os.kill(redis_pid, signal.SIGCONT)
            tasks.append(asyncio.create_task(stall_request(http, ledger, i)))
        os.kill(redis_pid, signal.SIGCONT)
        await asyncio.gather(*tasks)
    return ledger


def stall_report(ledger: StallLedger, stall_s: float) -> int:
    print(f"\nredis-server SIGSTOPped for {stall_s:.1f} s under open-loop arrivals "
          f"(timeout {STALL_TIMEOUT_MS} ms each)")
    print(f"  sent                         {ledger.sent}")
    for code, n in sorted(ledger.codes.items()):
        print(f"  answered {code:<20} {n}")
    print(f"  no answer by deadline+{STALL_MARGIN_S}s   {ledger.unanswered}")
    print(f"  answered after deadline+{STALL_MARGIN_S}s {ledger.late} (200s: {ledger.late_ok})")
    for miss in ledger.misses:
        print(f"    - {miss}")
    bad = ledger.unanswered + ledger.late
    print("\nRESULT:", "PASS (every request answered by its deadline)" if bad == 0 else "FAIL")
    return 0 if bad == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration-s", type=float, default=12.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--scenario", choices=("faults", "stall"), default="faults")
    parser.add_argument("--stall-s", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=40.0, help="stall: arrivals per second")
    args = parser.parse_args()
    if not shutil.which("redis-server"):
        raise SystemExit("chaos needs redis-server")
    workdir = Path(tempfile.mkdtemp(prefix="redbatch-chaos-"))
    stack = Stack(workdir)
    try:
        stack.start()
        if args.scenario == "stall":
            duration_s = max(args.duration_s, 3 * args.stall_s)
            stalled = asyncio.run(run_stall(stack, duration_s, args.stall_s, args.rate))
            return stall_report(stalled, args.stall_s)
        ledger = asyncio.run(run(stack, args.duration_s, args.concurrency))
        time.sleep(2.0)  # let the last leases and reaps settle before counting leftovers
        return report(ledger, redis.Redis.from_url(stack.url, socket_timeout=5))
    finally:
        stack.stop()
        print(f"logs: {workdir}")


if __name__ == "__main__":
    sys.exit(main())
