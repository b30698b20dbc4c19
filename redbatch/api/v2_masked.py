"""v2 infer with a mask: a variable-length model whose spec names a mask field
(``TensorSpec(..., mask="attention_mask")``) takes it as a second input beside its one
input, as a tokenizer gives both for a batch it padded.  Each row is cut to the
positions its mask marks (``redbatch.spec.real_span``), so that every row is served
as if it had come unpadded; consecutive rows of one real length travel together as
one multi-row request (a *run*), and the replies come back in the call's row order."""

from __future__ import annotations

from typing import Any

import numpy as np

from redbatch.api import v2_tensors
from redbatch.api.directory import ModelInfo
from redbatch.errors import BadRequest, InvalidPayload
from redbatch.producer import packing
from redbatch.spec import real_span

Run = tuple[int, np.ndarray[Any, Any]]  # the first row of a run, and its rows
RAGGED_OUTPUTS = ("the rows, cut to their masks, have different lengths, and so do their "
                  "per-token outputs: one v2 output tensor cannot hold them; send rows of "
                  "one real length per call")


def mask_name(info: ModelInfo) -> str | None:
    """The model's mask input, if its spec names one."""
    return info.spec.mask if info.spec is not None else None


def read_mask(tensor: dict[str, Any], binary: bytes, rows: tuple[int, ...]
              ) -> np.ndarray[Any, Any]:
    """The mask input as an array of shape ``rows`` (the input's batch and length)."""
    name = tensor.get("name")
    dtype = v2_tensors.dtype_of(tensor.get("datatype"))
    if dtype not in ("bool", "int8", "int16", "int32", "int64", "uint8"):
        raise BadRequest(f"input {name!r} is a mask: its datatype is BOOL or an integer "
                         f"type, got {tensor.get('datatype')}")
    shape = v2_tensors.shape_of(tensor.get("shape"))
    if shape != rows:
        raise BadRequest(f"input {name!r} has shape {list(shape)}; as the mask of the "
                         f"input it must have the input's batch and length {list(rows)}")
    return v2_tensors.tensor_data(tensor, binary, dtype, shape)


def runs(arr: np.ndarray[Any, Any], mask: np.ndarray[Any, Any], info: ModelInfo) -> list[Run]:
    """Each row of ``arr`` (``[batch, length, ...]``) cut to its real positions;
    consecutive rows of one real length stacked into one run.  Rows of several real
    lengths for a model that publishes per-token outputs are refused here, before any
    compute (a model that does not publish its output spec is refused once its outputs
    do not stack: ``v2.infer_response``)."""
    assert info.spec is not None
    out: list[tuple[int, list[np.ndarray[Any, Any]]]] = []
    for row in range(len(arr)):
        try:
            start, stop = real_span(mask[row], arr.shape[1], f"input {info.spec.mask!r}")
            info.spec.check_length(stop - start, f"input {info.input_name!r}")
            cut = arr[row, start:stop]
            info.spec.check_values(cut, f"input {info.input_name!r}")
        except InvalidPayload as exc:
            raise BadRequest(f"row {row}: {exc}") from exc
        if out and len(out[-1][1][0]) == len(cut):
            out[-1][1].append(cut)
        else:
            out.append((row, [cut]))
    if len(out) > 1 and info.per_token:
        raise BadRequest(RAGGED_OUTPUTS)
    return [(first, np.stack(rows)) for first, rows in out]


def slices(cut: list[Run], pack_rows: int) -> tuple[list[int], list[np.ndarray[Any, Any]]]:
    """The runs as multi-row requests of up to a pack's rows: each one's first row
    (in the call's rows), and its rows."""
    starts: list[int] = []
    parts: list[np.ndarray[Any, Any]] = []
    for first, rows in cut:
        run_starts, run_parts = packing.slices(rows, pack_rows)
        starts += [first + s for s in run_starts]
        parts += run_parts
    return starts, parts
