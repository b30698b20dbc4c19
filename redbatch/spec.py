"""What a model looks like from outside: its input spec and the metadata its workers
publish to ``meta_key(model)`` (written by the worker's heartbeat, read by gateways and
clients).  Imports neither torch nor a web framework: producers and gateways use it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from redbatch.codec import DTYPES
from redbatch.errors import ConfigError, InvalidPayload

_NATIVE: dict[str, np.dtype[Any]] = {name: np.dtype(name) for name in DTYPES}


@dataclass(frozen=True)
class TensorSpec:
    """One request's input: a dtype and a shape, ``None`` for a free dimension."""

    dtype: str = "float32"
    shape: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"TensorSpec dtype {self.dtype!r} not in {sorted(DTYPES)}")

    def check(self, value: Any) -> np.ndarray[Any, Any]:
        """Convert ``value`` (nested lists or an array) to this spec, or raise."""
        try:
            arr = value if type(value) is np.ndarray else np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise InvalidPayload(f"input is not a rectangular array: {exc}") from exc
        self._check_kind(arr)
        self._check_shape(arr.shape)
        if arr.dtype == self._np_dtype:
            cast = arr
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                cast = arr.astype(self._np_dtype)
        self._check_range(arr, cast)
        return cast

    def check_rows(self, value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Check a multi-row payload (first dimension: the rows) in one go."""
        return self._rows_spec.check(value)

    @functools.cached_property
    def _rows_spec(self) -> TensorSpec:
        return TensorSpec(self.dtype, (None, *self.shape))

    @property
    def _np_dtype(self) -> np.dtype[Any]:
        return _NATIVE[self.dtype]

    def _check_kind(self, arr: np.ndarray[Any, Any]) -> None:
        if arr.dtype.kind not in "biuf":
            raise InvalidPayload(f"input must be numbers, got {arr.dtype.kind!r} data")
        if self._np_dtype.kind in "iub" and arr.dtype.kind == "f":
            raise InvalidPayload(f"input must be integers for dtype {self.dtype}")

    def _check_range(self, arr: np.ndarray[Any, Any], cast: np.ndarray[Any, Any]) -> None:
        kind = cast.dtype.kind
        if kind == "f" and not np.isfinite(cast).all():
            raise InvalidPayload(f"input holds NaN, infinity or a number too large for "
                                 f"{self.dtype}")
        if kind in "iu" and arr.size and arr.dtype != cast.dtype:
            info = np.iinfo(cast.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise InvalidPayload(f"input holds an integer out of range for {self.dtype}")

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        ok = len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True))
        if not ok:
            dims = ["*" if d is None else str(d) for d in self.shape]
            want_text = f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(dims) + ")"
            raise InvalidPayload(f"input shape {tuple(shape)} does not match {want_text}")

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": [-1 if d is None else d for d in self.shape]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorSpec:
        shape = tuple(None if d == -1 else int(d) for d in data["shape"])
        return cls(dtype=str(data["dtype"]), shape=shape)


def model_meta(name: str, *, input_name: str, output_name: str, spec: TensorSpec | None,
               policy: dict[str, Any], limits: dict[str, Any],
               defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata a worker publishes for a model (``ModelInfo.from_meta`` reads it):
    ``policy`` and ``limits`` are the values in effect (live overrides included),
    ``defaults`` the model's own values of the live knobs (``redbatch.knobs``)."""
    return {
        "name": name,
        "input_name": input_name,
        "output_name": output_name,
        "spec": spec.to_json() if spec else None,
        "policy": policy,
        "limits": limits,
        "defaults": defaults,
    }


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

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ModelInfo:
        spec = TensorSpec.from_json(meta["spec"]) if meta.get("spec") else None
        limits = meta.get("limits") or {}
        cap, timeout = limits.get("max_queue_len"), limits.get("default_timeout_s")
        return cls(name=meta["name"], input_name=meta.get("input_name", "inputs"),
                   output_name=meta.get("output_name", "outputs"), spec=spec, meta=meta,
                   max_queue_len=int(cap) if cap else None,
                   default_timeout_s=float(timeout) if timeout else None)
