"""Multi-row requests: many same-shape inputs travel as one queue entry (the
``rows`` field), and its one reply is split back into one future per input."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from redbatch.errors import InvalidPayload, RedbatchError, error_from_code
from redbatch.protocol import Reply

PACK_BYTES = 1 << 20  # input bytes per multi-row request: far below the entry limit


def rows_per_request(inputs: Sequence[Any], pack_rows: int) -> int:
    """How many of ``inputs`` go in one multi-row request: up to ``pack_rows`` and
    ``PACK_BYTES`` of arrays of one shape and dtype; 1 means one request each."""
    if pack_rows < 2 or len(inputs) < 2 or not _same_arrays(inputs):
        return 1
    return pack_size(inputs[0].nbytes, pack_rows)


def pack_size(row_bytes: int, pack_rows: int) -> int:
    """Rows of ``row_bytes`` each in one multi-row request: at most ``pack_rows`` and
    ``PACK_BYTES`` (1: too big to pack)."""
    return max(1, min(pack_rows, PACK_BYTES // max(1, row_bytes)))


def _same_arrays(inputs: Sequence[Any]) -> bool:
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
    for future in futures:  # every caller gave up: so does the waiter (its slot frees)
        future.add_done_callback(lambda _f: _cancel_if_abandoned(waiter, futures))
    return futures


def _cancel_if_abandoned(waiter: asyncio.Future[Any],
                         futures: list[asyncio.Future[Any]]) -> None:
    if not waiter.done() and all(f.cancelled() for f in futures):
        waiter.cancel()


def _settle(done: asyncio.Future[Any], futures: list[asyncio.Future[Any]],
            want_reply: bool) -> None:
    try:
        _settle_rows(done, futures, want_reply)
    except Exception as exc:  # never leave a row unsettled: it has no timer of its own
        for future in futures:
            if not future.done():
                future.set_exception(RedbatchError(f"could not read the reply: {exc!r}"))


def _settle_rows(done: asyncio.Future[Any], futures: list[asyncio.Future[Any]],
                 want_reply: bool) -> None:
    if done.cancelled():
        for future in futures:
            future.cancel()
        return
    exc = done.exception()
    if exc is not None:
        outcomes: list[Any] = [exc] * len(futures)
    else:
        reply = done.result()
        outcomes = split_reply(reply, len(futures))
        if want_reply:
            outcomes = [row_reply(reply, f"{reply.id}:{row}", o)
                        for row, o in enumerate(outcomes)]
    for future, outcome in zip(futures, outcomes, strict=True):
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def row_reply(reply: Reply, row_id: str, outcome: Any) -> Reply:
    """A row's own ``Reply`` (id ``row_id``, the request's timings) from its outcome."""
    if isinstance(outcome, RedbatchError):
        return Reply(row_id, False, error_code=outcome.code, error_message=str(outcome),
                     timings=reply.timings)
    return Reply(row_id, True, outcome, timings=reply.timings)


def split_reply(reply: Reply, n: int) -> list[Any]:
    """Each row's output, or its error."""
    if not reply.ok:
        return [error_from_code(reply.error_code, reply.error_message) for _ in range(n)]
    payload = reply.payload
    if not isinstance(payload, np.ndarray | list) or (
            isinstance(payload, np.ndarray) and payload.ndim == 0) or len(payload) != n:
        exc: RedbatchError = InvalidPayload(
            f"a reply to {n} rows did not hold {n} outputs (a worker without multi-row "
            "support?)")
        return [exc] * n
    # as a lone request's output decodes: Python numbers for scalar rows
    outcomes = payload.tolist() if isinstance(payload, np.ndarray) and payload.ndim == 1 \
        else list(payload)
    for row, (code, message) in reply.row_errors.items():
        if 0 <= row < n:
            outcomes[row] = error_from_code(code, message)
    return outcomes
