"""The forward step: run a batch function off the event loop, check its contract,
and, when a batch raises, bisect it so that only the culprit items fail."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from redbatch.errors import ModelError, RedbatchError
from redbatch.redis_conn import cancel_requested
from redbatch.spec import TensorSpec, per_token
from redbatch.worker import cost, named, ragged
from redbatch.worker.autosize import AutoSizer
from redbatch.worker.model import BatchFn, Model

log = logging.getLogger("redbatch.worker")
AUTO_INLINE_MS = 5.0  # on a CPU worker, passes shorter than this run on the event loop
RECENT_PASSES = 8
SLOW_INLINE_MS = 1000.0  # an inline pass longer than this is logged (the loop waited)
CPU_BOUND = 0.2  # a pass on the CPU this share of its thread's wall time: CPU-timed
# (low: a CPU pass on a machine whose cores other processes share may get a third of a
# core; a pass timed by the wall among passes timed by the CPU would skew the curve)
TRACEBACK_EVERY_S = 60.0  # a model's traceback: once a minute per distinct error


class ErrorLog:
    """Logs a model's failures: the traceback of each distinct error (type and message)
    at most once per ``every_s``, a one-line warning for the repeats."""

    def __init__(self, model: str, every_s: float = TRACEBACK_EVERY_S) -> None:
        self.model = model
        self.every_s = every_s
        self._last: dict[tuple[str, str], float] = {}

    def failed(self, exc: BaseException, what: str, level: int = logging.WARNING) -> None:
        key, now = (type(exc).__name__, str(exc)), time.monotonic()
        first = now - self._last.get(key, -self.every_s) >= self.every_s
        if first:
            if len(self._last) >= 1024:  # distinct messages (ids in them) must not pile up
                self._last.clear()
            self._last[key] = now
        log.log(level, "model=%s %s: %s: %s%s", self.model, what, key[0], key[1],
                "" if first else " (traceback logged within the last minute)",
                exc_info=exc if first else None)


class ContractError(ModelError):
    """The batch function broke list-in/list-out: every caller of the batch fails."""


class Forwarder:
    def __init__(self, model: Model, fn: BatchFn, executor: Executor,
                 device: str = "cpu", sizer: AutoSizer | None = None) -> None:
        self.model = model
        self._fn = fn
        self._executor = executor
        # auto-inline only a sync function on a CPU worker (an inline pass may then run
        # beside another model's pass in the forward thread: harmless on CPU, unlike on
        # one GPU)
        self._auto = model.inline is None and device == "cpu" and not model.is_async
        self._recent: deque[float] = deque(maxlen=RECENT_PASSES)  # last passes, ms
        # ... and the largest pass (items, padded length) among them: an auto-inline
        # pass is never larger (a pass time grows with both; a larger one may be slow)
        self._sizes: deque[tuple[int, int]] = deque(maxlen=RECENT_PASSES)
        self._passes: list[int] = []  # items in each pass of ``run_batches`` since taken
        self._sig = model.signature  # named inputs and outputs
        self._spec = model.length_spec
        self._bucketed = self._spec  # with the live ``buckets`` knob applied...
        self._bucketed_by: tuple[int, ...] = ()  # ...which held these buckets
        self._length: Callable[[Any], int] = self._sig.length if self._sig else len
        self._pads = self._spec is not None and model.stack  # the worker pads its passes
        # stacked with a free dimension but no max_len: passes grouped by exact shape
        # (items of different shapes cannot stack, and are not padded)
        self._by_shape = model.stack and self._spec is None and ragged.free_dims(model)
        self._shaped = tuple(n for n, s in self._sig.inputs.items() if s is not None) \
            if self._sig else ()  # the named inputs a shape group is keyed on
        # ... and, within a length bucket, the named inputs that are not padded (a free
        # dimension, no max_len): a bucket's items stack only where those match
        self._unpadded = tuple(n for n, s in self._sig.inputs.items() if s is not None
                               and None in s.shape and not s.variable) \
            if self._sig and model.stack else ()
        self._trims = self._pads and (bool(self._sig.per_token) if self._sig
                                      else per_token(model.output_spec))
        self._padding = [0, 0]  # padded and real lengths of padded passes since taken
        self._cpu_s = 0.0  # CPU time of the threads that ran sync passes, since taken
        self._pass_cpu_s: float | None = None  # the last sync pass's own CPU time
        self._pass_wall_s = 0.0  # and its wall time in that thread (no hand-off)
        # ``auto_batch`` times a CPU pass by its thread's CPU time where that thread
        # does all of the compute (one intra-op thread): a pass descheduled by other
        # processes, or waiting for the executor, then moves nothing
        self._cpu_clock = device == "cpu" and not model.is_async and _one_thread()
        self._errors = ErrorLog(model.name)
        # ``auto_batch``: the learned pass sizes (shared by a runner's Forwarders), and
        # the items and time of the last pass that ran whole
        self.sizer = sizer or AutoSizer()
        self._timed: tuple[int, float] | None = None

    @property
    def pass_ms(self) -> float | None:
        """The longest of the recent passes (ms), None before the first."""
        return max(self._recent) if self._recent else None

    @property
    def inline(self) -> bool:
        """Whether the next sync pass runs on the event loop: while every recent pass
        was short (one slow pass sends the next ones back to the thread)."""
        if self.model.inline is not None and not self.model.is_async:
            return self.model.inline
        longest = self.pass_ms
        return self._auto and longest is not None and longest < AUTO_INLINE_MS

    async def run_batches(self, inputs: list[Any]) -> list[Any]:
        """``run`` in passes of at most ``max_batch_size`` inputs (the rows of multi-row
        requests can make a claimed batch larger), or with ``auto_batch`` of the size
        learned for the bucket (``autosize``), and, with a cost budget, at most that
        cost (``cost``); a variable-length model's inputs grouped by length bucket
        first (``ragged``), each group in passes of its own (with ``pad_to_longest``,
        its items in order of length, each pass padded to its longest); a stacked
        model with a free dimension but no ``max_len`` has its inputs grouped by shape
        (``ragged.shape_groups``), since only inputs of one shape stack."""
        limit = cost.budget(self.model.policy, self.model.batch_size_fn)
        groups = self._groups(inputs)
        if len(groups) == 1 and groups[0][0] is None:  # (one group of them all, in order)
            return await self._run_passes(inputs, None, limit)
        results: list[Any] = [None] * len(inputs)
        for length, indices in groups:
            await run_into(results, inputs, indices,
                           functools.partial(self._run_passes, length=length, limit=limit))
        return results

    @property
    def several_passes(self) -> bool:
        """Whether a batch may take several passes whatever its size: length buckets,
        shapes, a cost budget or learned pass sizes."""
        policy = self.model.policy
        return bool(self._spec is not None or self._by_shape or policy.auto_batch
                    or cost.budget(policy, self.model.batch_size_fn) is not None)

    def plan(self, inputs: list[Any]) -> list[int | None]:
        """The pass (0: the first) each input would run in, as ``run_batches`` cuts
        them now; None for one refused by its cost (answered at once)."""
        limit = cost.budget(self.model.policy, self.model.batch_size_fn)
        plan: list[int | None] = [None] * len(inputs)
        first = 0
        for length, indices in self._groups(inputs):
            passes, _errors = self._passes_of([inputs[i] for i in indices], length, limit,
                                              planned=True)
            for n, chunk in enumerate(passes):
                for j in chunk:
                    plan[indices[j]] = first + n
            first += len(passes)
        return plan

    def _groups(self, inputs: list[Any]) -> list[tuple[int | None, list[int]]]:
        """The inputs' groups, each run in passes of its own, in the order they run:
        (bucket length or None, indices into ``inputs``)."""
        if self._spec is None and not self._by_shape:
            return [(None, list(range(len(inputs))))]
        if self._spec is None:  # free dimensions, no max_len: one group per shape
            return [(None, indices)
                    for indices in ragged.shape_groups(inputs, self._shaped).values()]
        return [(length, group)
                for length, indices in ragged.bucket_groups(
                    inputs, self._bucketing(), self._length, self._to_longest).items()
                for group in self._unpadded_groups(inputs, indices)]

    def _unpadded_groups(self, inputs: list[Any], indices: list[int]) -> list[list[int]]:
        """A bucket's indices split by the shapes of its unpadded named inputs (a free
        dimension without max_len), in claim order: one group where there are none."""
        if not self._unpadded:
            return [indices]
        groups = ragged.shape_groups([inputs[i] for i in indices], self._unpadded)
        return [[indices[j] for j in group] for group in groups.values()]

    @property
    def _to_longest(self) -> bool:
        """Whether passes are padded to their longest item (``pad_to_longest``)."""
        return self._pads and self.model.policy.pad_to_longest

    def bucket(self, value: Any) -> int | None:
        """The length bucket ``value`` runs in (None: a fixed-shape model)."""
        return None if self._spec is None else self._bucketing().bucket_of(self._length(value))

    def _bucketing(self) -> TensorSpec:
        """The variable-length spec with the buckets in effect (``Model.buckets``, a
        live knob), rebuilt only when they change."""
        assert self._spec is not None and self._bucketed is not None
        wanted = tuple(self.model.buckets or self._spec.boundaries)
        if wanted != self._bucketed_by:
            self._bucketed = dataclasses.replace(self._spec, buckets=wanted)
            self._bucketed_by = wanted
        return self._bucketed

    async def _run_passes(self, inputs: list[Any], length: int | None, limit: float | None
                          ) -> list[Any]:
        passes, errors = self._passes_of(inputs, length, limit)
        results: list[Any] = [errors.get(i) for i in range(len(inputs))]
        for chunk in passes:
            await run_into(results, inputs, chunk,
                           functools.partial(self._run_pass, length=length))
        return results

    def _passes_of(self, inputs: list[Any], length: int | None, limit: float | None,
                   planned: bool = False) -> tuple[list[list[int]], dict[int, Exception]]:
        """The indices of each pass over a group's ``inputs``: at most the pass size,
        and with a cost budget at most ``limit`` cost (an item over it alone, or
        refused: its error).  ``planned``: for ``plan``, the learned size without its
        exploration, nothing recorded."""
        size = self._pass_size(length, planned)
        if limit is None:
            return [list(range(start, min(start + size, len(inputs))))
                    for start in range(0, len(inputs), size)], {}
        costs = cost.item_costs(inputs, self.model.batch_size_fn, length)
        kept, kept_costs, errors = cost.screen(costs, limit, self.model.oversize == "refuse",
                                               self.model.name)
        return [kept[start:end] for start, end in cost.cut(kept_costs, size, limit)], errors

    def _pass_size(self, length: int | None, planned: bool = False) -> int:
        """Most items in one of the bucket's passes: ``max_batch_size``, or with
        ``auto_batch`` the size learned for the bucket (at most that; ``planned``:
        without exploration, nothing recorded)."""
        policy = self.model.policy
        if not policy.auto_batch:
            return policy.max_batch_size
        if planned:
            return self.sizer.target(length, policy.max_batch_size)
        return self.sizer.size(length, policy.max_batch_size)

    async def _run_pass(self, chunk: list[Any], length: int | None) -> list[Any]:
        """One pass of ``chunk`` (items of the bucket ``length``), padded to the bucket
        or, with ``pad_to_longest``, to the chunk's longest item."""
        self._passes.append(len(chunk))
        padded, tokens = length, None
        if self._pads and length is not None:
            real = list(map(self._length, chunk))
            padded, tokens = (max(real) if self._to_longest else length), sum(real)
            self._padding[0] += padded * len(chunk)
            self._padding[1] += tokens
        if not self.model.policy.auto_batch:
            return await self.run(chunk, padded)
        self._timed = None
        outputs = await self.run(chunk, padded)
        if self._timed is not None and self._timed[0] == len(chunk):  # not bisected
            self.sizer.observe(length, len(chunk), self._bucket_ms(
                self._timed[1], length, padded, None if tokens is None else tokens / len(chunk)))
        return outputs

    @staticmethod
    def _bucket_ms(ms: float, length: int | None, padded: int | None,
                   mean_tokens: float | None = None) -> float:
        """A pass's time as ``auto_batch`` learns it: for a pass padded shorter than its
        bucket (``pad_to_longest``), the time it would take for items as long as the
        bucket at the same real tokens per ms, ``ms x length / mean_tokens`` (the
        items' mean real length; the padded length where it is not given).  So a
        bucket's curve compares sizes, not which items each pass happened to get (a
        bucket sorted by length leaves its longest items to its last, smallest pass),
        and a pass is charged its own padding: smaller passes of a sorted bucket pad
        less, and their items/s must show it (a size is chosen for real tokens/s)."""
        if not length or not padded or padded >= length:
            return ms
        return ms * length / (mean_tokens or padded)

    def take_passes(self) -> list[int]:
        """The items of each pass ``run_batches`` made since the last call."""
        passes, self._passes = self._passes, []
        return passes

    def take_padding(self) -> tuple[int, int]:
        """(padded, real) lengths summed over the padded passes since the last call;
        (0, 0) for a model the worker does not pad."""
        padded, real = self._padding
        self._padding = [0, 0]
        return padded, real

    def take_cpu_ms(self) -> float:
        """CPU ms of the sync passes since the last call (0 for an async model)."""
        cpu_s, self._cpu_s = self._cpu_s, 0.0
        return cpu_s * 1000

    async def run(self, inputs: list[Any], length: int | None = None) -> list[Any]:
        """One result per input: the model's output, or a ``RedbatchError``.  ``length``:
        the bucket length a variable-length model's pass is padded to."""
        if not inputs:
            return []
        try:
            return await self._call(inputs, length)
        except ContractError as exc:
            self._errors.failed(exc, f"broke the batch contract on {len(inputs)} items",
                                logging.ERROR)
            return [exc] * len(inputs)
        except Exception as exc:
            return await self._isolate(inputs, exc, length)
        except asyncio.CancelledError as exc:  # an async model's own (awaiting a
            if cancel_requested():  # cancelled future): a model error; a stop goes on up
                raise
            return await self._isolate(inputs, exc, length)

    async def _isolate(self, inputs: list[Any], exc: BaseException, length: int | None
                       ) -> list[Any]:
        """Bisect a batch that raised (a padded pass's halves keep its length)."""
        if len(inputs) == 1:
            self._errors.failed(exc, "an item failed the forward pass")
            return [exc if isinstance(exc, RedbatchError) else self._model_error(exc)]
        mid = len(inputs) // 2
        return await self.run(inputs[:mid], length) + await self.run(inputs[mid:], length)

    def _model_error(self, exc: BaseException) -> ModelError:
        return ModelError(f"model {self.model.name!r} raised {type(exc).__name__}: {exc}")

    def _arg(self, inputs: list[Any], length: int | None) -> Any:
        """What the batch function gets: the list, one stacked array, or, for a
        variable-length model, ``(padded, lengths)``."""
        if not self.model.stack:
            return inputs
        if self._sig is not None:
            return named.stacked(inputs, self._sig, length if self._pads else None)
        if self._spec is not None and length is not None:
            return ragged.pad_batch(inputs, length, self._spec.pad_value)
        return np.stack(inputs)

    async def _call(self, inputs: list[Any], length: int | None) -> list[Any]:
        arg = self._arg(inputs, length)
        size = (len(inputs), length or 0)
        inline = self.inline and (self.model.inline is not None or self._seen(size))
        started = time.perf_counter()
        try:
            outputs = await self._pass(arg, inline)
        finally:
            pass_ms = (time.perf_counter() - started) * 1000
            self._recent.append(pass_ms)
            self._sizes.append(size)
            if inline and pass_ms > SLOW_INLINE_MS:
                log.warning("model=%s a pass on the event loop took %.0f ms (the heartbeat "
                            "waited); set inline=False on a model whose passes vary so",
                            self.model.name, pass_ms)
        if inline:  # let the heartbeat and replies run between inline passes (untimed)
            await asyncio.sleep(0)
        if self._sig is not None:
            rows = self._named_rows(outputs, arg, len(inputs), length)
        else:
            rows = self._check_outputs(outputs, len(inputs))
            rows = self._trim(rows, arg[1], length) if self._trims and length else rows
        self._timed = (len(inputs), self._measured_ms(pass_ms))
        return rows

    def _measured_ms(self, pass_ms: float) -> float:
        """What ``auto_batch`` learns a pass took: its thread's CPU time where that
        thread does all of the compute and the pass was mostly on the CPU (at least
        ``CPU_BOUND`` of the wall time the call took in that thread, the hand-off to
        and from it aside: a pass that slept or waited on I/O is timed by the wall),
        else its wall time."""
        cpu_s, self._pass_cpu_s = self._pass_cpu_s, None
        if not self._cpu_clock or cpu_s is None or cpu_s < CPU_BOUND * self._pass_wall_s:
            return pass_ms
        return cpu_s * 1000

    def _trim(self, rows: list[Any], lengths: Any, length: int) -> list[Any]:
        trimmed = ragged.trim_rows(rows, lengths, length)
        if trimmed is None:
            raise ContractError(f"model {self.model.name!r} has per-token outputs (its "
                                f"output_spec) but did not return {length} of them per "
                                f"input for a pass padded to {length}")
        return trimmed

    def _named_rows(self, outputs: Any, arg: Any, n: int, length: int | None
                    ) -> list[Any]:
        """One output map per input of a model with named outputs (``named``)."""
        assert self._sig is not None
        try:
            rows = named.rows(outputs, self._sig, n, self.model.stack)
            if self._trims and length:
                rows = named.trimmed(rows, self._sig, arg[1], length)
        except ValueError as exc:
            raise ContractError(f"model {self.model.name!r} {exc}") from exc
        return rows

    def _seen(self, size: tuple[int, int]) -> bool:
        """Whether a pass of ``size`` (items, padded length) is no larger than a recent
        one, each way: only such a pass may run inline by itself (``Model.inline``
        None)."""
        return any(size[0] <= items and size[1] <= length for items, length in self._sizes)

    async def _pass(self, arg: Any, inline: bool) -> Any:
        if self.model.is_async:
            return await self._fn(arg)
        if not inline:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._cpu_timed, arg)
        return self._cpu_timed(arg)

    def _cpu_timed(self, arg: Any) -> Any:
        """A sync pass, adding the CPU time of the thread that runs it to ``_cpu_s``
        (with one torch thread, all of a CPU pass's compute; a pass descheduled by
        other processes costs wall time, not CPU time)."""
        started, wall = time.thread_time(), time.perf_counter()
        try:
            return self._fn(arg)
        finally:
            self._pass_cpu_s = time.thread_time() - started
            self._pass_wall_s = time.perf_counter() - wall
            self._cpu_s += self._pass_cpu_s

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


def _one_thread() -> bool:
    """Whether passes compute on the calling thread alone: one OpenMP thread (the
    worker's ``--threads 1`` sets it before torch loads), or torch loaded with one."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.get_num_threads() == 1)
    return os.environ.get("OMP_NUM_THREADS") == "1"


async def run_into(results: list[Any], inputs: list[Any], indices: list[int],
                   run: Callable[[list[Any]], Awaitable[list[Any]]]) -> None:
    """``run`` the inputs at ``indices`` and put each output at its input's place."""
    outputs = await run([inputs[i] for i in indices])
    for i, output in zip(indices, outputs, strict=True):
        results[i] = output
