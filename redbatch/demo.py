"""The demo models that ``redbatch up`` serves (``redbatch.demo:models``).

* ``mlp``: the W2 benchmark model, a torch MLP 64 -> 1024 -> 1024 -> 16 (seed 0);
  body ``{"x": [64 floats]}``, reply ``{"y": [16 floats]}``.
* ``echo``: the W1 no-op; body ``{"x": [floats]}``, reply ``{"y": x}``.
* ``echo_tokens``: variable-length token ids (int64, 1 to 512 of them); body
  ``{"x": [ids]}``, reply ``{"y": ids}``.  The worker batches them by length bucket,
  hands ``(padded, lengths)`` to the model and trims each output back to its length.
* ``textcls``: the W3 benchmark model, a one-layer transformer text classifier (seed 0)
  over 1 to 512 token ids, each in 0..8191 (its vocabulary); body ``{"input_ids":
  [ids]}``, with ``"attention_mask"`` beside it when the caller padded the ids itself
  (the gateway cuts them to the positions the mask marks: ``TensorSpec(mask=...)``),
  reply ``{"logits": [4 floats]}``.
  Batched by length bucket, each pass padded to its longest item (``pad_to_longest``);
  a pass longer than 256 tokens runs its rows one at a time, each at its own length.
* ``adder``: adds one to each integer; body ``{"inputs": 3}``, reply ``{"outputs": 4}``.
* ``generate``: the streaming demo (``redbatch.generate``), a seeded character-level
  GRU; body ``{"prompt": "hello", "max_tokens": 16}``, one chunk per character (SSE
  with ``Accept: text/event-stream``, else newline-delimited JSON).
* ``pair``: two named inputs and two named outputs: ``x`` (float32, 4) and ``scale``
  (float32 scalar) give ``y = x * scale`` and ``norm = |y|``; body
  ``{"inputs": {"x": [1, 2, 3, 4], "scale": 2}}``, reply
  ``{"outputs": {"y": [2, 4, 6, 8], "norm": 10.95...}}``.
* ``tok``: a word tokenizer (CPU pre-processing); body ``{"text": "some words"}``, reply
  ``{"input_ids": [ids]}``.
* ``classify_text``: a pipeline of ``tok`` then ``textcls``; body
  ``{"text": "some words"}``, reply ``{"logits": [4 floats]}``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from redbatch.bench.mlp import W2_IN, build_mlp
from redbatch.bench.textcls import MAX_LEN, VOCAB, build_served
from redbatch.generate import generate_model
from redbatch.pipelines import Pipeline
from redbatch.pipelines.tokenizer import tokenizer_model
from redbatch.spec import TensorSpec
from redbatch.worker.model import Model, batch
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.torch_helpers import torch_model


def echo_fn(items: list[Any]) -> list[Any]:
    return items


TOKENS = TensorSpec("int64", (None,), max_len=512)


def echo_padded(batch: tuple[Any, Any]) -> Any:
    """The padded batch as it came: the worker trims each row to its length."""
    padded, _lengths = batch
    return padded


def echo_tokens(policy: BatchPolicy) -> Model:
    """The no-op over variable-length token ids (per-token output: trimmed)."""
    return Model("echo_tokens", fn=echo_padded, policy=policy, spec=TOKENS,
                 output_spec=TensorSpec("int64", (None,)), input_name="x", output_name="y",
                 stack=True, inline=True)


@batch(max_batch_size=32, batch_wait_timeout_s=0.0, spec=TensorSpec("int64", ()))
def adder(numbers: list[Any]) -> list[int]:
    """Each int64 plus one (its spec refuses a float or an int out of range, which would
    otherwise change its batch-mates' answers: one array of the batch)."""
    result: list[int] = (np.asarray(numbers, dtype=np.int64) + 1).tolist()
    return result


@batch(max_batch_size=32, batch_wait_timeout_s=0.0, stack=True,
       inputs={"x": TensorSpec("float32", (4,)), "scale": TensorSpec("float32", ())},
       outputs={"y": TensorSpec("float32", (4,)), "norm": TensorSpec("float32", ())})
def pair(batch: dict[str, Any]) -> dict[str, Any]:
    """Named inputs and outputs: ``y = x * scale``, ``norm = |y|`` (stacked)."""
    y = batch["x"] * batch["scale"][:, None]
    return {"y": y, "norm": np.linalg.norm(y, axis=1)}


def models() -> list[Model | Pipeline]:
    policy = BatchPolicy(max_batch_size=32, batch_wait_timeout_s=0.005)
    mlp = torch_model("mlp", build_mlp, TensorSpec("float32", (W2_IN,)), policy,
                      input_name="x", output_name="y")
    echo = Model("echo", fn=echo_fn, policy=policy, spec=TensorSpec("float32", (None,)),
                 input_name="x", output_name="y", inline=True)
    ids = TensorSpec("int64", (None,), max_len=MAX_LEN, mask="attention_mask",
                     min_value=0, max_value=VOCAB - 1)  # an id outside the vocabulary: 422
    textcls = torch_model("textcls", build_served, ids,
                          replace(policy, pad_to_longest=True), input_name="input_ids",
                          output_name="logits")
    return [mlp, echo, echo_tokens(policy), textcls, adder, pair, generate_model(),
            tokenizer_model(), Pipeline("classify_text", ["tok", "textcls"])]
