"""Configuration: env vars, flags, loud failures, and no password in any repr."""

from __future__ import annotations

import logging

import pytest

from redbatch.config import (
    GatewayConfig,
    RedisSettings,
    WorkerConfig,
    check_socket_timeout,
    from_env,
    redact_url,
    tls_unverified,
)
from redbatch.errors import ConfigError
from redbatch.worker.policy import BatchPolicy


def test_env_vars_and_overrides() -> None:
    env = {"REDBATCH_PORT": "9001", "REDBATCH_MAX_TIMEOUT_S": "20",
           "REDBATCH_DEFAULT_TIMEOUT_S": "5"}
    cfg = from_env(GatewayConfig, {"host": "0.0.0.0"}, env)
    assert (cfg.port, cfg.max_timeout_s, cfg.default_timeout_s, cfg.host) == (
        9001, 20.0, 5.0, "0.0.0.0")
    assert from_env(GatewayConfig, {"port": 7000}, env).port == 7000


@pytest.mark.parametrize("env", [
    {"REDBATCH_PORT": "eighty"}, {"REDBATCH_PORT": "0"}, {"REDBATCH_MAX_BODY_BYTES": "-1"},
    {"REDBATCH_DEFAULT_TIMEOUT_S": "100", "REDBATCH_MAX_TIMEOUT_S": "10"},
    {"REDBATCH_HOST": ""}, {"REDBATCH_HOST": "  "},  # (else: every interface)
    {"REDBATCH_KEEP_ALIVE_S": "1e10"}, {"REDBATCH_BLOCK_TIMEOUT_S": "1e300"},
])
def test_bad_gateway_values_fail_loudly(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        from_env(GatewayConfig, None, env)


@pytest.mark.parametrize("name", ["REDBATCH_SOCKET_TIMEOUT_S", "REDBATCH_CONNECT_TIMEOUT_S"])
def test_a_redis_timeout_past_a_day_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="at most 86400 s"):  # (else: OverflowError later)
        RedisSettings.from_env("redis://127.0.0.1:6379/0", env={name: "1e10"})


def test_only_redis_url_names_the_redis() -> None:
    settings = RedisSettings.from_env(env={"REDBATCH_URL": "redis://10.9.9.9:6379/0"})
    assert settings.url == "redis://127.0.0.1:6379/0"  # (the default: REDIS_URL unset)
    assert RedisSettings.from_env(env={"REDIS_URL": "redis://h:1/0"}).url == "redis://h:1/0"
    # an empty one is unset (it was refused: "the Redis URL must start with redis://")
    assert RedisSettings.from_env(env={"REDIS_URL": ""}).url == "redis://127.0.0.1:6379/0"


def test_error_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="REDBATCH_REPLICAS"):
        from_env(WorkerConfig, None, {"REDBATCH_REPLICAS": "many"})


@pytest.mark.parametrize("kwargs", [
    {"replicas": 0}, {"device": "tpu"}, {"lease_ttl_s": 1.0, "heartbeat_interval_s": 1.0},
    {"grace_s": 1e12},
])
def test_bad_worker_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        WorkerConfig(**kwargs)  # type: ignore[arg-type]


def test_password_never_in_repr_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    settings = RedisSettings.from_env("redis://user:hunter2@db.example:6380/1", env={})
    assert "hunter2" not in repr(settings)
    assert settings.safe_url == "redis://user:***@db.example:6380/1"
    assert redact_url("redis://localhost:6379") == "redis://localhost:6379"
    # a password whose ':' was forgotten reads as a user name: masked all the same
    assert redact_url("redis://hunter2@db.example:6380/1") == "redis://***@db.example:6380/1"
    with caplog.at_level(logging.INFO):
        logging.getLogger("t").info("redis: %s", settings)
    assert "hunter2" not in caplog.text


def test_bad_redis_url_scheme_fails() -> None:
    with pytest.raises(ConfigError, match="redis://"):
        RedisSettings("http://x:secret@host")
    with pytest.raises(ConfigError) as info:
        RedisSettings("http://x:secret@host")
    assert "secret" not in str(info.value)


def test_socket_timeout_must_exceed_block_timeout() -> None:
    with pytest.raises(ConfigError):
        check_socket_timeout(RedisSettings(socket_timeout_s=2.0), block_timeout_s=1.5)
    check_socket_timeout(RedisSettings(socket_timeout_s=10.0), block_timeout_s=1.0)


def test_batch_policy_accepts_both_spellings() -> None:
    seed = BatchPolicy.from_mapping({"max_batch_size": 32, "timeout_s": 0.1, "stride_s": 0.0,
                                     "allow_small_batch": True})
    ray = BatchPolicy.from_mapping({"max_batch_size": 32, "batch_wait_timeout_s": 0.1})
    assert seed == ray
    with pytest.raises(ConfigError, match="unknown batching option"):
        BatchPolicy.from_mapping({"max_batch": 3})
    with pytest.raises(ConfigError):
        BatchPolicy(max_batch_size=0)


def test_window_anchor() -> None:
    ray_rule = BatchPolicy(batch_wait_timeout_s=0.01)
    assert ray_rule.window_end_ms(oldest_enqueue_ms=1000, claimed_ms=1500) == 1010
    full_wait = BatchPolicy(batch_wait_timeout_s=0.01, allow_small_batch=False)
    assert full_wait.window_end_ms(oldest_enqueue_ms=1000, claimed_ms=1500) == 1510
    # a readable deadline: the window closes for it alone without allow_small_batch
    assert full_wait.window_end_ms(1000, 1500, urgent_ms=9000) == 9000
    assert ray_rule.window_end_ms(1000, 1500, urgent_ms=9000) == 1010
    assert ray_rule.window_end_ms(1000, 1500, urgent_ms=1005) == 1005


MANGLED_URLS = [  # what passwords with a raw / # ? do to a URL (and other typos)
    "redis://:Qx7/Kp9@db.example:6379/0", "redis://:Qx7#Kp9@db.example:6379/0",
    "redis://:Qx7?Kp9@db.example:6379/0", "redis://user:707/Kp9@db.example/0",
    "redis://:707/Kp9@db.example/0", "redis://user:707#Kp9@db.example/0",
    "redis://user:707?Kp9@db.example/0", "redis://db.example:6379/zero",
    "redis://db.example:ab/0", "redis://db.example:99999/0", "redis:///0",
    "redis://:Qx7@[::1", "redis://db.example:0/0",
]


@pytest.mark.parametrize("url", MANGLED_URLS)
def test_a_url_that_does_not_parse_fails_without_quoting_it(url: str) -> None:
    with pytest.raises(ConfigError, match="percent-encode special characters") as info:
        RedisSettings(url)
    for secret in ("Qx7", "Kp9", "707"):
        assert secret not in str(info.value)


@pytest.mark.parametrize("url", [
    "redis://u:p%2Fs%23s%3F@db.example:6379/2", "redis://db.example", "redis://[::1]:6380/1",
    "rediss://:pw@db.example:6380/0?ssl_cert_reqs=required", "unix:///tmp/r.sock?db=1",
    "unix:///tmp/r.sock?db=2&password=x", "redis://db.example:6379/0?db=0",
])
def test_well_formed_urls_pass(url: str) -> None:
    assert "p%2F" not in repr(RedisSettings(url))


@pytest.mark.parametrize(("url", "problem"), [
    ("redis://db.example/0?socket_timeout=0.5", "option 'socket_timeout' is not one of db"),
    ("redis://db.example/0?health_check_interval=-1", "option 'health_check_interval'"),
    ("redis://db.example?foo=bar", "option 'foo' is not one of db"),
    ("redis://db.example?db=x", "option 'db' is not a database number"),
    ("redis://db.example?ssl_cert_reqs=none", "option 'ssl_cert_reqs' is not one of db"),
    ("rediss://db.example?ssl_cert_reqs=lax", "'ssl_cert_reqs' is not none, optional"),
    ("redis://:Qx7@db.example?password=Kp9", "option 'password' is not one of db"),
    ("unix:///tmp/r.sock?db=1&pass%77ord=Kp9", "not a list of name=value options"),
    ("unix:///tmp/r.sock?timeout=3", "option 'timeout' is not one of db, password, user"),
    ("REDIS://db.example", "must start with"), (" redis://db.example", "must start with"),
])
def test_a_plain_urls_options_are_checked_and_never_replace_the_settings(
        url: str, problem: str) -> None:
    """redis-py's ``from_url`` takes a URL's options over the settings: a timeout there
    would pass every check (``check_socket_timeout``) and replace the settings' own.  A
    plain URL takes ``db``, a socket's credentials and ``rediss://``'s TLS options."""
    with pytest.raises(ConfigError, match=problem) as info:
        RedisSettings(url)
    for secret in ("Qx7", "Kp9"):
        assert secret not in str(info.value)


@pytest.mark.parametrize("field", ["socket_timeout_s", "connect_timeout_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_infinity_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be a finite number"):
        RedisSettings("redis://db.example", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="finite"):
        WorkerConfig(lease_ttl_s=value)
    with pytest.raises(ConfigError, match="finite"):
        GatewayConfig(default_timeout_s=value)


def test_ipv6_password_is_masked_with_its_host() -> None:
    assert RedisSettings("redis://u:pw@[::1]:6380/1").safe_url == "redis://u:***@[::1]:6380/1"


def test_unverified_tls_is_spotted() -> None:
    assert tls_unverified("rediss://db:6380/0?ssl_cert_reqs=none")
    assert tls_unverified("rediss://db:6380/0?ssl_cert_reqs=NONE")
    assert not tls_unverified("rediss://db:6380/0?ssl_cert_reqs=required")
    assert not tls_unverified("redis://db:6379/0")


def test_metrics_ports_of_every_replica_must_exist() -> None:
    from redbatch.config import WorkerConfig

    assert WorkerConfig(metrics_port=65534, replicas=2).metrics_port == 65534
    with pytest.raises(ConfigError, match="replica 1 of 2"):
        WorkerConfig(metrics_port=65535, replicas=2)


@pytest.mark.parametrize("query", ["ssl_cert_reqs=None", "ssl_cert_reqs=%20none",
                                   "ssl_check_hostname=off", "ssl_check_hostname=%20false"])
def test_a_plain_tls_option_redis_py_would_read_otherwise_is_refused(query: str) -> None:
    """redis-py parses a plain URL itself: ``off`` reads as true there, ``None`` fails."""
    with pytest.raises(ConfigError, match="ssl_"):
        RedisSettings(f"rediss://db:6380/0?{query}")
    RedisSettings("rediss://db:6380/0?ssl_cert_reqs=none&ssl_check_hostname=false")


def test_place_slots_uses_the_urls_tls_and_says_why_no_seed_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    from redbatch import placement
    from redbatch.embedded import free_port
    from redbatch.errors import RedisUnavailable

    nodes = placement.Nodes(RedisSettings(f"redis+cluster://127.0.0.1:{free_port()}"))
    with pytest.raises(RedisUnavailable, match="ConnectionError"):
        nodes.slot_map()
    seen: dict[str, object] = {}

    class Recorded(redis.Redis):
        def __init__(self, **kwargs: object) -> None:
            seen.update(kwargs)
            raise redis.ConnectionError("recorded")

    monkeypatch.setattr(placement.redis, "Redis", Recorded)
    tls = placement.Nodes(RedisSettings("redis+cluster://127.0.0.1:7000?ssl=true"))
    with pytest.raises(RedisUnavailable):
        tls.slot_map()
    assert seen.get("ssl") is True
