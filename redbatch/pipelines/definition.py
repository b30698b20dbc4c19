"""What a pipeline is: a name and its stages, in order; stored in ``rb:pipelines`` so
that workers, gateways and clients know it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from redbatch import protocol
from redbatch.errors import ConfigError, InvalidPayload


@dataclass(frozen=True)
class Pipeline:
    """A chain of models: a request goes through ``stages`` in order, each stage's
    output the next one's input; the last stage's output is the reply.  Each stage is
    an ordinary model (its own queue, batching policy and workers)."""

    name: str
    stages: tuple[str, ...]

    def __init__(self, name: str, stages: Sequence[str]) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "stages", tuple(stages))
        self._check()

    def _check(self) -> None:
        try:
            protocol.check_model_name(self.name)
            for stage in self.stages:
                protocol.check_model_name(stage)
        except InvalidPayload as exc:
            raise ConfigError(f"pipeline {self.name!r}: {exc}") from exc
        if not self.stages:
            raise ConfigError(f"pipeline {self.name!r}: needs at least one stage")
        if len(set(self.stages)) != len(self.stages) or self.name in self.stages:
            raise ConfigError(f"pipeline {self.name!r}: a stage appears twice, or is named "
                              f"as the pipeline: {list(self.stages)}")

    @property
    def first(self) -> str:
        return self.stages[0]

    def to_json(self) -> bytes:
        return orjson.dumps({"name": self.name, "stages": list(self.stages)})

    @classmethod
    def from_json(cls, raw: bytes | str) -> Pipeline:
        data: Any = orjson.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise ConfigError(f"not a pipeline definition: {raw!r:.80}")
        return cls(str(data.get("name")), [str(s) for s in data["stages"]])


def parse_registry(raw: dict[Any, Any]) -> dict[str, Pipeline]:
    """The definitions of an ``HGETALL rb:pipelines``; a bad one is skipped."""
    found: dict[str, Pipeline] = {}
    for value in raw.values():
        try:
            pipe = Pipeline.from_json(value)
        except (ConfigError, orjson.JSONDecodeError):
            continue
        found[pipe.name] = pipe
    return found


def registry_mapping(pipelines: Iterable[Pipeline]) -> dict[str, bytes]:
    """The ``HSET rb:pipelines`` fields of ``pipelines``."""
    return {p.name: p.to_json() for p in pipelines}


def publish_sync(redis: Any, pipelines: Iterable[Pipeline]) -> None:
    """Store ``pipelines`` in the registry (a synchronous client: ``redbatch up``)."""
    mapping = registry_mapping(pipelines)
    if mapping:
        redis.hset(protocol.PIPELINES_KEY, mapping=mapping)


def pipelines(raw: Any) -> list[Pipeline]:
    """The ``[[pipelines]]`` tables of a configuration file, checked (each error names
    its table: ``pipelines[0].stages: ...``)."""
    if not isinstance(raw, list):
        raise ConfigError("pipelines: must be a list of [[pipelines]] tables")
    return [_table(table, f"pipelines[{i}]") for i, table in enumerate(raw)]


def _table(table: Any, where: str) -> Pipeline:
    if not isinstance(table, dict) or set(table) - {"name", "stages"}:
        raise ConfigError(f"{where}: must be a table of name and stages")
    name, stages = table.get("name"), table.get("stages")
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name: must be a string")
    if not isinstance(stages, list) or not all(isinstance(s, str) for s in stages):
        raise ConfigError(f"{where}.stages: must be a list of model names")
    try:
        return Pipeline(name, stages)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
