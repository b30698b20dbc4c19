"""Variable lengths: group a batch's items by length bucket, pad a bucket's pass to its
length, and trim per-token outputs back to each item's own length.

A variable-length spec (``TensorSpec(max_len=...)``) has ``None`` as its first
dimension.  Items are grouped by the smallest bucket boundary at least their length;
each group runs in passes of at most ``max_batch_size``, never split because shapes
differ.  A model the worker stacks for (``stack=True``, ``torch_model``) gets
``(padded, lengths)``: the items padded with ``pad_value`` to the bucket's length (with
the policy's ``pad_to_longest``: to the pass's longest item, the bucket's items sorted
by length first), and their true lengths (int64)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from redbatch.spec import TensorSpec


def bucket_groups(inputs: list[Any], spec: TensorSpec,
                  length: Callable[[Any], int] = len, by_length: bool = False
                  ) -> dict[int, list[int]]:
    """Bucket length -> the indices of the inputs in it, the bucket of the first input
    first, and so on (the inputs come earliest deadline first, so the bucket holding
    the most urgent request runs first; ``length``: an input's length; a map of named
    inputs has its shared one).  With
    ``by_length``, each bucket's indices in order of their inputs' lengths (ties in
    claim order), so that passes cut from a bucket each pad to as short a longest item
    as they can."""
    groups: dict[int, list[int]] = {}
    lengths = [length(value) for value in inputs]
    for i, n in enumerate(lengths):
        groups.setdefault(spec.bucket_of(n), []).append(i)
    if by_length:
        for indices in groups.values():
            indices.sort(key=lengths.__getitem__)
    return groups  # (in order of each bucket's first input)


def free_dims(model: Any) -> bool:
    """Whether a model's input spec (or any named input's) has a free dimension
    (``None``) without ``max_len``: its inputs may differ in shape and not be padded."""
    specs = list(model.signature.inputs.values()) if model.signature else [model.spec]
    return any(spec is not None and None in spec.shape and not spec.variable
               for spec in specs)


def shape_groups(inputs: list[Any], names: tuple[str, ...] = ()) -> dict[Any, list[int]]:
    """Shape -> the indices of the inputs of that shape, in claim order, so that each
    group stacks: a checked array's shape, or for a map of named inputs the tuple of
    the shapes of those in ``names`` (the inputs with a spec: checked arrays; one
    without a spec takes any value and is never stacked)."""
    groups: dict[Any, list[int]] = {}
    for i, value in enumerate(inputs):
        key = tuple(value[n].shape for n in names) if isinstance(value, dict) \
            else value.shape
        groups.setdefault(key, []).append(i)
    return groups


def pad_batch(items: list[Any], length: int, pad_value: float
              ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``items`` (arrays whose first dimension is at most ``length``) as one array
    ``[n, length, ...]`` padded with ``pad_value``, and their lengths."""
    first = np.asarray(items[0])
    padded = np.full((len(items), length, *first.shape[1:]), pad_value, dtype=first.dtype)
    lengths = np.fromiter((len(item) for item in items), dtype=np.int64, count=len(items))
    for row, item in enumerate(items):
        padded[row, :len(item)] = item
    return padded, lengths


def _sized(row: Any) -> bool:
    """An array of at least one dimension, or a list or tuple."""
    return len(getattr(row, "shape", ())) > 0 if hasattr(row, "shape") \
        else isinstance(row, (list, tuple))


def trim_rows(rows: list[Any], lengths: np.ndarray[Any, Any], length: int) -> list[Any] | None:
    """Each output cut to its item's length; None if one is not ``length`` long (the
    model broke the per-token contract).  An output may be an array or a list."""
    if any(not _sized(row) or len(row) != length for row in rows):
        return None
    return [row[:n] for row, n in zip(rows, lengths.tolist(), strict=True)]
