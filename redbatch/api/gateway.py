"""The gateway's state: its producer client, model directory and infer core."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from redbatch import defaults, protocol
from redbatch.api.core import InferCore
from redbatch.api.directory import ModelDirectory
from redbatch.api.errors import error_response
from redbatch.config import GatewayConfig, RedisSettings
from redbatch.errors import ConfigError, RedbatchError, RedisUnavailable
from redbatch.producer.client import Client
from redbatch.redis_conn import async_client, deadline_bound
from redbatch.scaling import FleetReader

log = logging.getLogger("redbatch.api")


class Gateway:
    """Holds the gateway's producer client, model directory and infer core."""

    def __init__(self, config: GatewayConfig, redis: RedisSettings) -> None:
        self.config = config
        self.redis_settings = redis
        self.client = Client(settings=redis, default_timeout_s=config.default_timeout_s,
                             max_timeout_s=config.max_timeout_s,
                             max_queue_len=config.max_queue_len,
                             max_waiters=config.max_waiters,
                             block_timeout_s=config.block_timeout_s,
                             replica_wait=config.replica_wait,
                             require_workers=False)  # the core checks, with a deadline
        self._redis = async_client(redis)
        self.directory = ModelDirectory(self._redis, redis, config.meta_refresh_s)
        self.core = InferCore(self.client, self.directory, config)
        self.fleet = FleetReader(self._redis)  # the autoscaling gauges' reads (/metrics)

    @property
    def redis(self) -> aioredis.Redis:
        """The gateway's own Redis client (model lookups, metrics)."""
        return self._redis

    async def start(self) -> None:
        """Start the client, within ``CONNECT_TIMEOUT_S`` (a stalled Redis would hold
        it for the socket timeout, the port unbound); without Redis the gateway serves
        503s, and the client starts with the first request once Redis answers."""
        started_by = protocol.now_ms() + round(1000 * defaults.CONNECT_TIMEOUT_S)
        try:
            async with deadline_bound(started_by, "connecting to redis at start"):
                await self.client.start()
        except ConfigError:  # a setting Redis cannot honour (WAIT refused): stop
            raise
        except RedbatchError as exc:  # serve 503s until Redis is back
            log.warning("gateway started without redis: %s", exc)
        log.info("gateway using redis at %s", self.redis_settings.safe_url)

    async def close(self) -> None:
        try:
            await self.core.aclose()  # its tasks use the client's pool
            await self.client.close()
        finally:  # (its own pool closes even if the client's close failed)
            await self._redis.aclose()

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
            return error_response(503, RedisUnavailable.code, "redis unavailable",
                                  {"Retry-After": "1"})  # (a stalled read's deadline too)
        if not live:
            return error_response(503, "no_workers", "redis is reachable but no worker is live",
                                  {"Retry-After": "1"})
        return JSONResponse({"status": "ready"})
