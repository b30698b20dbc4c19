"""The demo models that ``redbatch up`` serves (``redbatch.demo:models``).

* ``mlp``: the W2 benchmark model, a torch MLP 64 -> 1024 -> 1024 -> 16 (seed 0);
  body ``{"x": [64 floats]}``, reply ``{"y": [16 floats]}``.
* ``echo``: the W1 no-op; body ``{"x": [floats]}``, reply ``{"y": x}``.
* ``adder``: adds one to each integer; body ``{"inputs": 3}``, reply ``{"outputs": 4}``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from redbatch.bench.mlp import W2_IN, build_mlp
from redbatch.spec import TensorSpec
from redbatch.worker.model import Model, batch
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.torch_helpers import torch_model


def echo_fn(items: list[Any]) -> list[Any]:
    return items


@batch(max_batch_size=32, batch_wait_timeout_s=0.0)
def adder(numbers: list[int]) -> list[int]:
    result: list[int] = (np.asarray(numbers) + 1).tolist()
    return result


def models() -> list[Model]:
    policy = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.005)
    mlp = torch_model("mlp", build_mlp, TensorSpec("float32", (W2_IN,)), policy,
                      input_name="x", output_name="y")
    echo = Model("echo", fn=echo_fn, policy=policy, spec=TensorSpec("float32", (None,)),
                 input_name="x", output_name="y", inline=True)
    return [mlp, echo, adder]
