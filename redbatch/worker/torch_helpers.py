"""Torch helpers: stack inputs, move them to the device, run under inference
mode, and split the outputs back per request.  torch is imported lazily, so a
worker serving plain Python models never loads it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from redbatch import defaults
from redbatch.errors import ConfigError
from redbatch.spec import TensorSpec
from redbatch.worker.forward import ContractError
from redbatch.worker.model import BatchFn, CostFn, Model
from redbatch.worker.policy import BatchPolicy


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def stack_inputs(items: Sequence[Any]) -> Any:
    """Stack numpy arrays or tensors (one per request) into one batch tensor (an array
    the worker stacked already: as it is)."""
    import torch

    if isinstance(items, np.ndarray):
        return torch.from_numpy(items)
    if items and isinstance(items[0], torch.Tensor):
        return torch.stack(list(items))
    return torch.from_numpy(np.stack([np.asarray(item) for item in items]))


def to_device(batch: Any, device: str) -> Any:
    """Copy to ``device``; on CUDA through pinned memory with a non-blocking copy."""
    if device.startswith("cuda"):
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


def split_outputs(outputs: Any, n: int) -> list[Any]:
    """One numpy array per request from a batched tensor (or the list as it is)."""
    import torch

    if isinstance(outputs, torch.Tensor):
        if outputs.ndim == 0 or outputs.shape[0] != n:
            shape = tuple(outputs.shape)
            raise ContractError(f"model returned a tensor of shape {shape} for a batch of {n}")
        return list(outputs.detach().cpu().numpy())
    return list(outputs)


def torch_batch_fn(module: Callable[[Any], Any], device: str) -> BatchFn:
    """Wrap a module (already on ``device``) as a list-in/list-out batch function."""
    import torch

    def run(items: list[Any]) -> list[Any]:
        with torch.inference_mode():
            outputs = module(to_device(stack_inputs(items), device))
        return split_outputs(outputs, len(items))

    return run


def torch_padded_fn(module: Callable[..., Any], device: str) -> BatchFn:
    """Wrap a module (already on ``device``) for a variable-length spec: it is called as
    ``module(padded, lengths)``, both tensors on ``device`` (``lengths``: int64, one per
    row), and returns one output row per input (the worker trims per-token ones)."""
    import torch

    def run(arg: tuple[Any, Any]) -> list[Any]:
        padded, lengths = arg
        with torch.inference_mode():
            outputs = module(to_device(torch.from_numpy(padded), device),
                             to_device(torch.from_numpy(lengths), device))
        return split_outputs(outputs, len(lengths))

    return run


def torch_named_fn(module: Callable[..., Any], device: str, outputs: Sequence[str]
                   ) -> BatchFn:
    """Wrap a module (already on ``device``) for named inputs: it is called with each
    input as a keyword argument (a batched tensor on ``device``; with variable-length
    inputs also ``lengths=``) and returns a dict of batched outputs (keys other than
    ``outputs`` are dropped: a Hugging Face ``ModelOutput`` may hold more) or a tuple
    of them in ``outputs`` order; they come back as numpy arrays."""
    import torch

    def run(arg: Any) -> Any:
        batch, lengths = arg if isinstance(arg, tuple) else (arg, None)
        kwargs = {name: to_device(torch.from_numpy(value), device)
                  if isinstance(value, np.ndarray) else value  # an input without a spec
                  for name, value in batch.items()}
        if lengths is not None:
            kwargs["lengths"] = to_device(torch.from_numpy(lengths), device)
        with torch.inference_mode():
            returned = module(**kwargs)
        if isinstance(returned, tuple | list):
            returned = dict(zip(outputs, returned, strict=False))
        if not isinstance(returned, Mapping):
            return returned  # the worker names what is wrong
        return {name: value.detach().cpu().numpy() if isinstance(value, torch.Tensor)
                else value for name, value in returned.items() if name in outputs}

    return run


def _wrapper(spec: TensorSpec | None, inputs: dict[str, TensorSpec | None] | None,
             outputs: dict[str, TensorSpec | None] | Sequence[str] | None
             ) -> Callable[[Any, str], BatchFn]:
    """How the module is called: one tensor, ``(padded, lengths)``, or keywords."""
    if inputs is not None:
        if "lengths" in inputs and any(s is not None and s.variable for s in inputs.values()):
            raise ConfigError("a torch model with variable-length inputs gets lengths= "
                              "beside them: no input may be named 'lengths'")
        return functools.partial(torch_named_fn, outputs=list(outputs or ()))
    if spec is None:
        raise ConfigError("torch_model needs a spec, or inputs and outputs")
    return torch_padded_fn if spec.variable else torch_batch_fn


def torch_model(name: str, build: Callable[[], Any], spec: TensorSpec | None = None,
                policy: BatchPolicy | None = None, *, input_name: str = defaults.INPUT_NAME,
                output_name: str = defaults.OUTPUT_NAME,
                output_spec: TensorSpec | None = None, batch_size_fn: CostFn | None = None,
                oversize: str = defaults.OVERSIZE,
                inputs: dict[str, TensorSpec | None] | None = None,
                outputs: dict[str, TensorSpec | None] | Sequence[str] | None = None) -> Model:
    """A ``Model`` whose ``build()`` returns a torch module, built inside the worker
    process, moved to its device and put in eval mode.  With a variable-length
    ``spec`` (``max_len``) the module's forward takes ``(padded, lengths)``; an
    ``output_spec`` whose first dimension is ``None`` has its outputs trimmed;
    ``batch_size_fn`` and ``oversize``: batches by cost (``Model``).  With named
    ``inputs`` and ``outputs`` instead of ``spec``, the module takes its inputs as
    keyword arguments (``torch_named_fn``)."""
    wrap = _wrapper(spec, inputs, outputs)

    def load(device: str) -> BatchFn:
        resolved = resolve_device(device)
        module = build().to(resolved).eval()
        return wrap(module, resolved)

    # a spec with a free dimension but no max_len: the worker stacks, by shape (its
    # items may differ in shape: a stack of them all would fail)
    free = spec is not None and None in spec.shape
    return Model(name=name, loader=load, policy=policy or BatchPolicy(), spec=spec,
                 inputs=inputs, outputs=outputs, input_name=input_name,
                 output_name=output_name, stack=spec is None or spec.variable or free,
                 output_spec=output_spec, batch_size_fn=batch_size_fn, oversize=oversize)
