"""Encode and decode envelopes: msgpack (default) or JSON, never pickle.

Arrays travel as a one-key map ``{"__tensor__": {"dtype", "shape", "data"}}``
where ``data`` is the raw little-endian, C-order bytes (msgpack bin, or base64
text in JSON).  Decoding checks dtype, shape and size, so a hostile entry can
at worst be rejected with ``InvalidPayload``.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from typing import Any, Literal

import msgpack
import numpy as np
import orjson

from redbatch.errors import InvalidPayload
from redbatch.protocol import MAX_ENTRY_BYTES, TENSOR_TAG

Format = Literal["msgpack", "json"]

DTYPES: frozenset[str] = frozenset(
    {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"}
)
MAX_DEPTH = 32
# Lists and maps one entry may hold: a container costs 1 byte on the wire and about 64
# in memory once decoded (16 MiB of empty lists would take a worker about 1 GB and
# seconds of its event loop); an array past this goes as a tensor.
MAX_CONTAINERS = 1 << 19
# looked up, not computed: ``dtype.name`` and ``np.dtype(name)`` cost microseconds each
WIRE_DTYPES: dict[str, np.dtype[Any]] = {name: np.dtype(name).newbyteorder("<")
                                         for name in DTYPES}
_NAMES: dict[np.dtype[Any], str] = {np.dtype(name): name for name in DTYPES}
LITTLE_ENDIAN = sys.byteorder == "little"


def _as_array(obj: Any) -> np.ndarray[Any, Any] | None:
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__.startswith("torch") and hasattr(obj, "detach"):
        return np.asarray(obj.detach().cpu().numpy())
    return None


def _tensor_fields(arr: np.ndarray[Any, Any]) -> tuple[str, list[int], bytes]:
    name = _NAMES.get(arr.dtype)
    if name is None:  # not a wire dtype, or a byte-swapped one
        name = arr.dtype.name
        if name not in DTYPES:
            raise InvalidPayload(f"dtype {name} cannot travel on the wire")
        return name, list(arr.shape), arr.astype(WIRE_DTYPES[name]).tobytes()
    if not LITTLE_ENDIAN:
        arr = arr.astype(WIRE_DTYPES[name])
    return name, list(arr.shape), arr.tobytes()  # tobytes is C order


def _default_msgpack(obj: Any) -> Any:
    arr = _as_array(obj)
    if arr is not None:
        dtype, shape, data = _tensor_fields(arr)
        return {TENSOR_TAG: {"dtype": dtype, "shape": shape, "data": data}}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _default_json(obj: Any) -> Any:
    arr = _as_array(obj)
    if arr is not None:
        dtype, shape, data = _tensor_fields(arr)
        text = base64.b64encode(data).decode("ascii")
        return {TENSOR_TAG: {"dtype": dtype, "shape": shape, "data": text}}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode(message: Any, fmt: Format = "msgpack") -> bytes:
    """Encode an envelope (a dict from ``Request.to_wire`` / ``Reply.to_wire``)."""
    try:
        if fmt == "json":
            return orjson.dumps(message, default=_default_json)
        packed: bytes = msgpack.packb(message, default=_default_msgpack, use_bin_type=True)
    except (TypeError, ValueError, OverflowError, orjson.JSONEncodeError) as exc:
        raise InvalidPayload(f"cannot encode message: {exc}") from exc
    return packed


def sniff_format(data: bytes) -> Format:
    """JSON envelopes start with ``{``; a msgpack map never does."""
    return "json" if data[:1] == b"{" else "msgpack"


def decode(data: bytes, budget: bool = False) -> Any:
    """Decode an envelope of either format; raise ``InvalidPayload`` if it is bad.
    ``budget``: a producer's queue entry, of at most ``MAX_CONTAINERS`` lists and maps
    (a reply, or a pipeline's record, comes from a worker: its size alone bounds it)."""
    if len(data) > MAX_ENTRY_BYTES:
        raise InvalidPayload(f"entry of {len(data)} bytes is over {MAX_ENTRY_BYTES}")
    try:
        if sniff_format(data) == "json":
            if budget:
                check_containers(data)
            return _untag(orjson.loads(data), 0)
        if not budget or len(data) <= MAX_CONTAINERS:  # (a container takes a byte)
            return msgpack.unpackb(data, raw=False, object_hook=_tensor_hook,
                                   strict_map_key=True)
        counted = _Counted()
        return msgpack.unpackb(data, raw=False, object_hook=counted.mapping,
                               list_hook=counted.array, strict_map_key=True)
    except InvalidPayload:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise InvalidPayload(f"undecodable entry: {exc}") from exc


def check_containers(text: bytes) -> None:
    """``InvalidPayload`` when JSON ``text`` may hold more than ``MAX_CONTAINERS``
    lists and maps (its brackets counted, strings' too: an upper bound), before any is
    built; a text too short to hold that many is not scanned."""
    if len(text) > 2 * MAX_CONTAINERS and \
            text.count(b"[") + text.count(b"{") > MAX_CONTAINERS:
        raise InvalidPayload(_too_many())


def _too_many() -> str:
    return (f"message holds more than {MAX_CONTAINERS} lists and maps: send a large "
            "array as a tensor (dtype, shape and raw bytes)")


class _Counted:
    """msgpack hooks that count the containers decoded, refusing past the budget."""

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def _spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise InvalidPayload(_too_many())

    def array(self, obj: list[Any]) -> list[Any]:
        self._spend()
        return obj

    def mapping(self, obj: dict[str, Any]) -> Any:
        self._spend()
        return _tensor_hook(obj)


def _tensor_hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and TENSOR_TAG in obj:
        return array_from_fields(obj[TENSOR_TAG], binary=True)
    return obj


def _untag(obj: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise InvalidPayload(f"message nests deeper than {MAX_DEPTH}")
    if isinstance(obj, dict):
        if len(obj) == 1 and TENSOR_TAG in obj:
            return array_from_fields(obj[TENSOR_TAG], binary=False)
        return {k: _untag(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_untag(v, depth + 1) for v in obj]
    return obj


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_DEPTH:
        raise InvalidPayload("tensor shape must be a list of at most 32 ints")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidPayload(f"tensor shape {shape!r} must hold non-negative ints")
    return tuple(shape)


def _tensor_data(raw: Any, binary: bool) -> bytes:
    if binary and isinstance(raw, bytes):
        return raw
    if not binary and isinstance(raw, str):
        try:
            return base64.b64decode(raw, validate=True)
        except binascii.Error as exc:
            raise InvalidPayload(f"tensor data is not valid base64: {exc}") from exc
    raise InvalidPayload("tensor data must be bin (msgpack) or base64 text (JSON)")


def array_from_fields(fields: Any, *, binary: bool) -> np.ndarray[Any, Any]:
    """Build a read-only array from ``{"dtype", "shape", "data"}``, checking each."""
    if not isinstance(fields, dict):
        raise InvalidPayload("tensor must be a map of dtype, shape, data")
    dtype = fields.get("dtype")
    if dtype not in DTYPES:
        raise InvalidPayload(f"tensor dtype {dtype!r} is not one of {sorted(DTYPES)}")
    shape = _check_shape(fields.get("shape"))
    data = _tensor_data(fields.get("data"), binary)
    np_dtype = WIRE_DTYPES[dtype]
    expected = math.prod(shape) * np_dtype.itemsize
    if expected != len(data):
        raise InvalidPayload(f"tensor data has {len(data)} bytes, shape needs {expected}")
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)
