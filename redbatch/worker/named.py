"""Named inputs and outputs (``Signature``): what a batch function of such a model
gets, and its outputs split back into one map per request.

With ``stack=True`` the function gets a dict input name -> stacked array (for
variable-length inputs ``(dict, lengths)``: each of them padded with its own
``pad_value`` to the pass's bucket length, and the requests' shared true lengths)
and returns a dict output name -> batched outputs; with ``stack=False`` it gets a
list of dicts and returns a list of dicts.  A broken return raises ``ValueError``
(the forwarder fails the pass's requests with it)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from redbatch.spec import Signature
from redbatch.worker import ragged


def stacked(items: list[dict[str, Any]], signature: Signature, length: int | None) -> Any:
    """The stacked batch: a dict name -> array (a list, for an input without a spec),
    with ``length`` (a padded pass) ``(dict, lengths)``."""
    if length is None:
        return {name: [item[name] for item in items] if spec is None
                else np.stack([item[name] for item in items])
                for name, spec in signature.inputs.items()}
    batch: dict[str, Any] = {}
    lengths: Any = None
    for name, spec in signature.inputs.items():
        column = [item[name] for item in items]
        if spec is None:  # any value: the list of them
            batch[name] = column
        elif spec.variable:
            batch[name], lengths = ragged.pad_batch(column, length, spec.pad_value)
        else:
            batch[name] = np.stack(column)
    return batch, lengths


def rows(outputs: Any, signature: Signature, n: int, stacked: bool) -> list[dict[str, Any]]:
    """One output map per request, from a stacked pass's dict of batched outputs or
    an unstacked pass's list of maps; ``ValueError`` naming what is wrong."""
    if not stacked:
        return _listed_rows(outputs, signature, n)
    columns = _columns(outputs, signature, n)
    return [{name: column[i] for name, column in columns.items()} for i in range(n)]


def _check_names(returned: Mapping[Any, Any], signature: Signature, what: str) -> None:
    missing = [name for name in signature.outputs if name not in returned]
    unknown = [name for name in returned if name not in signature.outputs]
    if missing or unknown:
        wrong = f"no output {missing[0]!r}" if missing else f"unknown output {unknown[0]!r}"
        raise ValueError(f"returned {what} with {wrong}; its outputs are "
                         f"{list(signature.outputs)}")


def _columns(outputs: Any, signature: Signature, n: int) -> dict[str, list[Any]]:
    if not isinstance(outputs, Mapping):
        raise ValueError(f"must return a dict of its outputs {list(signature.outputs)} "
                         f"(stack=True), got {type(outputs).__name__}")
    _check_names(outputs, signature, "a dict")
    return {name: _column(name, outputs[name], n) for name in signature.outputs}


def _column(name: str, value: Any, n: int) -> list[Any]:
    """One output of a stacked pass as ``n`` values (one per input)."""
    column = None
    if not isinstance(value, str | bytes | Mapping) and getattr(value, "shape", None) != ():
        with contextlib.suppress(TypeError):  # not iterable: None
            column = list(value)
    if column is None:
        raise ValueError(f"returned {type(value).__name__} for output {name!r}; it needs "
                         f"a list, array or tensor of {n}")
    if len(column) != n:
        raise ValueError(f"returned {len(column)} values of output {name!r} for a batch "
                         f"of {n} inputs")
    return column


def _listed_rows(outputs: Any, signature: Signature, n: int) -> list[dict[str, Any]]:
    if not isinstance(outputs, list | tuple) or len(outputs) != n:
        got = len(outputs) if isinstance(outputs, list | tuple) else type(outputs).__name__
        raise ValueError(f"must return a list of {n} dicts (one per input, stack=False), "
                         f"got {got}")
    for row in outputs:
        if not isinstance(row, Mapping):
            raise ValueError(f"returned a {type(row).__name__} in its list; each output is "
                             f"a dict of {list(signature.outputs)}")
        _check_names(row, signature, "a dict")
    return [dict(row) for row in outputs]


def trimmed(rows: list[dict[str, Any]], signature: Signature, lengths: Any, length: int
            ) -> list[dict[str, Any]]:
    """Each per-token output cut back to its request's length; ``ValueError`` if one
    is not ``length`` long (the pass's padded length)."""
    for name in signature.per_token:
        cut = ragged.trim_rows([row[name] for row in rows], lengths, length)
        if cut is None:
            raise ValueError(f"has per-token output {name!r} (its spec) but did not "
                             f"return {length} of them per input for a pass padded to "
                             f"{length}")
        for row, value in zip(rows, cut, strict=True):
            row[name] = value
    return rows
