"""KServe v2 / Open Inference Protocol routes on the gateway (``docs/v2.md``).

``POST /v2/models/{name}/infer`` takes one input tensor whose first dimension is the
batch: its slices go out as multi-row requests (``InferCore.submit_tensor``: one
``Client.submit_many(..., batched=True)``, one enqueue, the rows never split apart),
are batched row by row by the workers with everyone else's traffic, and the requests'
outputs are concatenated into one output tensor.  Errors are
the v2 shape ``{"error": "message"}``; the status comes from ``redbatch.api.errors``
(v1's 422 for a bad payload becomes 400 here, as v2 clients expect).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from redbatch import __version__, protocol, versions
from redbatch.api import body, v2_masked, v2_named, v2_tensors
from redbatch.api.core import Picked
from redbatch.api.directory import ModelInfo, probe_deadline_ms
from redbatch.api.errors import error_for, public_message, retry_headers, status_of
from redbatch.api.v2_generate import GenerateApi, path_name
from redbatch.api.v2_repo import RepositoryApi
from redbatch.api.v2_tensors import (
    V2_DATATYPES,
    dtype_of,
    mapping,
    shape_of,
    tensor_data,
)
from redbatch.config import GatewayConfig
from redbatch.errors import (
    BadRequest,
    DeadlineExceeded,
    ModelError,
    NoLiveWorkers,
    QueueFull,
    RedbatchError,
    RedisUnavailable,
    error_from_code,
)
from redbatch.producer.admission import no_live_workers
from redbatch.protocol import Reply
from redbatch.redis_conn import deadline_bound
from redbatch.spec import TensorSpec

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

log = logging.getLogger("redbatch.api")

ANY_DATATYPE = "ANY"  # metadata of a model without a TensorSpec: any numeric datatype
VERSION = versions.UNVERSIONED  # the one version of a model served without versions
HEADER_LENGTH = b"inference-header-content-length"
Handler = Callable[[Request], Awaitable[Response]]


def v2_error(exc: RedbatchError) -> JSONResponse:
    """``{"error": message}`` with the gateway's status for ``exc`` (422 -> 400)."""
    status = status_of(exc)
    return error_for("/v2", 400 if status == 422 else status, exc.code, public_message(exc),
                     retry_headers(exc, status))


def _v2_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except RedbatchError as exc:
            return v2_error(exc)
        except Exception:
            log.exception("unexpected error on %s %r", request.method, request.url.path)
            return JSONResponse({"error": "internal error; see the gateway log"},
                                status_code=500)

    return wrapped


# --- metadata -----------------------------------------------------------------
def _datatype(info: ModelInfo) -> str:
    return V2_DATATYPES[info.spec.dtype] if info.spec else ANY_DATATYPE


def _row_dims(info: ModelInfo) -> list[int]:
    return info.spec.dims if info.spec else []


Described = list[tuple[str, str, list[int]]]  # (name, datatype, row dims) of tensors


def _described(specs: Mapping[str, TensorSpec | None]) -> Described:
    """Named tensors as v2 lists them; one without a spec is ``ANY`` of unknown dims."""
    return [(name, V2_DATATYPES[spec.dtype], spec.dims)
            if spec else (name, ANY_DATATYPE, [-1]) for name, spec in specs.items()]


def _inputs(info: ModelInfo) -> Described:
    """The named inputs, or the one input."""
    if info.signature is not None:
        return _described(info.signature.inputs)
    return [(info.input_name, _datatype(info), _row_dims(info))]


def _outputs(info: ModelInfo) -> Described:
    """The named outputs (a pipeline's last stage's, whatever its first stage takes),
    or the one output."""
    if info.named_outputs is not None:
        return _described(info.named_outputs)
    return [(info.output_name, *_output(info))]


def name_version(info: ModelInfo) -> tuple[str, str]:
    """The model's name and version as v2 names them (a version's served name split)."""
    name, version = protocol.split_name(info.name)
    return name, version or VERSION


def _output(info: ModelInfo) -> tuple[str, list[int]]:
    """The one output's datatype and row dims: from the output spec the worker
    publishes, else the input's datatype and unknown dims (a response's ``datatype``
    and ``shape`` are the real ones)."""
    out = info.output_spec
    if out is None:
        return _datatype(info), []
    return V2_DATATYPES[out.dtype], out.dims


def model_metadata(info: ModelInfo, listed: list[str] | None = None) -> dict[str, Any]:
    """v2 model metadata (``listed``: the model's versions, else the one of ``info``);
    the output as ``_output`` describes it."""
    name, version = name_version(info)
    head = {"name": name, "versions": listed or [version], "platform": "redbatch"}
    return {**head,
            **{kind: [{"name": name, "datatype": datatype, "shape": [-1, *dims]}
                      for name, datatype, dims in tensors]
               for kind, tensors in (("inputs", _inputs(info)), ("outputs", _outputs(info)))}}


def _config_tensors(info: ModelInfo) -> dict[str, list[dict[str, Any]]]:
    """The config's ``input`` and ``output`` lists."""
    data_type = f"TYPE_{_datatype(info)}" if info.spec else "TYPE_INVALID"
    if info.signature is None:
        mask = v2_masked.mask_name(info)  # an optional second input (v2_masked)
        inputs = [{"name": info.input_name, "data_type": data_type,
                   "dims": _row_dims(info)}] + ([] if mask is None else [
                       {"name": mask, "data_type": "TYPE_INT64", "dims": [-1],
                        "optional": True}])
    else:
        inputs = _config_list(_described(info.signature.inputs))
    return {"input": inputs, "output": [_config_output(info, data_type)]
            if info.named_outputs is None else _config_list(_outputs(info))}


def _config_list(tensors: Described) -> list[dict[str, Any]]:
    """Named tensors as a config lists them."""
    return [{"name": name, "dims": dims, "data_type": "TYPE_INVALID"
             if datatype == ANY_DATATYPE else f"TYPE_{datatype}"}
            for name, datatype, dims in tensors]


def _config_output(info: ModelInfo, input_type: str) -> dict[str, Any]:
    """The config's one output: as declared, else the input's type, one free dim."""
    if info.output_spec is None:
        return {"name": info.output_name, "data_type": input_type, "dims": [-1]}
    datatype, dims = _output(info)
    return {"name": info.output_name, "data_type": f"TYPE_{datatype}", "dims": dims or [1]}


def model_config(info: ModelInfo) -> dict[str, Any]:
    """A Triton-style model configuration (what perf_analyzer reads)."""
    policy = info.meta.get("policy") or {}
    wait_s = float(policy.get("batch_wait_timeout_s", 0.0))
    return {
        "name": name_version(info)[0], "platform": "redbatch", "backend": "redbatch",
        "max_batch_size": int(policy.get("max_batch_size", 0)),
        **_config_tensors(info),
        "dynamic_batching": {"max_queue_delay_microseconds": round(wait_s * 1e6)},
    }


def server_metadata() -> dict[str, Any]:
    return {"name": "redbatch", "version": __version__,
            "extensions": ["binary_tensor_data", "model_configuration", "model_repository",
                           "statistics"]}


# --- reading an infer request ---------------------------------------------------
@dataclass(frozen=True)
class InferCall:
    """What an infer request asks for, checked against the model."""

    request_id: str | None
    tensor: np.ndarray[Any, Any]
    timeout_s: float
    outputs: dict[str, bool]  # the outputs asked for (name -> as binary data)
    priority: int | None = None  # parameters.priority (as Triton's; 0: the default)
    runs: list[v2_masked.Run] | None = None  # with a mask input: the rows, cut


def split_body(raw: bytes, headers: body.Headers) -> tuple[bytes, bytes]:
    """The JSON header and the binary tensor data after it (binary data extension)."""
    if headers.get(b"content-encoding", b"identity").strip().lower() != b"identity":
        raise BadRequest("compressed request bodies (Content-Encoding) are not supported")
    declared = headers.get(HEADER_LENGTH)
    if declared is None:
        return raw, b""
    text = declared.decode("latin-1").strip()
    if not (text.isascii() and text.isdigit()) or int(text) > len(raw):  # not "²"
        raise BadRequest(f"Inference-Header-Content-Length {text!r} is not a length within "
                         f"the {len(raw)}-byte body")
    return raw[:int(text)], raw[int(text):]


def _request_id(data: dict[str, Any]) -> str | None:
    rid = data.get("id")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("'id' must be a string")
    return rid


def _only_input(data: dict[str, Any], info: ModelInfo
                ) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
    """The call's one input, its mask input (for a spec with ``mask``) or None, and
    whether the mask came first (the binary section holds them in the call's order)."""
    mask = v2_masked.mask_name(info)
    takes = f"one input {info.input_name!r}" + (f" (and its mask {mask!r})" if mask else "")
    inputs = data.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest(f"'inputs' must be a non-empty list; model {info.name!r} takes "
                         f"{takes}")
    names = [i.get("name") if isinstance(i, dict) else None for i in inputs]
    unknown = [n for n in names if n != info.input_name and (mask is None or n != mask)]
    if unknown:
        raise BadRequest(f"unknown input {unknown[0]!r}: model {info.name!r} takes {takes}")
    for name in set(names):
        if names.count(name) > 1:
            raise BadRequest(f"input {name!r} is given {names.count(name)} times")
    if info.input_name not in names:
        raise BadRequest(f"missing input {info.input_name!r}: model {info.name!r} takes "
                         f"{takes}")
    tensor: dict[str, Any] = inputs[names.index(info.input_name)]
    masked = inputs[names.index(mask)] if mask in names else None
    return tensor, masked, names[0] == mask


def _dtype(datatype: Any, info: ModelInfo) -> str:
    dtype = dtype_of(datatype)
    if info.spec is not None and info.spec.dtype != dtype:
        raise BadRequest(f"input {info.input_name!r} of model {info.name!r} has datatype "
                         f"{V2_DATATYPES[info.spec.dtype]}, got {datatype}")
    return dtype


def _fit_model(arr: np.ndarray[Any, Any], info: ModelInfo, lengths: bool = True
               ) -> np.ndarray[Any, Any]:
    """Every row must have the shape of the model's TensorSpec (free dims are free);
    ``lengths``: a variable length and the values (``min_value``, ``max_value``) are
    checked here (not for a masked input: its rows' real positions are, once cut)."""
    if info.spec is None:
        return arr
    want = (None, *info.spec.shape)
    fits = len(arr.shape) == len(want) and all(
        w is None or w == got for w, got in zip(want, arr.shape, strict=True))
    if not fits:
        raise BadRequest(f"input {info.input_name!r} has shape {list(arr.shape)}; model "
                         f"{info.name!r} takes {[-1, *_row_dims(info)]}")
    if lengths:
        if info.spec.variable:  # a variable length: at most the spec's max_len
            info.spec.check_length(arr.shape[1], info.input_name)
        info.spec.check_values(arr, f"input {info.input_name!r}")
    return arr


def input_tensor(data: dict[str, Any], info: ModelInfo, binary: bytes
                 ) -> tuple[np.ndarray[Any, Any], list[v2_masked.Run] | None]:
    """The request's one input as an array of shape ``[batch, *row]``, its values
    checked once (kinds, ranges, NaN/inf) against the datatype; with a mask input,
    also its rows cut to their real positions (``v2_masked.runs``)."""
    tensor, mask, mask_first = _only_input(data, info)
    dtype = _dtype(tensor.get("datatype"), info)
    shape = shape_of(tensor.get("shape"))
    if mask is None:
        arr = tensor_data(tensor, binary, dtype, shape)
        return _fit_model(TensorSpec(dtype, (None,) * len(shape)).check(arr), info), None
    own, other = _split_binary(binary, mask if mask_first else tensor)
    data_bytes, mask_bytes = (other, own) if mask_first else (own, other)
    arr = _fit_model(TensorSpec(dtype, (None,) * len(shape)).check(
        tensor_data(tensor, data_bytes, dtype, shape)), info, lengths=False)
    flags = v2_masked.read_mask(mask, mask_bytes, tuple(arr.shape[:2]))
    return arr, v2_masked.runs(arr, flags, info)


def _split_binary(binary: bytes, first: dict[str, Any]) -> tuple[bytes, bytes]:
    """The binary section cut after the bytes its first input claims."""
    size = v2_tensors.binary_size(first)
    return binary[:size], binary[size:]



def timeout_s(headers: body.Headers, params: dict[str, Any], default_s: float,
              max_s: float) -> float:
    """``parameters.timeout`` (microseconds, as Triton) may shorten the deadline, like
    v1's ``X-Redbatch-Timeout-Ms`` (also honoured here), never lengthen it."""
    chosen = body.timeout_s(headers, {}, default_s, max_s)
    raw = params.get("timeout")
    if raw is None:
        return chosen
    if type(raw) not in (int, float) or not 0 < raw < math.inf:
        raise BadRequest(f"parameters.timeout must be a positive number of microseconds, "
                         f"got {raw!r}")
    return min(chosen, float(raw) / 1e6)


def asked_timeout_s(raw: bytes, headers: body.Headers, config: GatewayConfig) -> float:
    """The deadline a call asks for before its model's info is known (the look-ups end
    by it): ``parameters.timeout`` or the header, else the gateway's default; the JSON
    is parsed for it only when it mentions a timeout."""
    header, _binary = split_body(raw, headers)
    params = mapping(body.parse_json(header).get("parameters"), "'parameters'") \
        if b'"timeout"' in header else {}
    return timeout_s(headers, params, config.default_timeout_s, config.max_timeout_s)


def parse_infer(raw: bytes, headers: body.Headers, info: ModelInfo, default_s: float,
                max_s: float) -> InferCall:
    header, binary = split_body(raw, headers)
    data = body.parse_json(header)
    params = mapping(data.get("parameters"), "'parameters'")
    tensor, runs = input_tensor(data, info, binary)
    return InferCall(request_id=_request_id(data), tensor=tensor, runs=runs,
                     timeout_s=timeout_s(headers, params, default_s, max_s),
                     outputs=v2_named.chosen_outputs(data, params, info),
                     priority=body.checked_priority(params.get("priority"),
                                                    "parameters.priority", info))


# --- answering ------------------------------------------------------------------
def _row_error(row: int, rows: int, exc: RedbatchError) -> RedbatchError:
    message = f"row {row} of {rows}: {exc}"
    if isinstance(exc, QueueFull):
        return QueueFull(message, exc.retry_after_s)
    return type(exc)(message)


@dataclass(frozen=True)
class Part:
    """One multi-row request of an infer call: its first row, its rows, its reply."""

    start: int
    rows: int
    result: Any  # the Reply, or the error its future raised


def parts_of(total: int, starts: list[int], results: list[Any]) -> list[Part]:
    ends = [*starts[1:], total]
    return [Part(start, end - start, result)
            for start, end, result in zip(starts, ends, results, strict=True)]


def settle(total: int, parts: list[Part]) -> list[Reply]:
    """The requests' replies, or the first failed row's error (naming the row)."""
    for part in parts:
        _check_part(total, part)
    return [part.result for part in parts]


def _check_part(total: int, part: Part) -> None:
    result = part.result
    if isinstance(result, RedbatchError):
        raise _row_error(part.start, total, result)
    if isinstance(result, BaseException):
        raise result
    if not result.ok:
        raise _row_error(part.start, total,
                         error_from_code(result.error_code, result.error_message))
    if result.row_errors:
        row = min(result.row_errors)
        raise _row_error(part.start + row, total, error_from_code(*result.row_errors[row]))


def _part_outputs(part: Part) -> np.ndarray[Any, Any]:
    """The outputs of one request's rows, as an array with one entry per row."""
    try:
        arr = np.asarray(part.result.payload)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"the rows' outputs do not stack into one tensor: {exc}") from exc
    if arr.ndim == 0 or len(arr) != part.rows:
        raise ModelError(f"a reply to {part.rows} rows did not hold {part.rows} outputs")
    return arr


def stack_outputs(parts: list[Part], spec: TensorSpec | None = None) -> np.ndarray[Any, Any]:
    """The requests' outputs, concatenated along the batch dimension (in the dtype of
    the model's ``output_spec``, when it declares one: a row's Python float comes back
    as float64 otherwise)."""
    outputs = [_part_outputs(part) for part in parts]
    try:
        arr = outputs[0] if len(outputs) == 1 else np.concatenate(outputs)
        if spec is not None:
            arr = arr.astype(spec.dtype, copy=False)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"the rows' outputs do not stack into one tensor: {exc}") from exc
    return v2_tensors.as_output(arr, "the model's output")


def _timing_headers(replies: list[Reply]) -> dict[str, str]:
    return {
        "x-redbatch-batch-size": str(max(r.timings.batch_size for r in replies)),
        "x-redbatch-queue-wait-ms": f"{max(r.timings.queue_wait_ms for r in replies):.1f}",
        "x-redbatch-forward-ms": f"{max(r.timings.forward_ms for r in replies):.2f}",
    }


def _listed(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def answer_head(info: ModelInfo, request_id: str | None) -> dict[str, Any]:
    """An infer answer's model name, version and the request's ``id``, if it gave one."""
    name, version = name_version(info)
    head: dict[str, Any] = {"model_name": name, "model_version": version}
    if request_id is not None:
        head["id"] = request_id
    return head


def _named_response(info: ModelInfo, call: InferCall, parts: list[Part]) -> Response:
    """The answer of one input's rows with named outputs, as ``v2_named`` gives it."""
    doc = answer_head(info, call.request_id)
    replies = settle(len(call.tensor), parts)
    try:
        return v2_named.respond(doc, call.outputs, replies, info, _timing_headers(replies),
                                len(call.tensor))
    except ModelError as exc:  # rows cut by a mask, of several lengths: as the one output
        if call.runs is None or len(call.runs) == 1:
            raise
        raise BadRequest(v2_masked.RAGGED_OUTPUTS) from exc


def infer_response(info: ModelInfo, call: InferCall, parts: list[Part]) -> Response:
    replies = settle(len(call.tensor), parts)
    try:
        arr = stack_outputs(parts, info.output_spec)
    except ModelError as exc:
        if call.runs is None or len(call.runs) == 1:
            raise
        raise BadRequest(v2_masked.RAGGED_OUTPUTS) from exc
    output: dict[str, Any] = {"name": info.output_name,
                              "datatype": V2_DATATYPES[arr.dtype.name],
                              "shape": list(arr.shape)}
    doc = answer_head(info, call.request_id)
    doc["outputs"] = [output]
    headers = _timing_headers(replies)
    if not call.outputs[info.output_name]:
        output["data"] = arr.ravel()  # orjson writes float32 as float32 (shortest form)
        content = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY, default=_listed)
        return Response(content, media_type="application/json", headers=headers)
    data = arr.tobytes()
    output["parameters"] = {"binary_data_size": len(data)}
    head = orjson.dumps(doc)
    headers["Inference-Header-Content-Length"] = str(len(head))
    return Response(head + data, media_type="application/octet-stream", headers=headers)


class V2Api:
    """The v2 handlers, on the gateway's producer client and model directory."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.repository = RepositoryApi(gateway)
        self._guarded_infer = _v2_errors(self._infer_call)

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        """Open without the API key: says nothing of Redis's address or its error (the
        gateway's log does)."""
        try:
            live = await self.gateway.directory.any_live_worker()
        except RedbatchError as exc:
            log.warning("not ready: %s", exc)
            return JSONResponse({"error": "redis unavailable"}, status_code=503,
                                headers={"Retry-After": "1"})
        if not live:
            raise NoLiveWorkers("redis is reachable but no worker is live")
        return Response(status_code=200)

    async def server(self, request: Request) -> Response:
        return JSONResponse(server_metadata())

    async def _versions(self, request: Request, open_only: bool = False
                        ) -> tuple[ModelInfo, list[str] | None]:
        """The info of the path's version (of ``latest`` when it names none), and the
        model's versions (None: served without versions); a draining version's too
        (its metadata, config and statistics stay readable while it drains), unless
        ``open_only`` (``NoLiveWorkers`` then)."""
        name, version = path_name(request)
        lookup_ms = protocol.now_ms() + round(1000 * self.gateway.core.config.default_timeout_s)
        table = await self.gateway.client.table(name, lookup_ms)
        version = table.latest if version is None else version
        if version is not None and version in table.versions and not open_only:
            served = table.served(name, version)
        else:
            served = table.route(name, version)
        return await self.gateway.directory.get(served, lookup_ms), table.ordered() or None

    async def _model(self, request: Request) -> ModelInfo:
        return (await self._versions(request))[0]

    async def _served(self, request: Request) -> ModelInfo:
        info = (await self._versions(request, open_only=True))[0]
        if not await self.gateway.client.live_workers(info.name):
            raise no_live_workers(info.name)
        return info

    async def metadata(self, request: Request) -> Response:
        return JSONResponse(model_metadata(*await self._versions(request)))

    async def config(self, request: Request) -> Response:
        return JSONResponse(model_config(await self._model(request)))

    async def stats(self, request: Request) -> Response:
        """One version's statistics, or (the path names none) every version's, as
        Triton's statistics extension answers."""
        name, version = path_name(request)
        if version is not None:
            return await self.repository.stats(request, [(await self._model(request)).name])
        lookup_ms = protocol.now_ms() + round(1000 * self.gateway.core.config.default_timeout_s)
        table = await self.gateway.client.table(name, lookup_ms)
        if not table:
            return await self.repository.stats(request, [(await self._model(request)).name])
        return await self.repository.stats(request, [table.served(name, v)
                                                     for v in table.ordered()])

    async def model_ready(self, request: Request) -> Response:
        """200 once a worker of the model is live; within ``PROBE_TIMEOUT_S`` (a
        stalled Redis: 503)."""
        try:
            async with deadline_bound(probe_deadline_ms(), "checking the model's workers"):
                await self._served(request)
        except DeadlineExceeded as exc:
            raise RedisUnavailable("redis did not answer in time") from exc
        return Response(status_code=200)

    async def infer(self, request: Request) -> Response:
        """Counted in the request metrics, as v1 predict is (errors included), under
        the served name of the version that answers when it is known: a request that
        pins none is pinned here to the version its cached table picks."""
        params, client = request.path_params, self.gateway.client
        if params.get("version") is None and (pick := client.cached_pick(params["name"])):
            params["version"] = Picked(pick)  # (``served`` picks again if it cannot serve)
        label = protocol.served_name(params["name"], params.get("version"))
        return await self.gateway.core.metered(label, self._guarded_infer(request))

    async def _infer_call(self, request: Request) -> Response:
        """Through the infer core, as v1 predict: the deadline runs from arrival and
        bounds the look-ups too."""
        arrived_ms, core = protocol.now_ms(), self.gateway.core
        headers = dict(request.headers.raw)
        body.check_content_type(headers, body.INFER_MEDIA_TYPES)  # (no cross-site form)
        name, version = path_name(request)
        raw = await core.read(headers, request.receive)  # (first: its timeout bounds the
        info = await core.served(name, headers, arrived_ms, version,  # look-ups too)
                                 asked_s=lambda: asked_timeout_s(raw, headers, core.config))
        if info.meta.get(protocol.F_STREAMING):
            raise BadRequest(f"model {name!r} streams its answers: use its generate_stream "
                             "endpoint (or generate, for the chunks joined in one answer)")
        if info.signature is not None:
            return await self._infer_named(info, raw, headers, arrived_ms)
        call = parse_infer(raw, headers, info, core.model_default_s(info),
                           core.config.max_timeout_s)
        deadline_ms = core.deadline_ms(info, arrived_ms, call.timeout_s)
        if call.runs is None:
            sent = await core.submit_tensor(info, call.tensor, deadline_ms, call.priority)
        else:
            starts, parts = v2_masked.slices(call.runs, core.client.pack_rows)
            sent = await core.submit_parts(info, starts, parts, deadline_ms, call.priority)
        results = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
        answered = parts_of(len(call.tensor), [s for s, _ in sent], list(results))
        if info.named_outputs is not None:  # a pipeline whose last stage names outputs
            return _named_response(info, call, answered)
        return infer_response(info, call, answered)

    async def _infer_named(self, info: ModelInfo, raw: bytes, headers: body.Headers,
                           arrived_ms: int) -> Response:
        """A model with named inputs and outputs (``v2_named``): multi-row requests of
        maps input name -> rows."""
        core = self.gateway.core
        header, binary = split_body(raw, headers)
        data = body.parse_json(header)
        params = mapping(data.get("parameters"), "'parameters'")
        doc = answer_head(info, _request_id(data))
        arrays = v2_named.input_arrays(data, info, binary)
        chosen = v2_named.chosen_outputs(data, params, info)
        deadline_ms = core.deadline_ms(info, arrived_ms, timeout_s(
            headers, params, core.model_default_s(info), core.config.max_timeout_s))
        priority = body.checked_priority(params.get("priority"), "parameters.priority", info)
        starts, parts = v2_named.slices(arrays, core.client.pack_rows)
        sent = await core.submit_parts(info, starts, parts, deadline_ms, priority)
        results = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
        total = len(next(iter(arrays.values())))
        replies = settle(total, parts_of(total, starts, list(results)))
        return v2_named.respond(doc, chosen, replies, info, _timing_headers(replies), total)


def v2_routes(gateway: Gateway) -> list[Route]:
    api, generate = V2Api(gateway), GenerateApi(gateway)
    model, version = "/v2/models/{name}", "/v2/models/{name}/versions/{version}"
    routes: list[tuple[str, Handler, str]] = [
        ("/v2", api.server, "GET"),
        ("/v2/health/live", api.live, "GET"),
        ("/v2/health/ready", api.ready, "GET"),
        ("/v2/repository/index", api.repository.index, "POST"),
        ("/v2/models/stats", api.repository.all_stats, "GET"),  # before {name}: "stats"
        (model, api.metadata, "GET"),
        (version, api.metadata, "GET"),
        (f"{model}/config", api.config, "GET"),
        (f"{version}/config", api.config, "GET"),
        (f"{model}/ready", api.model_ready, "GET"),
        (f"{version}/ready", api.model_ready, "GET"),
        (f"{model}/stats", api.stats, "GET"),
        (f"{version}/stats", api.stats, "GET"),
        (f"{model}/infer", api.infer, "POST"),
        (f"{version}/infer", api.infer, "POST"),
        (f"{model}/generate", generate.generate, "POST"),
        (f"{model}/generate_stream", generate.generate_stream, "POST"),
        (f"{version}/generate", generate.generate, "POST"),
        (f"{version}/generate_stream", generate.generate_stream, "POST"),
    ]
    return [Route(path, _v2_errors(handler), methods=[method]) for path, handler, method in routes]
