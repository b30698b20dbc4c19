"""``/v1/models/{model}/config``: a model's live knobs (``redbatch.knobs``).  GET shows
the stored overrides and the effective values; PATCH (a JSON object of knob -> value,
null to drop an override) checks and stores them, which every worker of the model
applies within a heartbeat or two.  Behind the API key like every route but health."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from redbatch import knobs
from redbatch.api import body
from redbatch.redis_conn import translated

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

CONFIG_PATH = "/v1/models/{model}/config"


def knobs_routes(gateway: Gateway) -> list[Route]:
    async def show(request: Request) -> Response:
        async with translated(gateway.redis_settings):
            return JSONResponse(await knobs.show(gateway.redis, request.path_params["model"]))

    async def change(request: Request) -> Response:
        headers = dict(request.headers.raw)
        body.check_content_type(headers)
        data = body.parse_json(await body.read_body(headers, request.receive,
                                                    gateway.config.max_body_bytes))
        async with translated(gateway.redis_settings):
            return JSONResponse(await knobs.configure(gateway.redis,
                                                      request.path_params["model"], data))

    return [Route(CONFIG_PATH, show, methods=["GET"]),
            Route(CONFIG_PATH, change, methods=["PATCH"])]
