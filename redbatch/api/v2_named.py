"""v2 infer for a model with named inputs and outputs (``Signature``, ``docs/v2.md``).

The call's ``inputs`` are the model's inputs, each once, each checked against its
spec (errors name the input), all sharing the batch dimension (and, for
variable-length ones, the length).  They go out as multi-row requests, as a single
input does (``InferCore.submit_tensor``): each a map input name -> a slice of its
rows, never split, each row one item batched by the workers with everyone else's
traffic; the rows' output maps are stacked back into one v2 output per name, in the
order the call asks for them (all of them, in the model's order, if it names none)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from starlette.responses import Response

from redbatch.api import v2_tensors
from redbatch.api.directory import ModelInfo
from redbatch.api.v2_tensors import V2_DATATYPES, flag, output_binary
from redbatch.errors import BadRequest, InvalidPayload, ModelError
from redbatch.producer import packing
from redbatch.protocol import Reply
from redbatch.spec import Signature, TensorSpec, field_message

Arrays = dict[str, np.ndarray[Any, Any]]


def _signature(info: ModelInfo) -> Signature:
    assert info.signature is not None
    return info.signature


def _listed_inputs(data: dict[str, Any], info: ModelInfo) -> list[dict[str, Any]]:
    """The call's inputs: each of the model's inputs exactly once."""
    known = list(_signature(info).inputs)
    inputs = data.get("inputs")
    if not isinstance(inputs, list) or not inputs or \
            not all(isinstance(i, dict) for i in inputs):
        raise BadRequest(f"'inputs' must be a non-empty list of tensors; model {info.name!r} "
                         f"takes the inputs {known}")
    names = [i.get("name") for i in inputs]
    for name in names:
        if not isinstance(name, str) or name not in known:
            raise BadRequest(f"unknown input {name!r}: model {info.name!r} takes the inputs "
                             f"{known}")
        if names.count(name) > 1:
            raise BadRequest(f"input {name!r} is given {names.count(name)} times")
    missing = [name for name in known if name not in names]
    if missing:
        raise BadRequest(f"missing input {missing[0]!r}: model {info.name!r} takes the "
                         f"inputs {known}")
    return inputs


def _read(tensor: dict[str, Any], signature: Signature, binary: bytes
          ) -> tuple[np.ndarray[Any, Any], int]:
    """One input as an array ``[batch, *row]``, checked against its spec, and the
    bytes it took from the front of ``binary``; an error names the input."""
    name = tensor["name"]
    spec = signature.inputs[name]
    try:
        size = v2_tensors.binary_size(tensor)
        chunk = binary[:size]
        dtype = v2_tensors.dtype_of(tensor.get("datatype"))
        if spec is not None and dtype != spec.dtype:
            raise BadRequest(f"input has datatype {V2_DATATYPES[spec.dtype]}, got "
                             f"{tensor.get('datatype')}")
        shape = v2_tensors.shape_of(tensor.get("shape"))
        arr = v2_tensors.tensor_data(tensor, chunk, dtype, shape)
        if spec is None:  # any value: any numeric tensor, its values checked for kind
            return TensorSpec(dtype, (None,) * len(shape)).check(arr), size
        return spec.check_rows(arr, f"input {name!r}"), size
    except (BadRequest, InvalidPayload) as exc:
        raise BadRequest(field_message(name, exc)) from exc


def _arrays(data: dict[str, Any], info: ModelInfo, binary: bytes) -> Arrays:
    """Every input read; the binary section holds them in the call's order."""
    arrays: Arrays = {}
    offset = 0
    for tensor in _listed_inputs(data, info):
        arrays[tensor["name"]], size = _read(tensor, _signature(info), binary[offset:])
        offset += size
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data follow the JSON "
                         "header but no input claims them (parameters.binary_data_size)")
    return arrays


def input_arrays(data: dict[str, Any], info: ModelInfo, binary: bytes) -> Arrays:
    """The call's inputs, checked: they share the batch dimension, and their
    variable lengths."""
    arrays = _arrays(data, info, binary)
    signature = _signature(info)
    first, rows = next(iter(arrays)), len(next(iter(arrays.values())))
    for name, arr in arrays.items():
        if len(arr) != rows:
            raise BadRequest(f"input {name!r} has batch dimension {len(arr)} but {first!r} "
                             f"has {rows}: all inputs share the batch dimension")
    signature.check_lengths({name: arrays[name].shape[1] for name in signature.variable})
    return arrays


def slices(arrays: Arrays, pack_rows: int) -> tuple[list[int], list[Arrays]]:
    """The inputs cut along the batch dimension into multi-row requests of up to a
    pack's rows (a map input name -> rows each): each one's first row, and the maps."""
    rows = len(next(iter(arrays.values())))
    per = packing.pack_size(sum(a.nbytes for a in arrays.values()) // rows, pack_rows)
    starts = list(range(0, rows, per))
    return starts, [{name: arr[start:start + per] for name, arr in arrays.items()}
                    for start in starts]


def chosen_outputs(data: dict[str, Any], params: dict[str, Any], info: ModelInfo
                   ) -> dict[str, bool]:
    """The outputs to answer with, each binary or not (binary data extension)."""
    known = list(info.output_specs)
    binary = flag(params, "binary_data_output", False)
    outputs = data.get("outputs")
    if outputs is None:
        return dict.fromkeys(known, binary)
    if not isinstance(outputs, list):
        raise BadRequest("'outputs' must be a list")
    chosen: dict[str, bool] = {}
    for output in outputs:
        name = output.get("name") if isinstance(output, dict) else None
        if not isinstance(name, str) or name not in known:
            raise BadRequest(f"unknown output {name!r}: model {info.name!r} has the outputs "
                             f"{known}")
        chosen[name] = output_binary(output, binary)
    return chosen or dict.fromkeys(known, binary)


def _stacked(name: str, rows: list[Any], spec: TensorSpec | None) -> np.ndarray[Any, Any]:
    """Output ``name`` of every row, stacked (in ``spec``'s dtype when there is one)."""
    try:
        arr = np.stack([np.asarray(row[name]) for row in rows])
        if spec is not None:
            arr = arr.astype(spec.dtype)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ModelError(f"the rows' outputs {name!r} do not stack into one tensor: "
                         f"{exc!r}") from exc
    return v2_tensors.as_output(arr, f"output {name!r}")


def _rows_of(reply: Reply) -> list[Any]:
    """The output maps of a multi-row request's rows (a list, one per row)."""
    if not isinstance(reply.payload, list):
        raise ModelError(f"a reply to a multi-row request holds "
                         f"{type(reply.payload).__name__}, not one output map per row")
    return reply.payload


def _all_rows(replies: list[Reply], total: int, info: ModelInfo) -> list[Any]:
    """Every row's output map, in order (a reply of one output made a map of it);
    ``ModelError`` unless there are ``total``."""
    rows = [row for reply in replies for row in _rows_of(reply)]
    if len(rows) != total:
        raise ModelError(f"the replies to {total} rows held {len(rows)} outputs")
    if info.named_outputs is None:  # named inputs (a pipeline's first stage), one output
        return [{info.output_name: row} for row in rows]
    return rows


def respond(doc: dict[str, Any], chosen: dict[str, bool], replies: list[Reply],
            info: ModelInfo, headers: dict[str, str], total: int) -> Response:
    """The v2 answer to ``total`` rows: ``doc`` with one output per chosen name; binary
    ones after the JSON header, in that order."""
    outputs: list[dict[str, Any]] = []
    binary: list[bytes] = []
    rows, specs = _all_rows(replies, total, info), info.output_specs
    for name, as_binary in chosen.items():
        arr = _stacked(name, rows, specs[name])
        output: dict[str, Any] = {"name": name, "datatype": V2_DATATYPES[arr.dtype.name],
                                  "shape": list(arr.shape)}
        if as_binary:
            binary.append(arr.tobytes())
            output["parameters"] = {"binary_data_size": len(binary[-1])}
        else:
            output["data"] = arr.ravel()
        outputs.append(output)
    head = orjson.dumps({**doc, "outputs": outputs}, option=orjson.OPT_SERIALIZE_NUMPY)
    if not binary:
        return Response(head, media_type="application/json", headers=headers)
    headers["Inference-Header-Content-Length"] = str(len(head))
    return Response(head + b"".join(binary), media_type="application/octet-stream",
                    headers=headers)
