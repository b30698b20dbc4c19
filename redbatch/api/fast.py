"""The hot path: ``POST /v1/models/{model}/predict`` answered ahead of Starlette.

Starlette's middleware stack (error and exception middleware, the router) and its
``Response`` objects cost about a third of the gateway's CPU per request (py-spy,
W2 at 64 connections).  ``GatewayApp`` serves predict requests before them, with the
same handler (``Gateway.predict_core``), the same API-key check and the same JSON
errors, and sends the response as two raw ASGI messages.  Every other route goes
through Starlette as usual.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from redbatch import metrics, protocol
from redbatch.api import body, metrics_view
from redbatch.api.auth import presented_key
from redbatch.api.errors import error_response, from_exception
from redbatch.errors import RedbatchError

if TYPE_CHECKING:
    from redbatch.api.app import Gateway

log = logging.getLogger("redbatch.api")
PREDICT_PATH = re.compile(r"^/v1/models/([^/]+)/predict$")
Headers = list[tuple[bytes, bytes]]


class RawResponse:
    """A response ready to send: status, headers and body, as ASGI wants them."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: Headers, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", str(len(self.body)).encode()), *self.headers]
        await send({"type": "http.response.start", "status": self.status,
                    "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class GatewayApp(Starlette):
    """Starlette, with predict requests served first.  ``state.gateway`` is the
    ``Gateway``; ``api_key`` (bytes), when set, guards the fast path as
    ``ApiKeyMiddleware`` guards the rest."""

    api_key: bytes | None = None

    meters = metrics.GatewayMeters()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PREDICT_PATH.match(scope["path"]) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            if scope["type"] == "http" and scope["path"] == "/metrics":
                await self._metrics(scope, receive, send)
                return
            await super().__call__(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key is not None and not hmac.compare_digest(presented_key(headers),
                                                                self.api_key):
            await error_response(401, "unauthorized", "missing or wrong API key",
                                 {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self._predict(match.group(1), headers, scope, receive, send)

    async def _predict(self, model: str, headers: dict[bytes, bytes], scope: Scope,
                       receive: Receive, send: Send) -> None:
        gateway: Gateway = self.state.gateway
        started = time.perf_counter()
        inflight = self.meters.get(self._label(gateway, model))[1]
        inflight.inc()
        try:
            response = await self._respond(gateway, model, headers, scope, receive)
            await response(scope, receive, send)
        finally:
            inflight.dec()
        duration, _, outcomes = self.meters.get(self._label(gateway, model))
        status = response.status if isinstance(response, RawResponse) else response.status_code
        outcomes[metrics.outcome_of(status)].inc()
        duration.observe(time.perf_counter() - started)

    @staticmethod
    def _label(gateway: Gateway, model: str) -> str:
        """Model names from URLs become labels only once a worker registered them."""
        return model if gateway.directory.known(model) else metrics.UNKNOWN_MODEL

    async def _respond(self, gateway: Gateway, model: str, headers: dict[bytes, bytes],
                       scope: Scope, receive: Receive) -> RawResponse | Response:
        """The response, with ``X-Request-ID``: the caller's, else the request's id (set
        by ``predict_core`` on answers from a worker), else a fresh one (errors before
        enqueueing, a bad X-Request-ID among them)."""
        trace = ""
        try:
            trace = body.trace_id(headers)
            body.check_content_type(headers)
            return await gateway.predict_core(model, headers, receive, trace)
        except RedbatchError as exc:
            response = from_exception(exc)
        except Exception:
            log.exception("unexpected error on POST %s (request id %s)", scope["path"], trace)
            response = error_response(500, "internal", "internal error; see the gateway log")
        response.headers["x-request-id"] = trace or protocol.new_request_id()
        return response

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Open like the health checks: Prometheus scrapes it without the API key."""
        body = await metrics_view.exposition(self.state.gateway)
        response = RawResponse(200, [(b"content-type", metrics.CONTENT_TYPE.encode())], body)
        await response(scope, receive, send)

