"""Find the models a worker serves from a ``MODULE:OBJECT`` string."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from redbatch.errors import ConfigError
from redbatch.pipelines.definition import Pipeline
from redbatch.worker.model import Model


def load_models(target: str) -> list[Model]:
    """``OBJECT`` may be a Model, a list of Models, or a zero-argument callable that
    returns either (called in the worker process, after it was spawned)."""
    return load_target(target)[0]


def load_target(target: str) -> tuple[list[Model], list[Pipeline]]:
    """The models of ``target`` (as ``load_models``), and the pipelines its list
    declares beside them (``Pipeline`` objects)."""
    return _as_models(_resolve(target), target)


def check_target(target: str) -> None:
    """``ConfigError`` unless ``target`` names models, a list of them, or a factory of
    them, checked where a pool starts, before any replica: a factory is not called
    here (it may load weights, or set up a GPU: only the worker processes call it)."""
    obj = _resolve(target)
    if not (callable(obj) and not isinstance(obj, Model)):
        _as_models(obj, target)


def _resolve(target: str) -> Any:
    """The object that ``MODULE:OBJECT`` names."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"worker target {target!r} must look like MODULE:OBJECT")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:  # its own code failed (a SyntaxError too): one line, and how
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: "  # to see
                          f"{exc} (python -c 'import {module_name}' shows where)") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _as_models(obj: Any, target: str) -> tuple[list[Model], list[Pipeline]]:
    if isinstance(obj, Model):
        return [obj], []
    if isinstance(obj, Iterable) and not isinstance(obj, str | bytes):
        items = list(obj)
        models = [m for m in items if not isinstance(m, Pipeline)]
        if models and all(isinstance(m, Model) for m in models):
            return _unique(models, target), [p for p in items if isinstance(p, Pipeline)]
    elif callable(obj):
        return _as_models(obj(), target)
    raise ConfigError(f"{target!r} is not a Model, a list of Models, or a factory of them")


def _unique(models: list[Model], target: str) -> list[Model]:
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ConfigError(f"{target!r} names a model twice: {names}")
    return models
