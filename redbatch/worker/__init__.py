"""The worker side: batch formation, the model contract, torch helpers, the pool."""

from redbatch.spec import TensorSpec
from redbatch.worker.model import Model, batch
from redbatch.worker.policy import BatchPolicy
from redbatch.worker.pool import Pool
from redbatch.worker.process import Worker

__all__ = ["BatchPolicy", "Model", "Pool", "TensorSpec", "Worker", "batch"]
