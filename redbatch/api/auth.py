"""Optional API-key auth: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``."""

from __future__ import annotations

import hmac

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from redbatch.api.errors import error_for

# Health checks, the API description and Prometheus's scrape stay open (no secrets in
# them); everything else needs the key.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready",
                        "/openapi.json", "/metrics"})


def presented_key(headers: dict[bytes, bytes]) -> bytes:
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    return headers.get(b"x-api-key", b"").strip()


def refusal(scope: Scope, api_key: bytes | None) -> Response | None:
    """The 401 (JSON, in the shape of the path's API) for a request without the key,
    or None when it may pass (no key set, or the right one presented)."""
    if api_key is None or hmac.compare_digest(presented_key(dict(scope["headers"])),
                                              api_key):
        return None
    return error_for(scope["path"], 401, "unauthorized", "missing or wrong API key",
                     {"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware:
    """Refuses every route but the health checks without the key (401, JSON)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = None
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            refused = refusal(scope, self._key)
        await (refused or self.app)(scope, receive, send)
