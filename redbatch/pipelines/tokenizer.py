"""The demo pipeline's CPU pre-processing stage: a word tokenizer feeding the ``textcls``
classifier (``classify_text``, ``redbatch.demo``).  Deterministic and download-free:
each lower-cased word's CRC-32 modulo the classifier's vocabulary."""

from __future__ import annotations

import re
import zlib
from typing import Any

import numpy as np

from redbatch.bench.textcls import MAX_LEN, VOCAB
from redbatch.errors import InvalidPayload
from redbatch.spec import TensorSpec
from redbatch.worker.model import Model
from redbatch.worker.policy import BatchPolicy

WORD_RE = re.compile(r"\w+")
UNKNOWN_ID = 1  # the id of a text without a word (the classifier needs one token)


def token_ids(text: str) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``text``'s token ids: 1 to ``MAX_LEN`` of them (int64)."""
    words = WORD_RE.findall(text.lower())[:MAX_LEN]
    ids = [zlib.crc32(w.encode()) % VOCAB for w in words] or [UNKNOWN_ID]
    return np.asarray(ids, dtype=np.int64)


def tokenize(texts: list[Any]) -> list[np.ndarray[Any, np.dtype[np.int64]]]:
    """Each text's ids; a batch holding a text that is not a string raises
    ``InvalidPayload`` (the worker then isolates that one request: a 422)."""
    for text in texts:
        if not isinstance(text, str):
            raise InvalidPayload(f"text must be a string, got {type(text).__name__}")
    return [token_ids(text) for text in texts]


def tokenizer_model(name: str = "tok", policy: BatchPolicy | None = None) -> Model:
    """The tokenizer stage: body ``{"text": "some words"}``, output the ids (a CPU
    function run on the worker's event loop: it takes microseconds)."""
    return Model(name, fn=tokenize, policy=policy or BatchPolicy(max_batch_size=64),
                 input_name="text", output_name="input_ids",
                 output_spec=TensorSpec("int64", (None,)), inline=True)
