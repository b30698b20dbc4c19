"""``/v1/models/{model}/versions``: a model's versions (``redbatch.versions``).  GET
shows the routing table with each version's weight, share, latest and draining flags
and live workers; PATCH (any of ``{"weights": {"1": 95, "2": 5}, "latest": "2",
"drain": "1", "undrain": "1"}``) checks and stores a change, which every gateway and
client applies within about a second.  Behind the API key like every route but health."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.routing import Route

from redbatch import versions
from redbatch.api.knobs_view import admin_routes

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from redbatch.api.gateway import Gateway

VERSIONS_PATH = "/v1/models/{model}/versions"


async def _change(redis: aioredis.Redis, model: str, data: Any) -> dict[str, Any]:
    table = await versions.change(redis, model, **versions.change_args(data))
    return await versions.describe(redis, model, table)


def versions_routes(gateway: Gateway) -> list[Route]:
    return admin_routes(gateway, VERSIONS_PATH, versions.describe, _change)
