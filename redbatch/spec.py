"""What a model looks like from outside: its input spec and the metadata its workers
publish to ``meta_key(model)`` (written by the worker's heartbeat, read by gateways and
clients).  Imports neither torch nor a web framework: producers and gateways use it."""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from redbatch.codec import DTYPES
from redbatch.errors import ConfigError, InvalidPayload

_NATIVE: dict[str, np.dtype[Any]] = {name: np.dtype(name) for name in DTYPES}


def power_buckets(max_len: int) -> tuple[int, ...]:
    """The default bucket boundaries: powers of two below ``max_len``, then ``max_len``."""
    bounds = [1 << i for i in range(max_len.bit_length()) if 1 << i < max_len]
    return (*bounds, max_len)


@dataclass(frozen=True)
class TensorSpec:
    """One request's input: a dtype and a shape, ``None`` for a free dimension.

    With ``max_len``, the first dimension (``None``) is a variable length (token ids):
    inputs longer than ``max_len`` are refused, and the worker batches them by length
    bucket (``buckets``: sorted boundaries, default powers of two up to ``max_len``),
    padded with ``pad_value`` (see docs/models.md, "Variable lengths").  ``mask``: the
    name of a request field (``"attention_mask"``) that a caller who padded the input
    itself may send beside it, 1 at each real position and 0 at each padded one; the
    gateway cuts the input to its real positions (``check_masked``) before enqueueing,
    so the model sees the request as if it had come unpadded.  ``min_value`` and
    ``max_value``: the values the model takes (inclusive; token ids below a vocabulary
    size), so that a value out of range is refused as invalid input, naming the field,
    before it is enqueued or computed (a padded position is not checked)."""

    dtype: str = "float32"
    shape: tuple[int | None, ...] = ()
    max_len: int | None = None
    pad_value: float = 0
    buckets: tuple[int, ...] | None = None
    mask: str | None = None
    min_value: float | None = None
    max_value: float | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"TensorSpec dtype {self.dtype!r} not in {sorted(DTYPES)}")
        object.__setattr__(self, "shape", _checked_shape(self.shape))
        if self.min_value is not None or self.max_value is not None:
            self._check_bounds_given()
        if self.max_len is not None or self.buckets is not None:
            self._check_variable()
        if self.mask is not None:
            self._check_mask_name()

    def _check_bounds_given(self) -> None:
        for name in ("min_value", "max_value"):
            bound = getattr(self, name)
            if bound is not None and not _finite_number(bound):
                raise ConfigError(f"TensorSpec {name} must be a finite number, got {bound!r}")
        low, high = self.min_value, self.max_value
        if low is not None and high is not None and low > high:
            raise ConfigError(f"TensorSpec min_value {low} is above max_value {high}")

    def _check_mask_name(self) -> None:
        if self.max_len is None:
            raise ConfigError("a TensorSpec mask goes with a variable length (max_len)")
        if not isinstance(self.mask, str) or not FIELD_NAME_RE.fullmatch(self.mask):
            raise ConfigError(f"TensorSpec mask {self.mask!r} must match "
                              f"{FIELD_NAME_RE.pattern}")

    def _check_variable(self) -> None:
        if self.max_len is None or self.max_len < 1:
            raise ConfigError("a variable-length TensorSpec needs max_len >= 1")
        if not self.shape or self.shape[0] is not None or None in self.shape[1:]:
            raise ConfigError(f"a TensorSpec with max_len has None as its first dimension "
                              f"and fixed ones after it, got {self.shape}")
        bounds = self.buckets or ()
        if list(bounds) != sorted(set(bounds)) or (bounds and bounds[0] < 1):
            raise ConfigError(f"TensorSpec buckets must be increasing positive lengths, "
                              f"got {bounds}")

    @property
    def variable(self) -> bool:
        """Whether the first dimension is a bounded variable length (``max_len``)."""
        return self.max_len is not None

    @functools.cached_property
    def boundaries(self) -> tuple[int, ...]:
        """The bucket lengths, ascending, the last one ``max_len``."""
        assert self.max_len is not None
        if self.buckets is None:
            return power_buckets(self.max_len)
        return (*(b for b in self.buckets if b < self.max_len), self.max_len)

    def bucket_of(self, length: int) -> int:
        """The smallest boundary at least ``length`` (``length`` <= ``max_len``)."""
        bounds = self.boundaries
        return bounds[bisect.bisect_left(bounds, length)]

    def check_length(self, length: int, name: str = "input") -> None:
        """Refuse a variable length of 0 or over ``max_len``, naming the field."""
        if self.max_len is not None and not 1 <= length <= self.max_len:
            raise InvalidPayload(f"{name} has length {length}; this model takes lengths "
                                 f"1..{self.max_len} (max_len)")

    def check(self, value: Any, name: str = "input") -> np.ndarray[Any, Any]:
        """Convert ``value`` (nested lists or an array) to this spec, or raise."""
        arr = _array(value, "input")
        self._check_kind(arr)
        self._check_shape(arr.shape)
        if self.max_len is not None:
            self.check_length(arr.shape[0], name)
        return self._cast(arr, name)

    def check_masked(self, value: Any, mask: Any, name: str = "input") -> np.ndarray[Any, Any]:
        """``check`` of an input the caller padded itself: cut first to the positions
        its ``mask`` marks (``real_span``), so that only the real length counts
        against ``max_len``."""
        arr = _array(value, "input")
        self._check_kind(arr)
        self._check_shape(arr.shape)
        start, stop = real_span(mask, arr.shape[0], self.mask or "mask")
        arr = arr[start:stop]
        self.check_length(arr.shape[0], name)
        return self._cast(arr, name)

    def _cast(self, arr: np.ndarray[Any, Any], name: str) -> np.ndarray[Any, Any]:
        if arr.dtype == self._np_dtype:
            cast = arr
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                cast = arr.astype(self._np_dtype)
        self._check_range(arr, cast)
        self.check_values(cast, name)
        return cast

    def check_values(self, arr: np.ndarray[Any, Any], name: str = "input") -> None:
        """Refuse a value below ``min_value`` or above ``max_value``, naming the field
        and the first such value (nothing to do for a spec without them)."""
        low, high = self.min_value, self.max_value
        if (low is None and high is None) or not arr.size:
            return
        if arr.dtype.kind == "f":  # compared in float64: a bound past float32 is no overflow
            low, high = (None if b is None else np.float64(b) for b in (low, high))
        out = (arr < low if low is not None else False) | (
            arr > high if high is not None else False)
        if np.any(out):
            bad = arr[out].flat[0].item()
            raise InvalidPayload(f"{name} holds {_bound(bad)}, outside the values this model takes "
                                 f"({_bound(self.min_value)}..{_bound(self.max_value)}: min_value, "
                                 "max_value)")

    def check_rows(self, value: np.ndarray[Any, Any], name: str = "input"
                   ) -> np.ndarray[Any, Any]:
        """Check a multi-row payload (first dimension: the rows) in one go."""
        rows = self._rows_spec.check(value)
        if self.max_len is not None:
            self.check_length(rows.shape[1], name)
        self.check_values(rows, name)
        return rows

    @functools.cached_property
    def _rows_spec(self) -> TensorSpec:
        return TensorSpec(self.dtype, (None, *self.shape))

    @property
    def _np_dtype(self) -> np.dtype[Any]:
        return _NATIVE[self.dtype]

    def _check_kind(self, arr: np.ndarray[Any, Any]) -> None:
        if arr.dtype.kind not in "biuf":
            raise InvalidPayload(f"input must be numbers, got {arr.dtype.kind!r} data")
        if self._np_dtype.kind in "iub" and arr.dtype.kind == "f" and arr.size:
            raise InvalidPayload(f"input must be integers for dtype {self.dtype}")
        # (an empty list reads as floats: its shape or length check names what is wrong)

    def _check_range(self, arr: np.ndarray[Any, Any], cast: np.ndarray[Any, Any]) -> None:
        kind = cast.dtype.kind
        if kind == "f" and not np.isfinite(cast).all():
            raise InvalidPayload(f"input holds NaN, infinity or a number too large for "
                                 f"{self.dtype}")
        if kind in "iu" and arr.size and arr.dtype != cast.dtype:
            info = np.iinfo(cast.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise InvalidPayload(f"input holds an integer out of range for {self.dtype}")
        if kind == "b" and arr.dtype.kind in "iu" and arr.size and \
                not ((arr == 0) | (arr == 1)).all():  # (-1 or 70000 cast to true)
            raise InvalidPayload("input must be true or false (or 0 and 1) for dtype bool")

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        ok = len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True))
        if not ok:
            dims = ["*" if d is None else str(d) for d in self.shape]
            want_text = f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(dims) + ")"
            raise InvalidPayload(f"input shape {tuple(shape)} does not match {want_text}")

    @property
    def dims(self) -> list[int]:
        """The shape as published: ``-1`` for a free dimension."""
        return [-1 if d is None else d for d in self.shape]

    def to_json(self) -> dict[str, Any]:
        """The published form; a fixed-shape spec's has only ``dtype`` and ``shape``."""
        data: dict[str, Any] = {"dtype": self.dtype, "shape": self.dims}
        if self.max_len is not None:
            data.update(max_len=self.max_len, pad_value=self.pad_value,
                        buckets=list(self.boundaries))
        if self.mask is not None:
            data["mask"] = self.mask
        data.update({k: v for k in ("min_value", "max_value")
                     if (v := getattr(self, k)) is not None})
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorSpec:
        shape = tuple(None if d == -1 else int(d) for d in data["shape"])
        max_len, buckets = data.get("max_len"), data.get("buckets")
        mask = data.get("mask")
        return cls(dtype=str(data["dtype"]), shape=shape,
                   max_len=None if max_len is None else int(max_len),
                   pad_value=data.get("pad_value", 0),
                   buckets=None if buckets is None else tuple(int(b) for b in buckets),
                   mask=None if mask is None else str(mask),
                   min_value=data.get("min_value"), max_value=data.get("max_value"))


def _finite_number(value: Any) -> bool:
    """A number (not a bool) within float64's finite range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past float64
        return False


def _bound(value: float | None) -> str:
    """A bound or value as a message shows it: an int whole, a float short."""
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:g}"


def row_count(value: Any) -> int | None:
    """How many rows ``value`` holds as one input's rows: a list's length, or an
    array's first dimension (None for anything else)."""
    if isinstance(value, list) or (isinstance(value, np.ndarray) and value.ndim):
        return len(value)
    return None


def _checked_shape(shape: Any) -> tuple[int | None, ...]:
    """A spec's shape as a tuple of dimensions, each an int >= 0 or None (free);
    ``ConfigError`` otherwise (an int alone, -1 for a free one)."""
    if not isinstance(shape, (tuple, list)) or not all(
            dim is None or (type(dim) is int and dim >= 0) for dim in shape):
        raise ConfigError(f"TensorSpec shape must be a tuple of ints >= 0 or None (a free "
                          f"dimension), such as (4,) or (None,), got {shape!r}")
    return tuple(shape)


def _array(value: Any, what: str) -> np.ndarray[Any, Any]:
    try:
        return value if type(value) is np.ndarray else np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InvalidPayload(f"{what} is not a rectangular array: {exc}") from exc


def real_span(mask: Any, length: int, name: str = "mask") -> tuple[int, int]:
    """``(start, stop)``: the real positions of an input of ``length`` that its caller
    padded itself, as its ``mask`` marks them (1 real, 0 padding; as a tokenizer's
    ``attention_mask``).  The mask must be ``length`` long, of 0s and 1s, and mark one
    run of real positions, padded on the left, the right or both: a mask with a hole
    (1 0 1) or no 1 at all is refused (``InvalidPayload``, naming the field)."""
    if type(mask) is list and (span := _list_span(mask, length)) is not None:
        return span
    arr = _array(mask, name)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise InvalidPayload(f"{name} has shape {tuple(arr.shape)}; it must be one 0 or 1 "
                             f"per position of the input ({length},)")
    if arr.size and (arr.dtype.kind not in "biu" or not np.isin(arr, (0, 1)).all()):
        raise InvalidPayload(f"{name} must hold only the integers 0 (padding) and 1 (a "
                             "real position)")
    real = np.flatnonzero(arr)
    if not real.size:
        raise InvalidPayload(f"{name} marks no real position (it holds no 1)")
    start, stop = int(real[0]), int(real[-1]) + 1
    if stop - start != real.size:
        raise InvalidPayload(f"{name} has padding between real positions: it must be one "
                             "run of 1s, with padding (0s) only before or after it")
    return start, stop


def _list_span(mask: list[Any], length: int) -> tuple[int, int] | None:
    """``real_span`` of a JSON list of ints, without an array (a gateway's usual case:
    a few µs where numpy takes about 15 for 100 positions); None where anything is
    off, for the array path to name it."""
    if len(mask) != length or not all(type(v) is int for v in mask):
        return None
    ones = mask.count(1)
    if ones == length:
        return 0, length
    if not ones or ones + mask.count(0) != length:
        return None
    start = mask.index(1)
    if mask[start:start + ones].count(1) != ones:
        return None
    return start, start + ones


def unpad(value: Any, mask: Any) -> np.ndarray[Any, Any]:
    """An input its caller padded, cut to the positions ``mask`` marks (1 real, 0
    padding), as the gateway does for a spec with ``mask``: send the result to a
    variable-length model with ``Client.predict``.  ``InvalidPayload`` for a mask that
    is not one run of 1s as long as the input."""
    arr = _array(value, "input")
    if arr.ndim < 1:
        raise InvalidPayload("input must have a length (its first dimension) to unpad")
    start, stop = real_span(mask, arr.shape[0])
    return arr[start:stop]


FIELD_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}")


def _field_names(names: Any, what: str) -> None:
    if not names:
        raise ConfigError(f"a model with named inputs and outputs needs at least one {what}")
    bad = [n for n in names if not isinstance(n, str) or not FIELD_NAME_RE.fullmatch(n)]
    if bad:
        raise ConfigError(f"{what} name {bad[0]!r} must match {FIELD_NAME_RE.pattern}")


def field_message(name: str, exc: Exception) -> str:
    """``exc``'s message, naming input ``name`` ("input shape ..." -> "input 'x'
    shape ...")."""
    field, message = f"input {name!r}", str(exc)
    if message.startswith(field):
        return message
    if message.startswith("input "):
        return f"{field} {message.removeprefix('input ')}"
    return f"{field}: {message}"


def _checked_field(spec: TensorSpec | None, value: Any, name: str) -> Any:
    """``spec.check`` of one named input, its error naming the input; an input without
    a spec (``None``) takes any value, as given."""
    if spec is None:
        return value
    try:
        return spec.check(value, f"input {name!r}")
    except InvalidPayload as exc:
        raise InvalidPayload(field_message(name, exc)) from exc


@dataclass(frozen=True, eq=False)
class Signature:
    """A model's named inputs and outputs (``@batch(inputs=..., outputs=...)``, as in
    Triton's model config): a request's payload is a map input name -> value, its
    reply's a map output name -> value.  Variable-length inputs (``max_len``) of one
    request share one length: it is the request's length bucket (by the boundaries of
    the first of them).  An output spec with ``None`` as its first dimension is
    per-token (trimmed back to each request's length); other output specs, and
    ``None``, say nothing the worker checks.  An input whose spec is ``None`` takes any
    value (a JSON field, such as an image's metadata), unchecked and never stacked:
    with ``stack=True`` the function gets the list of them."""

    inputs: dict[str, TensorSpec | None]
    outputs: dict[str, TensorSpec | None]

    def __post_init__(self) -> None:
        _field_names(list(self.inputs), "input")
        if self.outputs:  # (a gateway's, of a pipeline ending in one output: none named)
            _field_names(list(self.outputs), "output")
        wrong = [n for n, s in self.inputs.items() if not isinstance(s, TensorSpec | None)]
        if wrong:
            raise ConfigError(f"input {wrong[0]!r}: a TensorSpec, or None for any value")
        wrong = [n for n, s in self.outputs.items() if not isinstance(s, TensorSpec | None)]
        if wrong:
            raise ConfigError(f"output {wrong[0]!r}: a TensorSpec or None")

    @classmethod
    def of(cls, inputs: dict[str, TensorSpec | None],
           outputs: dict[str, TensorSpec | None] | Sequence[str]) -> Signature:
        """From ``@batch``'s arguments: ``outputs`` as names, or names -> specs."""
        if isinstance(outputs, str):
            raise ConfigError("outputs must be a sequence of names or a dict, not a string")
        named = dict(outputs) if isinstance(outputs, dict) else dict.fromkeys(outputs)
        _field_names(list(named), "output")
        return cls(dict(inputs), named)

    @functools.cached_property
    def variable(self) -> tuple[str, ...]:
        """The names of the variable-length inputs, in declaration order."""
        return tuple(name for name, spec in self.inputs.items()
                     if spec is not None and spec.variable)

    @property
    def length_spec(self) -> TensorSpec | None:
        """The spec whose buckets group requests (the first variable input's)."""
        return self.inputs[self.variable[0]] if self.variable else None

    @functools.cached_property
    def loose(self) -> tuple[str, ...]:
        """The inputs without a spec (any value), in declaration order."""
        return tuple(name for name, spec in self.inputs.items() if spec is None)

    @functools.cached_property
    def per_token(self) -> tuple[str, ...]:
        """The outputs trimmed to each request's length (first dimension ``None``)."""
        return tuple(name for name, spec in self.outputs.items() if per_token(spec))

    def length(self, value: dict[str, Any]) -> int:
        """A checked request's shared variable length."""
        return len(value[self.variable[0]])

    def check(self, payload: Any) -> dict[str, np.ndarray[Any, Any]]:
        """A request's payload as checked arrays, or ``InvalidPayload`` naming the field
        that is missing, unknown or bad."""
        self._check_names(payload)
        values = {name: _checked_field(spec, payload[name], name)
                  for name, spec in self.inputs.items()}
        self.check_lengths({name: len(values[name]) for name in self.variable})
        return values

    def _check_names(self, payload: Any) -> None:
        """``payload`` is a map with every input and no other key."""
        if not isinstance(payload, dict):
            raise InvalidPayload(f"the input must be a map of the named inputs "
                                 f"{list(self.inputs)}, got {type(payload).__name__}")
        unknown = [key for key in payload if key not in self.inputs]
        if unknown:
            raise InvalidPayload(f"unknown input {unknown[0]!r}; this model takes "
                                 f"{list(self.inputs)}")
        missing = [name for name in self.inputs if name not in payload]
        if missing:
            raise InvalidPayload(f"missing input {missing[0]!r}; this model takes "
                                 f"{list(self.inputs)}")

    def split_rows(self, payload: Any, rows: int) -> list[Any]:
        """A multi-row payload (a map input name -> ``rows`` rows, or a list of ``rows``
        maps, as a pipeline's previous stage answers rows) as one map per row,
        unchecked; ``InvalidPayload`` naming the input that is not ``rows`` long."""
        if isinstance(payload, list):
            if len(payload) != rows:
                raise InvalidPayload(f"a request of {rows} rows given as a list of maps "
                                     f"needs {rows} of them, got {len(payload)}")
            return payload
        self._check_names(payload)
        for name in self.inputs:
            if (length := row_count(payload[name])) != rows:
                raise InvalidPayload(f"input {name!r} of a request of {rows} rows needs "
                                     f"{rows} rows (a tensor or a list whose first "
                                     f"dimension is {rows}), got {length}")
        return [{name: payload[name][row] for name in self.inputs} for row in range(rows)]

    def check_lengths(self, lengths: dict[str, int]) -> None:
        """Variable-length inputs of one request share one length."""
        if not lengths:
            return
        first, want = next(iter(lengths.items()))
        for name, got in lengths.items():
            if got != want:
                raise InvalidPayload(f"input {name!r} has length {got} but {first!r} has "
                                     f"{want}: the variable-length inputs of one request "
                                     "share one length")

    def to_json(self) -> dict[str, Any]:
        return {"inputs": {name: spec.to_json() if spec else None
                           for name, spec in self.inputs.items()},
                "outputs": {name: spec.to_json() if spec else None
                            for name, spec in self.outputs.items()}}


def _specs(data: dict[str, Any]) -> dict[str, TensorSpec | None]:
    """Named specs as ``Signature.to_json`` writes them (``None``: any value)."""
    return {name: TensorSpec.from_json(spec) if spec else None for name, spec in data.items()}


def per_token(output_spec: TensorSpec | None) -> bool:
    """Whether outputs are per-token (first dimension ``None``): one row per real
    position of the input, trimmed back to each request's length after a padded pass."""
    return output_spec is not None and bool(output_spec.shape) and output_spec.shape[0] is None


def model_meta(name: str, *, input_name: str, output_name: str, spec: TensorSpec | None,
               policy: dict[str, Any], limits: dict[str, Any],
               defaults: dict[str, Any] | None = None,
               signature: Signature | None = None) -> dict[str, Any]:
    """The metadata a worker publishes for a model (``ModelInfo.from_meta`` reads it):
    ``policy`` and ``limits`` are the values in effect (live overrides included),
    ``defaults`` the model's own values of the live knobs (``redbatch.knobs``); a
    model with named inputs and outputs adds ``inputs`` and ``outputs``."""
    meta = {
        "name": name,
        "input_name": input_name,
        "output_name": output_name,
        "spec": spec.to_json() if spec else None,
        "policy": policy,
        "limits": limits,
        "defaults": defaults,
    }
    if signature is not None:
        meta.update(signature.to_json())
    return meta


@dataclass(frozen=True)
class ModelInfo:
    """A model's published metadata, as gateways use it."""

    name: str
    input_name: str
    output_name: str
    spec: TensorSpec | None
    meta: dict[str, Any]
    max_queue_len: int | None = None  # the model's own limits (None: the gateway's)
    default_timeout_s: float | None = None
    # Named inputs (a request is a map input name -> value), and the named outputs
    # (none: a pipeline that ends in one output; ``output_specs`` holds what replies do).
    signature: Signature | None = None
    output_spec: TensorSpec | None = None  # what one output looks like, if published
    # Named outputs (a reply is a map output name -> value): a model's with named
    # inputs, or a pipeline's whose last stage has them (whatever its first stage takes).
    named_outputs: dict[str, TensorSpec | None] | None = None

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ModelInfo:
        spec = TensorSpec.from_json(meta["spec"]) if meta.get("spec") else None
        limits = meta.get("limits") or {}
        cap, timeout = limits.get("max_queue_len"), limits.get("default_timeout_s")
        output_name = meta.get("output_name", "outputs")
        output_spec = TensorSpec.from_json(out) if (out := meta.get("output_spec")) else None
        named = _specs(meta["outputs"]) if meta.get("outputs") else None
        return cls(name=meta["name"], input_name=meta.get("input_name", "inputs"),
                   output_name=output_name, spec=spec, meta=meta,
                   max_queue_len=int(cap) if cap else None,
                   default_timeout_s=float(timeout) if timeout else None,
                   signature=Signature(_specs(meta["inputs"]), named or {})
                   if meta.get("inputs") else None,
                   output_spec=output_spec, named_outputs=named)

    @property
    def output_specs(self) -> dict[str, TensorSpec | None]:
        """The outputs a reply holds, by name: the named ones, or the one output."""
        return self.named_outputs or {self.output_name: self.output_spec}

    @property
    def per_token(self) -> bool:
        """Whether a published output spec is per-token (the one output's, or a named
        output's): outputs of several lengths, which cannot share one tensor."""
        return any(per_token(spec) for spec in self.output_specs.values())
