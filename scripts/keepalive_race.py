"""Reuse idle keep-alive connections right around a gateway's idle timeout.

40 httpx clients, one connection each, send a request, stay idle for IDLE_S +- 30 ms,
then send another on the same connection, four times over; prints how the second
requests ended.  A gateway that closes idle connections after IDLE_S (uvicorn's own
default is 5 s, httpx's idle expiry too) fails a few of them unanswered
(``RemoteProtocolError``); one that keeps them longer (``REDBATCH_KEEP_ALIVE_S``,
75 s by default) fails none.  Compare both in one run: two gateways on one Redis,

    REDBATCH_KEEP_ALIVE_S=5 python -m redbatch gateway --port 8001 &
    python -m redbatch gateway --port 8002 &
    python scripts/keepalive_race.py http://127.0.0.1:8001 5
    python scripts/keepalive_race.py http://127.0.0.1:8002 5
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys

import httpx

CLIENTS, ROUNDS = 40, 4


async def client(url: str, idle_s: float, counts: collections.Counter[str]) -> None:
    limits = httpx.Limits(max_connections=1, keepalive_expiry=idle_s + 1)
    async with httpx.AsyncClient(base_url=url, timeout=3, limits=limits) as http:
        for _ in range(ROUNDS):
            await http.get("/healthz")
            await asyncio.sleep(idle_s - 0.03 + random.random() * 0.06)
            try:
                await http.get("/healthz")
                counts["ok"] += 1
            except httpx.HTTPError as exc:
                counts[type(exc).__name__] += 1


async def main(url: str, idle_s: float) -> None:
    counts: collections.Counter[str] = collections.Counter()
    await asyncio.gather(*(client(url, idle_s, counts) for _ in range(CLIENTS)))
    print(f"{url}: {dict(counts)} of {CLIENTS * ROUNDS} requests after ~{idle_s} s idle")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 5.0))
