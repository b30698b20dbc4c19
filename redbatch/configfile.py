"""One declarative TOML file for ``redbatch up -c FILE``: the gateway, the workers'
defaults and every model to serve.

```toml
redis_url = "redis://127.0.0.1:6379/0"   # optional; else $REDIS_URL, else embedded

[gateway]                 # any GatewayConfig field: port, max_queue_len, ...
port = 8000
default_timeout_s = 10    # the deadline of requests that name none
max_queue_len = 5000      # the cap of every model's queue

[worker]                  # defaults for every [[models]] entry: any WorkerConfig field
lease_ttl_s = 10

[[models]]
target = "redbatch.demo:models"   # MODULE:OBJECT, as `redbatch worker` takes
device = "cpu"
replicas = 2
max_batch_size = 16               # batching knobs override the models' own policy
batch_wait_timeout_s = 0.002
max_queue_len = 1000              # this model's queue cap (the lower of it and the gateway's)
default_timeout_s = 5             # deadline of its requests that set none
priority_levels = 2               # priority levels of every model of the target
default_priority = 2              # the level of requests that name none
priority_caps = [1000, 100]       # each priority level's queue cap (models of 2 levels)
version = "2"                     # serve the target's models as this version (canaries)
sub_queues = 1                    # a hot model's queue split over this many (hash slots)

[[pipelines]]             # a chain of the models above, served under its own name
name = "classify_text"
stages = ["tok", "textcls"]
```

A bad file fails at start with a ``ConfigError`` that names the field
(``models[0].replicas: ...``).  Flags and
``REDBATCH_*`` variables win over the file (secrets such as ``REDBATCH_API_KEY``
belong in the environment, not in the file).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from redbatch import knobs, levels, protocol
from redbatch.config import GatewayConfig, WorkerConfig
from redbatch.errors import ConfigError
from redbatch.pipelines.definition import Pipeline, pipelines

T = TypeVar("T")
POLICY_KEYS = ("max_batch_size", "batch_wait_timeout_s", "max_batch_cost", "auto_batch",
               "hold_buckets", "pad_to_longest")
LIMIT_KEYS = ("max_queue_len", "default_timeout_s", "priority_caps",  # -> models' own
              "priority_levels", "default_priority", "version", "sub_queues")
TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,),
                                      "bool": (bool,)}


@dataclass(frozen=True)
class ModelEntry:
    target: str
    worker: WorkerConfig  # the file's values alone (checked)
    worker_values: dict[str, Any]  # what the file set, for from_env(base=...)
    overrides: dict[str, Any]  # batching knobs and limits, applied in each replica


@dataclass(frozen=True)
class Deployment:
    """The file, checked.  ``redbatch up`` rebuilds the configs with
    ``config.from_env(cls, flags, base=<the file's values>)``: flags > env > file."""

    redis_url: str | None = dataclasses.field(repr=False)  # (its password)
    gateway: GatewayConfig
    gateway_values: dict[str, Any] = dataclasses.field(repr=False)  # (an api_key)
    models: list[ModelEntry]
    pipelines: list[Pipeline] = dataclasses.field(default_factory=list)


def load(path: str | Path) -> Deployment:
    """Read and check the file; every error names the field it is about."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    _only(data, {"redis_url", "gateway", "worker", "models", "pipelines"}, "")
    redis_url = data.get("redis_url")
    if redis_url is not None and not isinstance(redis_url, str):
        raise ConfigError("redis_url: must be a string")
    gateway_values = _table(data, "gateway")
    gateway = build(GatewayConfig, gateway_values, "gateway")
    worker = _table(data, "worker")
    build(WorkerConfig, worker, "worker")
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError("models: need at least one [[models]] table")
    return Deployment(redis_url, gateway, gateway_values,
                      [_model(m, worker, f"models[{i}]") for i, m in enumerate(models)],
                      pipelines(data.get("pipelines", [])))


def _model(raw: Any, defaults: dict[str, Any], where: str) -> ModelEntry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a table")
    target = raw.get("target")
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(f"{where}.target: must be MODULE:OBJECT")
    policy = {k: raw[k] for k in POLICY_KEYS if k in raw}
    _check_policy(policy, where)
    limits = {k: raw[k] for k in LIMIT_KEYS if k in raw}
    _check_limits(limits, where)
    rest = {k: v for k, v in raw.items()
            if k != "target" and k not in POLICY_KEYS and k not in LIMIT_KEYS}
    values = {**defaults, **rest}
    return ModelEntry(target, build(WorkerConfig, values, where), values,
                      {**policy, **limits})


def _check_policy(policy: dict[str, Any], where: str) -> None:
    from redbatch.worker.policy import BatchPolicy

    size = policy.get("max_batch_size", 1)
    if type(size) is not int:
        raise ConfigError(f"{where}.max_batch_size: must be int, got {size!r}")
    wait = policy.get("batch_wait_timeout_s", 0.0)
    if type(wait) not in (int, float):
        raise ConfigError(f"{where}.batch_wait_timeout_s: must be float, got {wait!r}")
    for flag in ("auto_batch", "hold_buckets", "pad_to_longest"):
        if type(policy.get(flag, False)) is not bool:
            raise ConfigError(f"{where}.{flag}: must be true or false, got {policy[flag]!r}")
    try:
        BatchPolicy(**policy)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _check_limits(limits: dict[str, Any], where: str) -> None:
    cap = limits.get("max_queue_len", 1)
    if type(cap) is not int or cap < 1:
        raise ConfigError(f"{where}.max_queue_len: must be an int >= 1, got {cap!r}")
    timeout = limits.get("default_timeout_s", 1.0)
    if type(timeout) not in (int, float) or not 0 < timeout < math.inf:
        raise ConfigError(f"{where}.default_timeout_s: must be a number > 0, got {timeout!r}")
    try:
        knobs.check("priority_caps", limits.get("priority_caps"))
        knobs.check("sub_queues", limits.get("sub_queues", 1))
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc}") from exc
    version = limits.get("version", "1")
    if not isinstance(version, str) or not protocol.VERSION_RE.fullmatch(version):
        raise ConfigError(f"{where}.version: must be a string of 1-32 of [A-Za-z0-9_.-], "
                          f"got {version!r}")
    _check_priority(limits, where)


def _check_priority(limits: dict[str, Any], where: str) -> None:
    for key in ("priority_levels", "default_priority"):
        value = limits.get(key, 1)
        if type(value) is not int or not 1 <= value <= protocol.MAX_PRIORITY_LEVELS:
            raise ConfigError(f"{where}.{key}: must be an int "
                              f"1..{protocol.MAX_PRIORITY_LEVELS}, got {value!r}")
    if "priority_levels" in limits and "default_priority" in limits:  # (else: the model's)
        try:
            levels.check_levels(where, limits["priority_levels"], limits["default_priority"])
        except ConfigError as exc:
            raise ConfigError(f"{where}.default_priority: {exc}") from exc


def build(cls: type[T], values: dict[str, Any], where: str) -> T:
    """``cls(**values)`` with each key and type checked, errors prefixed by ``where``."""
    known = {f.name: str(f.type) for f in fields(cls) if f.init}  # type: ignore[arg-type]
    secret = {f.name for f in fields(cls) if not f.repr}  # type: ignore[arg-type]
    _only(values, set(known), where)
    for key, value in values.items():
        kinds = TYPES.get(known[key], (object,))
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            kind = type(value).__name__
            shown = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}" if key in secret \
                else repr(value)
            raise ConfigError(f"{where}.{key}: must be {known[key]}, got {shown}")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _only(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field (known: "
                          f"{', '.join(sorted(allowed))})")


def _table(data: dict[str, Any], name: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{name}: must be a table")
    return table


def with_overrides(models: list[Any], overrides: dict[str, Any]) -> list[Any]:
    """The models with their batching policy and limits overridden (in a replica)."""
    if not overrides:
        return models
    policy = {k: v for k, v in overrides.items() if k in POLICY_KEYS}
    limits = {k: v for k, v in overrides.items() if k in LIMIT_KEYS}
    return [dataclasses.replace(m, policy=dataclasses.replace(m.policy, **policy),
                                **_limits_for(m, limits)) for m in models]


def _limits_for(model: Any, limits: dict[str, Any]) -> dict[str, Any]:
    """The limits for ``model``: ``priority_caps`` only for a model of several levels
    (one target may hold models of one level beside it)."""
    if limits.get("priority_levels", model.priority_levels) > 1:
        return limits
    return {k: v for k, v in limits.items() if k != "priority_caps"}
