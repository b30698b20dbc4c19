"""The demo pipeline's CPU pre-processing stage: a word tokenizer feeding the ``textcls``
classifier (``classify_text``, ``redbatch.demo``).  Deterministic and download-free:
each lower-cased word's CRC-32 modulo the classifier's vocabulary."""

from __future__ import annotations

import itertools
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
# only a text's first characters are read: the stage runs on the worker's event loop,
# and a 16 MiB text scanned whole held every model of the worker for most of a second
MAX_TEXT_CHARS = 64 * MAX_LEN


def token_ids(text: str) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``text``'s token ids: those of its first ``MAX_LEN`` words (within its first
    ``MAX_TEXT_CHARS`` characters), at least one (int64)."""
    words = itertools.islice(WORD_RE.finditer(text[:MAX_TEXT_CHARS].lower()), MAX_LEN)
    ids = [zlib.crc32(w.group().encode()) % VOCAB for w in words] or [UNKNOWN_ID]
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
