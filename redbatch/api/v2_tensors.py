"""Reading v2 tensors: a datatype, a shape whose first dimension is the batch, and the
data, as a JSON list or bytes of the binary data extension (``docs/v2.md``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from redbatch.codec import WIRE_DTYPES
from redbatch.errors import BadRequest, ModelError

# redbatch (numpy) dtype -> v2 datatype; BYTES and BF16 are not supported.
V2_DATATYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "UINT8", "int8": "INT8", "int16": "INT16", "int32": "INT32",
    "int64": "INT64", "float16": "FP16", "float32": "FP32", "float64": "FP64",
}
DTYPES: dict[str, str] = {v2: dtype for dtype, v2 in V2_DATATYPES.items()}
MAX_ROWS = 4096  # rows (requests) in one infer call
MAX_DIMS = 32


def as_output(arr: np.ndarray[Any, Any], what: str) -> np.ndarray[Any, Any]:
    """An output in its wire dtype, contiguous; ``ModelError`` when no v2 tensor can
    hold it (``what`` names it)."""
    if arr.dtype.name not in V2_DATATYPES or arr.ndim > MAX_DIMS:
        raise ModelError(f"{what} ({arr.dtype.name}, {arr.ndim} dims) cannot be a v2 tensor")
    return np.ascontiguousarray(arr, dtype=WIRE_DTYPES[arr.dtype.name])


def mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be a JSON object")
    return value


def shape_of(raw: Any) -> tuple[int, ...]:
    ok = isinstance(raw, list) and 1 <= len(raw) <= MAX_DIMS and all(
        type(d) is int and d >= 1 for d in raw)
    if not ok:
        raise BadRequest(f"'shape' must be a list of 1 to {MAX_DIMS} positive integers, "
                         f"the first one the batch dimension; got {raw!r}")
    if raw[0] > MAX_ROWS:  # each row is a request: bound the work one call can ask for
        raise BadRequest(f"the batch dimension is {raw[0]}; one call may hold at most "
                         f"{MAX_ROWS} rows")
    return tuple(raw)


def _json_data(data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    if not isinstance(data, list):
        raise BadRequest("the input needs 'data' (a list in row-major order) or "
                         "parameters.binary_data_size")
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"'data' is not a flat or rectangular list: {exc}") from exc
    if arr.size != math.prod(shape):
        raise BadRequest(f"shape {list(shape)} holds {math.prod(shape)} elements but 'data' "
                         f"has {arr.size}")
    return arr.reshape(shape)


def _binary_data(raw: bytes, size: Any, dtype: str, shape: tuple[int, ...]
                 ) -> np.ndarray[Any, Any]:
    wire = WIRE_DTYPES[dtype]
    want = math.prod(shape) * wire.itemsize
    if type(size) is not int or size != len(raw) or size != want:
        raise BadRequest(f"binary_data_size {size!r}: the binary section has {len(raw)} bytes "
                         f"and shape {list(shape)} of {V2_DATATYPES[dtype]} needs {want}")
    if dtype == "bool":
        flags: np.ndarray[Any, Any] = np.frombuffer(raw, dtype=np.uint8) != 0
        return flags.reshape(shape)
    return np.frombuffer(raw, dtype=wire).reshape(shape)


def binary_size(tensor: dict[str, Any]) -> int:
    """The bytes of the binary section this input claims (0: its data is JSON); the
    section holds the inputs that claim bytes in the call's order."""
    size = mapping(tensor.get("parameters"), "the input's 'parameters'") \
        .get("binary_data_size", 0)
    return size if type(size) is int and size > 0 else 0


def tensor_data(tensor: dict[str, Any], binary: bytes, dtype: str, shape: tuple[int, ...]
                 ) -> np.ndarray[Any, Any]:
    params = mapping(tensor.get("parameters"), "the input's 'parameters'")
    if any(key.startswith("shared_memory") for key in params):
        raise BadRequest("shared-memory inputs are not supported")
    if "binary_data_size" in params:
        return _binary_data(binary, params["binary_data_size"], dtype, shape)
    if binary:
        raise BadRequest(f"{len(binary)} bytes of binary data follow the JSON header but no "
                         "input claims them (parameters.binary_data_size)")
    return _json_data(tensor.get("data"), dtype, shape)


def dtype_of(datatype: Any) -> str:
    """The redbatch dtype of a v2 datatype, or ``BadRequest``."""
    dtype = DTYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise BadRequest(f"datatype {datatype!r} is not supported; use one of "
                         f"{', '.join(sorted(DTYPES))}")
    return dtype


UNSUPPORTED_OUTPUT = ("classification", "shared_memory_region", "shared_memory_byte_size",
                      "shared_memory_offset")


def flag(params: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean parameter (absent: ``default``); anything else is refused."""
    value = params.get(name, default)
    if type(value) is not bool:
        raise BadRequest(f"parameter {name!r} must be true or false, got {value!r}")
    return value


def output_binary(output: dict[str, Any], default: bool) -> bool:
    """Whether a requested output goes back as binary data; the extensions this server
    does not support (classification, shared memory) are refused, naming the output."""
    params = mapping(output.get("parameters"), "an output's 'parameters'")
    if unsupported := [key for key in UNSUPPORTED_OUTPUT if key in params]:
        raise BadRequest(f"output {output.get('name')!r}: parameter {unsupported[0]!r} is "
                         "not supported (no classification or shared-memory extension)")
    return flag(params, "binary_data", default)
