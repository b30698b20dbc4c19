"""Batches by cost: each pass's items cost at most the budget in total.

The budget is ``BatchPolicy.max_batch_cost``, or, for a model with a ``batch_size_fn``
and no ``max_batch_cost``, ``max_batch_size`` (Ray's rule).  An item costs its
``batch_size_fn``, else its padded length in a variable-length model's bucket (a pass
then costs bucket length x items: padded tokens), else 1.  Passes are cut in order,
greedily: a pass closes when the next item would bring it over the budget or over
``max_batch_size`` items.  An item over the whole budget runs alone, or is refused.
A model with no cost settings never comes here."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from redbatch.errors import InvalidPayload, ModelError
from redbatch.worker.policy import BatchPolicy


def budget(policy: BatchPolicy, batch_size_fn: Callable[[Any], float] | None
           ) -> float | None:
    """The cost one pass may hold; None when the model has no cost settings."""
    if policy.max_batch_cost is None and batch_size_fn is not None:
        return float(policy.max_batch_size)
    return policy.max_batch_cost


def item_costs(inputs: list[Any], batch_size_fn: Callable[[Any], float] | None,
               length: int | None) -> list[float | Exception]:
    """Each input's cost: ``batch_size_fn`` of it (its exception, or ``ModelError`` for
    a cost that is not a finite number >= 0), else ``length`` (the bucket), else 1."""
    if batch_size_fn is None:
        return [float(length or 1)] * len(inputs)
    return [_cost(batch_size_fn, item) for item in inputs]


def _cost(batch_size_fn: Callable[[Any], float], item: Any) -> float | Exception:
    try:
        value = float(batch_size_fn(item))
    except Exception as exc:
        return ModelError(f"batch_size_fn raised {type(exc).__name__}: {exc}")
    if not math.isfinite(value) or value < 0:
        return ModelError(f"batch_size_fn returned {value}: a cost must be a number >= 0")
    return value


def screen(costs: list[float | Exception], limit: float, refuse: bool, model: str
           ) -> tuple[list[int], list[float], dict[int, Exception]]:
    """The indices that run and their costs, and the error of each that does not: its
    cost failed, or (with ``refuse``) it costs more than the whole budget."""
    kept: list[int] = []
    kept_costs: list[float] = []
    errors: dict[int, Exception] = {}
    for i, cost in enumerate(costs):
        if isinstance(cost, Exception):
            errors[i] = cost
        elif refuse and cost > limit:
            errors[i] = InvalidPayload(f"model {model!r}: this input costs {cost:g}, over the "
                                       f"model's max_batch_cost of {limit:g}")
        else:
            kept.append(i)
            kept_costs.append(cost)
    return kept, kept_costs, errors


def cut(costs: list[float], size: int, limit: float) -> list[tuple[int, int]]:
    """``(start, end)`` of each pass over ``costs`` in order: at most ``size`` items and
    ``limit`` cost each; an item costlier than ``limit`` in a pass of its own."""
    passes: list[tuple[int, int]] = []
    start, total = 0, 0.0
    for i, cost in enumerate(costs):
        if i > start and (i - start >= size or total + cost > limit):
            passes.append((start, i))
            start, total = i, 0.0
        total += cost
    if start < len(costs):
        passes.append((start, len(costs)))
    return passes
