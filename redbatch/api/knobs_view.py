"""``/v1/models/{model}/config``: a model's live knobs (``redbatch.knobs``).  GET shows
the stored overrides and the effective values; PATCH (a JSON object of knob -> value,
null to drop an override) checks and stores them, which every worker of the model
applies within a heartbeat or two.  Behind the API key like every route but health."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from redbatch import knobs
from redbatch.api import body
from redbatch.redis_conn import translated

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from redbatch.api.gateway import Gateway

CONFIG_PATH = "/v1/models/{model}/config"


def knobs_routes(gateway: Gateway) -> list[Route]:
    return admin_routes(gateway, CONFIG_PATH, knobs.show, knobs.configure)


Show = Callable[["aioredis.Redis", str], Awaitable[dict[str, Any]]]
Change = Callable[["aioredis.Redis", str, Any], Awaitable[dict[str, Any]]]


def admin_routes(gateway: Gateway, path: str, show: Show, change: Change) -> list[Route]:
    """GET ``path`` answers ``show(redis, model)``; PATCH (a JSON body) answers
    ``change(redis, model, data)``; Redis errors translated."""
    async def shown(request: Request) -> Response:
        async with translated(gateway.redis_settings):
            return JSONResponse(await show(gateway.redis, request.path_params["model"]))

    async def changed(request: Request) -> Response:
        headers = dict(request.headers.raw)
        body.check_content_type(headers)
        raw = await body.read_body(headers, request.receive, gateway.config.max_body_bytes)
        data = body.parse_json(raw)
        body.refuse_duplicate_keys(raw)
        async with translated(gateway.redis_settings):
            return JSONResponse(await change(gateway.redis, request.path_params["model"],
                                             data))

    async def either(request: Request) -> Response:
        return await (changed if request.method == "PATCH" else shown)(request)

    # one route for both methods: a 405 on ``path`` lists both in its ``Allow``
    return [Route(path, either, methods=["GET", "PATCH"])]
