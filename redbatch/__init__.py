"""redbatch: a dynamic-batching inference worker pool over Redis lists."""

from redbatch.config import GatewayConfig, RedisSettings, WorkerConfig
from redbatch.errors import (
    BadRequest,
    BodyTooLarge,
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
from redbatch.worker import BatchPolicy, Model, Pool, TensorSpec, Worker, batch
from redbatch.worker.torch_helpers import torch_model

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "BadRequest",
    "BatchPolicy",
    "BodyTooLarge",
    "Client",
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
    "SyncClient",
    "TensorSpec",
    "UnknownModel",
    "Worker",
    "WorkerConfig",
    "WorkerCrashed",
    "batch",
    "torch_model",
]
