"""What a streaming batch function sees: the members of its running batch.

A streaming model's batch function is a generator (sync or async) that takes a
``StreamBatch`` and yields, at each step, one list with an item per member, in the
batch's order at that step.  An item is a chunk for that member's caller, or ``STOP``,
which ends that member's stream.  When the generator returns, every member left ends.

Between two steps the worker changes the batch (continuous batching): members that
ended leave, and requests that were waiting join, up to ``max_batch_size``.  The
function reads ``joined()`` for the newcomers (to set up their state, keyed by
``keys``), and yields for ``len(batch)`` members in ``keys`` order.  A function that
reads its inputs once, as Ray's streaming ``@serve.batch`` does, needs
``continuous=False`` on its model: its batch then stays as it started, ended members
included (their further items are ignored), until every member ended.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final, overload


class _Stop:
    """The stop marker's type (one instance: ``STOP``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "STOP"


STOP: Final = _Stop()


class StreamBatch(Sequence[Any]):
    """The inputs of the members running now, in step order; ``keys`` names them
    (stable while a member runs: its request id)."""

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._inputs: list[Any] = []
        self._joined: list[tuple[str, Any]] = []

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    def joined(self) -> list[tuple[str, Any]]:
        """``(key, input)`` of the members that joined since the last call (all of
        them at the first step)."""
        joined, self._joined = self._joined, []
        return joined

    def add(self, key: str, value: Any) -> None:
        """(The worker) a member joins at the end."""
        self._keys.append(key)
        self._inputs.append(value)
        self._joined.append((key, value))

    def remove(self, keys: set[str]) -> None:
        """(The worker) these members leave; the others keep their order."""
        kept = [i for i, key in enumerate(self._keys) if key not in keys]
        self._keys = [self._keys[i] for i in kept]
        self._inputs = [self._inputs[i] for i in kept]
        self._joined = [(k, v) for k, v in self._joined if k not in keys]

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self._inputs[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._inputs))
