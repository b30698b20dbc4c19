"""The forward step: run a batch function off the event loop, check its contract,
and, when a batch raises, bisect it so that only the culprit items fail."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import Any

import numpy as np

from redbatch.errors import ModelError, RedbatchError
from redbatch.worker.model import BatchFn, Model

log = logging.getLogger("redbatch.worker")
AUTO_INLINE_MS = 5.0  # on a CPU worker, passes shorter than this run on the event loop


class ContractError(ModelError):
    """The batch function broke list-in/list-out: every caller of the batch fails."""


class Forwarder:
    def __init__(self, model: Model, fn: BatchFn, executor: Executor,
                 device: str = "cpu") -> None:
        self.model = model
        self._fn = fn
        self._executor = executor
        self._auto = model.inline is None and device == "cpu"
        self.pass_ms: float | None = None  # smoothed duration of a sync pass

    @property
    def inline(self) -> bool:
        """Whether the next sync pass runs on the event loop."""
        if self.model.inline is not None:
            return self.model.inline
        return self._auto and self.pass_ms is not None and self.pass_ms < AUTO_INLINE_MS

    async def run(self, inputs: list[Any]) -> list[Any]:
        """One result per input: the model's output, or a ``RedbatchError``."""
        if not inputs:
            return []
        try:
            return await self._call(inputs)
        except ContractError as exc:
            return [exc] * len(inputs)
        except Exception as exc:
            return await self._isolate(inputs, exc)

    async def _isolate(self, inputs: list[Any], exc: Exception) -> list[Any]:
        if len(inputs) == 1:
            log.warning("model=%s an item failed the forward pass: %s: %s", self.model.name,
                        type(exc).__name__, exc)
            return [exc if isinstance(exc, RedbatchError) else self._model_error(exc)]
        mid = len(inputs) // 2
        return await self.run(inputs[:mid]) + await self.run(inputs[mid:])

    def _model_error(self, exc: Exception) -> ModelError:
        return ModelError(f"model {self.model.name!r} raised {type(exc).__name__}: {exc}")

    async def _call(self, inputs: list[Any]) -> list[Any]:
        arg: Any = np.stack(inputs) if self.model.stack else inputs
        if self.model.is_async:
            outputs = await self._fn(arg)
        else:
            outputs = await self._call_sync(arg)
        return self._check_outputs(outputs, len(inputs))

    async def _call_sync(self, arg: Any) -> Any:
        started = time.perf_counter()
        if self.inline:
            outputs = self._fn(arg)
        else:
            loop = asyncio.get_running_loop()
            outputs = await loop.run_in_executor(self._executor, self._fn, arg)
        took_ms = (time.perf_counter() - started) * 1000
        self.pass_ms = took_ms if self.pass_ms is None else 0.8 * self.pass_ms + 0.2 * took_ms
        return outputs

    def _check_outputs(self, outputs: Any, n: int) -> list[Any]:
        name = self.model.name
        if outputs is None or isinstance(outputs, str | bytes | dict):
            raise ContractError(f"model {name!r} must return a list, array or tensor of {n} "
                                f"outputs, got {type(outputs).__name__}")
        if hasattr(outputs, "shape") and len(outputs.shape) == 0:
            raise ContractError(f"model {name!r} returned a scalar for a batch of {n}")
        rows = list(outputs)
        if len(rows) != n:
            raise ContractError(f"model {name!r} returned {len(rows)} outputs for a batch of "
                                f"{n} inputs; a batch function must return one output per "
                                "input")
        return rows
