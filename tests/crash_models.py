"""Models for worker processes that crash tests spawn (``tests.crash_models:...``)."""

from __future__ import annotations

import os

from redbatch import batch

KILLER_INPUT = -1


@batch(name="killer", max_batch_size=8, batch_wait_timeout_s=0.3)
def killer(xs: list[int]) -> list[int]:
    """Multiplies by 10; the whole process dies (no exception, no reply) on -1."""
    if KILLER_INPUT in xs:
        os._exit(17)
    return [x * 10 for x in xs]
