"""The HTTP gateway."""

from redbatch.api.app import create_app
from redbatch.api.gateway import Gateway

__all__ = ["Gateway", "create_app"]
