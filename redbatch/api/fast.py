"""The hot path: ``POST /v1/models/{model}/predict`` served straight from ASGI.

Starlette's router and exception middleware cost about a fifth of the gateway's CPU
per request; this middleware answers predict requests before them, with the same
handler (``Gateway.predict_core``) and the same JSON errors.  Every other route goes
through Starlette as usual.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from redbatch.api.errors import error_response, from_exception
from redbatch.errors import RedbatchError

if TYPE_CHECKING:
    from redbatch.api.app import Gateway

log = logging.getLogger("redbatch.api")
PREDICT_PATH = re.compile(r"^/v1/models/([^/]+)/predict$")


class FastPredict:
    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PREDICT_PATH.match(scope["path"]) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await self.gateway.predict_core(match.group(1), dict(scope["headers"]),
                                                       receive)
        except RedbatchError as exc:
            response = from_exception(exc)
        except Exception:
            log.exception("unexpected error on POST %s", scope["path"])
            response = error_response(500, "internal", "internal error; see the gateway log")
        await response(scope, receive, send)
