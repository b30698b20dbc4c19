"""A bulk job's output file, in input order, written atomically (temp file + rename).

* ``.jsonl``: one line per input, ``{"output": ...}`` or ``{"error": {"code", "message"}}``;
  arrays become nested lists.
* ``.npy``: the outputs stacked along a new first axis (all of one shape, numeric); the
  row of a failed item is NaN (an integer result is then stored as float64).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from typing import IO, Any

import numpy as np

from redbatch.jobs.errors import BadSource, ItemError
from redbatch.jobs.sources import file_format


def to_jsonable(value: Any) -> Any:
    """``json.dumps`` ``default``: arrays to lists, numpy scalars to Python numbers."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def write_output(path: str, outputs: list[Any]) -> None:
    """Write ``outputs`` (values, or ``ItemError`` for failed items) to ``path``."""
    fmt = file_format(path)
    tmp = ""
    try:  # a fresh file beside it (O_EXCL: never a link someone planted there)
        handle, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                                       prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        os.fchmod(handle, 0o666 & ~_umask())  # (mkstemp's 0600: as a plain open would)
        with os.fdopen(handle, "wb") as out:
            if fmt == "npy":
                np.save(out, stack_outputs(outputs), allow_pickle=False)
            else:
                _write_jsonl(out, outputs)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        raise BadSource(f"cannot write the outputs to {path}: {exc}") from exc
    finally:
        if tmp:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_jsonl(out: IO[bytes], outputs: list[Any]) -> None:
    for value in outputs:
        line = ({"error": value.as_dict()} if isinstance(value, ItemError)
                else {"output": value})
        try:
            text = json.dumps(line, default=to_jsonable, allow_nan=False)
        except ValueError:  # NaN or inf: no JSON holds it; the line says so
            text = json.dumps({"error": ItemError(
                "model_error", "the output holds NaN or inf, which JSON cannot").as_dict()})
        out.write(text.encode() + b"\n")


def stack_outputs(outputs: list[Any]) -> np.ndarray[Any, Any]:
    """One array, a row per output; NaN rows for failed items."""
    good = {i: np.asarray(v) for i, v in enumerate(outputs) if not isinstance(v, ItemError)}
    if not good:
        raise ValueError("no successful output to stack")
    shapes = {a.shape for a in good.values()}
    if len(shapes) > 1:
        raise ValueError(f"outputs have different shapes {sorted(shapes)[:3]}: use .jsonl")
    dtype = functools.reduce(np.promote_types, {a.dtype for a in good.values()})
    if dtype.kind not in "biufc":
        raise ValueError(f"outputs are not numeric (dtype {dtype}): use .jsonl")
    if len(good) < len(outputs) and dtype.kind not in "fc":
        dtype = np.promote_types(dtype, np.float64)  # room for the NaN of failed rows
    stacked = np.full((len(outputs), *shapes.pop()), np.nan if len(good) < len(outputs)
                      else 0, dtype=dtype)
    for index, arr in good.items():
        stacked[index] = arr
    return stacked
