"""The model that scripts/chaos serves: slow enough that kills land mid-batch, and
poisoned by one input value so that only the poisoned request fails.  Its inputs are
int64 scalars (a TensorSpec), so that the gateway's concurrent requests travel as
multi-row entries: the kills and the restart hit packs too."""

from __future__ import annotations

import time

from redbatch import TensorSpec, batch

POISON = -13


@batch(name="chaos", max_batch_size=16, batch_wait_timeout_s=0.005,
       spec=TensorSpec("int64", ()))
def chaos(xs: list[int]) -> list[int]:
    time.sleep(0.03)
    if POISON in xs:
        raise ValueError(f"poisoned input {POISON}")
    return [x * 2 for x in xs]
