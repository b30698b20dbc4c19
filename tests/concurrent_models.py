"""A model for the worker processes that tests/test_concurrent_batches.py spawns."""

from __future__ import annotations

import asyncio
import os

from redbatch import batch


@batch(name="sleepy", max_batch_size=4, batch_wait_timeout_s=0.0, max_concurrent_batches=3)
async def sleepy(xs: list[int]) -> list[int]:
    """Sleeps ``SLEEPY_S`` (default 30 s) per batch, then doubles: three batches wait at once."""
    await asyncio.sleep(float(os.environ.get("SLEEPY_S", "30")))
    return [x * 2 for x in xs]
