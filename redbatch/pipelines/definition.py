"""What a pipeline is: a name and its stages, in order; stored in ``rb:pipelines`` so
that workers, gateways and clients know it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from redbatch import protocol
from redbatch.errors import ConfigError, InvalidPayload

Step = str | tuple[str, ...]  # a stage, or a fan-out: several stages, run side by side


@dataclass(frozen=True)
class Pipeline:
    """A chain of models: a request goes through ``stages`` in order, each stage's
    output the next one's input; the last stage's output is the reply.  Each stage is
    an ordinary model (its own queue, batching policy and workers).  A step may be a
    **fan-out**, a list of stages that each get the previous output; the step after it
    is the **merge** stage, whose input is a map branch stage -> its output."""

    name: str
    stages: tuple[Step, ...]

    def __init__(self, name: str, stages: Sequence[str | Sequence[str]]) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "stages", tuple(
            s if isinstance(s, str) else tuple(s) for s in stages))
        self._check()

    @property
    def models(self) -> tuple[str, ...]:
        """Every stage, fan-out branches included, in order."""
        return tuple(m for step in self.stages
                     for m in ((step,) if isinstance(step, str) else step))

    def _check(self) -> None:
        try:
            protocol.check_model_name(self.name)
            for stage in self.models:
                protocol.check_model_name(stage)
        except InvalidPayload as exc:
            raise ConfigError(f"pipeline {self.name!r}: {exc}") from exc
        if not self.stages:
            raise ConfigError(f"pipeline {self.name!r}: needs at least one stage")
        if len(set(self.models)) != len(self.models) or self.name in self.models:
            raise ConfigError(f"pipeline {self.name!r}: a stage appears twice, or is named "
                              f"as the pipeline: {self.models}")
        self._check_fan_outs()

    def _check_fan_outs(self) -> None:
        """A fan-out has two stages or more, neither first nor last: a merge follows."""
        for i, step in enumerate(self.stages):
            if isinstance(step, str):
                continue
            if not 2 <= len(step) <= protocol.MAX_ROW_MAP_NAMES or i == 0 or \
                    i == len(self.stages) - 1 or not isinstance(self.stages[i + 1], str):
                raise ConfigError(f"pipeline {self.name!r}: a fan-out {list(step)} needs "
                                  f"2 to {protocol.MAX_ROW_MAP_NAMES} stages, a stage "
                                  "before it and one merge stage after it")

    @property
    def first(self) -> str:
        return str(self.stages[0])

    @property
    def last(self) -> str:
        return str(self.stages[-1])

    def to_json(self) -> bytes:
        return orjson.dumps({"name": self.name, "stages": self.stages})

    @classmethod
    def from_json(cls, raw: bytes | str) -> Pipeline:
        data: Any = orjson.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise ConfigError(f"not a pipeline definition: {raw!r:.80}")
        return cls(str(data.get("name")), [_step(s) for s in data["stages"]])


def _step(raw: Any) -> str | list[str]:
    return [str(s) for s in raw] if isinstance(raw, list) else str(raw)


def meta_stages(meta: dict[str, Any]) -> tuple[str, ...]:
    """The stages (fan-out branches included) that a pipeline's metadata names; () for
    a model's metadata (``kind`` is not ``pipeline``)."""
    stages = meta.get("stages")
    if meta.get("kind") != "pipeline" or not isinstance(stages, list):
        return ()
    return tuple(m for step in stages for m in (step if isinstance(step, list) else [step])
                 if isinstance(m, str))


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
    if not isinstance(stages, list) or not all(
            isinstance(s, str) or (isinstance(s, list) and all(isinstance(m, str) for m in s))
            for s in stages):
        raise ConfigError(f"{where}.stages: must be a list of model names (a list of "
                          "names in it: a fan-out)")
    try:
        return Pipeline(name, stages)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
