"""Multi-row requests: many same-shape inputs travel as one queue entry (the
``rows`` field), and its one reply is split back into one future per input."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from redbatch.errors import InvalidPayload, RedbatchError, error_from_code
from redbatch.protocol import Reply


def packable(inputs: Sequence[Any], pack_rows: int) -> bool:
    """Whether ``inputs`` can travel as rows: two or more arrays of one shape and dtype."""
    if pack_rows < 2 or len(inputs) < 2:
        return False
    first = inputs[0]
    if type(first) is not np.ndarray:
        return False
    shape, dtype = first.shape, first.dtype
    return all(type(x) is np.ndarray and x.shape == shape and x.dtype == dtype
               for x in inputs)


def chunks(inputs: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [inputs[start:start + size] for start in range(0, len(inputs), size)]


def split(waiter: asyncio.Future[Any], n: int, want_reply: bool = False
          ) -> list[asyncio.Future[Any]]:
    """One future per row of the request ``waiter`` waits on (its whole ``Reply``): the
    row's output (or, with ``want_reply``, a ``Reply`` of its own), or its error."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(n)]
    waiter.add_done_callback(lambda done: _settle(done, futures, want_reply))
    return futures


def _settle(done: asyncio.Future[Any], futures: list[asyncio.Future[Any]],
            want_reply: bool) -> None:
    if done.cancelled():
        for future in futures:
            future.cancel()
        return
    exc = done.exception()
    outcomes = _outcomes(done.result(), len(futures)) if exc is None else [exc] * len(futures)
    if want_reply and exc is None:
        outcomes = [_row_reply(done.result(), row, o) for row, o in enumerate(outcomes)]
    for future, outcome in zip(futures, outcomes, strict=True):
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _row_reply(reply: Reply, row: int, outcome: Any) -> Reply:
    """A row's own ``Reply`` (id ``<request id>:<row>``, the request's timings)."""
    row_id = f"{reply.id}:{row}"
    if isinstance(outcome, RedbatchError):
        return Reply(row_id, False, error_code=outcome.code, error_message=str(outcome),
                     timings=reply.timings)
    return Reply(row_id, True, outcome, timings=reply.timings)


def _outcomes(reply: Reply, n: int) -> list[Any]:
    """Each row's output, or its error."""
    if not reply.ok:
        return [error_from_code(reply.error_code, reply.error_message) for _ in range(n)]
    payload = reply.payload
    if not isinstance(payload, np.ndarray | list) or len(payload) != n:
        exc: RedbatchError = InvalidPayload(
            f"a reply to {n} rows did not hold {n} outputs (a worker without multi-row "
            "support?)")
        return [exc] * n
    outcomes = list(payload)
    for row, (code, message) in reply.row_errors.items():
        if 0 <= row < n:
            outcomes[row] = error_from_code(code, message)
    return outcomes
