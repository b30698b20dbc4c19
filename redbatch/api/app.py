"""The HTTP gateway: a Starlette app with one reply listener per process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from redbatch import protocol
from redbatch.api import body
from redbatch.api.auth import ApiKeyMiddleware
from redbatch.api.directory import ModelDirectory, ModelInfo
from redbatch.api.errors import (
    error_response,
    from_exception,
    on_http_error,
    on_redbatch_error,
    on_unexpected,
)
from redbatch.api.fast import GatewayApp, RawResponse
from redbatch.api.openapi import openapi_routes
from redbatch.api.v2 import v2_routes
from redbatch.config import GatewayConfig, RedisSettings
from redbatch.errors import BadRequest, DeadlineExceeded, RedbatchError, error_from_code
from redbatch.producer.admission import no_live_workers
from redbatch.producer.client import Client
from redbatch.protocol import Reply
from redbatch.redis_conn import async_client

log = logging.getLogger("redbatch.api")


WATCH_AFTER_S = 0.05  # a request waiting this long notices its client's disconnect


@dataclass(frozen=True, slots=True)
class Pending:
    """An enqueued request whose reply the gateway awaits."""

    model: str
    request_id: str
    deadline_ms: int
    future: asyncio.Future[Reply]


class Gateway:
    """Holds the gateway's producer client and model directory."""

    def __init__(self, config: GatewayConfig, redis: RedisSettings) -> None:
        self.config = config
        self.redis_settings = redis
        self.client = Client(settings=redis, default_timeout_s=config.default_timeout_s,
                             max_timeout_s=config.max_timeout_s,
                             max_queue_len=config.max_queue_len,
                             max_waiters=config.max_waiters,
                             block_timeout_s=config.block_timeout_s,
                             require_workers=False)  # predict_core checks, with a deadline
        self._redis = async_client(redis)
        self.directory = ModelDirectory(self._redis, redis, config.meta_refresh_s)
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def redis(self) -> aioredis.Redis:
        """The gateway's own Redis client (model lookups, metrics)."""
        return self._redis

    async def start(self) -> None:
        try:
            await self.client.start()
        except RedbatchError as exc:  # serve 503s until Redis is back
            log.warning("gateway started without redis: %s", exc)
        log.info("gateway using redis at %s", self.redis_settings.safe_url)

    async def close(self) -> None:
        await self.client.close()
        await self._redis.aclose()

    async def predict(self, request: Request) -> Response | RawResponse:
        """The routed handler; ``GatewayApp`` serves the same requests ahead of it."""
        headers = dict(request.headers.raw)
        body.check_content_type(headers)
        return await self.predict_core(request.path_params["model"], headers, request.receive,
                                       body.trace_id(headers))

    async def predict_core(self, model: str, headers: body.Headers, receive: Receive,
                           trace_id: str = "") -> Response | RawResponse:
        """The deadline runs from the request's arrival and bounds every Redis call
        made for it: the look-ups (cached; bounded by the header's timeout, else the
        gateway's default, as the model's own is not known yet), the enqueue and the
        wait for the reply (bounded by the final deadline)."""
        arrived_ms = protocol.now_ms()
        config = self.config
        lookup_ms = arrived_ms + round(1000 * body.timeout_s(
            headers, {}, config.default_timeout_s, config.max_timeout_s))
        info = await self.directory.get(model, lookup_ms)
        if not await self.client.live_workers(model, lookup_ms):
            raise no_live_workers(model)
        data = body.parse_json(await body.read_body(headers, receive, config.max_body_bytes))
        value = body.model_input(data, info)
        deadline_ms = arrived_ms + round(1000 * body.timeout_s(
            headers, data, self.model_default_s(info), config.max_timeout_s))
        if protocol.now_ms() >= deadline_ms:
            raise DeadlineExceeded(f"deadline passed before model {model!r} was reached")
        self.client.set_queue_cap(model, info.max_queue_len)
        request_id, pending = await self.client.submit_reply(
            model, value, trace_id=trace_id, deadline_ms=deadline_ms)
        watch = asyncio.get_running_loop().call_later(
            WATCH_AFTER_S, self._watch, Pending(model, request_id, deadline_ms, pending),
            receive)
        try:
            reply = await pending
        except RedbatchError as exc:  # 503 or 504 after enqueueing: named as the request
            response = from_exception(exc)
            response.headers["x-request-id"] = trace_id or request_id
            return response
        finally:
            watch.cancel()
        return _reply_response(info, reply, trace_id or request_id)

    def _watch(self, pending: Pending, receive: Receive) -> None:
        """A request still waiting after ``WATCH_AFTER_S``: from now on, its client's
        disconnect cancels it (quick ones, most of them, never cost a task)."""
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
                            BadRequest("the client disconnected before the reply"))
        task = asyncio.create_task(self._mark_cancelled(pending))  # this one ends now
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _mark_cancelled(self, pending: Pending) -> None:
        try:
            await self.client.mark_cancelled(pending.model, pending.request_id,
                                             pending.deadline_ms)
        except RedbatchError as exc:
            log.warning("could not mark request %s of model %s cancelled: %s",
                        pending.request_id, pending.model, exc)

    def model_default_s(self, info: ModelInfo) -> float:
        """The deadline of a request that sets none: the model's own default if it has
        one, else the gateway's; never past ``max_timeout_s``."""
        return min(info.default_timeout_s or self.config.default_timeout_s,
                   self.config.max_timeout_s)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"models": await self.directory.listing()})

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.client.stats())

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        try:
            live = await self.directory.any_live_worker()
        except RedbatchError as exc:  # open without the key: the address stays in the log
            log.warning("not ready: %s", exc)
            return error_response(503, exc.code, "redis unavailable", {"Retry-After": "1"})
        if not live:
            return error_response(503, "no_workers", "redis is reachable but no worker is live",
                                  {"Retry-After": "1"})
        return JSONResponse({"status": "ready"})


def _reply_response(info: ModelInfo, reply: Reply, request_id: str) -> Response | RawResponse:
    """200 with the model's output, or the reply's typed error as JSON; both carry
    ``X-Request-ID``."""
    if not reply.ok:
        response = from_exception(error_from_code(reply.error_code, reply.error_message))
        response.headers["x-request-id"] = request_id
        return response
    content = orjson.dumps({info.output_name: reply.payload}, default=_jsonable,
                           option=orjson.OPT_SERIALIZE_NUMPY)
    timings = reply.timings
    return RawResponse(200, [
        (b"content-type", b"application/json"),
        (b"x-request-id", request_id.encode()),
        (b"x-redbatch-batch-size", b"%d" % timings.batch_size),
        (b"x-redbatch-queue-wait-ms", b"%.1f" % timings.queue_wait_ms),
        (b"x-redbatch-forward-ms", b"%.2f" % timings.forward_ms),
    ], content)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def _routes(gateway: Gateway) -> list[Route]:
    return [
        Route("/v1/models/{model}/predict", gateway.predict, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/stats", gateway.stats, methods=["GET"]),
        Route("/healthz", gateway.healthz, methods=["GET"]),
        Route("/readyz", gateway.readyz, methods=["GET"]),
        *v2_routes(gateway),
        *openapi_routes(),
    ]


def _lifespan(gateway: Gateway) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    return lifespan


def create_app(config: GatewayConfig | None = None, redis: RedisSettings | None = None
               ) -> Starlette:
    """The ASGI app.  ``app.state.gateway`` holds the ``Gateway``."""
    gateway = Gateway(config or GatewayConfig(), redis or RedisSettings.from_env())
    handlers: dict[Any, Any] = {RedbatchError: on_redbatch_error, HTTPException: on_http_error,
                                Exception: on_unexpected}
    key = gateway.config.api_key
    middleware = [Middleware(ApiKeyMiddleware, api_key=key)] if key else []
    app = GatewayApp(routes=_routes(gateway), exception_handlers=handlers,
                     lifespan=_lifespan(gateway), middleware=middleware)
    app.api_key = key.encode() if key else None
    app.state.gateway = gateway
    return app
