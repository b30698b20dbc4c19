"""``/v1/models/{model}/versions``: a model's versions (``redbatch.versions``).  GET
shows the routing table with each version's weight, share, latest and draining flags
and live workers; PATCH (``{"weights": {"1": 95, "2": 5}, "latest": "2", "drain": "1",
"undrain": "1"}``, any of them) checks and stores a change, which every gateway and
client applies within about a second.  Behind the API key like every route but health."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from redbatch import versions
from redbatch.api import body
from redbatch.redis_conn import translated

if TYPE_CHECKING:
    from redbatch.api.gateway import Gateway

VERSIONS_PATH = "/v1/models/{model}/versions"


def versions_routes(gateway: Gateway) -> list[Route]:
    async def show(request: Request) -> Response:
        async with translated(gateway.redis_settings):
            return JSONResponse(await versions.describe(gateway.redis,
                                                        request.path_params["model"]))

    async def change(request: Request) -> Response:
        headers = dict(request.headers.raw)
        body.check_content_type(headers)
        data = body.parse_json(await body.read_body(headers, request.receive,
                                                    gateway.config.max_body_bytes))
        model = request.path_params["model"]
        async with translated(gateway.redis_settings):
            table = await versions.change(gateway.redis, model, **versions.change_args(data))
            return JSONResponse(await versions.describe(gateway.redis, model, table))

    return [Route(VERSIONS_PATH, show, methods=["GET"]),
            Route(VERSIONS_PATH, change, methods=["PATCH"])]
