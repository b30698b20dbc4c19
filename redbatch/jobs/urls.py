"""Which Redis RQ's queue lives on, and which holds redbatch's model queues.

RQ needs one plain Redis (``redis://``, ``rediss://`` or ``unix://``): its commands
span keys of many slots.  When redbatch's queues are on a Redis Cluster or behind
Sentinel (``REDIS_URL=redis+cluster://...``), ``REDBATCH_JOBS_REDIS_URL`` names the
plain Redis for RQ, and the jobs' items go to ``REDIS_URL``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from redbatch.config import RedisSettings, topology
from redbatch.errors import ConfigError

JOBS_URL_ENV = "REDBATCH_JOBS_REDIS_URL"
PLAIN_NEEDED = ("bulk jobs need a plain Redis for RQ (redis://, rediss:// or unix://): "
                f"set {JOBS_URL_ENV} (or --redis-url) to one; the items still go to "
                "REDIS_URL")


def rq_settings(given: str | None, env: Mapping[str, str] | None = None) -> RedisSettings:
    """RQ's Redis: ``--redis-url``, else ``$REDBATCH_JOBS_REDIS_URL``, else
    ``$REDIS_URL``; ``ConfigError`` unless it is a plain Redis."""
    env = os.environ if env is None else env
    settings = RedisSettings.from_env(given or env.get(JOBS_URL_ENV), env)
    if settings.topology is not None:
        raise ConfigError(PLAIN_NEEDED)
    return settings


def queues_url(given: str | None, rq_given: str | None,
               env: Mapping[str, str] | None = None) -> str | None:
    """Where a job's items go: ``--bulk-redis-url``; else ``$REDIS_URL`` when RQ's Redis
    came from ``$REDBATCH_JOBS_REDIS_URL``, or from ``--redis-url`` while ``$REDIS_URL``
    names a cluster or a sentinel set-up (which RQ cannot use); else None (RQ's own)."""
    env = os.environ if env is None else env
    redis_url = env.get("REDIS_URL")
    if given or not redis_url:
        return given
    if rq_given:
        return redis_url if topology(redis_url) is not None else None
    return redis_url if env.get(JOBS_URL_ENV) else None
