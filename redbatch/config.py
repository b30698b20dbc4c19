"""Configuration: frozen dataclasses read from flags and ``REDBATCH_*`` env vars.

Bad values fail loudly with the setting's name.  A Redis password never shows
in a ``repr`` or a log line: ``RedisSettings`` keeps the URL out of its repr
and ``redact_url`` is what logs print.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from redbatch.errors import ConfigError
from redbatch.protocol import MAX_TIMEOUT_S

T = TypeVar("T")
ENV_PREFIX = "REDBATCH_"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redact_url(url: str) -> str:
    """``redis://user:secret@host`` -> ``redis://user:***@host``; a ``password=``
    query parameter (``unix://`` URLs) is masked too."""
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (
            f":{parts.port}" if parts.port else "")
        url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(kind: Callable[[str], T], name: str, raw: str) -> T:
    try:
        return _parse_bool(raw) if kind is bool else kind(raw)  # type: ignore[return-value]
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is invalid: {exc}") from exc


def from_env(cls: type[T], overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None, base: Mapping[str, Any] | None = None
             ) -> T:
    """Build a config dataclass: explicit overrides (flags) > ``REDBATCH_<FIELD>`` env >
    ``base`` (a config file's table) > defaults."""
    env = os.environ if env is None else env
    values: dict[str, Any] = dict(base or {})
    for f in fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        name = ENV_PREFIX + f.name.upper()
        if overrides and overrides.get(f.name) is not None:
            values[f.name] = overrides[f.name]
        elif name in env:
            values[f.name] = _convert(_field_kind(f.type), name, env[name])
    return cls(**values)


def _field_kind(annotation: Any) -> Callable[[str], Any]:
    kinds: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "bool": bool}
    return kinds.get(str(annotation), str)


@dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis.  ``url`` may hold a password: it is kept out of repr."""

    url: str = field(default=DEFAULT_REDIS_URL, repr=False)
    socket_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if urlsplit(self.url).scheme not in {"redis", "rediss", "unix"}:
            raise ConfigError(f"REDIS_URL {redact_url(self.url)!r} must be redis://, rediss://"
                              " or unix://")
        _positive("socket_timeout_s", self.socket_timeout_s)
        _positive("connect_timeout_s", self.connect_timeout_s)

    @property
    def safe_url(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:
        return (f"RedisSettings(url={self.safe_url!r}, socket_timeout_s={self.socket_timeout_s},"
                f" connect_timeout_s={self.connect_timeout_s})")

    @classmethod
    def from_env(cls, url: str | None = None, env: Mapping[str, str] | None = None
                 ) -> RedisSettings:
        env = os.environ if env is None else env
        base = from_env(cls, {"url": url or env.get("REDIS_URL")}, env)
        return base


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    default_timeout_s: float = 30.0
    max_timeout_s: float = 60.0
    max_body_bytes: int = 1024 * 1024
    max_queue_len: int = 10_000
    max_waiters: int = 10_000
    meta_refresh_s: float = 2.0
    block_timeout_s: float = 1.0
    api_key: str = field(default="", repr=False)  # empty: no auth
    # HTTP edge limits (redbatch.api.limits): request line + headers, the time a request's
    # headers and then its body may take to arrive, and open connections.
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be 1-65535, got {self.port}")
        for name in ("default_timeout_s", "max_timeout_s", "meta_refresh_s", "block_timeout_s",
                     "header_timeout_s", "body_timeout_s"):
            _positive(name, getattr(self, name))
        for name in ("max_body_bytes", "max_queue_len", "max_waiters", "max_connections"):
            _positive(name, getattr(self, name))
        if self.max_header_bytes < 1024:
            raise ConfigError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"max_timeout_s may be at most {MAX_TIMEOUT_S}")
        if self.default_timeout_s > self.max_timeout_s:
            raise ConfigError("default_timeout_s must not exceed max_timeout_s")


@dataclass(frozen=True)
class WorkerConfig:
    block_timeout_s: float = 1.0
    heartbeat_interval_s: float = 1.0
    lease_ttl_s: float = 10.0
    replicas: int = 1
    device: str = "auto"
    threads: int = 1
    max_attempts: int = 3
    grace_s: float = 30.0
    metrics_port: int = 0  # Prometheus /metrics of replica i on metrics_port + i; 0: off

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be 0 (off) or 1-65535, got "
                              f"{self.metrics_port}")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be >= 1")
        for name in ("block_timeout_s", "heartbeat_interval_s", "lease_ttl_s", "grace_s"):
            _positive(name, getattr(self, name))
        if self.replicas < 1 or self.threads < 1:
            raise ConfigError("replicas and threads must be >= 1")
        if self.lease_ttl_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError("lease_ttl_s must be more than twice heartbeat_interval_s")
        if not (self.device in {"auto", "cpu", "cuda"} or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N[,cuda:M], got "
                              f"{self.device!r}")


def check_socket_timeout(redis: RedisSettings, block_timeout_s: float) -> None:
    """A blocking command must return before the socket gives up on it."""
    if redis.socket_timeout_s <= block_timeout_s + 1.0:
        raise ConfigError(f"socket_timeout_s ({redis.socket_timeout_s}) must exceed "
                          f"block_timeout_s ({block_timeout_s}) by more than 1 s")
