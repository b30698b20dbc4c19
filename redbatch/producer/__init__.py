"""The producer side: enqueue requests and await replies."""

from redbatch.producer.client import Client
from redbatch.producer.sync import SyncClient

__all__ = ["Client", "SyncClient"]
