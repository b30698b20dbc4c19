"""A worker process for the pipeline crash test: serves ``inc`` (the first stage of
``calc``) and dies, with no cleanup, in its hand-off of ``DIE_ON`` (after taking the
records under a lease, before handing any of them on)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from redbatch import RedisSettings
from redbatch.config import WorkerConfig
from redbatch.pipelines import Pipeline
from redbatch.pipelines.mover import Mover
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.process import Worker

DIE_ON = 1001  # inc's output for the input 1000
CALC = Pipeline("calc", ["inc", "dbl"])


def inc_fn(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


def main(url: str) -> None:
    real_plan = Mover._plan

    async def dying_plan(self: Mover, reply: Any, ctx: Any) -> Any:
        if reply.payload == DIE_ON:
            os._exit(17)
        return await real_plan(self, reply, ctx)

    Mover._plan = dying_plan  # type: ignore[method-assign]
    model = Model("inc", fn=inc_fn, policy=BatchPolicy(max_batch_size=16,
                                                        batch_wait_timeout_s=0.01))
    config = WorkerConfig(block_timeout_s=0.2, heartbeat_interval_s=0.2, lease_ttl_s=1.0)
    asyncio.run(Worker([model], RedisSettings(url), config, pipelines=[CALC]).run(
        asyncio.Event()))


if __name__ == "__main__":
    main(sys.argv[1])
