"""redbatch: a dynamic-batching inference worker pool over Redis lists.

``import redbatch`` is light: each name below is imported on first use (PEP 562), so
a producer (``from redbatch import Client``) never imports torch or a web server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from redbatch.config import GatewayConfig, RedisSettings, WorkerConfig
    from redbatch.errors import (
        BadRequest,
        BodyTooLarge,
        ClientDisconnected,
        ConfigError,
        DeadlineExceeded,
        InvalidPayload,
        ModelError,
        NoLiveWorkers,
        QueueFull,
        RedbatchError,
        RedisUnavailable,
        UnknownModel,
        WorkerCrashed,
    )
    from redbatch.producer import Client, SyncClient
    from redbatch.protocol import PROTOCOL_VERSION, Reply, Request
    from redbatch.spec import TensorSpec, unpad
    from redbatch.worker import BatchPolicy, Model, Pool, Worker, batch
    from redbatch.worker.stream_batch import STOP, StreamBatch
    from redbatch.worker.torch_helpers import torch_model


def _version() -> str:
    """The installed distribution's version (importlib.metadata costs ~25 ms: on use)."""
    from importlib import metadata

    try:
        return metadata.version("redbatch")
    except metadata.PackageNotFoundError:  # running from a source tree, not installed
        return "0.0.0+unknown"

_ERRORS = ("BadRequest", "BodyTooLarge", "ClientDisconnected", "ConfigError",
           "DeadlineExceeded", "InvalidPayload", "ModelError", "NoLiveWorkers", "QueueFull",
           "RedbatchError", "RedisUnavailable", "UnknownModel", "WorkerCrashed")
# Where each public name lives: imported on first access only.
_HOMES: dict[str, str] = {
    **dict.fromkeys(("GatewayConfig", "RedisSettings", "WorkerConfig"), "redbatch.config"),
    **dict.fromkeys(_ERRORS, "redbatch.errors"),
    **dict.fromkeys(("Client", "SyncClient"), "redbatch.producer"),
    **dict.fromkeys(("PROTOCOL_VERSION", "Reply", "Request"), "redbatch.protocol"),
    **dict.fromkeys(("TensorSpec", "unpad"), "redbatch.spec"),
    **dict.fromkeys(("BatchPolicy", "Model", "Pool", "Worker", "batch"), "redbatch.worker"),
    "torch_model": "redbatch.worker.torch_helpers",
    **dict.fromkeys(("STOP", "StreamBatch"), "redbatch.worker.stream_batch"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if name == "__version__":
        value: Any = _version()
    elif home is None:
        raise AttributeError(f"module 'redbatch' has no attribute {name!r}")
    else:
        value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


__all__ = [
    "PROTOCOL_VERSION",
    "STOP",
    "BadRequest",
    "BatchPolicy",
    "BodyTooLarge",
    "Client",
    "ClientDisconnected",
    "ConfigError",
    "DeadlineExceeded",
    "GatewayConfig",
    "InvalidPayload",
    "Model",
    "ModelError",
    "NoLiveWorkers",
    "Pool",
    "QueueFull",
    "RedbatchError",
    "RedisSettings",
    "RedisUnavailable",
    "Reply",
    "Request",
    "StreamBatch",
    "SyncClient",
    "TensorSpec",
    "UnknownModel",
    "Worker",
    "WorkerConfig",
    "WorkerCrashed",
    "batch",
    "torch_model",
    "unpad",
]
