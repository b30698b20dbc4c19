"""Configuration: frozen dataclasses read from flags and ``REDBATCH_*`` env vars.

Every default comes from ``redbatch.defaults``.  Bad values fail loudly with the
setting's name.  A Redis password never shows in a ``repr`` or a log line:
``RedisSettings`` keeps the URL out of its repr and ``redact_url`` is what logs print.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final, TypeVar
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit, urlunsplit

from redbatch import defaults, url_options
from redbatch.errors import ConfigError
from redbatch.protocol import MAX_ATTEMPT, MAX_TIMEOUT_S

T = TypeVar("T")
ENV_PREFIX = "REDBATCH_"
CLUSTER_SCHEME = "redis+cluster"
SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_PORTS = {CLUSTER_SCHEME: 6379, SENTINEL_SCHEME: 26379}  # of a seed that names none
REDIS_SCHEMES = frozenset({"redis", "rediss", "unix", *DEFAULT_PORTS})
SERVICE_PATH = re.compile(r"/([A-Za-z0-9_.-]+)(?:/(\d+))?/?")
CLUSTER_PATH = re.compile(r"/?0?")
QUERY_NAME = re.compile(r"[a-z_]+")
DB_PATH = re.compile(r"/?\d*")
ENCODE_HINT = ("percent-encode special characters in the password (/ as %2F, # as %23, "
               "? as %3F, @ as %40, : as %3A; in a password=... option, + as %2B)")


def redact_url(url: str) -> str:
    """``redis://user:secret@host`` -> ``redis://user:***@host``; a ``password=``
    query parameter (``unix://`` URLs) and a ``sentinel_password=`` are masked too, and
    so is a user named without a password (``redis://secret@host``, where the ``:``
    before a password was forgotten, is ``redis://***@host``)."""
    parts = urlsplit(url)
    if parts.password is not None or parts.username:
        user = f"{parts.username or ''}:" if parts.password is not None else ""
        netloc = f"{user}***@{parts.netloc.rpartition('@')[2]}"
        url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return re.sub(r"(?i)([?&](?:sentinel_)?password=)[^&#]*", r"\1***", url)


def check_redis_url(url: str) -> None:
    """Raise ``ConfigError`` unless ``url`` parses as a Redis URL whose host, port and
    database are what they seem.  A password with a raw ``/``, ``#`` or ``?`` cuts the
    URL short: its tail would pass for a host, port, path or query (and redis-py echoes
    a bad port in its error).  The message never quotes any part of the URL."""
    try:
        parts = urlsplit(url)
    except ValueError:  # a host in brackets left open ("Invalid IPv6 URL")
        raise ConfigError(f"the Redis URL does not parse: its host is not a name or an "
                          f"address; {ENCODE_HINT}") from None
    if parts.scheme not in REDIS_SCHEMES or not url.startswith(f"{parts.scheme}://"):
        raise ConfigError("the Redis URL must start with redis://, rediss://, unix://, "
                          "redis+cluster:// or redis+sentinel://")
    problem = "it has a '#'" if "#" in url else _url_problem(parts)
    if problem:
        raise ConfigError(f"the Redis URL does not parse: {problem}; {ENCODE_HINT}")


def _url_problem(parts: SplitResult) -> str | None:
    if "@" in parts.path or "@" in parts.query:
        return "it has an '@' after its host"
    # the names as written, not decoded: a percent-encoded name ("pass%77ord") would
    # reach redis-py as the option it spells, past every check and mask of its value
    if any(not QUERY_NAME.fullmatch(pair.partition("=")[0])
           for pair in parts.query.split("&") if pair):
        return "its query (after '?') is not a list of name=value options"
    if parts.scheme in DEFAULT_PORTS:
        return _nodes_problem(parts)
    try:
        url_options.check_plain(parts.query, parts.scheme)
    except ValueError as exc:
        return str(exc)
    if parts.scheme == "unix":
        return None if parts.path else "it has no socket path"
    return _host_problem(parts)


def _host_problem(parts: SplitResult) -> str | None:
    try:
        port = parts.port  # raises ValueError when the port is not a number
    except ValueError:
        port = 0
    if port == 0:  # (redis-py would take a port of 0 for its default, 6379)
        return "its port is not a number from 1 to 65535"
    if not parts.hostname:
        return "it has no host"
    if not DB_PATH.fullmatch(parts.path):
        return "its database (the path after the port) is not a number"
    return None


def _nodes_problem(parts: SplitResult) -> str | None:
    """What is wrong with a ``redis+cluster://`` or ``redis+sentinel://`` URL, if
    anything: its seed nodes, its path (a cluster's database, a sentinel's service)."""
    try:
        _seeds(parts)
        url_options.parse(parts.query, parts.scheme == SENTINEL_SCHEME)
    except ValueError as exc:
        return str(exc)
    if parts.scheme == CLUSTER_SCHEME:
        return None if CLUSTER_PATH.fullmatch(parts.path) else "a cluster has database 0 only"
    if not SERVICE_PATH.fullmatch(parts.path):
        return ("it has no service name (redis+sentinel://host:port[,host:port]/"
                "service_name[/db])")
    return None


def _seeds(parts: SplitResult) -> tuple[tuple[str, int], ...]:
    """The URL's ``host:port`` list; ``ValueError`` (quoting nothing) when one is bad."""
    hosts = parts.netloc.rpartition("@")[2]
    if not hosts:
        raise ValueError("it has no seed node (host:port)")
    return tuple(_seed(text, DEFAULT_PORTS[parts.scheme]) for text in hosts.split(","))


def _seed(text: str, default_port: int) -> tuple[str, int]:
    seed = urlsplit(f"//{text}")
    try:
        port = seed.port
    except ValueError:
        port = 0
    if port == 0 or not 0 < (port or default_port) < 65536:
        raise ValueError("a seed node's port is not a number from 1 to 65535")
    if not seed.hostname:
        raise ValueError("a seed node has no host (give host:port, separated by commas)")
    return seed.hostname, port or default_port


@dataclass(frozen=True)
class Topology:
    """Where a ``redis+cluster://`` or ``redis+sentinel://`` URL points: its seed nodes
    (cluster nodes or sentinels), the credentials of the data nodes, and for Sentinel
    the monitored service and the database."""

    mode: str  # "cluster" or "sentinel"
    seeds: tuple[tuple[str, int], ...]
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    service: str = ""
    db: int = 0
    options: url_options.NodeOptions = field(  # TLS, the sentinels' credentials
        default_factory=url_options.NodeOptions)


def topology(url: str) -> Topology | None:
    """The nodes of a checked several-node URL; None for a plain one (``redis://``,
    ``rediss://``, ``unix://``)."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS:
        return None
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    options = url_options.parse(parts.query, parts.scheme == SENTINEL_SCHEME)
    if parts.scheme == CLUSTER_SCHEME:
        return Topology("cluster", _seeds(parts), user, password, options=options)
    found = SERVICE_PATH.fullmatch(parts.path)
    assert found is not None  # (checked by check_redis_url)
    return Topology("sentinel", _seeds(parts), user, password, found[1], int(found[2] or 0),
                    options)


def tls_unverified(url: str) -> bool:
    """Whether a ``rediss://`` URL turns certificate verification off."""
    query = dict(parse_qsl(urlsplit(url).query))
    return query.get("ssl_cert_reqs", "").strip().lower() == "none"


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """A finite number above 0 (or 0 itself, with ``allow_zero``): NaN and infinity are
    refused, as they would pass every comparison's check or none."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}"
                          f", got {value!r}")


MAX_FLAG_S: Final = 86400.0  # a pause or poll interval given as a flag: at most a day


def _seconds(name: str, value: float) -> None:
    """A duration of a setting: finite, above 0 and at most ``MAX_FLAG_S`` (a day); a
    larger one would overflow a socket's timeout (``OverflowError`` from the OS) or
    never end."""
    _positive(name, value)
    if value > MAX_FLAG_S:
        raise ConfigError(f"{name} must be at most {MAX_FLAG_S:g} s (a day), got {value!r}")


def seconds_flag(text: str) -> float:
    """An argparse ``type`` for a flag in seconds: a number > 0 and at most a day
    (argparse then names the flag in its one-line error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= MAX_FLAG_S:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 and at most "
                                         f"{MAX_FLAG_S:g}, got {text!r}")
    return value


def count_flag(text: str) -> int:
    """An argparse ``type`` for a count: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def positive_flag(text: str) -> int:
    """An argparse ``type`` for a count of seconds or items: an integer >= 1."""
    value = count_flag(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _stripped_key(key: str) -> str:
    """An API key without the white space around it (a secret read from a file often
    ends in a newline, which no client sends); one of white space alone is refused."""
    if key and not key.strip():
        raise ConfigError("api_key is only white space (leave it empty for no key)")
    return key.strip()


def _at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value!r}")


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

    url: str = field(default=defaults.REDIS_URL, repr=False)
    socket_timeout_s: float = defaults.SOCKET_TIMEOUT_S
    connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S

    def __post_init__(self) -> None:
        check_redis_url(self.url)
        _seconds("socket_timeout_s", self.socket_timeout_s)
        _seconds("connect_timeout_s", self.connect_timeout_s)

    @property
    def safe_url(self) -> str:
        return redact_url(self.url)

    @property
    def topology(self) -> Topology | None:
        """Cluster or Sentinel nodes (None: one plain Redis)."""
        return topology(self.url)

    def __repr__(self) -> str:
        return (f"RedisSettings(url={self.safe_url!r}, socket_timeout_s={self.socket_timeout_s},"
                f" connect_timeout_s={self.connect_timeout_s})")

    @classmethod
    def from_env(cls, url: str | None = None, env: Mapping[str, str] | None = None
                 ) -> RedisSettings:
        env = os.environ if env is None else env
        own = {k: v for k, v in env.items() if k != f"{ENV_PREFIX}URL"}  # REDIS_URL's alone
        # (an empty REDIS_URL is unset, as a shell's ``REDIS_URL= cmd`` means)
        return from_env(cls, {"url": url or env.get("REDIS_URL") or None}, own)


def _check_address(host: str, port: int) -> None:
    if not host.strip():  # (an empty one would listen on every interface)
        raise ConfigError("host must name an interface (127.0.0.1, or 0.0.0.0 for every "
                          "one), got an empty value")
    if not 0 < port < 65536:
        raise ConfigError(f"port must be 1-65535, got {port}")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = defaults.HOST
    port: int = defaults.PORT
    default_timeout_s: float = defaults.DEFAULT_TIMEOUT_S
    max_timeout_s: float = defaults.GATEWAY_MAX_TIMEOUT_S
    max_body_bytes: int = defaults.MAX_BODY_BYTES
    max_queue_len: int = defaults.MAX_QUEUE_LEN
    max_waiters: int = defaults.MAX_WAITERS
    meta_refresh_s: float = defaults.META_REFRESH_S
    block_timeout_s: float = defaults.BLOCK_TIMEOUT_S
    api_key: str = field(default=defaults.API_KEY, repr=False)  # empty: no auth
    # HTTP edge limits (redbatch.api.limits): request line + headers, the time a request's
    # headers and then its body may take to arrive, and open connections.
    max_header_bytes: int = defaults.MAX_HEADER_BYTES
    header_timeout_s: float = defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = defaults.BODY_TIMEOUT_S
    send_timeout_s: float = defaults.SEND_TIMEOUT_S  # an answer nobody reads: closed after
    keep_alive_s: float = defaults.KEEP_ALIVE_S  # an idle connection is closed after it
    max_connections: int = defaults.GATEWAY_MAX_CONNECTIONS
    gateway_processes: int = defaults.GATEWAY_PROCESSES  # sharing the port (gateway_procs)
    wait_replicas: int = defaults.WAIT_REPLICAS  # replicas that acknowledge an enqueue
    wait_timeout_ms: int = defaults.WAIT_TIMEOUT_MS  # how long that WAIT may block

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", _stripped_key(self.api_key))
        _check_address(self.host, self.port)
        if not 1 <= self.gateway_processes <= 64:
            raise ConfigError(f"gateway_processes (--workers, --gateways) must be 1..64, "
                              f"got {self.gateway_processes}")
        for name in ("default_timeout_s", "max_timeout_s", "meta_refresh_s", "block_timeout_s",
                     "header_timeout_s", "body_timeout_s", "send_timeout_s", "keep_alive_s"):
            _seconds(name, getattr(self, name))
        for name in ("max_body_bytes", "max_queue_len", "max_waiters", "max_connections"):
            _positive(name, getattr(self, name))
        if self.max_header_bytes < 1024:
            raise ConfigError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"max_timeout_s may be at most {MAX_TIMEOUT_S}")
        if self.default_timeout_s > self.max_timeout_s:
            raise ConfigError("default_timeout_s must not exceed max_timeout_s")
        self.replica_wait.check_budget(self.default_timeout_s)

    @property
    def replica_wait(self) -> ReplicaWait:
        """The WAIT after each enqueue (``ReplicaWait``), checked."""
        return ReplicaWait(self.wait_replicas, self.wait_timeout_ms)


@dataclass(frozen=True)
class WorkerConfig:
    block_timeout_s: float = defaults.BLOCK_TIMEOUT_S  # a claim's blocking pop
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S  # renews the lease
    lease_ttl_s: float = defaults.LEASE_TTL_S  # past it, the worker's requests are reaped
    replicas: int = defaults.REPLICAS  # worker processes
    device: str = defaults.DEVICE  # auto, cpu, cuda or cuda:N[,cuda:M]
    threads: int = defaults.THREADS  # CPU threads per process
    max_attempts: int = defaults.MAX_ATTEMPTS  # crashes a request may cause
    grace_s: float = defaults.GRACE_S  # on SIGTERM, the time to finish a batch
    metrics_port: int = defaults.METRICS_PORT  # /metrics of replica i on metrics_port + i
    dead_letter_ttl_s: int = defaults.DEAD_LETTER_TTL_S  # they expire this long after the last
    dead_letter_max_bytes: int = defaults.DEAD_LETTER_MAX_BYTES  # each keeps its first bytes
    max_failed_starts: int = defaults.MAX_FAILED_STARTS  # failing before it serves: stop all

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be 0 (off) or 1-65535, got "
                              f"{self.metrics_port}")
        if self.metrics_port and self.metrics_port + self.replicas - 1 > 65535:
            raise ConfigError(f"metrics_port {self.metrics_port} leaves no port for replica "
                              f"{65536 - self.metrics_port} of {self.replicas} (replica i "
                              "listens on metrics_port + i, at most 65535)")
        if not 1 <= self.max_attempts <= MAX_ATTEMPT:
            raise ConfigError(f"max_attempts must be 1..{MAX_ATTEMPT}")
        for name in ("block_timeout_s", "heartbeat_interval_s", "lease_ttl_s", "grace_s"):
            _seconds(name, getattr(self, name))
        for name in ("replicas", "threads", "max_failed_starts", "dead_letter_ttl_s",
                     "dead_letter_max_bytes"):
            _at_least_one(name, getattr(self, name))
        if self.lease_ttl_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError("lease_ttl_s must be more than twice heartbeat_interval_s")
        if not (self.device in {"auto", "cpu", "cuda"} or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N[,cuda:M], got "
                              f"{self.device!r}")


def check_gateway(config: GatewayConfig, redis: RedisSettings) -> None:
    """What each gateway process's client checks of its settings, checked once before
    the port is bound or a process started: one message, not one per process."""
    check_socket_timeout(redis, config.block_timeout_s)
    config.replica_wait.check_budget(config.default_timeout_s, redis.socket_timeout_s)


def check_client(block_timeout_s: float, listener_idle_s: float, max_queue_len: int,
                 max_waiters: int) -> None:
    """A ``Client``'s own limits: durations as settings take them (``_seconds``), caps
    whole numbers >= 1."""
    _seconds("block_timeout_s", block_timeout_s)
    _seconds("listener_idle_s", listener_idle_s)
    for name, value in (("max_queue_len", max_queue_len), ("max_waiters", max_waiters)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        _at_least_one(name, value)


def check_socket_timeout(redis: RedisSettings, block_timeout_s: float) -> None:
    """A blocking command must return before the socket gives up on it."""
    if redis.socket_timeout_s <= block_timeout_s + 1.0:
        raise ConfigError(f"socket_timeout_s ({redis.socket_timeout_s}) must exceed "
                          f"block_timeout_s ({block_timeout_s}) by more than 1 s")


@dataclass(frozen=True)
class ReplicaWait:
    """Redis ``WAIT`` after each enqueue: ``wait_replicas`` replicas must acknowledge the
    enqueue's writes within ``wait_timeout_ms`` (0 replicas: off, no WAIT is sent).
    ``REDBATCH_WAIT_REPLICAS`` and ``REDBATCH_WAIT_TIMEOUT_MS`` in the environment."""

    wait_replicas: int = defaults.WAIT_REPLICAS
    wait_timeout_ms: int = defaults.WAIT_TIMEOUT_MS

    def __post_init__(self) -> None:
        for name in ("wait_replicas", "wait_timeout_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if self.wait_replicas < 0:
            raise ConfigError(f"wait_replicas must be >= 0 (0: off), got {self.wait_replicas}")
        low = 1 if self.wait_replicas else 0  # WAIT n 0 would block without end
        if not low <= self.wait_timeout_ms <= defaults.WAIT_TIMEOUT_MAX_MS:
            raise ConfigError(f"wait_timeout_ms must be {low}..{defaults.WAIT_TIMEOUT_MAX_MS}"
                              f" with wait_replicas={self.wait_replicas}, got "
                              f"{self.wait_timeout_ms}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReplicaWait:
        return from_env(cls, env=env)

    def check_budget(self, default_timeout_s: float, socket_timeout_s: float | None = None
                     ) -> None:
        """The WAIT must fit well inside a default request's deadline and end before the
        socket gives up on it."""
        if not self.wait_replicas:
            return
        wait_s = self.wait_timeout_ms / 1000
        if wait_s >= default_timeout_s:
            raise ConfigError(f"wait_timeout_ms ({self.wait_timeout_ms}) must be below "
                              f"default_timeout_s ({default_timeout_s}) in ms")
        if socket_timeout_s is not None and socket_timeout_s <= wait_s + 1.0:
            raise ConfigError(f"socket_timeout_s ({socket_timeout_s}) must exceed "
                              f"wait_timeout_ms ({self.wait_timeout_ms}) by more than 1 s")
