"""The one infer core: v1 predict (POST or GET), and v2 infer, go through it.

The deadline runs from the request's arrival and bounds every Redis call made for
it: the look-ups (cached; bounded by the header's timeout, else the gateway's
default, as the model's own is not known yet), the enqueue and the wait for the
reply (bounded by the final deadline).  The model's own limits (default timeout,
queue cap) travel with each call; the request metrics are recorded here too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import orjson
from prometheus_client import Gauge, Histogram
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from redbatch import metrics, protocol
from redbatch.api import body, streaming
from redbatch.api.directory import ModelDirectory, ModelInfo
from redbatch.api.errors import error_response, from_exception
from redbatch.config import GatewayConfig
from redbatch.errors import (
    BadRequest,
    ClientDisconnected,
    DeadlineExceeded,
    ModelError,
    NoLiveWorkers,
    RedbatchError,
    UnknownModel,
    error_from_code,
)
from redbatch.pipelines.definition import meta_stages
from redbatch.producer import packing
from redbatch.producer.admission import no_live_workers
from redbatch.producer.client import Client
from redbatch.protocol import Reply
from redbatch.spec import TensorSpec

log = logging.getLogger("redbatch.api")

WATCH_AFTER_S = 0.05  # a request waiting this long notices its client's disconnect
RawHeaders = list[tuple[bytes, bytes]]


class RawResponse:
    """A response ready to send: status, headers and body, as ASGI wants them."""

    __slots__ = ("body", "headers", "status_code")

    def __init__(self, status: int, headers: RawHeaders, body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", str(len(self.body)).encode()), *self.headers]
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class Answer(Protocol):
    status_code: int


AnswerT = TypeVar("AnswerT", bound=Answer)


@dataclass(frozen=True, slots=True)
class Pending:
    """An enqueued request whose reply the gateway awaits."""

    model: str
    request_id: str
    deadline_ms: int
    future: asyncio.Future[Reply]
    stages: tuple[str, ...] = ()  # a pipeline request's: its stages (each one skips it)


class InferCore:
    """Look-up, live-worker check, body, deadline, admission and submit, once."""

    def __init__(self, client: Client, directory: ModelDirectory,
                 config: GatewayConfig) -> None:
        self.client = client
        self.directory = directory
        self.config = config
        self.meters = metrics.GatewayMeters()
        self._watchers: set[asyncio.Task[None]] = set()

    # --- the steps -------------------------------------------------------------
    async def served(self, model: str, headers: body.Headers, arrived_ms: int,
                     version: str | None = None, plain: bool | None = None,
                     asked_s: Callable[[], float] | None = None) -> ModelInfo:
        """The info of the model (of the version pinned, else picked by its routing
        table: ``Client.route``) once a live worker serves it; the look-ups end by the
        header's timeout (else the gateway's default) from arrival, or by the caller's
        own timeout in its body (``asked_s``, read only when Redis is to be read: a
        stalled Redis answers a call that asked for 2 s with a 504 at 2 s).  ``plain``:
        the request's verdict ``Client.direct``, when its caller took it (None: taken
        here)."""
        config = self.config
        if plain is None:
            plain = version is None and self.client.direct(model)
        lookup_s = body.timeout_s(headers, {}, config.default_timeout_s, config.max_timeout_s)
        if asked_s is not None and not (plain and self.directory.cached(model)):
            lookup_s = min(lookup_s, asked_s())
        lookup_ms = arrived_ms + round(1000 * lookup_s)
        if plain:  # its own name; a live worker
            return await self.directory.get(model, lookup_ms)
        if isinstance(version, Picked):  # the gateway's pick, by a table it had cached
            try:
                return await self._live_info(await self.client.route(
                    model, version, lookup_ms), lookup_ms)
            except (NoLiveWorkers, UnknownModel):
                version = None  # it cannot serve: picked again, by live workers
        return await self._live_info(await self.client.route(model, version, lookup_ms),
                                     lookup_ms)

    async def _live_info(self, name: str, lookup_ms: int) -> ModelInfo:
        """The info of served name ``name`` once a live worker serves it."""
        info = await self.directory.get(name, lookup_ms)
        if not await self.client.live_workers(name, lookup_ms):
            raise no_live_workers(name)
        return info

    async def read(self, headers: body.Headers, receive: Receive) -> bytes:
        """A v2 request's body (v1's ``predict`` calls ``body.read_body`` itself: one
        call less per request, so an override of this one does not reach v1)."""
        return await body.read_body(headers, receive, self.config.max_body_bytes)

    def asked_s(self, headers: body.Headers, data: dict[str, Any]) -> float:
        """The caller's own timeout (header or ``timeout_ms``), else the gateway's."""
        return body.timeout_s(headers, data, self.config.default_timeout_s,
                              self.config.max_timeout_s)

    def model_default_s(self, info: ModelInfo) -> float:
        """The deadline of a request that sets none: the model's own default if it has
        one, else the gateway's; never past ``max_timeout_s``."""
        return min(info.default_timeout_s or self.config.default_timeout_s,
                   self.config.max_timeout_s)

    @staticmethod
    def deadline_ms(info: ModelInfo, arrived_ms: int, timeout_s: float) -> int:
        """The request's absolute deadline; ``DeadlineExceeded`` once it has passed."""
        deadline_ms = arrived_ms + round(1000 * timeout_s)
        if protocol.now_ms() >= deadline_ms:
            raise DeadlineExceeded(f"deadline passed before model {info.name!r} was reached")
        return deadline_ms

    async def submit_tensor(self, info: ModelInfo, tensor: np.ndarray[Any, Any],
                            deadline_ms: int, priority: int | None = None
                            ) -> list[tuple[int, asyncio.Future[Reply]]]:
        """A batch tensor as multi-row requests (one enqueue), sliced into views of up
        to a pack's rows, never split into rows: each one's first row and the future
        of its ``Reply`` (whose ``row_errors`` name its failed rows)."""
        starts, parts = packing.slices(tensor, self.client.pack_rows)
        return await self.submit_parts(info, starts, parts, deadline_ms, priority)

    async def submit_parts(self, info: ModelInfo, starts: list[int], parts: list[Any],
                           deadline_ms: int, priority: int | None = None
                           ) -> list[tuple[int, asyncio.Future[Reply]]]:
        """Multi-row requests (``parts``, each starting at row ``starts[i]``) in one
        enqueue: each one's first row and the future of its ``Reply``."""
        futures = await self.client.submit_many(
            info.name, parts, reply=True, batched=True, deadline_ms=deadline_ms,
            max_queue_len=info.max_queue_len, priority=priority)
        return list(zip(starts, futures, strict=True))

    # --- v1 predict -------------------------------------------------------------
    async def serve(self, model: str, scope: Scope, receive: Receive, send: Send,
                    version: str | None = None) -> None:
        """Answer ``POST`` or ``GET /v1/models/{model}[/versions/{version}]/predict``
        (metered under the served name of the version that answers, when known).  The
        plain verdict (``Client.direct``) is taken here and passed down (``predict``
        takes it again after the body read)."""
        plain = False
        if not version:  # a plain model has no version to pick (no table read)
            plain = self.client.direct(model)
            version = None if plain else picked(self.client.cached_pick(model))
        response = await self.metered(
            model if version is None else protocol.served_name(model, version),
            self._respond(model, scope, receive, version, plain))
        await response(scope, receive, send)

    async def _respond(self, model: str, scope: Scope, receive: Receive,
                       version: str | None = None, plain: bool = False
                       ) -> RawResponse | Response:
        """The response, with ``X-Request-ID``: the caller's, else the request's id (set
        by ``predict`` on answers from a worker), else a fresh one (errors before
        enqueueing, a bad X-Request-ID among them)."""
        headers: body.Headers = dict(scope["headers"])
        trace = ""
        try:
            trace = body.trace_id(headers)
            query: bytes | None = scope.get("query_string", b"")
            if scope["method"] not in ("GET", "HEAD"):  # (HEAD: a GET's answer, no body)
                body.check_content_type(headers)
                query = None
            return await self.predict(model, headers, receive, trace, query, version, plain)
        except RedbatchError as exc:
            response = from_exception(exc)
            trace = trace or exc.request_id  # (one enqueued before it failed: its own id)
            if version and self.directory.cached(served := protocol.served_name(model, version)):
                tag_version(response, served)  # (a version refused it)
        except Exception:
            log.exception("unexpected error on %s %s (request id %s)", scope["method"],
                          scope["path"], trace)
            response = error_response(500, "internal", "internal error; see the gateway log")
        response.headers["x-request-id"] = trace or protocol.new_request_id()
        return response

    async def predict(self, model: str, headers: body.Headers, receive: Receive,
                      trace_id: str = "", query: bytes | None = None,
                      version: str | None = None, plain: bool = False
                      ) -> Response | RawResponse:
        """One v1 request: its input from the JSON body, or from ``query`` (a GET).
        ``plain``: ``Client.direct`` said so for ``model`` (no version pinned) when the
        request arrived: its info from the directory's cache while fresh; judged again
        once the body is read, its request straight to the model's queue while the
        verdict holds (``Client._submit_direct``), else down the full path."""
        arrived_ms = protocol.now_ms()
        # (the model's info cached: the body is read after it; else first, so that its
        # ``timeout_ms`` bounds the look-ups, a malformed body's 400 coming first then)
        info = self.directory.cached(model) if plain and body.TIMEOUT_HEADER not in headers \
            else None
        data = None
        if info is None:  # a look-up: a POST's body first (its ``timeout_ms`` bounds it)
            if query is None:
                data = body.parse_json(await body.read_body(headers, receive,
                                                            self.config.max_body_bytes))
            asked = data if data is not None else query_timeout(query or b"")
            info = await self.served(model, headers, arrived_ms, version, plain,
                                     lambda: self.asked_s(headers, asked))
        if data is None:
            raw = await body.read_body(headers, receive, self.config.max_body_bytes)
            data = body.parse_json(raw) if query is None else query_input(query, raw, info)
        # judged again (a cached verdict): a pipeline, version or sub-queue that came
        # during a slow upload sends the request down the full path (``Client.submit``)
        plain = plain and self.client.direct(model)
        if info.meta.get(protocol.F_STREAMING):
            if query is not None:
                raise BadRequest(f"model {info.name!r} is a streaming model: call it with "
                                 "POST and a JSON body of its fields (GET takes numbers "
                                 "for one input)")
            return await self.stream(info, data, headers, arrived_ms, trace_id,
                                     streaming.v1_shapes(info.output_name),
                                     streaming.wants_sse(headers), receive)
        value = body.model_input(data, info)
        deadline_ms = self.deadline_ms(info, arrived_ms, body.timeout_s(
            headers, data, self.model_default_s(info), self.config.max_timeout_s))
        submit = self.client._submit_direct if plain else self.client.submit
        pending = await submit(info.name, value, reply=True, trace_id=trace_id,
                               deadline_ms=deadline_ms, max_queue_len=info.max_queue_len,
                               priority=body.priority_header(headers, info))
        request_id = pending.request_id
        watch = asyncio.get_running_loop().call_later(  # most end first: no task, no Pending
            WATCH_AFTER_S, self._watch, pending.tag or info.name, request_id, deadline_ms,
            pending, receive, info.meta)
        try:
            reply = await pending
        except RedbatchError as exc:  # 503 or 504 after enqueueing: named as the request
            response = from_exception(exc)
            response.headers["x-request-id"] = trace_id or request_id
            tag_version(response, info.name)
            return response
        finally:
            watch.cancel()
        return reply_response(info, reply, trace_id or request_id)

    async def stream(self, info: ModelInfo, data: dict[str, Any], headers: body.Headers,
                     arrived_ms: int, trace_id: str, shapes: tuple[streaming.Shape,
                                                                   streaming.Final],
                     sse: bool, receive: Receive) -> streaming.StreamAnswer:
        """A streaming model's answer (``redbatch.api.streaming``): the body's fields
        are its input; the deadline bounds the whole stream.  Its one priority level
        is the only one an ``X-Redbatch-Priority`` header may name (400 otherwise)."""
        deadline_ms = self.deadline_ms(info, arrived_ms, body.timeout_s(
            headers, data, self.model_default_s(info), self.config.max_timeout_s))
        body.priority_header(headers, info)
        stream = self.client.stream(info.name, streaming.stream_input(data),
                                    deadline_ms=deadline_ms, trace_id=trace_id,
                                    max_queue_len=info.max_queue_len, chunks=True)
        try:
            first = await streaming.first_chunk(stream, receive)
        except RedbatchError as exc:  # failed before its first chunk: its answer is
            exc.request_id = stream.request_id  # named as the request (``_respond``)
            raise
        answer = streaming.StreamAnswer(stream, first, shapes, sse,
                                        trace_id or stream.request_id)
        if protocol.VERSION_SEP in info.name:  # a version answers: which one
            answer.raw_headers.append((b"x-redbatch-version", info.name.partition(
                protocol.VERSION_SEP)[2].encode()))
        return answer

    # --- metrics ---------------------------------------------------------------
    async def metered(self, model: str, respond: Awaitable[AnswerT]) -> AnswerT:
        """``respond``'s response, counted: duration, in flight, outcome by status.  A
        streamed answer counts its first chunk now, its duration and its time in flight
        once its last chunk is sent (``StreamAnswer.on_end``)."""
        started = time.perf_counter()
        label = self._label(model)
        duration, inflight, outcomes = self.meters.get(label)
        inflight.inc()
        try:
            response = await respond
        except BaseException:
            inflight.dec()
            raise
        if label != model:  # a name that may have become known meanwhile: labelled anew
            label = self._label(model)
            duration, _, outcomes = self.meters.get(label)
        outcomes[metrics.outcome_of(response.status_code, getattr(response, "code", None))
                 ].inc()
        if isinstance(response, streaming.StreamAnswer):
            self.meters.first_chunk(label).observe(time.perf_counter() - started)
            response.on_end = functools.partial(_ended, inflight, duration, started)
        else:
            inflight.dec()
            duration.observe(time.perf_counter() - started)
        return response

    def _label(self, model: str) -> str:
        """Model names from URLs become labels only once a worker registered them (a
        version's served name: else its model's, as version "1" of one served
        without versions)."""
        if self.directory.known(model) or self.client.has_versions(model):
            return model
        base = model.partition(protocol.VERSION_SEP)[0]
        return base if base != model and self.directory.known(base) else \
            metrics.UNKNOWN_MODEL

    # --- disconnects -------------------------------------------------------------
    async def aclose(self) -> None:
        """End the disconnect watchers and the cancel marks still under way (the gateway
        stops: its requests go with it) before the client's connection pool closes."""
        watchers = list(self._watchers)
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)

    def _watch(self, model: str, request_id: str, deadline_ms: int,
               future: asyncio.Future[Reply], receive: Receive, meta: dict[str, Any]) -> None:
        """A request still waiting after ``WATCH_AFTER_S``: from now on, its client's
        disconnect cancels it (quick ones, most of them, never cost a task)."""
        pending = Pending(model, request_id, deadline_ms, future, meta_stages(meta))
        task = asyncio.create_task(self._on_disconnect(pending, receive))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        pending.future.add_done_callback(lambda _f: task.cancel())

    async def _on_disconnect(self, pending: Pending, receive: Receive) -> None:
        """Once the client is gone, free the request's waiter and mark it cancelled,
        so that a worker skips it (the body was read: the next message is the end)."""
        message = await receive()
        if message["type"] != "http.disconnect" or pending.future.done():
            return
        self.client.abandon(pending.request_id,
                            ClientDisconnected("the client disconnected before the reply"),
                            pending.model)
        task = asyncio.create_task(self._mark_cancelled(pending))  # this one ends now
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _mark_cancelled(self, pending: Pending) -> None:
        """Mark the request cancelled where it is claimed: at its model, or at every
        stage of its pipeline (each stage's workers skip it: the stage it is queued at,
        or the next one it reaches), each stage's set in its own slot.  One stage after
        another, the last first (so a request cannot slip past an unmarked later stage),
        on one pool connection at a time: a mass disconnect takes no more of the pool
        the requests share than a model's."""
        for tag in reversed(pending.stages or (pending.model,)):
            await self._mark_one(tag, pending)

    async def _mark_one(self, tag: str, pending: Pending) -> None:
        try:
            await self.client.mark_cancelled(tag, pending.request_id, pending.deadline_ms)
        except RedbatchError as exc:
            log.warning("could not mark request %s of model %s cancelled: %s",
                        pending.request_id, tag, exc)


def _ended(inflight: Gauge, duration: Histogram, started: float) -> None:
    """A request's answer is sent (a stream's last chunk): counted out, its duration
    observed."""
    inflight.dec()
    duration.observe(time.perf_counter() - started)


class PredictEndpoint:
    """The routed ``/v1/models/{model}/predict`` (an ASGI app): ``GatewayApp`` serves
    GET and POST ahead of the router, so the route answers other methods with 405."""

    def __init__(self, core: InferCore) -> None:
        self.core = core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]
        await self.core.serve(params["model"], scope, receive, send, params.get("version"))


# --- GET: the input in the query string -------------------------------------------
def _query_fields(info: ModelInfo) -> int:
    """The most query fields a GET of ``info`` may hold: the values of its input (or of
    each named input) as repeated keys, and a few more (its mask, ``timeout_ms``)."""
    inputs = len(info.signature.inputs) if info.signature is not None else 1
    return protocol.MAX_QUERY_VALUES * inputs + 8


def query_timeout(query: bytes) -> dict[str, Any]:
    """A GET's ``timeout_ms``, read from its query string before the model's info (the
    look-ups end by it too); {} without one, or when the query cannot be read (its
    400 comes with its input's)."""
    if body.TIMEOUT_FIELD.encode() not in query:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(query.decode("latin-1"), errors="strict")
    except (UnicodeDecodeError, ValueError):
        return {}
    values = [value for key, value in pairs if key == body.TIMEOUT_FIELD]
    return {body.TIMEOUT_FIELD: values[0]} if len(values) == 1 else {}


def query_input(query: bytes, raw_body: bytes, info: ModelInfo) -> dict[str, Any]:
    """The fields of a GET's query string that a POST body would hold: the model's
    input (JSON numbers; a repeated key or a comma list makes a list), or each named
    input under its own name, its spec's mask field, and ``timeout_ms``.  Other keys
    are ignored, as a body's other fields are."""
    if raw_body:
        raise BadRequest("a GET predict takes its input from the query string, not a body")
    try:
        pairs = urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True,
                                       errors="strict",
                                       max_num_fields=_query_fields(info))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"unreadable query string: {exc}") from exc
    fields: dict[str, list[str]] = {}
    for key, value in pairs:
        fields.setdefault(key, []).append(value)
    data: dict[str, Any] = {}
    if info.signature is not None:  # named inputs: one query parameter each
        data[info.input_name] = {
            name: _shaped(_query_value(name, fields[name]), info.signature.inputs[name])
            for name in info.signature.inputs if name in fields}
    elif info.input_name in fields:
        data[info.input_name] = _shaped(_query_value(info.input_name,
                                                     fields[info.input_name]), info.spec)
    mask = info.spec.mask if info.spec is not None else None
    if mask is not None and mask in fields:
        data[mask] = _query_value(mask, fields[mask])
    if body.TIMEOUT_FIELD in fields:
        data[body.TIMEOUT_FIELD] = _single(body.TIMEOUT_FIELD, fields[body.TIMEOUT_FIELD])
    return data


def _shaped(value: Any, spec: TensorSpec | None) -> Any:
    """One number for an input whose spec has dimensions: a list of one (``?x=5`` for
    an input of shape ``(None,)``)."""
    if spec is not None and spec.shape and not isinstance(value, list):
        return [value]
    return value


def _single(key: str, values: list[str]) -> str:
    if len(values) != 1:
        raise BadRequest(f"query parameter {key!r} is given {len(values)} times")
    return values[0]


def _query_value(key: str, values: list[str]) -> Any:
    items = [_number(key, item) for value in values for item in value.split(",")]
    if len(items) > protocol.MAX_QUERY_VALUES:
        raise BadRequest(f"query parameter {key!r} holds {len(items)} values; at most "
                         f"{protocol.MAX_QUERY_VALUES}")
    return items if len(values) > 1 or "," in values[0] else items[0]


def _number(key: str, text: str) -> int | float:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    if type(value) not in (int, float) or not math.isfinite(value):
        raise BadRequest(f"query parameter {key!r}: {text[:40]!r} is not a finite number")
    number: int | float = value
    return number


# --- answers --------------------------------------------------------------------
class Picked(str):
    """A version the gateway picked, by weight from its cached table, for a request
    that pinned none (the caller's pin is a plain ``str``): ``served`` picks again, by
    live workers, when it cannot serve (the table's live counts were stale)."""


def picked(version: str | None) -> Picked | None:
    return None if version is None else Picked(version)


def tag_version(response: Response, name: str) -> None:
    """``x-redbatch-version`` on an error answered by a version (``name``: served)."""
    if protocol.VERSION_SEP in name:
        response.headers["x-redbatch-version"] = name.partition(protocol.VERSION_SEP)[2]


def reply_response(info: ModelInfo, reply: Reply, request_id: str) -> Response | RawResponse:
    """200 with the model's output, or the reply's typed error as JSON; both carry
    ``X-Request-ID``."""
    if not reply.ok:
        response = from_exception(error_from_code(reply.error_code, reply.error_message))
        response.headers["x-request-id"] = request_id
        tag_version(response, info.name)
        return response
    try:
        content = orjson.dumps({info.output_name: reply.payload}, default=body.jsonable,
                               option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:  # bytes, or nested deeper than orjson writes (254 levels)
        failed = ModelError(f"the output of model {info.name!r} cannot be written as "
                            f"JSON: {exc}")
        return reply_response(info, Reply(reply.id, False, error_code=failed.code,
                                          error_message=str(failed)), request_id)
    timings = reply.timings
    headers = [
        (b"content-type", b"application/json"),
        (b"x-request-id", request_id.encode()),
        (b"x-redbatch-batch-size", b"%d" % timings.batch_size),
        (b"x-redbatch-queue-wait-ms", b"%.1f" % timings.queue_wait_ms),
        (b"x-redbatch-forward-ms", b"%.2f" % timings.forward_ms),
    ]
    if protocol.VERSION_SEP in info.name:  # a version answered: which one
        headers.append((b"x-redbatch-version", info.name.partition(protocol.VERSION_SEP)[2]
                        .encode()))
    return RawResponse(200, headers, content)
