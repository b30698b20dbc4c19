"""Which Redis RQ's queue lives on, and which holds redbatch's model queues.

RQ needs one plain Redis (``redis://``, ``rediss://`` or ``unix://``): its commands
span keys of many slots.  When redbatch's queues are on a Redis Cluster or behind
Sentinel (``REDIS_URL=redis+cluster://...``), ``REDBATCH_JOBS_REDIS_URL`` names the
plain Redis for RQ, and the jobs' items go to ``REDIS_URL``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from redbatch.config import RedisSettings, check_redis_url, topology
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
    for url in (given, redis_url):
        if url:
            check_redis_url(url)  # (ConfigError, quoting nothing: before it is stored)
    if given or not redis_url:
        return given
    if rq_given:
        return redis_url if topology(redis_url) is not None else None
    return redis_url if env.get(JOBS_URL_ENV) else None


PASSWORD_PARAM = re.compile(r"(?i)&?\b(?:sentinel_)?password=[^&#]*")


def portable(url: str | None) -> str | None:
    """``url`` as a job stores it: without its passwords (the user's, a ``password=``
    or ``sentinel_password=`` option), since RQ shows a job's arguments to whoever
    reads its Redis (``rq info``, dashboards).  ``with_password`` puts them back on
    the RQ worker."""
    if url is None:
        return None
    check_redis_url(url)  # a password cut short by a raw '/' or '?' would be stored
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    netloc = f"{parts.username}@{hosts}" if parts.username else hosts
    query = PASSWORD_PARAM.sub("", parts.query).lstrip("&")
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def with_password(stored: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The URL a job connects to: its stored one, or, when the RQ worker's own
    ``$REDIS_URL`` names the same Redis (equal once its passwords are taken out), that
    one, passwords included."""
    env = os.environ if env is None else env
    own = env.get("REDIS_URL")
    return own if stored is not None and own and portable(own) == stored else stored
