"""The vectorized adder, ported from Ray Serve's "Dynamic Request Batching" tutorial.

Ray's version::

    @serve.batch(max_batch_size=4)
    async def handle_batch(self, numbers: list[int]):
        input_array = np.array(numbers)
        print("Our input array has shape:", input_array.shape)
        return (input_array + 1).tolist()

Here the batch function becomes a ``Model`` named ``adder`` that a worker process
serves from Redis, and the client is redbatch's Python ``Client``.

How to run it (from the repository root)::

    redis-server --port 6379 --save '' &
    export REDIS_URL=redis://127.0.0.1:6379/0
    python -m redbatch worker examples.adder:adder --replicas 1 --device cpu --threads 1 &
    python -m examples.adder          # prints [1, 2, 3, 4, 5, 6, 7, 8, 9]

The worker's log shows how the 9 requests were batched, at most 4 at a time, e.g.::

    INFO examples.adder[1234] batch shape: (1,)
    INFO examples.adder[1234] batch shape: (4,)
    INFO examples.adder[1234] batch shape: (4,)

Through the HTTP gateway (``python -m redbatch gateway --port 8000``) the same model
answers ``POST /v1/models/adder/predict`` with body ``{"inputs": 3}``: ``{"outputs": 4}``.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from redbatch import Client, batch

log = logging.getLogger("examples.adder")

MODEL = "adder"
QUERIES = 9


# ``max_batch_size=4`` as in Ray.  The 50 ms window lets requests that arrive close
# together share a batch (``@serve.batch``'s ``batch_wait_timeout_s``).
@batch(name=MODEL, max_batch_size=4, batch_wait_timeout_s=0.05)
def adder(numbers: list[int]) -> list[int]:
    """Add one to every number of the batch in one vectorized numpy operation."""
    input_array = np.array(numbers)
    log.info("batch shape: %s", input_array.shape)
    result: list[int] = (input_array + 1).tolist()
    return result


async def query(url: str | None = None, count: int = QUERIES,
                timeout_s: float = 10.0) -> list[int]:
    """Send ``0..count-1`` as ``count`` parallel requests; return the outputs in order."""
    async with Client(url, default_timeout_s=timeout_s) as client:
        return list(await asyncio.gather(*(client.predict(MODEL, n) for n in range(count))))


def main(url: str | None = None) -> None:
    """Query the adder at ``url`` (default: ``$REDIS_URL``) and print the results."""
    print(asyncio.run(query(url)))


if __name__ == "__main__":
    main()
