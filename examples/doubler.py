"""Calling a model from Python with futures: redbatch's answer to Ray's handles.

In Ray Serve a deployment is called through a handle, and ``handle.remote(x)``
returns at once with a reference to the future result::

    refs = [handle.remote(i) for i in range(8)]
    print(ray.get(refs))           # [0, 2, 4, ..., 14]

redbatch's clients do the same: ``await Client.submit(model, x)`` enqueues the
request and returns an ``asyncio.Future``; ``SyncClient.submit(model, x)`` returns a
``concurrent.futures.Future`` for code without an event loop.  The requests wait in
Redis together, so the worker doubles them in one or a few batches.

How to run it (from the repository root)::

    redis-server --port 6379 --save '' &
    export REDIS_URL=redis://127.0.0.1:6379/0
    python -m redbatch worker examples.doubler:doubler --device cpu --threads 1 &
    python -m examples.doubler     # async client, then sync client:
                                   # [0, 2, 4, 6, 8, 10, 12, 14] twice
"""

from __future__ import annotations

import asyncio

from redbatch import Client, SyncClient, batch

MODEL = "doubler"
CALLS = 8


@batch(name=MODEL, max_batch_size=8, batch_wait_timeout_s=0.01)
def doubler(numbers: list[float]) -> list[float]:
    """Double every number of the batch."""
    return [2 * n for n in numbers]


async def submit_all(url: str | None = None, count: int = CALLS,
                     timeout_s: float = 10.0) -> list[float]:
    """Like ``[handle.remote(i) for i in ...]`` then ``ray.get``, with the async client."""
    async with Client(url, default_timeout_s=timeout_s) as client:
        futures = [await client.submit(MODEL, i) for i in range(count)]
        return list(await asyncio.wait_for(asyncio.gather(*futures), timeout_s))


def submit_all_sync(url: str | None = None, count: int = CALLS,
                    timeout_s: float = 10.0) -> list[float]:
    """The same with the blocking ``SyncClient`` and ``concurrent.futures`` futures."""
    with SyncClient(url, default_timeout_s=timeout_s) as client:
        futures = [client.submit(MODEL, i) for i in range(count)]
        return [future.result(timeout_s) for future in futures]


def main(url: str | None = None) -> None:
    """Call the doubler at ``url`` (default: ``$REDIS_URL``) both ways; print the results."""
    print(asyncio.run(submit_all(url)))
    print(submit_all_sync(url))


if __name__ == "__main__":
    main()
