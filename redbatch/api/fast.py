"""The hot path: ``/v1/models/{model}/predict`` (POST, GET; and a pinned version's
``/v1/models/{model}/versions/{version}/predict``) answered ahead of Starlette.

Starlette's middleware stack (error and exception middleware, the router) and its
``Response`` objects cost about a third of the gateway's CPU per request (py-spy,
W2 at 64 connections).  ``GatewayApp`` serves predict requests before them, with the
infer core (``InferCore.serve``), the same API-key check (``auth.refusal``) and the
same JSON errors, and sends the response as two raw ASGI messages.  Every other
route goes through Starlette as usual.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from redbatch import metrics, protocol
from redbatch.api import auth, body, metrics_view
from redbatch.api.core import RawResponse
from redbatch.api.errors import error_response
from redbatch.errors import BadRequest

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

PREDICT_PATH = re.compile(r"^/v1/models/([^/]+)(?:/versions/([^/]+))?/predict$")
PREDICT_METHODS = frozenset({"POST", "GET"})
METRICS_METHODS = frozenset({"GET", "HEAD"})


class GatewayApp(Starlette):
    """Starlette, with predict requests served first.  ``state.gateway`` is the
    ``Gateway``; ``api_key`` (bytes), when set, guards the fast path as
    ``ApiKeyMiddleware`` guards the rest."""

    api_key: bytes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PREDICT_PATH.match(scope["path"]) if scope["type"] == "http" else None
        if match is None or scope["method"] not in PREDICT_METHODS:
            if scope["type"] == "http" and scope["path"] == "/metrics":
                await self._metrics(scope, receive, send)
                return
            await super().__call__(scope, receive, send)
            return
        refused = auth.refusal(scope, self.api_key)
        if refused is not None:  # (named as every predict answer is: its own id when the
            refused.headers["x-request-id"] = _named(scope)  # caller's is no good)
            await refused(scope, receive, send)
            return
        gateway: Gateway = self.state.gateway
        await gateway.core.serve(match.group(1), scope, receive, send, match.group(2))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Open like the health checks: Prometheus scrapes it without the API key.  Only
        GET (and HEAD) read it: another method is 405, as on the other routes."""
        if scope["method"] not in METRICS_METHODS:
            refused = error_response(405, "http_error", "Method Not Allowed",
                                     {"Allow": ", ".join(sorted(METRICS_METHODS))})
            await refused(scope, receive, send)
            return
        body = await metrics_view.exposition(self.state.gateway)
        response = RawResponse(200, [(b"content-type", metrics.CONTENT_TYPE.encode())], body)
        await response(scope, receive, send)


def _named(scope: Scope) -> str:
    """The request id of an answer refused before the request was read: the caller's
    ``X-Request-ID`` if it is a good one, else a new id (the 401 stands, not a 400)."""
    try:
        return body.trace_id(dict(scope["headers"])) or protocol.new_request_id()
    except BadRequest:
        return protocol.new_request_id()
