"""An app factory for running the gateway under uvicorn directly, e.g. with several
worker processes: ``uvicorn --factory redbatch.api.serve:app_from_env --workers 2``.
Each process gets its own reply listeners (one per model in use).  Config comes from
``REDBATCH_*`` env vars."""

from __future__ import annotations

from starlette.applications import Starlette

from redbatch.api.app import create_app
from redbatch.config import GatewayConfig, RedisSettings, from_env
from redbatch.heap import freeze_startup_heap
from redbatch.logs import setup_logging


def app_from_env() -> Starlette:
    setup_logging()
    app = create_app(from_env(GatewayConfig), RedisSettings.from_env())
    freeze_startup_heap()  # redbatch.heap: no full collection walks the imports under load
    return app
