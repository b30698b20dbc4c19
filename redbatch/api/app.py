"""The HTTP gateway: a Starlette app whose process has one reply listener per model
with requests in flight."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from redbatch.api.auth import ApiKeyMiddleware
from redbatch.api.core import PredictEndpoint
from redbatch.api.errors import on_http_error, on_redbatch_error, on_unexpected
from redbatch.api.fast import GatewayApp
from redbatch.api.gateway import Gateway
from redbatch.api.knobs_view import knobs_routes
from redbatch.api.openapi import openapi_routes
from redbatch.api.v2 import v2_routes
from redbatch.api.versions_view import versions_routes
from redbatch.config import GatewayConfig, RedisSettings
from redbatch.errors import RedbatchError

__all__ = ["Gateway", "create_app"]


def _routes(gateway: Gateway) -> list[Route]:
    return [
        Route("/v1/models/{model}/predict", PredictEndpoint(gateway.core),
              methods=["GET", "POST"]),
        Route("/v1/models/{model}/versions/{version}/predict", PredictEndpoint(gateway.core),
              methods=["GET", "POST"]),
        *versions_routes(gateway),
        Route("/v1/models", gateway.models, methods=["GET"]),
        *knobs_routes(gateway),
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
