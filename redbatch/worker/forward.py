"""The forward step: run a batch function off the event loop, check its contract,
and, when a batch raises, bisect it so that only the culprit items fail."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Any

import numpy as np

from redbatch.errors import ModelError, RedbatchError
from redbatch.worker.model import BatchFn, Model

log = logging.getLogger("redbatch.worker")


class ContractError(ModelError):
    """The batch function broke list-in/list-out: every caller of the batch fails."""


class Forwarder:
    def __init__(self, model: Model, fn: BatchFn, executor: Executor) -> None:
        self.model = model
        self._fn = fn
        self._executor = executor

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
        elif self.model.inline:
            outputs = self._fn(arg)
        else:
            loop = asyncio.get_running_loop()
            outputs = await loop.run_in_executor(self._executor, self._fn, arg)
        return self._check_outputs(outputs, len(inputs))

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
